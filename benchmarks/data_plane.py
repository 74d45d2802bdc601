"""The data plane of a ship, measured apart from the plugin's code: what any code that ships a
venv has to do per receiver, timed on the cluster it would ship on.

- `pipe`: the venv's files packed by `tar`, hashed (sha256) and sent over TCP from the sending
  host's network namespace; received in the receiving host's, hashed again and unpacked by
  `tar` onto the receiver's disk. Two small processes with `tar` below each; their CPU seconds
  (each process and the children it waited for) and the wall time from the first byte's
  request to the receiver's end. Both sides report the bytes and their sha256, which must agree.
- `worker_start`: a plain Ray actor (no runtime_env) placed on one node, and the CPU seconds its
  worker process used from its start to its first call, as a receiver's worker needs.

Nothing here imports the plugin (`tests/benchmarks/test_data_plane.py` checks it): the floor
that `benchmarks.bounds.data_plane_floor` reads off these figures does not move when the code
it judges gets slower or faster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

BLOCK = 1 << 20

RECEIVE = textwrap.dedent(
    f"""\
    import hashlib, socket, subprocess, sys
    ip, dest = sys.argv[1], sys.argv[2]
    server = socket.create_server((ip, 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    tar = subprocess.Popen(["tar", "-C", dest, "-xf", "-"], stdin=subprocess.PIPE)
    digest, size = hashlib.sha256(), 0
    while block := conn.recv({BLOCK}):
        digest.update(block)
        tar.stdin.write(block)
        size += len(block)
    tar.stdin.close()
    if tar.wait() != 0:
        sys.exit("tar -x failed")
    print(size, digest.hexdigest(), flush=True)
    """
)

SEND = textwrap.dedent(
    f"""\
    import hashlib, socket, subprocess, sys
    venv, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tar = subprocess.Popen(["tar", "-C", venv, "-cf", "-", "."], stdout=subprocess.PIPE)
    conn = socket.create_connection((ip, port))
    digest, size = hashlib.sha256(), 0
    while block := tar.stdout.read({BLOCK}):
        digest.update(block)
        conn.sendall(block)
        size += len(block)
    conn.close()
    if tar.wait() != 0:
        sys.exit("tar -c failed")
    print(size, digest.hexdigest(), flush=True)
    """
)

WORKER_START = textwrap.dedent(
    """\
    import json, sys, time
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    gcs, node = sys.argv[1], sys.argv[2]
    ray.init(address=gcs, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Plain:
        def cpu_seconds(self):
            import resource
            used = resource.getrusage(resource.RUSAGE_SELF)
            return used.ru_utime + used.ru_stime

    start = time.monotonic()
    actor = Plain.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    ).remote()
    cpu = ray.get(actor.cpu_seconds.remote())
    took = time.monotonic() - start
    ray.kill(actor)
    print("RESULT " + json.dumps({"seconds": took, "cpu_seconds": cpu}))
    """
)


class DataPlaneError(RuntimeError):
    """A measurement failed; the message says which side and what it printed."""


@dataclass(frozen=True)
class Pipe:
    bytes: int
    seconds: float  # wall time, from starting the sender to the receiver's end
    send_cpu_seconds: float  # tar -c, sha256, the socket's sends
    receive_cpu_seconds: float  # the socket's receives, sha256, tar -x


def _waited(proc: subprocess.Popen[str], side: str) -> tuple[str, float]:
    """What `proc` printed, and the CPU seconds it and the children it waited for used."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise DataPlaneError(f"the {side} failed ({proc.returncode}): {out}{err}".strip())
    return out, usage.ru_utime + usage.ru_stime


def pipe(
    venv: Path,
    dest: Path,
    receiver_ip: str = "127.0.0.1",
    sender_prefix: tuple[str, ...] = (),
    receiver_prefix: tuple[str, ...] = (),
) -> Pipe:
    """`venv`'s files unpacked into a fresh `dest` (the caller removes it; a failed pipe
    removes it itself) by the sender's and receiver's processes, each run under its prefix
    (`ip netns exec <ns>`: its host's namespace)."""
    dest.mkdir(parents=True)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    try:
        receiver = subprocess.Popen(
            [*receiver_prefix, sys.executable, "-c", RECEIVE, receiver_ip, str(dest)], **popen
        )
        try:
            assert receiver.stdout is not None
            port = receiver.stdout.readline().strip()
            if not port.isdigit():
                receiver.kill()
                _waited(receiver, "receiver")
                raise DataPlaneError(f"the receiver did not listen: {port!r}")
            start = time.monotonic()
            sender = subprocess.Popen(
                [*sender_prefix, sys.executable, "-c", SEND, str(venv), receiver_ip, port],
                **popen,
            )
            sent, send_cpu = _waited(sender, "sender")
            received, receive_cpu = _waited(receiver, "receiver")
            seconds = time.monotonic() - start
        finally:
            if receiver.returncode is None:
                receiver.kill()
                receiver.wait()
        if sent.split() != received.split():
            raise DataPlaneError(f"sent {sent.strip()}, received {received.strip()}")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return Pipe(int(sent.split()[0]), round(seconds, 2), round(send_cpu, 2), round(receive_cpu, 2))


def worker_start(driver: list[str], gcs: str, node_id: str, env: dict[str, str]) -> dict:
    """A plain actor on `node_id`: {"seconds": from its creation to its first call's answer,
    "cpu_seconds": its worker process's, from its start}; the driver runs under `driver` (the
    head's namespace) with `env` (the cluster's token)."""
    out = subprocess.run(
        [*driver, sys.executable, "-c", WORKER_START, gcs, node_id],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise DataPlaneError(f"the plain actor failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    return {k: round(v, 2) for k, v in result.items()}

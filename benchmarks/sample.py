"""One sample, in a process of its own: start Ray, start N actors, time their first calls, stop.

Run as ``python -m benchmarks.sample '<json>'`` by `benchmarks.runner`; prints one JSON line.
A process per sample gives every sample a fresh Ray session, and the actor class defined here in
``__main__`` travels by value, so workers need nothing of this package. Nor does this file:
`benchmarks.uv_run_driver` copies it into a project as the driver a user starts with `uv run`
(`BENCH_T0`, the shell's clock as `uv run` started, adds the times counted from there).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
import traceback
from typing import Any

import ray

RESULT_PREFIX = "BENCH_RESULT "
_SETUP_LINE = re.compile(r"uv_project (\w+): (reused|built) in ([\d.]+)(ms|s)")


@ray.remote(num_cpus=0)
class Probe:
    def ping(self, imports: list[str]) -> tuple[str, str, float]:
        """The worker's python and host, after importing `imports` (and how long that took)."""
        import importlib
        import socket

        start = time.perf_counter()
        for name in imports:
            importlib.import_module(name)
        return sys.executable, socket.gethostname(), time.perf_counter() - start


def _start_ray(config: dict[str, Any]) -> Any:
    """Local Ray, a 2-raylet cluster on this host, or the running cluster at `address`."""
    job_env = config.get("job_runtime_env") or None
    if config.get("address"):
        ray.init(address=config["address"], runtime_env=job_env, log_to_driver=False)
        return None
    if config.get("cluster"):
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, runtime_env=job_env, log_to_driver=False)
        cluster.wait_for_nodes()
        return cluster
    # "local": always a new Ray of our own, never one that someone else started on this host.
    ray.init(address="local", runtime_env=job_env, include_dashboard=False, log_to_driver=False)
    return None


def _placements(n: int, spread: bool) -> list[dict[str, Any]]:
    """Actors round-robin over the alive nodes when asked to spread, else Ray's choice."""
    if not spread:
        return [{} for _ in range(n)]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
    return [
        {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)}
        for i in range(n)
    ]


def setup_logs() -> list[str]:
    """The texts of this Ray session's runtime_env setup logs, one per job; none outside one."""
    try:
        session = ray._private.worker._global_node.get_session_dir_path()
    except Exception:
        return []
    texts = []
    for path in sorted(glob.glob(os.path.join(session, "logs", "runtime_env_setup-*.log"))):
        with open(path, errors="replace") as f:
            texts.append(f.read())
    return texts


def _setup_log_lines() -> list[dict[str, Any]]:
    """The plugin's `uv_project <key>: reused|built in X` lines from this session's setup logs."""
    found = []
    for text in setup_logs():
        for match in _SETUP_LINE.finditer(text):
            key, verb, value, unit = match.groups()
            seconds = float(value) / (1000 if unit == "ms" else 1)
            found.append({"key": key, "verb": verb, "seconds": seconds})
    return found


def measure(config: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False}
    t0 = os.environ.get("BENCH_T0")
    if t0:
        result["driver_start_s"] = time.time() - float(t0)
    cluster = None
    try:
        t = time.perf_counter()
        cluster = _start_ray(config)
        result["ray_start_s"] = time.perf_counter() - t
        result["job_runtime_env"] = ray.get_runtime_context().runtime_env
        n = int(config["actors"])
        options = _placements(n, spread=bool(config.get("cluster")))
        start = time.perf_counter()
        actors = [
            Probe.options(runtime_env=config.get("runtime_env"), **options[i]).remote()
            for i in range(n)
        ]
        imports = list(config.get("imports") or [])
        pending = {actor.ping.remote(imports): i for i, actor in enumerate(actors)}
        done: dict[int, float] = {}
        answers: list[Any] = [None] * n
        deadline = start + float(config["timeout"])
        while pending:
            left = max(0.0, deadline - time.perf_counter())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(
                    f"{len(pending)} of {n} actors had not answered after {config['timeout']}s"
                )
            now = time.perf_counter()
            for ref in ready:
                i = pending.pop(ref)
                done[i] = now - start
                answers[i] = ray.get(ref)
        result["first_call_s"] = [done[i] for i in range(n)]
        if t0:
            result["total_s"] = time.time() - float(t0)
        result["executables"] = sorted({a[0] for a in answers})
        if imports:
            result["import_s"] = [a[2] for a in answers]
        result["ok"] = True
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        result["setup_log"] = _setup_log_lines()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return result


def main() -> None:
    config = json.loads(sys.argv[1])
    print(RESULT_PREFIX + json.dumps(measure(config)), flush=True)


if __name__ == "__main__":
    main()

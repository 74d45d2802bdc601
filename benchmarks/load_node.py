"""The node that `benchmarks.load` puts under load, and what watches it: a `ray start --head`
of its own (free ports, its own temp dir, token auth, the plugin registered), stopped by its
pids; samplers of the runtime-env agent's RSS and fds (from /proc) and of anything else every
few seconds; and `ray-uv gc` in a loop."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray_uv_plugin
from benchmarks.raylets import free_ports
from ray_uv_plugin.settings import MAX_BUILDS_ENV, VENV_DIR_MAX_BYTES_ENV
from ray_uv_plugin.store.build_slots import default_max_builds

from .load_stats import percentile

BIN = Path(sys.executable).parent
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def node_env(venvs: Path, budget: int | None) -> dict[str, str]:
    """The environment of `ray start` and of every driver and `ray-uv` run: this run's token,
    the plugin registered, the build limit set (to its default, so that it shows), the budget;
    none of the caller's RAY_ or UV_ settings (`uv run` sets some), nor Ray's `uv run` hook."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UV_"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(AUTH, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    env["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    env["RAY_UV_PLUGIN_VENV_DIR"] = str(venvs)
    env[MAX_BUILDS_ENV] = str(default_max_builds())
    if budget is not None:
        env[VENV_DIR_MAX_BYTES_ENV] = str(budget)
    return env


class Head:
    """`ray start --head --block` with Ray's defaults, on free ports and a temp dir of its own;
    stopped by its process group and the processes naming its temp dir, never `ray stop`."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="rload-", dir="/tmp"))  # short: socket paths
        gcs, dash, client, nm, om, listen, grpc, rtenv, metrics = free_ports(9)
        self.gcs = f"127.0.0.1:{gcs}"
        self.temp_bytes = str(self.temp).encode()
        self.env = env
        args = [
            str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}",
            f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
            f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={rtenv}", f"--metrics-export-port={metrics}",
            f"--temp-dir={self.temp}", "--node-ip-address=127.0.0.1",
        ]  # fmt: skip
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        code = "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR')"
        deadline = time.monotonic() + 180
        while subprocess.run([sys.executable, "-c", code, self.gcs], env=env).returncode:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
            time.sleep(1)

    def agent_pid(self) -> int | None:
        """The runtime-env agent of this head: the child of our raylet (its cmdline names our
        temp dir) started as `python -u .../runtime_env/agent/main.py`, which renames itself
        `ray::RuntimeEnvAgent`."""
        procs = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes()
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            procs[int(pid)] = (ppid, line)
        raylets = {
            pid
            for pid, (_, line) in procs.items()
            if line.split(b"\0")[0].endswith(b"/raylet") and self.temp_bytes in line
        }
        for pid, (ppid, line) in procs.items():
            agent = line.startswith(b"ray::RuntimeEnvAgent") or b"runtime_env/agent/main.py" in line
            if ppid in raylets and agent:
                return pid
        return None

    def stop(self, clients: Sequence[subprocess.Popen] = ()) -> None:
        """Stop the node, after `clients` (processes in sessions of their own that use it).
        Whatever interrupts the run, a second Ctrl-C (or `timeout --signal=INT` and `uv run`
        both passing one on) must not leave it running: SIGINT waits until it is down."""
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for proc in clients:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            self._stop()
        finally:
            signal.signal(signal.SIGINT, interrupt)

    def _stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in os.listdir("/proc"):  # what Ray started under our own temp dir
            try:
                if (
                    pid.isdigit()
                    and str(self.temp).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                ):
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


class Sampler:
    """Calls `sample()` every `every` seconds in a thread until stopped; keeps (t, value)."""

    def __init__(self, sample: Any, every: float) -> None:
        self.sample, self.every, self.points = sample, every, []
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.sample()
            except OSError:
                value = None  # a venv removed while walked, the agent gone: no sample
            if value is not None:
                self.points.append((round(time.monotonic() - self.start, 2), value))
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, Any]]:
        self._stop.set()
        self._thread.join()
        return self.points


def agent_sample(head: Head) -> dict[str, int] | None:
    pid = head.agent_pid()
    if pid is None:
        return None
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return {"pid": pid, "rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class GcLoop:
    """`ray-uv gc --max-size <budget>` every `every` seconds until stopped."""

    def __init__(self, env: dict[str, str], budget: int, every: float) -> None:
        self.args = [str(BIN / "ray-uv"), "gc", "--max-size", f"{budget / 1024**3:.6f}"]
        self.env, self.every, self.runs = env, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            start = time.monotonic()
            out = subprocess.run(self.args, env=self.env, capture_output=True, text=True)
            self.runs.append(
                {
                    "rc": out.returncode,
                    "seconds": round(time.monotonic() - start, 2),
                    "removed": sum(line.startswith("Removed ") for line in out.stdout.splitlines()),
                    "error": out.stderr.strip()[-300:] if out.returncode else None,
                }
            )

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        failed = [r for r in self.runs if r["rc"] != 0]
        return {
            "runs": len(self.runs),
            "failed": len(failed),
            "first_failure": failed[0]["error"] if failed else None,
            "venvs_removed": sum(r["removed"] for r in self.runs),
            "median_s": percentile([r["seconds"] for r in self.runs], 50),
        }

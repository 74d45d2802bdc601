"""One registry download per cluster: per-node `uv sync` against build-once-and-ship, measured.

A cluster of raylets on this host started with `ray start`, each with its own venv dir and its
own uv cache (as separate machines have), and a package index on 127.0.0.1 that serves generated
wheels of a realistic size and counts the bytes it serves. For each scenario, on a fresh cluster:

- `ray-uv prepare --no-ship`: every node runs `uv sync` against the index;
- `ray-uv prepare` (shipping): one node syncs, the others receive its venv through Ray's object
  store;

then the time to the first call of a worker group with one worker per node, in that env.
Figures: bytes the index served, wall time until every node is ready, the group's first call.

    uv run python -m benchmarks.cluster_ship --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ray

import ray_uv_plugin
from ray_uv_plugin.trust import thaw
from ray_uv_plugin.uv import find_uv, uv_version

BIN = Path(sys.executable).parent
WHEEL_CACHE = Path(tempfile.gettempdir()) / "ruv-bench-wheels"

# --- generated wheels and the counting index ---------------------------------------------------


def make_wheel(out: Path, index: int, size: int) -> Path:
    """`benchpkg_NN-1.0-py3-none-any.whl`: a module and `size` bytes of incompressible data."""
    name = f"benchpkg_{index:02d}"
    path = out / f"{name}-1.0-py3-none-any.whl"
    if path.exists():
        return path
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = '1.0'\nINDEX = {index}\n".encode(),
        f"{name}/data.bin": os.urandom(size),
        f"{dist}/METADATA": metadata(index).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n" for n, d in files.items()
    )
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for n, d in files.items():
            z.writestr(n, d)
    tmp.rename(path)
    return path


def metadata(index: int) -> str:
    return f"Metadata-Version: 2.1\nName: benchpkg-{index:02d}\nVersion: 1.0\n"


class CountingIndex:
    """A PEP 503 index with PEP 658 metadata (so `uv lock` needs no wheel), counting the wheel
    bytes it serves."""

    def __init__(self, wheels: list[Path]) -> None:
        self.wheels = {w.name: w for w in wheels}
        self.served = 0
        self.lock = threading.Lock()
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body, kind = index.answer(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if self.path.endswith(".whl"):
                    with index.lock:
                        index.served += len(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> tuple[bytes | None, str]:
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "simple":  # /simple/benchpkg-07/
            index = int(parts[1].rsplit("-", 1)[1])
            wheel = next(
                w for n, w in self.wheels.items() if n.startswith(f"benchpkg_{index:02d}-")
            )
            sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
            meta = hashlib.sha256(metadata(index).encode()).hexdigest()
            link = (
                f'<a href="/files/{wheel.name}#sha256={sha}" '
                f'data-dist-info-metadata="sha256={meta}" '
                f'data-core-metadata="sha256={meta}">{wheel.name}</a>'
            )
            return f"<html><body>{link}</body></html>".encode(), "text/html"
        if len(parts) == 2 and parts[0] == "files":
            name = parts[1]
            if name.endswith(".whl.metadata"):
                index = int(name.split("-")[0].rsplit("_", 1)[1])
                return metadata(index).encode(), "text/plain"
            if name in self.wheels:
                return self.wheels[name].read_bytes(), "application/octet-stream"
        return None, ""

    def reset(self) -> None:
        with self.lock:
            self.served = 0


def write_project(path: Path, index_url: str, count: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pkgs = [f"benchpkg-{i:02d}" for i in range(count)]
    deps = ", ".join(f'"{p}"' for p in [f"ray=={ray.__version__}", *pkgs])
    sources = "".join(f'{p} = {{ index = "bench" }}\n' for p in pkgs)
    (path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "shipbench"
            version = "0.1.0"
            requires-python = ">=3.11"
            dependencies = [{deps}]

            [tool.uv]
            environments = ["sys_platform == 'linux'"]

            [[tool.uv.index]]
            name = "bench"
            url = "{index_url}"
            explicit = true

            [tool.uv.sources]
            """
        )
        + sources
    )
    (path / "benchworker.py").write_text(
        "import os\n\nclass Pinger:\n    def ping(self):\n"
        "        return os.environ.get('RAY_UV_PLUGIN_VENV')\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "UV_CACHE_DIR": cache}
        subprocess.run([find_uv(), "lock", "--project", str(path)], check=True, env=env)
    return path


# --- a cluster of `ray start` raylets -----------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextmanager
def raylets(nodes: int, base: Path) -> Iterator[str]:
    """`nodes` raylets via `ray start --block`, each with its own venv dir and uv cache; yields
    the GCS address; stops them by their process groups and their own temp dir."""
    temp = Path(tempfile.mkdtemp(prefix="rship-", dir="/tmp"))  # short: socket paths
    procs: list[subprocess.Popen] = []
    env0 = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UV_"))}
    env0["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    env0["RAY_AUTH_MODE"] = "disabled"  # as the drivers below: a private cluster on this host
    env0["UV_COMPILE_BYTECODE"] = os.environ.get("UV_COMPILE_BYTECODE", "1")
    gcs = None
    try:
        for i in range(nodes):
            p = free_ports(9 + 8)
            node_env = {
                **env0,
                "RAY_UV_PLUGIN_VENV_DIR": str(base / f"node{i}" / "venvs"),
                "UV_CACHE_DIR": str(base / f"node{i}" / "uv-cache"),
            }
            args = [
                str(BIN / "ray"), "start", "--block", "--num-cpus=1",
                "--object-store-memory=1500000000", f"--node-manager-port={p[0]}",
                f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
                f"--dashboard-agent-grpc-port={p[3]}", f"--runtime-env-agent-port={p[4]}",
                f"--metrics-export-port={p[5]}", "--worker-port-list=" + ",".join(map(str, p[9:])),
            ]  # fmt: skip
            if gcs is None:
                args += ["--head", f"--port={p[6]}", f"--temp-dir={temp}"]
                args += ["--node-ip-address=127.0.0.1", "--include-dashboard=false"]
                args += [f"--ray-client-server-port={p[7]}"]
                gcs = f"127.0.0.1:{p[6]}"
            else:
                args += [f"--address={gcs}", "--node-ip-address=127.0.0.1"]
            log = open(base / f"ray-start-{i}.log", "w")  # noqa: SIM115 - lives with the node
            procs.append(
                subprocess.Popen(
                    args, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            wait_for_nodes(gcs, i + 1)
        yield gcs
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in os.listdir("/proc"):  # what Ray started under our own temp dir
            if pid.isdigit():
                try:
                    if str(temp).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_nodes(gcs: str, count: int, timeout: float = 180) -> None:
    code = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-c", code, gcs], capture_output=True, text=True, env=driver_env()
        )
        if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= count:
            return
        time.sleep(1)
    raise RuntimeError(f"{count} raylets did not come up within {timeout:.0f}s")


def driver_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"
    return env


FIRST_CALL = textwrap.dedent(
    """\
    import json, sys, time
    import ray
    from worker_groups import (ACTOR_ENVIRONMENT_REGISTRY, RayVirtualCluster, RayWorkerBuilder,
                               RayWorkerGroup)

    gcs, project, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address=gcs, runtime_env={"working_dir": project}, logging_level="ERROR")
    ACTOR_ENVIRONMENT_REGISTRY["benchworker.Pinger"] = {}
    start = time.monotonic()
    cluster = RayVirtualCluster([1] * nodes, use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("benchworker.Pinger"))
    venvs = ray.get(group.run_all_workers_single_data("ping"))
    took = time.monotonic() - start
    group.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps({"seconds": took, "venvs": venvs}))
    """
)


def first_call(gcs: str, project: Path, nodes: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", FIRST_CALL, gcs, str(project), str(nodes)],
        capture_output=True, text=True, env=driver_env(), timeout=1200,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the worker group failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def remove(path: Path) -> None:
    """Venvs the plugin made are read-only (and immutable, as root): thaw them first."""
    if path.exists():
        thaw(path)
        shutil.rmtree(path)


def scenario(ship: bool, nodes: int, project: Path, index: CountingIndex, base: Path) -> dict:
    work = base / ("ship" if ship else "sync")
    remove(work)
    work.mkdir(parents=True)
    with raylets(nodes, work) as gcs:
        index.reset()
        args = [str(BIN / "ray-uv"), "prepare", "--address", gcs, "--project", str(project)]
        args += ["--json"] + ([] if ship else ["--no-ship"])
        start = time.monotonic()
        out = subprocess.run(args, capture_output=True, text=True, env=driver_env(), timeout=3600)
        ready = time.monotonic() - start
        if out.returncode != 0:
            raise RuntimeError(f"prepare failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        served = index.served
        per_node = json.loads(out.stdout)["nodes"]
        call = first_call(gcs, project, nodes)
        venv_sizes = [du(p) for p in sorted(work.glob("node*/venvs/*")) if p.is_dir()]
    return {
        "scenario": "ship" if ship else "per-node sync",
        "nodes": nodes,
        "index_bytes": served,
        "ready_seconds": round(ready, 2),
        "first_call_seconds": round(call["seconds"], 2),
        "per_node": per_node,
        "venv_du_bytes": venv_sizes,
    }


def du(path: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = [r["scenario"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = [
        ("index_bytes", 1024**3, "GiB served by the package index"),
        ("ready_seconds", 1, "seconds until every node is ready"),
        ("first_call_seconds", 1, "seconds to a 4-node group's first call"),
    ]
    for ax, (field, scale, title) in zip(axes, panels, strict=True):
        values = [r[field] / scale for r in runs]
        bars = ax.bar(names, values, color=["#999999", "#3b7dd8"][: len(names)])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(title, fontsize=9)
    wheels = results["wheels"]
    fig.suptitle(
        f"{results['nodes']} raylets, {wheels['count']} wheels x {wheels['mb']} MB "
        "(+ Ray from PyPI), one run",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=int, default=20)
    parser.add_argument("--wheel-mb", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ruv-ship-bench"))
    args = parser.parse_args(argv)
    cache = WHEEL_CACHE / f"{args.wheel_mb}mb"  # a wheel's size is in its directory's name
    cache.mkdir(parents=True, exist_ok=True)
    wheels = [make_wheel(cache, i, args.wheel_mb * 10**6) for i in range(args.wheels)]
    index = CountingIndex(wheels)
    base = args.workdir
    remove(base)
    project = write_project(base / "project", index.url, args.wheels)
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
        "loadavg_start": os.getloadavg(),
        "ray": ray.__version__,
        "uv": uv_version(),
        "nodes": args.nodes,
        "wheels": {
            "count": args.wheels,
            "mb": args.wheel_mb,
            "bytes": sum(w.stat().st_size for w in wheels),
        },
        "runs": [],
    }
    for ship in (False, True):
        run = scenario(ship, args.nodes, project, index, base)
        print(json.dumps({k: v for k, v in run.items() if k != "per_node"}), flush=True)
        for n in run["per_node"]:
            print("   ", n["address"], n["outcome"], n["seconds"], n["bytes"], n["note"] or "")
        results["runs"].append(run)
    results["loadavg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    remove(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

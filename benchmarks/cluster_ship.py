"""One registry download per cluster: per-node `uv sync` against build-once-and-ship, measured.

A cluster of raylets started with `ray start`, each with its own venv dir and its own uv cache
(as separate machines have), and a package index that serves generated wheels of a realistic
size and counts the bytes it serves. For each scenario, on a fresh cluster:

- `ray-uv prepare --no-ship`: every node runs `uv sync` against the index;
- `ray-uv prepare` (shipping): one node syncs, the others receive its venv through Ray's object
  store.

On one host (the default): the raylets and the index share loopback; then the time to the first
call of a worker group with one worker per node, in that env. Figures: bytes the index served,
wall time until every node is ready, the group's first call.

    uv run python -m benchmarks.cluster_ship --json out.json --plot out.png

With `--netns` (root): a simulated cluster with real links (`benchmarks.netns`). Each raylet
and the index get a network namespace and a shaped link of their own (nodes 1 Gbit/s each way,
the index's uplink 200 Mbit/s, shared by every node that downloads: a NAT gateway's or a proxy's
share), and each raylet a disk of its own for its venv dir and uv cache (`benchmarks.node_disks`;
`--shared-fs` for the host's filesystem); the driver runs in the head's namespace, and nothing
can reach beyond these hosts, so the index also serves Ray and its dependencies (mirrored once
from PyPI for this interpreter) and `slowbuild`, an sdist whose build backend sleeps
`--build-seconds` (a package built from source on every node that syncs). For each N of
`--nodes`: the time until every node is ready, the index's bytes, the bytes each host sent (the
bridge ports' counters: the source node's show whether receivers pull from each other), how busy
the host's cores were, and two lower bounds for shipping (`benchmarks.bounds`): the link bound,
the first node's build plus the venv's stream over one node's link, and the CPU bound, the first
node's build plus the CPU-seconds the receiving nodes' processes used after it (sampled from
/proc every second under each node's `ray start`, summed over the receivers) divided by the
host's cores; a ship is judged against the larger.

    uv run python -m benchmarks.cluster_ship --netns --nodes 2,4,8 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
import tomllib
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ray

import ray_uv_plugin
from benchmarks import netns, node_disks
from benchmarks.bounds import HostCpu, NodeCgroups, NodeCpu, cpu_bound, judge, link_bound
from ray_uv_plugin.agent.uv import find_uv, uv_version
from ray_uv_plugin.store.freezing import thaw

BIN = Path(sys.executable).parent
# "-2": the wheels' RECORDs in the wheel spec's hash form (the plugin checks installs against them)
WHEEL_CACHE = Path(tempfile.gettempdir()) / "ruv-bench-wheels-2"
NODE_MBIT = 1000  # each simulated node's link, both ways
INDEX_MBIT = 200  # the index's uplink, shared by every node that downloads

# --- generated wheels, a slow sdist, a PyPI mirror, and the counting index ----------------------


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
    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for n, d in files.items():
            z.writestr(n, d)
    tmp.rename(path)
    return path


def record_hash(data: bytes) -> str:
    """A RECORD entry's hash as the wheel spec writes it (urlsafe base64, no padding): the
    plugin checks installed files against it."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def metadata(index: int) -> str:
    return f"Metadata-Version: 2.1\nName: benchpkg-{index:02d}\nVersion: 1.0\n"


# An in-tree PEP 517 backend with no build requirements (the index serves no setuptools): its
# metadata comes at once, its wheel after SECONDS, tagged for this platform as a compiled
# extension's would be (so the venv ships only to nodes of the same build target).
SLOW_BACKEND = """\
import base64, hashlib, os, sys, sysconfig, time, zipfile

SECONDS = {seconds}
NAME, VERSION = "slowbuild", "1.0"
DIST = f"{{NAME}}-{{VERSION}}.dist-info"
META = f"Metadata-Version: 2.1\\nName: {{NAME}}\\nVersion: {{VERSION}}\\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    os.makedirs(os.path.join(metadata_directory, DIST), exist_ok=True)
    with open(os.path.join(metadata_directory, DIST, "METADATA"), "w") as f:
        f.write(META)
    return DIST


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(SECONDS)  # the compiler
    py = f"cp{{sys.version_info[0]}}{{sys.version_info[1]}}"
    tag = f"{{py}}-{{py}}-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    files = {{
        f"{{NAME}}/__init__.py": f"BUILD_SECONDS = {{SECONDS}}\\n".encode(),
        f"{{DIST}}/METADATA": META.encode(),
        f"{{DIST}}/WHEEL": f"Wheel-Version: 1.0\\nRoot-Is-Purelib: false\\nTag: {{tag}}\\n"
        .encode(),
    }}
    def record_hash(d):
        digest = base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=")
        return "sha256=" + digest.decode()

    record = "".join(f"{{n}},{{record_hash(d)}},{{len(d)}}\\n" for n, d in files.items())
    files[f"{{DIST}}/RECORD"] = (record + f"{{DIST}}/RECORD,,\\n").encode()
    name = f"{{NAME}}-{{VERSION}}-{{tag}}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return name
"""


def make_slow_sdist(out: Path, seconds: int) -> Path:
    """`slowbuild-1.0.tar.gz`, whose wheel takes `seconds` to build (a fixed, known cost)."""
    path = out / "slowbuild-1.0.tar.gz"
    if path.exists():
        return path
    files = {
        "PKG-INFO": "Metadata-Version: 2.2\nName: slowbuild\nVersion: 1.0\n",
        "pyproject.toml": textwrap.dedent(
            """\
            [build-system]
            requires = []
            build-backend = "slow_backend"
            backend-path = ["."]

            [project]
            name = "slowbuild"
            version = "1.0"
            """
        ),
        "slow_backend.py": SLOW_BACKEND.format(seconds=seconds),
    }
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"slowbuild-1.0/{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(path)
    return path


def mirror_pypi(requirement: str, out: Path) -> list[Path]:
    """The wheels of `requirement` and its dependencies that suit this interpreter, from PyPI
    (fetched once into `out`, checked against the lock's sha256), for an index that has no
    internet to serve: uv locks them here, in the host's own namespace."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_text(
            f'[project]\nname = "mirror"\nversion = "0"\nrequires-python = "{this_python()}"\n'
            f'dependencies = ["{requirement}"]\n[tool.uv]\nenvironments = ["sys_platform == '
            "'linux'\"]\n"
        )
        subprocess.run([find_uv(), "lock", "-q", "--project", tmp], check=True)
        lock = tomllib.loads((Path(tmp) / "uv.lock").read_text())
    rank = {tag: i for i, tag in enumerate(sys_tags())}
    files = []
    for package in lock["package"]:
        fits = []
        for wheel in package.get("wheels", []):
            name = urllib.parse.unquote(wheel["url"].rsplit("/", 1)[1])
            tags = parse_wheel_filename(name)[3]
            best = min((rank[t] for t in tags if t in rank), default=None)
            if best is not None:
                fits.append((best, name, wheel))
        if not fits:
            continue  # the project itself, or a package only for other interpreters
        _, name, wheel = min(fits, key=lambda fit: fit[0])
        path = out / name
        if not path.exists():
            tmp_path = path.with_suffix(".part")
            urllib.request.urlretrieve(wheel["url"], tmp_path)  # noqa: S310 - PyPI's https URL
            digest = hashlib.sha256(tmp_path.read_bytes()).hexdigest()
            if f"sha256:{digest}" != wheel["hash"]:
                tmp_path.unlink()
                raise RuntimeError(f"{name} from PyPI does not match the lock's {wheel['hash']}")
            tmp_path.rename(path)
        files.append(path)
    return files


def this_python() -> str:
    return f"=={sys.version_info[0]}.{sys.version_info[1]}.*"


def project_name(filename: str) -> str:
    """The PEP 503 normalised project name of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        raw = filename.split("-")[0]
    else:
        raw = filename.removesuffix(".tar.gz").rsplit("-", 1)[0]
    return re.sub(r"[-_.]+", "-", raw).lower()


class CountingIndex:
    """A PEP 503 index of `files` (wheels and sdists) with PEP 658 metadata for the wheels (so
    `uv lock` downloads none), counting the file bytes it serves. `bind`: the address to serve
    on; the caller may make it in a network namespace (`netns.inside`)."""

    def __init__(self, files: list[Path], bind: str = "127.0.0.1") -> None:
        self.files = {f.name: f for f in files}
        self.projects: dict[str, list[Path]] = {}
        for f in files:
            self.projects.setdefault(project_name(f.name), []).append(f)
        self.hashes: dict[str, str] = {}
        self.served = 0
        self.lock = threading.Lock()
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = [p for p in self.path.split("/") if p]
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                    self.send_file(index.files[parts[1]])
                    return
                body = index.answer(parts)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def send_file(self, path: Path) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with path.open("rb") as f:
                    while block := f.read(1024 * 1024):
                        self.wfile.write(block)
                        with index.lock:
                            index.served += len(block)

        self.server = ThreadingHTTPServer((bind, 0), Handler)
        self.url = f"http://{bind}:{self.server.server_port}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sha256(self, path: Path) -> str:
        with self.lock:
            if path.name not in self.hashes:
                self.hashes[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self.hashes[path.name]

    def answer(self, parts: list[str]) -> bytes | None:
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in self.projects:
            links = []
            for f in self.projects[parts[1]]:
                attrs = ""
                if f.name.endswith(".whl"):
                    meta = hashlib.sha256(wheel_metadata(f)).hexdigest()
                    attrs = f' data-dist-info-metadata="sha256={meta}" '
                    attrs += f'data-core-metadata="sha256={meta}"'
                links.append(
                    f'<a href="/files/{f.name}#sha256={self.sha256(f)}"{attrs}>{f.name}</a>'
                )
            return f"<html><body>{''.join(links)}</body></html>".encode()
        if len(parts) == 2 and parts[0] == "files" and parts[1].endswith(".whl.metadata"):
            wheel = self.files.get(parts[1].removesuffix(".metadata"))
            return wheel_metadata(wheel) if wheel else None
        return None

    def reset(self) -> None:
        with self.lock:
            self.served = 0


def wheel_metadata(wheel: Path) -> bytes:
    """The wheel's own METADATA file, as PEP 658 serves it."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name)


def write_project(
    path: Path,
    index_url: str,
    count: int,
    extra: list[str] | None = None,
    lock_prefix: list[str] | None = None,
) -> Path:
    """The benchmark's uv project: Ray and `count` generated packages, locked. Without `extra`,
    Ray comes from PyPI and the packages from the index; with `extra` (more requirements,
    `slowbuild`), the index is the only one and serves everything, and `lock_prefix` runs the
    lock where the index can be reached (a host's namespace)."""
    path.mkdir(parents=True, exist_ok=True)
    pkgs = [f"benchpkg-{i:02d}" for i in range(count)]
    deps = ", ".join(f'"{p}"' for p in [f"ray=={ray.__version__}", *pkgs, *(extra or [])])
    if extra is None:
        python = ">=3.11"
        index = f'url = "{index_url}"\nexplicit = true\n\n[tool.uv.sources]\n'
        index += "".join(f'{p} = {{ index = "bench" }}\n' for p in pkgs)
    else:
        python, index = this_python(), f'url = "{index_url}"\ndefault = true\n'
    (path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "shipbench"
            version = "0.1.0"
            requires-python = "{python}"
            dependencies = [{deps}]

            [tool.uv]
            environments = ["sys_platform == 'linux'"]

            [[tool.uv.index]]
            name = "bench"
            """
        )
        + index
    )
    (path / "benchworker.py").write_text(
        "import os\n\nclass Pinger:\n    def ping(self):\n"
        "        return os.environ.get('RAY_UV_PLUGIN_VENV')\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "UV_CACHE_DIR": cache}
        argv = [*(lock_prefix or []), find_uv(), "lock", "--project", str(path)]
        subprocess.run(argv, check=True, env=env)
    return path


# --- a cluster of `ray start` raylets -----------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    gcs: str  # the head's GCS address
    driver: list[str]  # the command prefix a driver runs under: the head's namespace, or none
    roots: tuple[int, ...] = ()  # each node's `ray start --block`: every Ray process is below it


# The simulated cluster runs with token auth, as Ray 2.61 runs every cluster: every node's
# `ray start` and every driver hold its token (KubeRay's way: in the environment).
CLUSTER_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextmanager
def raylets(
    nodes: int,
    base: Path,
    hosts: list[netns.Host] | None = None,
    object_store: int = 1_500_000_000,
    temp_parent: Path = Path("/tmp"),
    cgroups: NodeCgroups | None = None,
) -> Iterator[Cluster]:
    """`nodes` raylets via `ray start --block`, each with its own venv dir and uv cache, and in
    its own network namespace where `hosts` names them (and its own cpuacct cgroup where
    `cgroups` has them); yields the cluster; stops them by their process groups and their own
    temp dir (made in `temp_parent`)."""
    temp = Path(tempfile.mkdtemp(prefix="rship-", dir=temp_parent))  # short: socket paths
    procs: list[subprocess.Popen] = []
    env0 = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UV_"))}
    env0["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    env0.update(CLUSTER_AUTH)  # token auth, as the drivers below: a token of this run's own
    env0["RAY_USAGE_STATS_ENABLED"] = "0"
    env0["UV_COMPILE_BYTECODE"] = os.environ.get("UV_COMPILE_BYTECODE", "1")
    prefix = [h.exec() for h in hosts] if hosts else [[] for _ in range(nodes)]
    ip = [h.ip for h in hosts] if hosts else ["127.0.0.1"] * nodes
    cluster = None
    try:
        for i in range(nodes):
            p = free_ports(9 + 8)
            node_env = {
                **env0,
                "RAY_UV_PLUGIN_VENV_DIR": str(base / f"node{i}" / "venvs"),
                "UV_CACHE_DIR": str(base / f"node{i}" / "uv-cache"),
            }
            args = [
                *prefix[i], str(BIN / "ray"), "start", "--block", "--num-cpus=1",
                f"--object-store-memory={object_store}", f"--node-manager-port={p[0]}",
                f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
                f"--dashboard-agent-grpc-port={p[3]}", f"--runtime-env-agent-port={p[4]}",
                f"--metrics-export-port={p[5]}", "--worker-port-list=" + ",".join(map(str, p[9:])),
                f"--node-ip-address={ip[i]}",
            ]  # fmt: skip
            if cluster is None:
                args += ["--head", f"--port={p[6]}", f"--temp-dir={temp}"]
                args += ["--include-dashboard=false", f"--ray-client-server-port={p[7]}"]
                cluster = Cluster(f"{ip[0]}:{p[6]}", prefix[0])
            else:
                args += [f"--address={cluster.gcs}"]
            log = open(base / f"ray-start-{i}.log", "w")  # noqa: SIM115 - lives with the node
            procs.append(
                subprocess.Popen(
                    cgroups.wrap(i, args) if cgroups else args,
                    env=node_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            wait_for_nodes(cluster, i + 1)  # one at a time: they share the head's session dir
        assert cluster is not None
        yield replace(cluster, roots=tuple(proc.pid for proc in procs))
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


def wait_for_nodes(cluster: Cluster | None, count: int, timeout: float = 180) -> None:
    assert cluster is not None
    code = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [*cluster.driver, sys.executable, "-c", code, cluster.gcs],
            capture_output=True, text=True, env=driver_env(),
        )  # fmt: skip
        if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= count:
            return
        time.sleep(1)
    raise RuntimeError(f"{count} raylets did not come up within {timeout:.0f}s")


def driver_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    env.update(CLUSTER_AUTH)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
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


def first_call(cluster: Cluster, project: Path, nodes: int) -> dict[str, Any]:
    out = subprocess.run(
        [*cluster.driver, sys.executable, "-c", FIRST_CALL, cluster.gcs, str(project), str(nodes)],
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


def prepare(cluster: Cluster, project: Path, ship: bool) -> tuple[float, list[dict[str, Any]]]:
    """`ray-uv prepare --json` on the cluster: (wall seconds, the per-node results)."""
    args = [*cluster.driver, str(BIN / "ray-uv"), "prepare", "--address", cluster.gcs]
    args += ["--project", str(project), "--json"] + ([] if ship else ["--no-ship"])
    start = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, env=driver_env(), timeout=3600)
    ready = time.monotonic() - start
    if out.returncode != 0:
        raise RuntimeError(f"prepare failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ready, json.loads(out.stdout)["nodes"]


def scenario(ship: bool, nodes: int, project: Path, index: CountingIndex, base: Path) -> dict:
    work = base / ("ship" if ship else "sync")
    remove(work)
    work.mkdir(parents=True)
    with raylets(nodes, work) as cluster:
        index.reset()
        ready, per_node = prepare(cluster, project, ship)
        served = index.served
        call = first_call(cluster, project, nodes)
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


# --- the simulated cluster: namespaces and shaped links -----------------------------------------


def netns_scenario(
    ship: bool,
    nodes: int,
    project: Path,
    index: CountingIndex,
    net: netns.Network,
    base: Path,
    disks: bool = True,
) -> dict[str, Any]:
    """One fresh cluster of `nodes` raylets in their namespaces, empty venv dirs and caches
    (each node's on a disk of its own where `disks`: `node_disks`); `ray-uv prepare` with or
    without shipping; what it took and what each link carried."""
    work = base / f"{'ship' if ship else 'sync'}-{nodes}"
    remove(work)
    work.mkdir(parents=True)
    hosts = [net.hosts[f"n{i}"] for i in range(nodes)]
    node_dirs = [work / f"node{i}" for i in range(nodes)] if disks else []
    # Ray's temp dir in the run's own: removed at the end even if a Ray process that the
    # stop here missed (one that renamed itself) writes to it until the namespaces go.
    cgroups = NodeCgroups(f"{netns.PREFIX}{net.run_id}-cpu{nodes}-", nodes)
    try:
        with (
            node_disks.mounted(node_dirs, work),
            raylets(nodes, work, hosts, 800_000_000, base, cgroups) as cluster,
        ):
            index.reset()
            before = net.counters()
            read = cgroups.usage if cgroups.available else None
            with HostCpu() as host_cpu, NodeCpu(cluster.roots, read=read) as node_cpu:
                ready, per_node = prepare(cluster, project, ship)
            after = net.counters()
            served = index.served
            venv_sizes = [du(p) for p in work.glob("node*/venvs/*") if p.is_dir()]
    finally:
        cgroups.remove()
    links = {
        host: {way: after[host][way] - before[host][way] for way in ("sent", "received")}
        for host in after
        if host == "index" or host in {h.name for h in hosts}
    }
    built = [n for n in per_node if n["outcome"] == "built"]
    shipped = [n for n in per_node if n["outcome"] == "shipped"]
    source = hosts[0].name  # the driver's node: `prepare` builds there and ships from it
    run: dict[str, Any] = {
        "scenario": "ship" if ship else "per-node sync",
        "nodes": nodes,
        "ready_seconds": round(ready, 2),
        "index_bytes": served,
        "builds": len(built),
        "shipped": len(shipped),
        "failed": sum(n["outcome"] == "failed" for n in per_node),
        "source_sent_bytes": links[source]["sent"],
        "links": links,
        # Each node's processes' CPU seconds during `prepare` (the head's GCS included).
        "node_cpu_seconds": node_cpu.used(0.0),
        "node_cpu_from": "cpuacct cgroups" if cgroups.available else "/proc, each node's tree",
        # The host's busy share of its cores, each second of `prepare`.
        "host_cpu_busy": host_cpu.shares,
        "per_node": per_node,
        "venv_du_bytes": venv_sizes,
    }
    if ship and shipped:
        stream = shipped[0]["bytes"]
        first_build = built[0]["seconds"] if built else 0.0
        run["stream_bytes"] = stream
        run["first_build_seconds"] = first_build
        run["bound_seconds"] = link_bound(first_build, stream, NODE_MBIT)
        # Each node's CPU seconds from the first build's end (the source node's first): the
        # receivers' sum over the host's cores is the CPU bound (`benchmarks.bounds`).
        run["node_cpu_seconds_after_build"] = after_build = node_cpu.used(first_build)
        run["cpu_bound_seconds"] = cpu_bound(first_build, after_build[1:], os.cpu_count() or 1)
        # How busy the host was after the first build: the ship's share of the run.
        run["host_cpu_busy_after_build"] = host_cpu.mean(first_build, ready)
    remove(work)
    return run


def summarize_netns(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: both modes' times, the link and CPU bounds, and the issue's targets read off
    them ("within 1.5 x" of the larger bound)."""
    rows = []
    for nodes in sorted({r["nodes"] for r in runs}):
        by = {r["scenario"]: r for r in runs if r["nodes"] == nodes}
        sync, ship = by.get("per-node sync"), by.get("ship")
        row: dict[str, Any] = {"nodes": nodes}
        if sync:
            row["sync_seconds"] = sync["ready_seconds"]
            row["sync_index_bytes"] = sync["index_bytes"]
            row["sync_builds"] = sync["builds"]
        if ship:
            row["ship_seconds"] = ship["ready_seconds"]
            row["ship_index_bytes"] = ship["index_bytes"]
            row["ship_builds"] = ship["builds"]
            row["source_sent_bytes"] = ship["source_sent_bytes"]
            receivers = ship.get("node_cpu_seconds", [])[1:]
            if receivers:
                row["receiver_cpu_seconds"] = round(sum(receivers) / len(receivers), 2)
            row["stream_bytes"] = ship.get("stream_bytes")
            row["host_cpu_busy_after_build"] = ship.get("host_cpu_busy_after_build")
            row["bound_seconds"] = ship.get("bound_seconds")  # the link bound
            row["cpu_bound_seconds"] = ship.get("cpu_bound_seconds")  # none in older runs
            if ship.get("bound_seconds"):
                bounds = ship["bound_seconds"], ship.get("cpu_bound_seconds")
                row.update(judge(ship["ready_seconds"], *bounds))
            row["built_once"] = ship["builds"] == 1 and ship["shipped"] == nodes - 1
        if sync and ship:
            row["ship_below_sync"] = ship["ready_seconds"] < sync["ready_seconds"]
        rows.append(row)
    return rows


def run_netns(args: argparse.Namespace) -> dict[str, Any]:
    """The whole simulated-cluster measurement; everything it makes is gone when it returns or
    raises."""
    node_counts = sorted({int(n) for n in str(args.nodes).split(",")})
    cache = WHEEL_CACHE / f"{args.wheel_mb}mb"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = [make_wheel(cache, i, args.wheel_mb * 10**6) for i in range(args.wheels)]
    slow_dir = WHEEL_CACHE / f"slowbuild-{args.build_seconds}s"
    slow_dir.mkdir(parents=True, exist_ok=True)
    extra = []
    files = [*wheels, *mirror_pypi(f"ray=={ray.__version__}", WHEEL_CACHE / "pypi")]
    if args.build_seconds >= 0:
        files.append(make_slow_sdist(slow_dir, args.build_seconds))
        extra.append("slowbuild")
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().release}",
        "loadavg_start": os.getloadavg(),
        "ray": ray.__version__,
        "uv": uv_version(),
        "links": {
            "node_mbit": NODE_MBIT,
            "index_uplink_mbit": INDEX_MBIT,
            "shaping": f"tc tbf, burst {netns.BURST}, latency {netns.QUEUE_LATENCY}, each way",
        },
        "wheels": {
            "count": args.wheels,
            "mb": args.wheel_mb,
            "index_files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
        },
        "build_seconds": args.build_seconds,
        "runs": [],
    }
    no_disks = "--shared-fs" if args.shared_fs else node_disks.unavailable()
    results["node_disks"] = (
        f"each node's own ext4 with a journal ({node_disks.SIZE} sparse, a loop device)"
        if no_disks is None
        else f"one filesystem for every node: the host's ({no_disks})"
    )
    base = Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}w", dir="/tmp"))  # short: sockets
    results["workdir"] = str(base)
    try:
        with netns.network() as net:
            index_host = net.add_host("index", INDEX_MBIT, NODE_MBIT)
            for i in range(max(node_counts)):
                net.add_host(f"n{i}", NODE_MBIT, NODE_MBIT)
            results["network"] = net.run_id
            with netns.inside(index_host):
                index = CountingIndex(files, bind=index_host.ip)
            try:
                project = write_project(
                    base / "project", index.url, args.wheels, extra, net.hosts["n0"].exec()
                )
                for nodes in node_counts:
                    for ship in args.modes:
                        run = netns_scenario(
                            ship, nodes, project, index, net, base, no_disks is None
                        )
                        print(json.dumps({k: v for k, v in run.items() if k != "per_node"}))
                        results["runs"].append(run)
            finally:
                index.server.shutdown()
                index.server.server_close()
    finally:
        remove(base)
    results["summary"] = summarize_netns(results["runs"])
    results["loadavg_end"] = os.getloadavg()
    return results


# --- charts and the command line ------------------------------------------------------------------


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


def plot_netns(results: dict[str, Any], path: Path) -> None:
    """Time to all nodes ready against N for each scenario and the bound, the index's bytes,
    and what the source node sent against a star's (N-1) streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, rows = results["runs"], results["summary"]
    names = list(dict.fromkeys(r["scenario"] for r in runs))
    known = {"per-node sync": ("#999999", "o"), "ship": ("#3b7dd8", "s")}
    styles = {name: known.get(name, ("#d8533b", "d")) for name in names}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))

    def draw(ax: Any, field: str, scale: float, only_shipped: bool = False) -> None:
        for name in names:
            points = [
                (r["nodes"], r[field] / scale)
                for r in runs
                if r["scenario"] == name
                and r.get(field) is not None
                and (r.get("stream_bytes") or not only_shipped)
            ]
            if points:
                color, marker = styles[name]
                ax.plot(*zip(*points, strict=True), marker=marker, color=color, label=name)

    draw(axes[0], "ready_seconds", 1)
    bounds = [
        ("bound_seconds", "--", "#2a9d4b", "link bound: one build + the venv over one link"),
        ("cpu_bound_seconds", "-.", "#c98a1b", "CPU bound: one build + receivers' CPU-s / cores"),
    ]
    for field, line, color, label in bounds:
        points = [(r["nodes"], r[field]) for r in rows if r.get(field)]
        if points:
            axes[0].plot(*zip(*points, strict=True), line, color=color, label=label)
    larger = [
        (r["nodes"], max(r["bound_seconds"], r.get("cpu_bound_seconds") or 0))
        for r in rows
        if r.get("bound_seconds")
    ]
    if larger:
        axes[0].plot(
            *zip(*[(n, 1.5 * b) for n, b in larger], strict=True),
            ":",
            color="#444444",
            label="1.5 x the larger bound (the target)",
        )
    axes[0].set(xlabel="nodes", ylabel="seconds until every node is ready")
    draw(axes[1], "index_bytes", 1e9)
    axes[1].set(xlabel="nodes", ylabel="GB served by the index")
    draw(axes[2], "source_sent_bytes", 1e9, only_shipped=True)
    star = [
        (r["nodes"], (r["nodes"] - 1) * r["stream_bytes"] / 1e9)
        for r in rows
        if r.get("stream_bytes")
    ]
    if star:
        axes[2].plot(
            *zip(*star, strict=True), ":", color="#444444", label="(N-1) x the venv's stream"
        )
    axes[2].set(xlabel="nodes", ylabel="GB the source node sent")
    for ax in axes:
        ax.set_xticks(sorted({r["nodes"] for r in runs}))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    links = results["links"]
    fig.suptitle(
        f"Simulated cluster: nodes at {links['node_mbit']} Mbit/s, the index's uplink "
        f"{links['index_uplink_mbit']} Mbit/s shared; {results['wheels']['bytes'] / 1e9:.2f} GB "
        f"of wheels + an sdist that builds in {results['build_seconds']} s; one run each\n"
        f"{results.get('node_disks', 'one filesystem for every node')}; "
        f"{results['machine']}, shared by every node",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=int, default=20)
    parser.add_argument("--wheel-mb", type=int, default=50)
    parser.add_argument("--nodes", default="4", help="N, or with --netns a list: 2,4,8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ruv-ship-bench"))
    parser.add_argument("--netns", action="store_true", help="a simulated cluster, real links")
    parser.add_argument(
        "--build-seconds", type=int, default=30, help="--netns: slowbuild's build (-1: none)"
    )
    parser.add_argument(
        "--modes", default="sync,ship", help="--netns: sync, ship or both (in that order)"
    )
    parser.add_argument(
        "--shared-fs",
        action="store_true",
        help="--netns: every node's venv dir and uv cache on the host's filesystem, not on a "
        "disk of its own (benchmarks.node_disks)",
    )
    args = parser.parse_args(argv)
    if args.netns:
        args.modes = [m == "ship" for m in args.modes.split(",")]
        signal.signal(signal.SIGTERM, netns.interrupted)  # the teardown runs
        results = run_netns(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        if args.plot:
            plot_netns(results, args.plot)
        for row in results["summary"]:
            print(json.dumps(row))
        return 0
    return main_one_host(args)


def main_one_host(args: argparse.Namespace) -> int:
    args.nodes = int(args.nodes)
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

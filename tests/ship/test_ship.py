"""Shipping a built venv to other nodes (`ship.transfer`, `ship.archive`, `ops.prepare`).

The stream tests pack a real venv (real uv, real packages) and unpack it under another venv dir
without Ray. The cluster tests start two raylets on this host, each with its own venv dir, uv
cache and uv (a counting wrapper), as separate machines have, and ship through Ray's object
store; the faults are real: a SIGKILLed receiver, a killed sender, a killed driver.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from packaging.version import Version
from ray.cluster_utils import Cluster

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.cluster.options import PrepareOptions, Quiet
from ray_uv_plugin.cluster.prepare import alive_nodes, prepare_nodes
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.ship import archive, relocation
from ray_uv_plugin.ship.archive import ArchiveError, Packer
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.options import QuietShipReporter, ShipOptions
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store.build_lock import is_held
from ray_uv_plugin.store.disk import venv_size
from ray_uv_plugin.store.layout import Venv
from tests.support.uvproject import CountingUv, write_project

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def chunked(chunk_bytes: int) -> ShipOptions:
    """A ship's options: the defaults, in chunks of `chunk_bytes`."""
    return ShipOptions(chunk_bytes=chunk_bytes)


def on_progress(see: Callable[[Any], None]) -> QuietShipReporter:
    """A ship's reporter that shows each chunk's progress to `see` (a fault, at a chunk)."""

    class Seeing(QuietShipReporter):
        def progress(self, progress: Any) -> None:
            see(progress)

    return Seeing()


PREPARE = PrepareOptions(timeout=600)  # a prepare's options: shipping unless RAY_UV_PLUGIN_SHIP=0


def telling(see: Callable[[Any], None]) -> Quiet:
    """A prepare's reporter that shows each shipped chunk's progress to `see` (a fault, at a
    chunk)."""

    class Seeing(Quiet):
        def progress(self, progress: Any) -> None:
            see(progress)

    return Seeing()


# Run in a venv: import every top-level module of every installed distribution.
IMPORT_ALL = textwrap.dedent(
    """\
    import importlib, importlib.metadata as md, json, sys
    names = set()
    for dist in md.distributions():
        for f in dist.files or []:
            parts = f.parts
            if len(parts) == 1 and parts[0].endswith(".py"):
                names.add(parts[0][:-3])
            elif len(parts) == 2 and parts[1] == "__init__.py" and "." not in parts[0]:
                names.add(parts[0])
    failed = {}
    for name in sorted(n for n in names if not n.startswith("_")):
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = repr(e)
    print(json.dumps({"imported": sorted(names), "failed": failed, "python": sys.executable}))
    """
)


def import_all(python: Path) -> dict:
    out = subprocess.run(
        [str(python), "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def works_where_it_is(venv: Path) -> None:
    """The venv runs from its own path: a console script and every package import."""
    assert relocation.relocate(venv, "/nowhere/else", str(venv)) == 0
    script = venv / "bin" / "ray"
    assert script.read_text().splitlines()[0] == f"#!{venv}/bin/python"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and ray.__version__ in out.stdout, out.stdout + out.stderr
    seen = import_all(venv / "bin" / "python")
    assert seen["failed"] == {} and {"ray", "six"} <= set(seen["imported"]), seen
    assert seen["python"] == str(venv / "bin" / "python")


# --- the stream, without Ray -----------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ready venv (ray and six) under a venv dir of its own."""
    base = tmp_path_factory.mktemp("stream")
    project = write_project(base / "proj", ["six"])
    spec = parse_spec({"project": str(project)})
    return ensure_venv(spec, load_project(project), root=base / "venvs-a").path


def stream(venv: Path, chunk_bytes: int = 4 * MiB) -> tuple[list[archive.Chunk], Packer]:
    packer = Packer(venv, chunk_bytes)
    chunks = [packer.next_chunk()]
    while not chunks[-1].last:
        chunks.append(packer.next_chunk())
    return chunks, packer


def receive(root: Path, key: str, chunks, total: int, whole: str) -> Path:
    root.mkdir(mode=0o700, exist_ok=True)
    unpacker = Unpacker(root, key, "test")
    try:
        for c in chunks:
            unpacker.add(c.index, c.sha256, c.data)
        return unpacker.finish(len(chunks), total, whole)
    except BaseException:
        unpacker.abort()
        raise


def test_a_venv_streamed_to_another_venv_dir_works_there(built: Path, tmp_path: Path) -> None:
    chunks, packer = stream(built)
    assert len(chunks) > 3 and all(len(c.data) == 4 * MiB for c in chunks[:-1])
    size, _ = venv_size(built)
    # The files' bytes plus tar headers; uv's hardlinks into its cache went as content.
    assert size <= packer.total <= size * 1.1 + 10 * MiB, (size, packer.total)
    root = tmp_path / "venvs-b"
    tree = receive(root, built.name, chunks, packer.total, packer.whole_sha256)
    install_received(root, built.name, tree, {**Venv.at(built).read_marker(), "venv": str(built)})
    assert Venv(root, built.name).check_ready()
    assert not list(root.glob("*.ship-*"))
    works_where_it_is(root / built.name)
    marker = Venv.at(root / built.name).read_marker()
    assert marker["key"] == built.name and "venv" not in marker


def test_a_corrupt_chunk_is_refused_and_nothing_is_kept(built: Path, tmp_path: Path) -> None:
    chunks, packer = stream(built)
    bad = bytearray(chunks[2].data)
    bad[1000] ^= 0xFF
    chunks[2] = archive.Chunk(2, bytes(bad), chunks[2].sha256, chunks[2].last)
    with pytest.raises(ArchiveError, match="chunk 2 .* is corrupt"):
        receive(tmp_path / "v", built.name, chunks, packer.total, packer.whole_sha256)
    assert os.listdir(tmp_path / "v") == []


def test_a_missing_chunk_is_refused(built: Path, tmp_path: Path) -> None:
    chunks, packer = stream(built)
    with pytest.raises(ArchiveError, match="chunk 3 arrived where chunk 2 was due"):
        receive(tmp_path / "v", built.name, chunks[:2] + chunks[3:], *whole(packer))
    with pytest.raises(ArchiveError, match="ended after"):
        receive(tmp_path / "v", built.name, chunks[:-1], *whole(packer))
    assert os.listdir(tmp_path / "v") == []


def whole(packer: Packer) -> tuple[int, str]:
    return packer.total, packer.whole_sha256


def evil_stream(member: tarfile.TarInfo, data: bytes = b"") -> tuple[list, int, str]:
    """A well-formed, correctly hashed stream (with its manifest) whose content breaks the
    venv's rules."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        bin_dir, lib_dir, python = (tarfile.TarInfo(n) for n in ("bin", "lib", "bin/python"))
        bin_dir.type = lib_dir.type = tarfile.DIRTYPE
        for info in (bin_dir, lib_dir, python):
            tar.addfile(info, io.BytesIO())
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
        archive.write_manifest(tar, [bin_dir, lib_dir, python, member])
    payload = buf.getvalue()
    sha = hashlib.sha256(payload).hexdigest()
    return [archive.Chunk(0, payload, sha, True)], len(payload), archive.stream_sha256([sha])


def _link(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_link("lib/x.py", "/etc/passwd"), "outside the venv"),
        (_link("bin/python3", "/bin/sh"), "outside the venv"),
        (_link("lib/up", "../../../../etc"), "outside the venv"),
        (_link("lib/hard", "/etc/passwd", hard=True), "no file earlier in the stream"),
        (tarfile.TarInfo("../escaped.py"), "outside"),
        (tarfile.TarInfo("/abs.py"), "absolute|outside"),
    ],
    ids=["symlink-out", "bin-link-not-python", "relative-out", "hardlink-out", "dotdot", "abs"],
)
def test_members_that_leave_the_venv_are_refused(
    tmp_path: Path, member: tarfile.TarInfo, message: str
) -> None:
    with pytest.raises(ArchiveError, match=message):
        receive(tmp_path / "v", "0123456789abcdef", *evil_stream(member))
    assert os.listdir(tmp_path / "v") == []
    assert not (tmp_path / "escaped.py").exists()


def test_set_id_bits_and_group_write_are_dropped(tmp_path: Path) -> None:
    member = tarfile.TarInfo("lib/tool")
    member.size, member.mode = 2, 0o6777
    tree = receive(tmp_path / "v", "0123456789abcdef", *evil_stream(member, b"hi"))
    assert oct((tree / "lib" / "tool").stat().st_mode & 0o7777) == oct(0o755)


# --- two raylets, through Ray ----------------------------------------------------------------


class Node:
    def __init__(self, base: Path) -> None:
        self.venvs = base / "venvs"
        self.cache = base / "uv-cache"
        self.uv = CountingUv(base / "uv")

    def env(self) -> dict[str, str]:
        return {
            "RAY_UV_PLUGIN_VENV_DIR": str(self.venvs),
            "UV_CACHE_DIR": str(self.cache),
            "RAY_UV_PLUGIN_UV": str(self.uv.path),
        }


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Node, Node]]:
    """The driver's node A (which builds) and the other node B, each with its own venv dir, uv
    cache and uv."""
    a = Node(tmp_path_factory.mktemp("node-a"))
    b = Node(tmp_path_factory.mktemp("node-b"))
    saved = {k: os.environ.get(k) for k in a.env()}
    os.environ.update(a.env())  # the head node's raylet inherits the driver's environment
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        added = cluster.add_node(num_cpus=1, env_vars=b.env())
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        # Both raylets share this host's address: a driver may attach to either (Ray 2.44
        # picks the added one here), and prepare builds on the driver's node.
        if ray.get_runtime_context().get_node_id() == added.node_id:
            a, b = b, a
        yield cluster, a, b
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def new_project(tmp_path: Path) -> Path:
    """A project of its own per test, so that its venv is on no node yet."""
    return write_project(tmp_path / "proj", ["six"], name=f"ship{time.monotonic_ns()}")


def run_on(node_id: str, project: Path, timeout: float = 300) -> dict:
    """What a job's task pinned to the node sees: the venv it runs in."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> dict:
        return {"venv": os.environ.get("RAY_UV_PLUGIN_VENV"), "python": sys.executable}

    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    env = {"uv_project": {"project": str(project)}}
    return ray.get(
        where.options(scheduling_strategy=strategy, runtime_env=env).remote(), timeout=timeout
    )


def by_dir(results, node: Node):
    """The result of the node whose venvs live in `node.venvs`."""
    for r in results:
        if r.python and r.python.startswith(str(node.venvs)):
            return r
    raise AssertionError(f"no result with a venv under {node.venvs}: {results}")


def test_prepare_builds_once_and_ships_to_the_other_node(two_nodes, tmp_path: Path) -> None:
    _, a, b = two_nodes
    project = new_project(tmp_path)
    syncs_a, syncs_b = a.uv.syncs(), b.uv.syncs()
    results = prepare_nodes(
        parse_spec({"project": str(project)}), live_nodes(), PREPARE, chunk_bytes=8 * MiB
    )
    assert [r.outcome for r in results] == ["built", "shipped"], results
    shipped = results[1]
    assert shipped.python.startswith(str(b.venvs)), shipped
    assert shipped.shipped_bytes > 50 * MiB and shipped.key == results[0].key
    assert a.uv.syncs() == syncs_a + 1 and b.uv.syncs() == syncs_b  # B never ran uv sync
    venv = b.venvs / shipped.key
    assert Venv.at(venv).read_marker()["shipped_from"]
    # How each venv came to be: built on A, shipped to B with the bytes it took.
    built = Venv.at(venv).read_marker()["built"]
    assert built["how"] == "shipped" and built["bytes"] == shipped.shipped_bytes
    assert Venv.at(a.venvs / shipped.key).read_marker()["built"]["how"] in ("full", "seeded")
    assert not list(b.venvs.glob("*.ship-*"))
    # A worker on B runs in the shipped venv, which works at B's path.
    assert run_on(shipped.node_id, project)["venv"] == str(venv)
    # ... and B's setup log says the venv it reused was shipped, and from where.
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    setup = "".join(p.read_text() for p in logs.glob("runtime_env_setup-*.log"))
    assert f"{shipped.key} (made: shipped (" in setup, setup[-2000:]
    works_where_it_is(venv)
    again = prepare_nodes(parse_spec({"project": str(project)}), live_nodes(), PREPARE)
    assert [r.outcome for r in again] == ["reused", "reused"], again
    assert b.uv.syncs() == syncs_b


def test_a_node_with_other_uv_settings_builds_its_own(two_nodes, tmp_path: Path) -> None:
    """Node C keys the venv differently (its raylet has UV_COMPILE_BYTECODE=1): it does not
    take the shipped venv, builds its own, and its result says why."""
    cluster, a, _ = two_nodes
    c = Node(tmp_path / "node-c")
    node = cluster.add_node(num_cpus=1, env_vars={**c.env(), "UV_COMPILE_BYTECODE": "1"})
    try:
        cluster.wait_for_nodes()
        project = new_project(tmp_path)
        results = prepare_nodes(parse_spec({"project": str(project)}), live_nodes(), PREPARE)
    finally:
        remove(cluster, node)
    on_c = by_dir(results, c)
    assert on_c.outcome == "built" and c.uv.syncs() == 1, results
    assert "not shipped: another set of uv settings here" in on_c.note
    assert "UV_COMPILE_BYTECODE" in on_c.note
    assert [r.outcome for r in results if r is not on_c] == ["built", "shipped"]


REMOVED: set[str] = set()  # raylets the tests removed; the GCS lists them alive for a while


def remove(cluster: Cluster, node, graceful: bool = True) -> None:
    REMOVED.add(node.node_id)
    cluster.remove_node(node, allow_graceful=graceful)


def wait_removed_gone(seconds: float = 120) -> None:
    """For a driver of its own (the CLI), which sees every node the GCS lists as alive."""
    deadline = time.monotonic() + seconds
    while len(live_nodes()) != len(alive_nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)


def live_nodes() -> list[tuple[str, str]]:
    return [n for n in alive_nodes() if n[0] not in REMOVED]


def newest_lock(node: Node) -> Path:
    return max(node.venvs.glob("*.lock"), key=lambda p: p.stat().st_mtime)


@pytest.fixture
def whole_venvs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole venvs on the link (`RAY_UV_PLUGIN_SHIP_SEEDS=0`, read by the driver's `ship`): a
    fault mid-stream needs a stream of many chunks, and the earlier tests' venvs on node B are
    near enough to seed all but a few MB of this one."""
    from ray_uv_plugin.settings import SHIP_SEEDS_ENV

    monkeypatch.setenv(SHIP_SEEDS_ENV, "0")


def wait_free(lock: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while is_held(lock) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not is_held(lock), f"{lock} is still held"


def test_a_receiver_killed_mid_unpack_leaves_nothing_used(
    two_nodes, tmp_path: Path, whole_venvs
) -> None:
    _, _, b = two_nodes
    project = new_project(tmp_path)
    killed: list[int] = []

    def kill_receiver(p) -> None:
        if p.chunk == 2 and not killed:
            pid = int(newest_lock(b).read_text().split()[0])  # the receiver holds it
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    syncs_b = b.uv.syncs()
    results = prepare_nodes(
        parse_spec({"project": str(project)}), live_nodes(), PREPARE, telling(kill_receiver),
        chunk_bytes=4 * MiB,
    )  # fmt: skip
    assert killed
    on_b = by_dir(results, b)
    # Not used half-unpacked: B built its own, and says the receive failed and where.
    assert on_b.outcome == "built" and b.uv.syncs() == syncs_b + 1, results
    assert "not shipped: " in on_b.note and "chunk" in on_b.note, on_b.note
    assert Venv(b.venvs, on_b.key).check_ready()
    assert not list(b.venvs.glob("*.ship-*"))  # the build removed the leftover


def test_a_sender_killed_mid_way_fails_cleanly_and_the_next_attempt_ships(
    two_nodes, tmp_path: Path, whole_venvs
) -> None:
    _, _, b = two_nodes
    project = new_project(tmp_path)

    def kill_sender(p) -> None:
        if p.chunk == 2:
            os.kill(p.source_pid, signal.SIGKILL)

    value = {"project": str(project)}
    # B builds for itself after the failed receive; remove that venv to try shipping again.
    results = prepare_nodes(
        parse_spec(value), live_nodes(), PREPARE, telling(kill_sender), chunk_bytes=4 * MiB
    )
    on_b = by_dir(results, b)
    assert on_b.outcome == "built", results
    assert "the source node" in on_b.note and "sending chunk 3" in on_b.note, on_b.note
    assert not list(b.venvs.glob("*.ship-*"))
    from ray_uv_plugin.store.freezing import remove_tree

    remove_tree(b.venvs / on_b.key)
    again = prepare_nodes(parse_spec(value), live_nodes(), PREPARE, chunk_bytes=4 * MiB)
    assert [r.outcome for r in again] == ["reused", "shipped"], again


DRIVER = textwrap.dedent(
    """\
    import sys, time
    import ray
    from ray_uv_plugin.env.spec import parse_spec
    from ray_uv_plugin.cluster.options import PrepareOptions, Quiet
    from ray_uv_plugin.cluster.prepare import alive_nodes, prepare_nodes

    class Slow(Quiet):
        def progress(self, p):
            print("chunk", p.chunk, flush=True)
            time.sleep(0.5)

    ray.init(address=sys.argv[1])
    prepare_nodes(
        parse_spec({"project": sys.argv[2]}), alive_nodes(), PrepareOptions(timeout=600), Slow(),
        chunk_bytes=2**21,
    )
    """
)


@pytest.mark.slow
def test_a_driver_killed_mid_way_leaves_nothing_used(
    two_nodes, tmp_path: Path, whole_venvs
) -> None:
    cluster, _, b = two_nodes
    project = new_project(tmp_path)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cluster.address, str(project)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        for line in driver.stdout:
            if line.startswith("chunk 3"):
                break
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    lock = newest_lock(b)  # the key's, which the killed driver's receiver held
    key = lock.name.removesuffix(".lock")
    wait_free(lock)  # Ray ends the dead driver's actors
    # B's probe, submitted when B took the venv, was waiting for the receive: its request may
    # take the lock once the receiver is gone and build the venv itself, whole.
    time.sleep(2)
    wait_free(lock)
    why = Venv(b.venvs, key).check_ready().why_not
    assert why in (None, "absent"), why  # never a half-received venv
    if why is None:
        marker = Venv.at(b.venvs / key).read_marker() or {}
        assert "received_at" not in marker and marker.get("built_at"), marker
        time.sleep(5)  # so that the prepare below does not count that build as its own
    results = prepare_nodes(parse_spec({"project": str(project)}), live_nodes(), PREPARE)
    outcomes = [r.outcome for r in results]
    assert outcomes == ["reused", "shipped" if why == "absent" else "reused"], results
    assert Venv(b.venvs, key).check_ready()
    assert not list(b.venvs.glob("*.ship-*"))


def test_the_cli_ships_and_reports_per_node(two_nodes, tmp_path: Path) -> None:
    """`ray-uv prepare` ships the project as working_dir, then the venv; `--json` for scripts,
    `--no-ship` (or RAY_UV_PLUGIN_SHIP=0) lets every node build."""
    cluster, _, b = two_nodes
    project = new_project(tmp_path)
    wait_removed_gone()
    ray_uv = str(Path(sys.executable).parent / "ray-uv")
    args = [ray_uv, "prepare", "--address", cluster.address, "--project", str(project)]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)["nodes"]
    assert [n["outcome"] for n in nodes] == ["built", "shipped"], nodes
    # The earlier tests' venvs on B may seed it (`ship.delta`): only the difference is sent.
    built = Venv.at(b.venvs / nodes[1]["key"]).read_marker()["built"]
    assert nodes[1]["bytes"] + built.get("reused_bytes", 0) > 50 * MiB
    assert nodes[1]["bytes"] == built["bytes"] and nodes[0]["key"] == nodes[1]["key"]
    assert "Prepared 2 nodes (1 built, 1 shipped, 0 reused)" in out.stderr
    assert "shipped " in out.stderr and "MiB in " in out.stderr
    syncs_b = b.uv.syncs()
    out = subprocess.run([*args, "--no-ship", "--extra", "nope"], capture_output=True, text=True)
    assert out.returncode == 1 and "unknown extra(s) nope" in out.stderr
    other = write_project(tmp_path / "other", ["iniconfig"], name=f"o{time.monotonic_ns()}")
    out = subprocess.run(
        [ray_uv, "prepare", "--address", cluster.address, "--project", str(other)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_UV_PLUGIN_SHIP": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Prepared 2 nodes (2 built, 0 shipped, 0 reused)" in out.stderr
    # B ran uv itself. Not `== syncs_b + 1`: both raylets of this one-host cluster unpack the
    # working_dir into the same session dir, Ray's working_dir plugin removes the dir to unpack
    # it again, and a sync in it fails and is retried by Ray (a CI run saw 2 syncs here).
    assert b.uv.syncs() > syncs_b


def test_a_worker_group_ships_its_env_before_its_workers_start(
    two_nodes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One worker per node: the env is built on one node and shipped to the other before the
    workers start (B never runs uv sync); a second group on the same env pays no shipping."""
    from tests.worker_groups.conftest import WORKER_ENV
    from worker_groups import (
        ACTOR_ENVIRONMENT_REGISTRY,
        RayVirtualCluster,
        RayWorkerBuilder,
        RayWorkerGroup,
    )

    _, a, b = two_nodes
    project = new_project(tmp_path)
    syncs_a, syncs_b = a.uv.syncs(), b.uv.syncs()
    caplog.set_level("INFO", logger="worker_groups.group")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ACTOR_ENVIRONMENT_REGISTRY, "wg_workers.EchoWorker", {"project": str(project)})
        cluster = RayVirtualCluster([1, 1], use_gpus=False)
        try:
            for _ in range(2):
                group = RayWorkerGroup(
                    cluster, RayWorkerBuilder("wg_workers.EchoWorker"), env_vars=WORKER_ENV
                )
                pythons = [
                    i["executable"] for i in ray.get([w.info.remote() for w in group.workers])
                ]
                group.shutdown()
        finally:
            cluster.shutdown()
    assert {Path(p).parents[2] for p in pythons} == {a.venvs, b.venvs}, pythons
    assert a.uv.syncs() == syncs_a + 1 and b.uv.syncs() == syncs_b
    lines = [r.getMessage() for r in caplog.records]
    assert any("ready on 2 of 2 nodes" in m and "1 shipped" in m for m in lines), lines
    assert any("ready on 2 of 2 nodes" in m and "2 reused" in m for m in lines), lines


@pytest.mark.slow
def test_the_building_node_dying_mid_way_fails_cleanly(
    two_nodes, tmp_path: Path, whole_venvs
) -> None:
    """Node D has the venv and ships it to B; D's raylet dies after chunk 2. B's receive fails
    naming D and the step, B keeps nothing of it, and B's next prepare ships from A."""
    from ray_uv_plugin.cluster.probe import probe_nodes
    from ray_uv_plugin.ship.transfer import ship

    cluster, _, b = two_nodes
    d = Node(tmp_path / "node-d")
    node_d = cluster.add_node(num_cpus=1, env_vars=d.env())
    cluster.wait_for_nodes()
    project = new_project(tmp_path)
    value = {"project": str(project)}
    ids = {r.node_id: r for r in probe_nodes({"uv_project": value}, live_nodes(), 600)}
    on_d = by_dir(ids.values(), d)
    on_b = by_dir(ids.values(), b)
    assert on_d.built and on_b.built  # every node built it; B's goes, to be shipped again
    from ray_uv_plugin.store.freezing import remove_tree

    remove_tree(b.venvs / on_b.key)

    def kill_d(p) -> None:
        if p.chunk == 2:
            remove(cluster, node_d, graceful=False)

    results = ship(on_d.key, on_d.node_id, [on_b.node_id], chunked(4 * MiB), on_progress(kill_d))
    failed = results[on_b.node_id]
    assert failed.outcome == "failed", failed
    assert failed.why.startswith(f"the source node {on_d.address} ({on_d.node_id[:8]}): "), failed
    assert "sending chunk 3" in failed.why or "receiving chunk" in failed.why, failed
    wait_free(b.venvs / f"{on_b.key}.lock")
    assert Venv(b.venvs, on_b.key).check_ready().why_not == "absent"
    assert not list(b.venvs.glob("*.ship-*"))
    again = prepare_nodes(parse_spec(value), live_nodes(), PREPARE, chunk_bytes=4 * MiB)
    assert [r.outcome for r in again] == ["reused", "shipped"], again


# --- stalls, a venv changed while sent, what may go where, the actors' Python ------------------


def driver_node() -> str:
    return ray.get_runtime_context().get_node_id()


def build_on_driver_node(project: Path) -> str:
    """The project's venv, built on the driver's node A only; returns its key."""
    from ray_uv_plugin.cluster.probe import probe_nodes

    here = driver_node()
    (result,) = probe_nodes({"uv_project": {"project": str(project)}}, [(here, "A")], 600)
    assert result.ok and result.key, result
    return result.key


def other_node(*not_these: str) -> str:
    return next(n for n, _ in live_nodes() if n not in {driver_node(), *not_these})


def test_a_stalled_receiver_is_given_up_alone(two_nodes, tmp_path: Path) -> None:
    """Three raylets: node C's receiver stops (SIGSTOP) after chunk 1. B still gets the venv;
    C's result says it stalled, and C's receiver is killed, which frees C's lock."""
    from ray_uv_plugin.ship.transfer import ship

    cluster, _, _ = two_nodes
    c = Node(tmp_path / "node-c")
    node_c = cluster.add_node(num_cpus=1, env_vars=c.env())
    stopped: list[int] = []
    try:
        cluster.wait_for_nodes()
        key = build_on_driver_node(new_project(tmp_path))
        b_id = other_node(node_c.node_id)

        def stop_c(p) -> None:
            if p.chunk == 1 and not stopped:
                pid = int(newest_lock(c).read_text().split()[0])  # C's receiver holds it
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)

        start = time.monotonic()
        options = ShipOptions(chunk_bytes=2 * MiB, stall_timeout=10)
        results = ship(key, driver_node(), [b_id, node_c.node_id], options, on_progress(stop_c))
        assert time.monotonic() - start < 120  # not the ship's whole time limit
        assert stopped
        assert results[b_id].outcome == "shipped", results
        on_c = results[node_c.node_id]
        assert on_c.outcome == "failed", results
        assert "receiving chunk" in on_c.why and "stalled: no answer for" in on_c.why, on_c.why
        lock = c.venvs / f"{key}.lock"
        if Version(ray.__version__) >= Version("2.60"):
            # Killed while stopped (Ray's raylet SIGKILLs it): its lock is free without SIGCONT.
            wait_free(lock, 60)
        else:
            # Ray 2.44's kill of an actor whose process is stopped takes effect once it runs
            # again (docs/operations.md, "Versions"): then its lock is freed.
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            wait_free(lock, 60)
        assert Venv(c.venvs, key).check_ready().why_not == "absent"
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # Ray killed it
        remove(cluster, node_c)


def test_a_receiver_lets_go_of_the_lock_by_itself(two_nodes, tmp_path: Path) -> None:
    """The driver stalls mid-ship; B's receiver gives the key's lock up once it has held it
    for RAY_UV_PLUGIN_BUILD_TIMEOUT_S (5 s here), as long as a build may hold it."""
    from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV
    from ray_uv_plugin.ship.transfer import ship

    _, _, b = two_nodes
    key = build_on_driver_node(new_project(tmp_path))
    lock = b.venvs / f"{key}.lock"
    held: list[float] = []

    def stalled_driver(p) -> None:
        if p.chunk == 1:
            start = time.monotonic()
            assert is_held(lock)
            wait_free(lock, 60)  # nothing but the receiver's own watchdog can free it now
            held.append(time.monotonic() - start)

    options = ShipOptions(chunk_bytes=MiB, runtime_env={"env_vars": {BUILD_TIMEOUT_ENV: "5"}})
    results = ship(key, driver_node(), [other_node()], options, on_progress(stalled_driver))
    assert held and held[0] < 30, held
    (failed,) = results.values()
    assert failed.outcome == "failed", failed
    assert f"gave up after holding the build lock for 5s ({BUILD_TIMEOUT_ENV}" in failed.why
    assert Venv(b.venvs, key).check_ready().why_not == "absent"
    assert not list(b.venvs.glob("*.ship-*"))


def test_a_venv_moved_while_it_is_sent_is_taken_by_no_node(
    two_nodes, tmp_path: Path, whole_venvs
) -> None:
    """The sender holds the key's lock shared (gc leaves the venv alone meanwhile); an operator
    who moves the venv away mid-ship anyway makes the receive fail, and B keeps nothing."""
    from ray_uv_plugin.ship.transfer import ship
    from ray_uv_plugin.store import inventory, removal

    _, a, b = two_nodes
    project = new_project(tmp_path)
    key = build_on_driver_node(project)
    venv, moved = a.venvs / key, a.venvs / f"{key}.moved"
    seen: dict[str, object] = {}

    def gc_then_move(p) -> None:
        if p.chunk == 1:
            seen["held"] = is_held(a.venvs / f"{key}.lock")
            (entry,) = inventory.scan_one(a.venvs, key).venvs
            seen["gc"] = removal.remove_venv(a.venvs, entry)  # the reason it kept it, or None
            os.rename(venv, moved)

    try:
        results = ship(key, driver_node(), [other_node()], chunked(MiB), on_progress(gc_then_move))
    finally:
        if moved.exists():
            os.rename(moved, venv)
    assert seen["held"] is True and "sent to another node" in str(seen["gc"]), seen
    (failed,) = results.values()
    assert failed.outcome == "failed", failed
    wait_free(a.venvs / f"{key}.lock")  # the sender is gone, and with it its shared lock
    wait_free(b.venvs / f"{key}.lock")
    assert Venv(b.venvs, key).check_ready().why_not == "absent"
    assert not list(b.venvs.glob("*.ship-*"))
    again = prepare_nodes(
        parse_spec({"project": str(project)}), live_nodes(), PREPARE, chunk_bytes=4 * MiB
    )
    assert [r.outcome for r in again] == ["reused", "shipped"], again


def test_a_venv_changed_after_its_build_is_sent_nowhere_and_rebuilt(
    two_nodes, tmp_path: Path
) -> None:
    """A's venv is changed in place after its build (root, past its read-only and
    immutable dirs, replaces six.py). prepare sends none of it: B builds its own and says
    why; A's venv is marked not whole, and its next use rebuilds it, as its build made it."""
    from ray_uv_plugin.store.freezing import thaw

    _, a, b = two_nodes
    project = new_project(tmp_path)
    key = build_on_driver_node(project)
    venv = a.venvs / key
    six = next(venv.glob("lib/python*/site-packages/six.py"))
    original = six.read_bytes()
    thaw(six.parent)  # a new file: the one in A's uv cache that it was linked to stays as it is
    six.unlink()
    changed = original.replace(b"PY2 = sys.version_info[0] == 2", b"PY2 = sys.version_info[0] >= 2")
    assert changed != original and len(changed) == len(original)
    six.write_bytes(changed)
    syncs_a, syncs_b = a.uv.syncs(), b.uv.syncs()
    # prepare calls a venv "built" if its build ended within its probe's time + 1 s: let A's
    # build be older than that, so that A's outcome says what prepare did there (reused it).
    time.sleep(max(0.0, Venv.at(venv).read_marker()["built_at"] + 2.0 - time.time()))
    results = prepare_nodes(
        parse_spec({"project": str(project)}), live_nodes(), PREPARE, chunk_bytes=4 * MiB
    )
    on_b = by_dir(results, b)
    assert [r.outcome for r in results] == ["reused", "built"], results
    rel = six.relative_to(venv)
    assert "not shipped: the source" in on_b.note, on_b.note
    assert f"{rel} has other content now" in on_b.note, on_b.note
    assert "not sent, and it is rebuilt at its next use here" in on_b.note, on_b.note
    assert (b.venvs / key / rel).read_bytes() == original
    assert not list(b.venvs.glob("*.ship-*"))
    why = Venv(a.venvs, key).check_ready().why_not
    assert why and f"{rel} has other content now" in why, why
    assert b.uv.syncs() == syncs_b + 1 and a.uv.syncs() == syncs_a
    # The next setup on A (a worker already running there keeps its venv) rebuilds it.
    rebuilt = ensure_venv(
        parse_spec({"project": str(project)}), load_project(project), root=a.venvs
    )
    assert rebuilt.key == key and rebuilt.built and rebuilt.rebuilt_because == why
    assert six.read_bytes() == original and Venv(a.venvs, key).check_ready()


def test_a_venv_with_wheels_built_for_its_node_goes_only_to_the_same_hardware(
    two_nodes, tmp_path: Path
) -> None:
    """uv builds `hostpkg` into a platform wheel on A. B (the same machine) takes the venv;
    node C, whose nvidia-smi shows a GPU that A lacks, refuses it and says why."""
    from ray_uv_plugin.ship.transfer import ship
    from tests.ship.test_build_target import fake_tool, host_package_project

    cluster, _, b = two_nodes
    c = Node(tmp_path / "node-c")
    fake_tool(tmp_path / "fake-bin", "nvidia-smi", 'echo "3.5, 1.0"')
    path = f"{tmp_path / 'fake-bin'}:{os.environ['PATH']}"
    node_c = cluster.add_node(num_cpus=1, env_vars={**c.env(), "PATH": path})
    try:
        cluster.wait_for_nodes()
        project = host_package_project(tmp_path / "proj", f"host{time.monotonic_ns()}")
        key = build_on_driver_node(project)
        b_id = other_node(node_c.node_id)
        results = ship(key, driver_node(), [b_id, node_c.node_id], chunked(8 * MiB))
    finally:
        remove(cluster, node_c)
    assert results[b_id].outcome == "shipped", results
    assert (b.venvs / key / "lib").exists()
    refused = results[node_c.node_id]
    assert refused.outcome == "refused", results
    assert refused.why.startswith("holds hostpkg built on the source node for its GPUs ("), refused
    assert refused.why.endswith("; this node has 3.5"), refused
    assert not (c.venvs / key).exists()


UV_RUN_DRIVER = textwrap.dedent(
    """\
    import json, sys
    import ray
    from ray_uv_plugin.env.spec import parse_spec
    from ray_uv_plugin.cluster.options import PrepareOptions
    from ray_uv_plugin.cluster.prepare import alive_nodes, prepare_nodes

    # As under `uv run` on a laptop: the job's py_executable and this driver's interpreter are
    # paths that the cluster's nodes do not have.
    ray.init(address=sys.argv[1], runtime_env={"py_executable": "/driver-only/uv run python"})
    sys.executable = "/driver-only/project/.venv/bin/python"
    results = prepare_nodes(
        parse_spec({"project": sys.argv[2]}), alive_nodes(), PrepareOptions(timeout=240)
    )
    print("RESULT", json.dumps([r.as_json() for r in results]))
    """
)


def test_shipping_runs_on_each_nodes_own_python_under_a_uv_run_job(
    two_nodes, tmp_path: Path
) -> None:
    cluster, _, b = two_nodes
    project = new_project(tmp_path)
    wait_removed_gone()
    out = subprocess.run(
        [sys.executable, "-c", UV_RUN_DRIVER, cluster.address, str(project)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    nodes = json.loads(line.removeprefix("RESULT "))
    assert [n["outcome"] for n in nodes] == ["built", "shipped"], nodes
    assert Venv(b.venvs, nodes[1]["key"]).check_ready()

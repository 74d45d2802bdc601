"""Containers and KubeRay: `gc` where it cannot see every process, root without
CAP_LINUX_IMMUTABLE, and a uv cache on another file system than the venv dir.

Each uses what a container does: a PID or mount namespace of its own (`unshare`, as root),
a bounding set without the capability (`setpriv`), a tmpfs volume (`mount -t tmpfs`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.cache_split import cache_split_note
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv_env import sync_environment
from ray_uv_plugin.store import freezing, gc, inventory, outcomes, processes, removal
from ray_uv_plugin.store.layout import MARKER, MARKER_FORMAT, Venv
from tests.support.uvproject import write_project

RAY_UV = str(Path(sys.executable).parent / "ray-uv")
DAY = 86400.0
NO_IMMUTABLE_CAP = ["setpriv", "--bounding-set", "-linux_immutable"]
IMMUTABLE_FLAG = 0x10  # FS_IMMUTABLE_FL, what chattr +i sets

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and mounts need root")


def tool(name: str) -> None:
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed")


def ready_venv(root: Path, key: str, days_idle: float) -> Path:
    """A ready venv as the plugin leaves it (uv's pyvenv.cfg, its lock, a marker naming its
    key), last used `days_idle` ago: what `gc --older-than 0` removes when nothing uses it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nuv = 0.13.9\nversion_info = 3.11.7\n")
    Venv(root, key).lock.write_text("4242 node-a\n")
    Venv.at(venv).write_marker({"format": MARKER_FORMAT, "key": key, "project": "/p"})
    age(venv, days_idle)
    return venv


def age(venv: Path, days: float) -> None:
    t = time.time() - days * DAY
    os.utime(venv / MARKER, (t, t))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


def stop(proc: subprocess.Popen) -> None:
    """End a process started in a session of its own, with everything it forked."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_for_user(venv_name: str, timeout: float = 60) -> int:
    """The pid of the process that names `venv_name` (a path) as its venv, once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = processes.processes().users.get(os.path.realpath(venv_name))
        if pids:
            return min(pids)
        time.sleep(0.1)
    raise AssertionError(f"no process runs in {venv_name}")


# --- gc that cannot see every process ------------------------------------------------------


def test_gc_without_a_readable_pid_namespace_counts_itself_blind(tmp_path: Path) -> None:
    """What cannot be told (no /proc/self/ns/pid: a kernel or sandbox without it) is unseen."""
    assert "cannot tell which PID namespace" in (gc.pid_namespace_blind_spot(tmp_path) or "")
    assert gc.blind_spot(processes.Processes(proc=None), tmp_path) == (
        "/proc cannot be listed",
        gc.NO_PROC_HINT,
    )


@needs_root
def test_gc_in_a_pid_namespace_of_its_own_keeps_what_may_be_used_and_says_why(
    tmp_path: Path,
) -> None:
    """A pod sharing a hostPath venv dir: a worker runs on the host (or in another pod), gc in
    a container. gc sees no users there, so it keeps every venv a worker may use, says why and
    what to do, still removes dead builds, and removes the venv when told `--assume-unused`."""
    tool("unshare")
    root = tmp_path / "venvs"
    used = ready_venv(root, "a" * 16, days_idle=30)
    dead = root / ("b" * 16)  # a build that died two hours ago: never handed to a worker
    (dead / "bin").mkdir(parents=True)
    (dead / "pyvenv.cfg").write_text("uv = 0.13.9\n")
    Venv(root, dead.name).lock.touch()
    for path in (dead, Venv(root, dead.name).lock):
        os.utime(path, (time.time() - 7200,) * 2)
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    in_container = ["unshare", "--pid", "--fork", "--mount-proc", RAY_UV, "gc"]
    worker = subprocess.Popen(["sleep", "300"], env={**os.environ, "RAY_UV_PLUGIN_VENV": str(used)})
    try:
        for dry_run in (["--dry-run"], []):
            out = run(*in_container, "--older-than", "0", *dry_run, env=env)
            assert out.returncode == 0, out.stderr
            assert re.search(
                rf"^Kept {used.name} \(/p\): unused for 30\.0 days, but may be in use by "
                r"processes this user cannot see \(gc runs in a PID namespace of its own, as in "
                r"a container: the processes of the host and of other containers that share "
                r"this venv dir are invisible to it\): run gc on the host, or pass "
                r"--assume-unused if only processes of this container use the venv dir$",
                out.stdout,
                re.MULTILINE,
            ), out.stdout
            assert used.exists()
        assert f"Removed {dead.name}" in out.stdout, out.stdout
        assert not dead.exists()
        # On the host, gc sees the worker itself.
        host = gc.collect(root, older_than_days=0, dry_run=True)
        assert [d.reason for d in host.kept] == [f"in use by pid {worker.pid}"]
        # --assume-unused vouches only for what gc cannot see: a worker it sees keeps its venv.
        gc_beside_a_worker = (
            'RAY_UV_PLUGIN_VENV="$1" sleep 300 & "$2" gc --older-than 0 --assume-unused; kill $!'
        )
        args = ["sh", "-c", gc_beside_a_worker, "sh", str(used), RAY_UV]
        out = run("unshare", "--pid", "--fork", "--mount-proc", *args, env=env)
        assert re.search(rf"^Kept {used.name} \(/p\): in use by pid \d+$", out.stdout, re.M), (
            out.stdout + out.stderr
        )
        out = run(*in_container, "--older-than", "0", "--assume-unused", env=env)
        assert f"Removed {used.name} (/p): unused for 30.0 days" in out.stdout, out.stdout
        assert not used.exists()
    finally:
        worker.kill()
        worker.wait()


@needs_root
def test_gc_sees_a_worker_that_names_the_venv_by_its_path_in_a_container(
    tmp_path: Path,
) -> None:
    """A pod mounts the host's venv dir at another path: its workers' RAY_UV_PLUGIN_VENV names
    a path that means nothing on the host. gc on the host resolves it in the worker's own
    mount namespace (`/proc/<pid>/root`) and keeps the venv."""
    tool("unshare")
    root = tmp_path / "venvs"
    venv = ready_venv(root, "c" * 16, days_idle=30)
    mount_point = tmp_path / "pod-view"  # empty on the host; the venv dir inside the "pod"
    mount_point.mkdir()
    seen_as = mount_point / venv.name
    pod = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--fork",
            "--kill-child",
            "sh",
            "-c",
            'mount --bind "$1" "$2" && exec env RAY_UV_PLUGIN_VENV="$2/$3" sleep 300',
            "sh",
            str(root),
            str(mount_point),
            venv.name,
        ],
        start_new_session=True,
    )
    try:
        pid = wait_for_user(str(seen_as))
        assert not seen_as.exists()  # the host does not see the pod's mount
        report = gc.collect(root, older_than_days=0)
        assert [(d.entry.key, d.reason) for d in report.kept] == [
            (venv.name, f"in use by pid {pid}")
        ]
        assert venv.exists()
        listed = inventory.scan(root)
        assert [e.users for e in listed.venvs] == [(pid,)]
    finally:
        stop(pod)
    assert [d.entry.key for d in gc.collect(root, older_than_days=0).removed] == [venv.name]


# --- root without CAP_LINUX_IMMUTABLE ---------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("containers") / "p", dependencies=["six"])


SHIP_WITHOUT_CAP = """
import io, json, logging, sys
from pathlib import Path
from ray_uv_plugin.store import freezing
from ray_uv_plugin.ship import archive, relocation, unpack
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.store.layout import Venv

root, project, receiver = map(Path, sys.argv[1:4])
log = io.StringIO()
logger = logging.getLogger("setup")
logger.addHandler(logging.StreamHandler(log))
logger.setLevel(logging.INFO)
spec, files = parse_spec({}), load_project(project)
built = ensure_venv(spec, files, root=root, logger=logger)
reused = ensure_venv(spec, files, root=root, logger=logger)

# What a receiving node does with a venv shipped to it (`ship`), under the key's lock.
packer = archive.Packer(built.path, 8 * 1024 * 1024)
chunks = [packer.next_chunk()]
while not chunks[-1].last:
    chunks.append(packer.next_chunk())
receiver.mkdir(mode=0o700)
lock = BuildLock(Venv(receiver, built.key).lock)
assert lock.try_acquire()
unpacker = unpack.Unpacker(receiver, built.key, "test", sender_venv=str(built.path))
for c in chunks:
    unpacker.add(c.index, c.sha256, c.data)
tree = unpacker.finish(len(chunks), packer.total, packer.whole_sha256)
meta = Venv.at(built.path).read_marker()
install_received(receiver, built.key, tree, {**meta, "venv": str(built.path)})
lock.release()
print(json.dumps({
    "can_change_immutable": freezing.can_change_immutable(),
    "built": built.built, "reused": not reused.built, "key": built.key, "log": log.getvalue(),
}))
"""


@needs_root
def test_without_cap_linux_immutable_builds_reuse_ship_check_and_gc_work(
    project: Path, tmp_path: Path
) -> None:
    """Root in a container without CAP_LINUX_IMMUTABLE: a real build, its reuse, the receiving
    end of a ship, `ray-uv check` and `ray-uv gc --all` all work; the setup log and `check`
    say that the venv is not immutable, what protects it still, and how to get chattr +i."""
    tool("setpriv")
    root, receiver = tmp_path / "venvs", tmp_path / "received"
    script = tmp_path / "ship.py"
    script.write_text(SHIP_WITHOUT_CAP)
    out = run(
        *NO_IMMUTABLE_CAP, sys.executable, str(script), str(root), str(project), str(receiver)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["can_change_immutable"] is False
    assert result["built"] and result["reused"]
    unfrozen = (
        f"uv_project {result['key']}: not made immutable (chattr +i): this process lacks "
        "CAP_LINUX_IMMUTABLE (containers drop it by default). What protects it still: "
        "read-only directories"
    )
    assert unfrozen in result["log"], result["log"]
    assert "(securityContext.capabilities.add)." in result["log"]
    for venv in (root / result["key"], receiver / result["key"]):
        assert Venv(venv.parent, venv.name).check_ready()
        assert Venv.at(venv).read_marker()["immutable"] is False  # type: ignore[index]
        assert not removal.chattr_flags(venv / "lib") & IMMUTABLE_FLAG  # nothing half-frozen
        assert not os.stat(venv / "lib").st_mode & 0o222  # read-only still
        ran = run(str(venv / "bin" / "python"), "-c", "import six; print(six.__name__)")
        assert ran.stdout.strip() == "six", ran.stderr

    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    checked = run(*NO_IMMUTABLE_CAP, RAY_UV, "check", "--project", str(project), env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"uv_project {result['key']}: reused" in checked.stdout
    assert "note: not made immutable (chattr +i): this process lacks CAP_LINUX_IMMUTABLE" in (
        checked.stdout
    )

    for venv_dir in (root, receiver):
        age(venv_dir / result["key"], 1)
        out = run(
            *NO_IMMUTABLE_CAP, RAY_UV, "gc", "--all", env={"RAY_UV_PLUGIN_VENV_DIR": str(venv_dir)}
        )
        assert f"Removed {result['key']}" in out.stdout, out.stdout + out.stderr
        # the setups' count (`store.outcomes`, read by the node's metrics) stays
        assert set(os.listdir(venv_dir)) <= {outcomes.OUTCOMES}


@needs_root
def test_root_without_cap_linux_immutable_keeps_a_frozen_venv_whole(
    project: Path, tmp_path: Path
) -> None:
    """A venv frozen by root with the capability (on the host), gc'd by root without it (in a
    pod sharing the dir): gc cannot clear chattr +i, so it keeps the venv whole and says
    where to run, instead of renaming it and deleting half of it."""
    tool("setpriv")
    root = tmp_path / "venvs"
    venv = ensure_venv(parse_spec({}), load_project(project), root=root).path
    try:
        if not Venv.at(venv).read_marker()["immutable"]:  # type: ignore[index]
            pytest.skip("this file system has no chattr +i")
        age(venv, 1)
        env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
        out = run(*NO_IMMUTABLE_CAP, RAY_UV, "gc", "--all", env=env)
        assert out.returncode == 0, out.stderr
        assert re.search(
            rf"^Kept {venv.name} \(.*\): {venv}/\S+ is immutable \(chattr \+i\) and this "
            r"process lacks CAP_LINUX_IMMUTABLE \(as in a container\), which undoing it needs: "
            r"run gc where root has it, e.g. on the host$",
            out.stdout,
            re.MULTILINE,
        ), out.stdout
        assert Venv(root, venv.name).check_ready()  # still whole and ready
        dry = run(*NO_IMMUTABLE_CAP, RAY_UV, "gc", "--all", "--dry-run", env=env)
        assert f"Kept {venv.name}" in dry.stdout, dry.stdout  # a dry run promises no more
    finally:
        gc.collect(root, everything=True, now=time.time() + DAY)
    assert not venv.exists()


# --- a uv cache on another file system ---------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs volume (private to root), unmounted after the test whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o700)
    mounted = run("mount", "-t", "tmpfs", "-o", "mode=0700,size=4g", "tmpfs", str(volume))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", str(volume)], check=False, timeout=120)
        if os.path.ismount(volume):
            subprocess.run(["umount", "--lazy", str(volume)], check=True, timeout=120)


def test_cache_split_note_compares_file_systems(tmpfs: Path, tmp_path: Path) -> None:
    """On another file system than the venv dir, the uv cache is named with the fix; on the
    same one, or where uv copies anyway, nothing is said."""
    venv_dir = tmp_path / "venvs"
    # The node's cache (a job's is refused): as `ray start`'s environment sets it.
    elsewhere = sync_environment({}, {**os.environ, "UV_CACHE_DIR": str(tmpfs / "uv-cache")})
    note = cache_split_note(elsewhere, venv_dir, tmp_path)
    assert note is not None
    assert note.startswith(
        f"the uv cache {tmpfs / 'uv-cache'} and the venv dir {venv_dir} are on different file "
        "systems, so uv copies every file into the venv instead of hardlinking it"
    )
    assert f"set UV_CACHE_DIR to a directory on the venv dir's file system (e.g. {tmp_path}" in note
    same = sync_environment({}, {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache")})
    assert cache_split_note(same, venv_dir, tmp_path) is None
    copies = sync_environment({"UV_LINK_MODE": "copy"}, {**os.environ, "UV_CACHE_DIR": str(tmpfs)})
    assert cache_split_note(copies, venv_dir, tmp_path) is None


def test_a_build_beside_the_uv_cache_on_another_volume_says_so(project: Path, tmpfs: Path) -> None:
    """The venv dir on a volume of its own (a tmpfs) and the warm uv cache on the root disk:
    uv copies, and both the build's setup log and `ray-uv check` say why and what to do."""
    root = tmpfs / "venvs"
    log = io.StringIO()
    logger = logging.getLogger("test_containers.setup")
    logger.addHandler(logging.StreamHandler(log))
    logger.setLevel(logging.INFO)
    try:
        outcome = ensure_venv(parse_spec({}), load_project(project), root=root, logger=logger)
    finally:
        logger.handlers.clear()
    assert outcome.built
    said = f"uv_project {outcome.key}: the uv cache "
    assert said in log.getvalue(), log.getvalue()
    assert f"and the venv dir {root} are on different file systems" in log.getvalue()
    six = next(outcome.path.glob("lib/python*/site-packages/six.py"))
    assert os.stat(six).st_nlink == 1  # copied, as the note says
    out = run(RAY_UV, "check", "--project", str(project), env={"RAY_UV_PLUGIN_VENV_DIR": str(root)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"uv_project {outcome.key}: reused" in out.stdout
    assert re.search(
        rf"^note: the uv cache \S+ and the venv dir {root} are on different file systems, .*"
        r"Put both on one volume: set UV_CACHE_DIR",
        out.stdout,
        re.MULTILINE,
    ), out.stdout
    freezing.remove_tree(outcome.path)  # frozen: the unmount would not mind, but be tidy

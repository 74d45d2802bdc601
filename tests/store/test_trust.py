"""Only the plugin user's own, private files are ever used as a venv. Real uv, no Ray
(tests/agent/test_plugin.py shows the same refusal reaching a Ray caller)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import ANY

import pytest

from ray_uv_plugin.building.ensure import Outcome, ensure_venv, lookup
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.settings import TRUSTED_GROUP_ENV, VENV_DIR_ENV
from ray_uv_plugin.store.build_lock import BuildLock, DiskFullError
from ray_uv_plugin.store.layout import MARKER, Venv, venv_root
from ray_uv_plugin.store.trust import UntrustedPathError, check_root, make_root
from tests.support.uvproject import write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("p") / "proj", ["six"])


def private_root(parent: Path) -> Path:
    root = parent / "venvs"
    root.mkdir(mode=0o700)
    return root


def key_of(project: Path, root: Path) -> str:
    return make_request(parse_spec({}), load_project(project), {}).key


def plant(root: Path, key: str, pwned: Path) -> Path:
    """What an attacker would put at `<key>`: a python that runs their code, and a marker."""
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\ntouch {pwned}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    marker = {"format": 1, "key": key, "site_packages": str(site.relative_to(venv))}
    (venv / MARKER).write_text(json.dumps(marker))
    return venv


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.lchown(name, uid, gid)


def test_a_venv_planted_by_another_user_is_refused(project, tmp_path, other_user):
    name, uid, gid = other_user
    root = private_root(tmp_path)
    pwned = tmp_path / "pwned"
    venv = plant(root, key_of(project, root), pwned)
    chown_tree(venv, uid, gid)
    with pytest.raises(UntrustedPathError) as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    message = str(info.value)
    assert str(venv) in message and f"owner {name} (uid {uid})" in message
    assert "mode 0o755" in message and "owned by another user" in message
    assert "RAY_UV_PLUGIN_VENV_DIR" in message  # what to do
    assert venv.exists() and not pwned.exists()  # not theirs to delete, never run


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_venv_dir_others_can_write_is_refused(project, tmp_path, mode):
    root = private_root(tmp_path)
    root.chmod(mode)
    with pytest.raises(UntrustedPathError, match=r"can write it .*mode 0o1?77[57]") as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert f"the venv dir {root}" in str(info.value)
    assert list(root.iterdir()) == []  # nothing built, nothing locked


def test_an_ancestor_others_can_write_is_refused_unless_sticky(project, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename our venv dir away and put theirs in its place
    root = private_root(shared)
    with pytest.raises(UntrustedPathError, match=f"above the venv dir {root}: {shared}"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    shared.chmod(0o1777)  # sticky, like /tmp: only we may rename our entries
    assert ensure_venv(parse_spec({}), load_project(project), root=root).built


def test_a_trusted_group_may_share_the_venv_dir(project, tmp_path, other_user, monkeypatch):
    _, _, gid = other_user
    root = private_root(tmp_path)
    os.chown(root, -1, gid)
    root.chmod(0o2770)
    with pytest.raises(UntrustedPathError, match="its group can write it"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    monkeypatch.setenv(TRUSTED_GROUP_ENV, str(gid))
    outcome = ensure_venv(parse_spec({}), load_project(project), root=root)
    assert outcome.built
    assert stat.S_IMODE(Venv(root, outcome.key).lock.stat().st_mode) == 0o660


@pytest.mark.parametrize("where", ["key", "marker"])
def test_symlinks_at_the_key_or_marker_are_never_followed(project, tmp_path, where):
    root = private_root(tmp_path)
    key = key_of(project, root)
    elsewhere = plant(tmp_path / "elsewhere", key, tmp_path / "pwned")
    if where == "key":
        (root / key).symlink_to(elsewhere)
    else:
        (root / key).mkdir()
        (root / key / MARKER).symlink_to(elsewhere / MARKER)
    with pytest.raises(UntrustedPathError, match="symlink, which is never followed"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert not (tmp_path / "pwned").exists()


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(project, tmp_path):
    root = private_root(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    Venv(root, key_of(project, root)).lock.symlink_to(victim)
    with pytest.raises(UntrustedPathError, match="symlink"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert victim.read_text() == "precious\n"


def test_what_the_plugin_builds_is_private_and_read_only(project, tmp_path):
    root = tmp_path / "new" / "venvs"  # created by the plugin
    outcome = ensure_venv(parse_spec({}), load_project(project), root=root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(Venv(root, outcome.key).lock.stat().st_mode) == 0o600
    for dirpath, _dirs, _files in os.walk(outcome.path):
        assert os.lstat(dirpath).st_mode & 0o222 == 0, dirpath
    marker = outcome.path / MARKER
    assert marker.stat().st_mode & 0o022 == 0
    # Nobody can add a package to it: modes stop other users than root, chattr +i root too.
    if os.geteuid() != 0 or Venv.at(outcome.path).read_marker()["immutable"]:
        with pytest.raises(PermissionError):
            (outcome.path / "lib").joinpath("x").mkdir()


def test_a_second_user_cannot_use_or_build_in_our_venv_dir(other_user):
    """Root's venv dir, as another user's plugin would see it: refused, nothing written."""
    name, uid, gid = other_user
    root = Path(tempfile.mkdtemp(prefix="ray-uv-trust-"))  # in /tmp, which they can search
    root.chmod(0o755)
    # The trust checks need only the standard library: any Python 3.11 they may run will do.
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    code = (
        "import sys; from pathlib import Path\n"
        "from ray_uv_plugin.store.trust import check_root, UntrustedPathError\n"
        "try:\n    check_root(Path(sys.argv[1]))\n"
        "except UntrustedPathError as e:\n    print(e); sys.exit(3)\n"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        result = subprocess.run(
            ["runuser", "-u", name, "--", python, "-c", code, str(root)],
            capture_output=True,
            text=True,
            env=env,
            cwd="/",
        )
    finally:
        root.rmdir()
    if "Permission denied" in result.stderr:
        pytest.skip(f"{name} cannot read this checkout's Python: {result.stderr.strip()[-200:]}")
    assert result.returncode == 3, result.stderr
    assert "owned by another user" in result.stdout and "owner root (uid 0)" in result.stdout


# --- The venv dir's own path: symlinks on its way, the dirs we make, a full disk ---


def sticky_dir(parent: Path, mode: int = 0o1777, gid: int = 0) -> Path:
    """A shared dir like /tmp (or a group's 1775 one): anyone may add entries, not replace ours."""
    shared = parent / "shared"
    shared.mkdir()
    os.chown(shared, 0, gid)
    shared.chmod(mode)
    return shared


@pytest.mark.parametrize("shared_mode", [0o1777, 0o1775], ids=["sticky-1777", "group-sticky-1775"])
@pytest.mark.parametrize("where", ["venv dir", "above it"])
def test_a_symlink_another_user_made_on_the_way_is_refused(
    project, tmp_path, other_user, monkeypatch, shared_mode, where
):
    """The reviewer's attack: they point a link at our private dir before our first build, we
    build through it, they re-point it at their planted `<key>/bin/python`, and our next
    worker runs it. Now the link is refused before anything is built through it."""
    name, uid, gid = other_user
    shared = sticky_dir(tmp_path, shared_mode, gid)
    private = private_root(tmp_path)
    link = shared / "ray-uv-venvs"
    link.symlink_to(private if where == "venv dir" else tmp_path)
    os.lchown(link, uid, gid)
    root = link if where == "venv dir" else link / private.name
    with pytest.raises(UntrustedPathError) as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    message = str(info.value)
    assert f"refusing the symlink {link} -> " in message
    assert f"owner {name} (uid {uid})" in message and "owned by another user" in message
    assert "RAY_UV_PLUGIN_VENV_DIR" in message  # what to do
    assert list(private.iterdir()) == []  # nothing built there for them to swap away
    monkeypatch.setenv(VENV_DIR_ENV, str(root))
    assert venv_root() == root  # left as given: every use checks it, and says why


def test_our_symlink_is_followed_and_workers_get_the_resolved_path(
    project, tmp_path, other_user, monkeypatch
):
    """A link we (root) made in a sticky dir: nobody else can replace it, so it is followed.
    The venv handed out is under its target, so re-pointing the link afterwards (at a venv
    someone planted) changes nothing for a worker started with it."""
    _, uid, gid = other_user
    shared = sticky_dir(tmp_path)
    private = private_root(tmp_path)
    link = shared / "ray-uv-venvs"
    link.symlink_to(private)
    outcome = ensure_venv(parse_spec({}), load_project(project), root=link)
    pwned = tmp_path / "pwned"
    chown_tree(plant(tmp_path / "theirs", outcome.key, pwned), uid, gid)
    link.unlink()
    link.symlink_to(tmp_path / "theirs")
    run = subprocess.run([outcome.python, "-c", "print('ours')"], capture_output=True, text=True)
    assert run.stdout == "ours\n" and not pwned.exists()
    assert outcome.built and outcome.path == private / outcome.key
    assert Venv(private, outcome.key).lock.exists() and (outcome.path / MARKER).exists()
    link.unlink()
    link.symlink_to(private)
    request = make_request(parse_spec({}), load_project(project), {})
    assert lookup(request, link) == Outcome(outcome.key, outcome.path, False, ANY)
    monkeypatch.setenv(VENV_DIR_ENV, str(link))
    assert venv_root() == private


def test_the_plugin_gives_workers_the_resolved_python(project, tmp_path, monkeypatch):
    """`modify_context` of the real plugin (no Ray cluster needed for it): the interpreter and
    `RAY_UV_PLUGIN_VENV` it sets are under the link's target, not the link."""
    from ray._private.runtime_env.context import RuntimeEnvContext

    from ray_uv_plugin.agent.plugin import UvProjectPlugin
    from ray_uv_plugin.settings import VENV_ENV

    shared = sticky_dir(tmp_path)
    private = private_root(tmp_path)
    link = shared / "ray-uv-venvs"
    link.symlink_to(private)
    monkeypatch.setenv(VENV_DIR_ENV, str(link))
    plugin, context = UvProjectPlugin(), RuntimeEnvContext()
    runtime_env = {"uv_project": {"project": str(project)}}
    asyncio.run(plugin.create(None, runtime_env, context))
    plugin.modify_context([], runtime_env, context)
    key = key_of(project, private)
    assert context.py_executable == str(private / key / "bin" / "python")
    assert context.env_vars[VENV_ENV] == str(private / key)


@pytest.mark.parametrize(
    "how, error",
    [
        ("loop", "more than 40 symlinks"),
        ("file on the way", "is not a directory"),
        ("target under a dir others can write", "above the venv dir .*: others can write it"),
    ],
)
def test_what_a_link_of_ours_leads_to_is_checked_too(project, tmp_path, how, error):
    link = tmp_path / "venvs"
    if how == "loop":
        (tmp_path / "other").symlink_to(link)
        link.symlink_to(tmp_path / "other")
        root = link
    elif how == "file on the way":
        (tmp_path / "file").write_text("")
        link.symlink_to(tmp_path / "file")
        root = link / "venvs"
    else:
        open_dir = tmp_path / "open"
        open_dir.mkdir(mode=0o777)
        open_dir.chmod(0o777)
        private_root(open_dir)
        link.symlink_to(open_dir / "venvs")
        root = link
    with pytest.raises(UntrustedPathError, match=error):
        ensure_venv(parse_spec({}), load_project(project), root=root)


@pytest.fixture
def umask_002() -> Iterator[None]:
    """The default umask for users on many Linux distributions."""
    saved = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(saved)


@pytest.mark.parametrize("group", [False, True], ids=["private", "trusted-group"])
def test_a_new_nested_venv_dir_gets_our_modes_under_umask_002(
    tmp_path, umask_002, monkeypatch, group
):
    """`~/.cache/ray-uv-plugin/venvs` on a home without `.cache`: every dir we make has the
    mode the trust check asks for, whatever the umask, so the check accepts it."""
    if group:
        monkeypatch.setenv(TRUSTED_GROUP_ENV, "0")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    root = home / ".cache" / "ray-uv-plugin" / "venvs"
    assert make_root(root) == root
    for parent in (home / ".cache", home / ".cache" / "ray-uv-plugin"):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o755, parent
    assert stat.S_IMODE(root.stat().st_mode) == (0o2770 if group else 0o700)
    assert check_root(root) == root


def test_a_build_into_a_new_nested_venv_dir_under_umask_002(project, tmp_path, umask_002):
    outcome = ensure_venv(parse_spec({}), load_project(project), root=tmp_path / "a" / "venvs")
    assert outcome.built
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
    assert stat.S_IMODE(Venv(outcome.path.parent, outcome.key).lock.stat().st_mode) == 0o600


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 1 MiB tmpfs holding an empty venv dir, then filled up (root only; unmounted after)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill up needs root")
    mount = tmp_path / "disk"
    mount.mkdir(mode=0o700)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        root = mount / "venvs"
        root.mkdir(mode=0o700)
        yield root
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)


def test_a_full_disk_at_lock_time_is_named_and_leaves_no_lock_file(project, full_disk):
    fill(full_disk.parent)
    with pytest.raises(DiskFullError) as info:
        ensure_venv(parse_spec({}), load_project(project), root=full_disk)
    message = str(info.value)
    assert f"the disk of the venv dir {full_disk} is full (0 MiB free" in message
    assert "ray-uv gc --max-size" in message and "RAY_UV_PLUGIN_VENV_DIR" in message
    assert list(full_disk.iterdir()) == []


def test_a_full_disk_still_lets_gc_take_an_existing_lock(full_disk):
    """`gc` frees space on a full disk: a lock file a build left can still be taken."""
    lock = BuildLock(full_disk / "k.lock")
    assert lock.try_acquire()
    lock.release()
    fill(full_disk.parent)
    assert lock.try_acquire()
    lock.release()
    assert lock.holder() == f"pid {os.getpid()} on {socket.gethostname()}"

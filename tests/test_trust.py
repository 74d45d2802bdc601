"""Only the plugin user's own, private files are ever used as a venv (issue 8.1). Real uv, no Ray
(tests/test_plugin.py shows the same refusal reaching a Ray caller)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ray_uv_plugin.project import load_project
from ray_uv_plugin.request import make_request
from ray_uv_plugin.spec import parse_spec
from ray_uv_plugin.trust import TRUSTED_GROUP_ENV, UntrustedPathError
from ray_uv_plugin.venv_cache import MARKER, ensure_venv, lock_path, read_marker
from tests.uvproject import write_project


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
    assert stat.S_IMODE(lock_path(root, outcome.key).stat().st_mode) == 0o660


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
    lock_path(root, key_of(project, root)).symlink_to(victim)
    with pytest.raises(UntrustedPathError, match="symlink"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert victim.read_text() == "precious\n"


def test_what_the_plugin_builds_is_private_and_read_only(project, tmp_path):
    root = tmp_path / "new" / "venvs"  # created by the plugin
    outcome = ensure_venv(parse_spec({}), load_project(project), root=root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(lock_path(root, outcome.key).stat().st_mode) == 0o600
    for dirpath, _dirs, _files in os.walk(outcome.path):
        assert os.lstat(dirpath).st_mode & 0o222 == 0, dirpath
    marker = outcome.path / MARKER
    assert marker.stat().st_mode & 0o022 == 0
    # Nobody can add a package to it: modes stop other users than root, chattr +i root too.
    if os.geteuid() != 0 or read_marker(outcome.path)["immutable"]:
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
        "from ray_uv_plugin.trust import check_root, UntrustedPathError\n"
        "try:\n    check_root(Path(sys.argv[1]))\n"
        "except UntrustedPathError as e:\n    print(e); sys.exit(3)\n"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[1])}
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

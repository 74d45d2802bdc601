"""Every error says what and where (issue 8.7). Real uv and real files; no Ray (the same
messages reaching a Ray caller are in tests/test_plugin.py's bad-input test)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ray_uv_plugin.agent.builder import ensure_venv
from ray_uv_plugin.agent.project import ProjectError, check_ray_pin, load_project
from ray_uv_plugin.agent.spec import parse_spec
from ray_uv_plugin.agent.uv import UV_ENV_VAR, UvNotFoundError, UvResult, UvSyncError, sync_failure
from ray_uv_plugin.store.layout import VENV_DIR_ENV, VenvDirError, venv_root
from ray_uv_plugin.store.trust import UntrustedPathError
from tests.uvproject import RAY_PIN, write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("p") / "proj", ["six"])


@pytest.mark.parametrize("what", ["missing", "not executable"])
def test_a_bad_uv_setting_says_which_and_what_to_do(project, tmp_path, monkeypatch, what):
    uv = tmp_path / "uv"
    if what == "not executable":
        uv.write_text("#!/bin/sh\n")
    monkeypatch.setenv(UV_ENV_VAR, str(uv))
    words = "does not exist" if what == "missing" else "is not executable"
    with pytest.raises(UvNotFoundError, match=f"{UV_ENV_VAR}='{uv}' {words} on this node"):
        ensure_venv(parse_spec({}), load_project(project), root=tmp_path / "venvs")


def test_a_relative_venv_dir_is_refused_and_nothing_is_made_in_the_project(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv(VENV_DIR_ENV, "venvs")
    with pytest.raises(VenvDirError, match="'venvs' is relative.*set an absolute path"):
        venv_root()
    assert not (project / "venvs").exists()


def test_a_venv_dir_or_key_that_is_a_file(project, tmp_path):
    root = tmp_path / "venvs-file"
    root.write_text("not a dir\n")
    with pytest.raises(UntrustedPathError, match=f"the venv dir {root} is not a directory"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    root = tmp_path / "venvs"
    first = ensure_venv(parse_spec({}), load_project(project), root=root)
    from ray_uv_plugin.store.freezing import remove_tree

    remove_tree(first.path)
    first.path.write_text("someone's file\n")
    with pytest.raises(UntrustedPathError, match=f"the venv {first.path} is not a directory"):
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert first.path.read_text() == "someone's file\n"  # reported, not removed


def test_a_project_that_is_a_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    with pytest.raises(ProjectError, match="is a file, not a directory"):
        load_project(tmp_path / "pyproject.toml")


def test_a_lock_with_crlf_line_endings_works(tmp_path):
    crlf = write_project(tmp_path / "crlf", ["six"])
    lock = crlf / "uv.lock"
    lock.write_bytes(lock.read_bytes().replace(b"\n", b"\r\n"))
    check_ray_pin(load_project(crlf), RAY_PIN.split("==")[1])  # was: "holds no ray"
    outcome = ensure_venv(parse_spec({}), load_project(crlf), root=tmp_path / "venvs")
    assert outcome.built


def test_unknown_extras_are_named_as_the_user_wrote_them(project):
    from ray_uv_plugin.agent.project import check_request

    with pytest.raises(ProjectError, match=r"unknown extra\(s\) Flash_Attn for"):
        check_request(load_project(project), parse_spec({"extras": ["Flash_Attn"]}))


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 48 MiB tmpfs: too small for a venv with Ray (~260 MiB). Needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_says_which_dir_and_how_much_is_free(project, small_disk, monkeypatch):
    monkeypatch.setenv("UV_LINK_MODE", "copy")  # hardlinks cannot cross into the tmpfs anyway
    root = small_disk / "venvs"
    with pytest.raises(UvSyncError) as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    message = str(info.value)
    assert f"the disk of the venv dir {root} is full" in message and "MiB free" in message
    assert "Nothing half-built was kept" in message
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


# uv's words (0.13) for each kind of failure; a network one may succeed when tried again.
HASH = "error: Failed to download `six==1.17.0`\n  cause: Hash mismatch for `six==1.17.0`\n"
RETRIES = "error: Failed to download `six==1.17.0`\n  cause: Request failed after 3 retries\n"
BUILD = (
    "error: Failed to build `broken @ file:///p`\n  cause: The build backend returned an error\n"
)
SERVER = "error: Failed to fetch: `https://pypi.org/simple/six/`\n  cause: HTTP status server error"


@pytest.mark.parametrize(
    ("output", "hint", "transient"),
    [
        (HASH, "does not have the hash that uv.lock records", False),
        (RETRIES, "the package index could not be reached", True),
        (SERVER, "the package index could not be reached", True),
        (BUILD, "see uv's output below", False),
    ],
)
def test_a_failed_sync_says_what_to_do_and_whether_to_try_again(output, hint, transient):
    error = sync_failure(Path("/p"), UvResult(1, output, 1.0))
    assert hint in str(error) and output.strip().splitlines()[-1] in str(error)
    assert error.transient is transient

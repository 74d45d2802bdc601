"""Every error says what and where. Real uv and real files; the errors of a node's
setup as the driver reads them, from a real Ray: the cause first, paths as the user
wrote them. Every bad input reaching a Ray caller is in tests/agent/test_plugin.py's bad-input
test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.project import ProjectError, check_ray_pin, load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvNotFoundError, UvResult, UvSyncError, sync_failure
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_ENV, VenvDirError
from ray_uv_plugin.store.layout import venv_root
from ray_uv_plugin.store.trust import UntrustedPathError
from tests.support.uvproject import RAY_PIN, CountingUv, left_in, write_project


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
    from ray_uv_plugin.env.project import check_request

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
    assert [name for name in left_in(root) if not name.endswith(".lock")] == []


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


# --- a node's setup error as the driver reads it -----------------------------------------------


def test_a_setup_error_hides_the_traceback_and_names_the_working_dir_as_given(tmp_path):
    """Without Ray: what Ray's agent formats for the driver (`traceback.format_exception`)."""
    import traceback

    from ray_uv_plugin.agent.setup_error import Where, setup_error

    copy = str(tmp_path / "session" / "working_dir_files" / "_ray_pkg_0123abcd")
    where = Where("sub/proj", copy, "gcs://_ray_pkg_0123abcd.zip", "/s/runtime_env_setup-01.log")
    try:
        try:
            raise ProjectError(f"uv_project: project directory {copy}/sub/proj does not exist")
        except ProjectError as e:
            raise setup_error(e, where) from None
    except Exception as e:  # noqa: BLE001 - as Ray's agent catches it
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        assert e.__traceback__ is None and sys.exc_info()[2] is not None  # logging keeps it
    first, *rest = text.splitlines()
    assert first == (
        "ray_uv_plugin.UvProjectSetupError: uv_project: project directory "
        "<working_dir>/sub/proj does not exist"
    )
    assert rest == [
        "uv_project.project 'sub/proj' is relative, so it was read relative to the working_dir: "
        "<working_dir>/sub/proj.",
        "<working_dir> is the job's working_dir (gcs://_ray_pkg_0123abcd.zip) as Ray unpacked "
        f"it on this node: {copy}",
        "This setup's log on this node: /s/runtime_env_setup-01.log",
    ]
    # An absolute project, or a working_dir the user gave as local://, is named as it is.
    local = Where("/data/proj", "/shared/wd", "local:///shared/wd", None)
    said = str(setup_error(ProjectError("uv_project: /data/proj has no uv.lock"), local))
    assert said == "uv_project: /data/proj has no uv.lock"


def test_a_file_changed_in_uvs_cache_fails_every_later_build_that_links_it(tmp_path, monkeypatch):
    """A job that writes into its own venv's file writes uv's cache (the same inode: uv
    hardlinks), and so into every venv later made from it: one job would decide what another
    runs. The next build that links that file (another key) is not made ready: its setup fails
    naming the file, the likely cause and the fix, and keeps nothing but the setup's records.
    Was: ready, with a warning. Real uv and a uv cache of the test's own (the node's, set for
    `ray start`: here the driver's environment, which the local Ray's agent inherits)."""
    import ray

    from ray_uv_plugin.store import phases

    cache, root = tmp_path / "uv-cache", tmp_path / "venvs"
    monkeypatch.setenv("UV_CACHE_DIR", str(cache))
    monkeypatch.setenv(VENV_DIR_ENV, str(root))
    proj = write_project(tmp_path / "proj", ["six"], extras={"fig": ["six"]})
    first = ensure_venv(parse_spec({}), load_project(proj), root=tmp_path / "first")
    six = next(first.path.glob("lib/python*/site-packages/six.py"))
    linked = [p for p in cache.rglob("six.py") if p.stat().st_ino == six.stat().st_ino]
    assert linked, "uv did not hardlink six.py from its cache"
    with open(six, "a") as f:  # what a worker running as the file's owner can do
        f.write("\nRAN = 'another job decided this'\n")
    ray.init(address="local", num_cpus=1)
    try:
        text = _setup_error({"uv_project": {"project": str(proj), "extras": ["fig"]}})
    finally:
        ray.shutdown()
    cause = after_node(text.splitlines()[1])
    rel = str(six.relative_to(first.path))
    assert re.match(
        r"ray_uv_plugin\.UvProjectSetupError: uv_project: the venv (?P<key>\w+) holds 1 files "
        rf"that differ from their distribution's RECORD: {re.escape(rel)} "
        rf"\(six-[\d.]+\.dist-info\)\. Most likely they changed in this node's uv cache "
        rf"\({re.escape(str(cache))}\), through a hardlink of another venv",
        cause,
    ), text
    assert f"run `UV_CACHE_DIR={cache} uv cache clean six` on this node, then retry" in text
    assert "the wheel's own RECORD is wrong: report it to the package" in text
    key = re.search(r"the venv (\w+) holds", cause)[1]
    assert key != first.path.name
    assert [name for name in left_in(root) if name != f"{key}.lock"] == []  # nothing half-built
    record = phases.read_record(root, key)
    assert (
        record["state"] == "failed" and "differ from their distribution's RECORD" in record["cause"]
    )
    assert any(line.startswith(f"{key} ") for line in (root / ".outcomes").read_text().splitlines())


@pytest.fixture(scope="module")
def ray_with_working_dir(tmp_path_factory):
    """A local Ray whose job has a working_dir holding projects, good and bad."""
    import ray

    wd = tmp_path_factory.mktemp("job")
    write_project(wd / "app", ["six"], extras={"fig": ["six"]})
    stale = write_project(wd / "stale", ["six"])
    text = (stale / "pyproject.toml").read_text()
    (stale / "pyproject.toml").write_text(text.replace('"six"', '"six", "tomli-w"'))
    uv = CountingUv(tmp_path_factory.mktemp("uv"))
    saved = os.environ.get(UV_ENV_VAR)
    os.environ[UV_ENV_VAR] = str(uv.path)
    ray.init(address="local", num_cpus=2, runtime_env={"working_dir": str(wd)})
    yield uv
    ray.shutdown()
    os.environ.pop(UV_ENV_VAR) if saved is None else os.environ.__setitem__(UV_ENV_VAR, saved)


def _setup_error(runtime_env: dict) -> str:
    import ray
    from ray.exceptions import RuntimeEnvSetupError

    @ray.remote(num_cpus=0)
    def nothing() -> None:
        return None

    with pytest.raises(RuntimeEnvSetupError) as info:
        ray.get(nothing.options(runtime_env=runtime_env).remote(), timeout=180)
    return str(info.value)


def after_node(line: str) -> str:
    """The line less the `[Node <ip>] ` that Ray 2.60 puts first (Ray 2.44.1 puts none)."""
    return re.sub(r"^\[Node [^\]]+\] ", "", line)


@pytest.mark.parametrize(
    ("project", "extras", "cause"),
    [
        (
            "stale",
            [],
            "uv_project: `uv sync` failed for <working_dir>/stale (exit 1): uv.lock is out of "
            "date with pyproject.toml: run `uv lock`",
        ),
        (
            "app",
            ["gpu"],
            "uv_project: unknown extra(s) gpu for <working_dir>/app; the project has fig",
        ),
        (
            "nope",
            [],
            "uv_project: project directory <working_dir>/nope does not exist on this node: point "
            "uv_project.project",
        ),
    ],
)
def test_the_driver_reads_the_cause_first_with_paths_as_given(
    ray_with_working_dir, project, extras, cause
):
    """Was: 1.5-2.4k characters, 18-27 lines, the cause after ~20 traceback lines, naming
    `/tmp/ray/session_.../_ray_pkg_<hash>/<project>`. Now the line after Ray's own prefix."""
    text = _setup_error({"uv_project": {"project": project, "extras": extras}})
    ray_says, node_line, *details = text.splitlines()
    assert ray_says == "Failed to set up runtime environment."
    assert "Traceback" not in text
    assert after_node(node_line).startswith(f"ray_uv_plugin.UvProjectSetupError: {cause}")
    assert "_ray_pkg_" not in node_line  # Ray's copy is named after the cause, once
    relative = (
        f"uv_project.project {project!r} is relative, so it was read relative to the "
        f"working_dir: <working_dir>/{project}."
    )
    assert relative in details
    copy = next(line for line in details if line.startswith("<working_dir> is the job's"))
    assert "_ray_pkg_" in copy and "as Ray unpacked it on this node: /" in copy
    log = next(line for line in details if line.startswith("This setup's log on this node: "))
    assert Path(log.split(": ", 1)[1]).name.startswith("runtime_env_setup-")
    # uv's output, where it matters, stays; the rest is a few short lines.
    assert len(text) < (1900 if project == "stale" else 900), text
    if project == "stale":
        assert "error: The lockfile at `uv.lock` needs to be updated" in text


def test_rays_retries_run_uv_once_and_only_another_request_hears_of_it(ray_with_working_dir):
    """Ray's agent tries a failed setup 3 times; a request with env_vars (on whose PYTHONPATH
    Ray's working_dir plugin puts the working_dir again on each try) ran uv 3 times. Its
    driver then read "This is Ray retrying the same request" (487 of 1,358 characters) on the
    user's first try: now the first try's error as it was, and only another request with the
    same build settings, for which uv did not run, is told why."""
    uv = ray_with_working_dir
    before = uv.syncs()
    text = _setup_error({"uv_project": {"project": "stale"}, "env_vars": {"RETRY": "7"}})
    assert uv.syncs() == before + 1
    cause = after_node(text.splitlines()[1])
    assert cause.startswith("ray_uv_plugin.UvProjectSetupError: uv_project: `uv sync` failed")
    assert "not run again" not in text and "retrying" not in text, text
    # Another runtime_env (Ray sets it up anew) with the same sync: answered from memory.
    other = {"project": "stale", "job_default": True}
    again = _setup_error({"uv_project": other, "env_vars": {"RETRY": "7"}})
    assert uv.syncs() == before + 1
    assert after_node(again.splitlines()[1]) == cause
    assert "(uv was not run again for this request: a request with the same build settings" in again

"""Building, reusing and rebuilding venvs with the real uv, across processes. No Ray."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.project import ProjectError, load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_MAX_BYTES_ENV, NodeSettings
from ray_uv_plugin.store.layout import MARKER, Venv
from tests.support.uvproject import CountingUv, write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(
        tmp_path_factory.mktemp("p") / "proj", ["six"], extras={"fig": ["pyfiglet"]}
    )


@pytest.fixture
def counting_uv(tmp_path, monkeypatch) -> CountingUv:
    uv = CountingUv(tmp_path / "uvbin")
    monkeypatch.setenv(UV_ENV_VAR, str(uv.path))
    return uv


def _python_can_import(venv: Path, module: str) -> bool:
    code = f"import {module}"
    return (
        subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True).returncode == 0
    )


def test_build_once_then_reuse_without_uv(project, tmp_path, counting_uv):
    spec = parse_spec({"extras": ["fig"]})
    first = ensure_venv(spec, load_project(project), root=tmp_path / "venvs")
    assert first.built and counting_uv.syncs() == 1
    assert _python_can_import(first.path, "pyfiglet") and _python_can_import(first.path, "six")
    assert not _python_can_import(first.path, "pytest")  # nothing of the caller's environment
    meta = Venv.at(first.path).read_marker()
    assert meta["extras"] == ["fig"] and meta["ray"] == ray.__version__
    again = ensure_venv(spec, load_project(project), root=tmp_path / "venvs")
    assert (again.path, again.built) == (first.path, False)
    assert counting_uv.syncs() == 1
    assert again.seconds < 0.05
    other = ensure_venv(parse_spec({}), load_project(project), root=tmp_path / "venvs")
    assert other.path != first.path and not _python_can_import(other.path, "pyfiglet")
    assert counting_uv.syncs() == 2


def test_a_request_builds_with_the_node_settings_it_was_handed(
    project, tmp_path, counting_uv, monkeypatch
):
    """The node's settings are read once per request and handed on to its build: a budget no
    venv fits, handed in, fails the build where this process's environment sets none."""
    monkeypatch.delenv(VENV_DIR_MAX_BYTES_ENV, raising=False)
    settings = NodeSettings(venv_dir_max_bytes="1K")
    root = tmp_path / "venvs"
    with pytest.raises(
        UvSyncError, match=f"over its budget of 1.0KiB \\({VENV_DIR_MAX_BYTES_ENV}\\)"
    ):
        ensure_venv(parse_spec({}), load_project(project), root=root, settings=settings)
    assert counting_uv.syncs() == 1
    assert [p.name for p in root.iterdir() if p.is_dir()] == []  # the new venv was not kept


def _ensure_in_child(project: str, root: str) -> str:
    return str(ensure_venv(parse_spec({}), load_project(Path(project)), root=Path(root)).path)


def test_processes_racing_for_one_key_sync_once(project, tmp_path, counting_uv):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(6) as pool:
        paths = pool.starmap(_ensure_in_child, [(str(project), str(tmp_path / "v"))] * 6)
    assert len(set(paths)) == 1
    assert counting_uv.syncs() == 1


def test_a_sync_killed_half_way_is_rebuilt(project, tmp_path, monkeypatch):
    slow = CountingUv(tmp_path / "slow", sleep_after=60)  # uv finishes, then the build hangs
    root = tmp_path / "venvs"
    code = (
        "import sys; from pathlib import Path; "
        "from tests.building.test_venv_cache import _ensure_in_child;"
        f"_ensure_in_child({str(project)!r}, {str(root)!r})"
    )
    env = {**os.environ, UV_ENV_VAR: str(slow.path)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 120
    while "synced" not in slow.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    # uv has written the venv; the marker has not been written
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    (venv,) = [p for p in root.iterdir() if p.is_dir()]
    assert not (venv / MARKER).exists()

    counting = CountingUv(tmp_path / "count")
    monkeypatch.setenv(UV_ENV_VAR, str(counting.path))
    outcome = ensure_venv(parse_spec({}), load_project(project), root=root)
    assert outcome.built and outcome.path == venv and counting.syncs() == 1
    assert (venv / MARKER).exists() and _python_can_import(venv, "six")


def test_a_failed_sync_leaves_nothing_and_says_what_to_do(project, tmp_path):
    stale = tmp_path / "stale"
    write_project(stale, ["six"])
    write_project(stale, ["six", "pyfiglet"], lock=False)  # pyproject changed, lock did not
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError, match=r"uv.lock is out of date.*run `uv lock`") as info:
        ensure_venv(parse_spec({}), load_project(stale), root=root)
    assert "uv output" in str(info.value)
    assert not [p for p in root.iterdir() if p.is_dir()]
    # frozen uses the lock as it is.
    assert ensure_venv(parse_spec({"frozen": True}), load_project(stale), root=root).built


def test_ray_missing_from_the_chosen_environment(tmp_path):
    proj = write_project(
        tmp_path / "p", ["six"], extras={"ray": [f"ray=={ray.__version__}"]}, with_ray=False
    )
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError, match=f"got ray none but this node runs ray {ray.__version__}"):
        ensure_venv(parse_spec({}), load_project(proj), root=root)
    assert not [p for p in root.iterdir() if p.is_dir()]
    assert ensure_venv(parse_spec({"extras": ["ray"]}), load_project(proj), root=root).built


def test_checks_before_uv_runs(project, tmp_path, counting_uv):
    with pytest.raises(ProjectError, match="unknown extra"):
        ensure_venv(parse_spec({"extras": ["gpu"]}), load_project(project), root=tmp_path)
    assert counting_uv.syncs() == 0


def _break(venv: Path, how: str) -> None:
    """Damage a ready venv the way an operator or a crashed disk might."""
    from ray_uv_plugin.store.freezing import remove_tree, thaw

    site = next(venv.glob("lib/python*/site-packages"))
    thaw(venv)  # the plugin leaves venvs read-only
    if how == "site-packages removed":
        remove_tree(site)
    elif how == "bin/python removed":
        (venv / "bin" / "python").unlink()
    elif how == "marker a directory":
        (venv / MARKER).unlink()
        (venv / MARKER).mkdir()
    else:
        (venv / MARKER).unlink()
        content = {
            "marker empty": b"",
            "marker garbage": b"\x89PNG\x00\xff",
            "marker a JSON list": b"[1, 2]",
            "marker of another key": b'{"format": 1, "key": "0000000000000000"}',
        }[how]
        (venv / MARKER).write_bytes(content)


@pytest.mark.parametrize(
    "how",
    [
        "site-packages removed",
        "bin/python removed",
        "marker empty",
        "marker garbage",
        "marker a JSON list",
        "marker of another key",
        "marker a directory",
    ],
)
def test_a_ready_venv_that_is_no_longer_whole_is_rebuilt(project, tmp_path, counting_uv, how):
    root = tmp_path / "venvs"
    first = ensure_venv(parse_spec({}), load_project(project), root=root)
    _break(first.path, how)
    again = ensure_venv(parse_spec({}), load_project(project), root=root)
    assert again.built and again.path == first.path and counting_uv.syncs() == 2
    assert again.rebuilt_because is not None
    assert _python_can_import(again.path, "six")
    assert Venv.at(again.path).read_marker()["key"] == first.key


def test_bytecode_is_compiled_at_build_time_by_default(project, tmp_path, monkeypatch):
    """The venv is read-only: workers of a user other than root could not write `.pyc` files,
    and every one of them would compile every module it imports again."""
    monkeypatch.delenv("UV_COMPILE_BYTECODE")  # the test suite turns it off for speed
    outcome = ensure_venv(parse_spec({}), load_project(project), root=tmp_path / "venvs")
    site = next(outcome.path.glob("lib/python*/site-packages"))
    assert list((site / "__pycache__").glob("six.cpython-*.pyc"))
    assert Venv.at(outcome.path).read_marker()["inputs"]["env"] == [["UV_COMPILE_BYTECODE", "1"]]

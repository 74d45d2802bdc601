"""What a failed build leaves behind: a memory of it that answers only the same sync,
a uv killed by someone else's signal that is tried again, a uv that dies with the process that
started it, and a message that says how long Ray itself keeps the failure. Real uv; Ray at the
end."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import RuntimeEnvSetupError

from ray_uv_plugin.building import failed_builds
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.building.failed_builds import RAY_CACHE_ENV
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvResult, UvSyncError, find_uv, run_uv, sync_failure
from ray_uv_plugin.settings import FAILED_BUILD_MEMO_ENV, UV_ENV_VAR, VENV_DIR_ENV
from ray_uv_plugin.store.layout import Venv
from tests.support.uvproject import CountingUv, tamper_hashes, write_project

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("failed") / "proj", ["six"])


# --- the memo answers only the sync that failed -------------------------------------------------


def test_a_failure_is_remembered_only_for_the_same_settings(project, tmp_path, monkeypatch):
    """A job whose UV_HTTP_TIMEOUT uv cannot read fails; a job a moment later with a good one (a
    setting outside the venv's key) builds instead of getting that failure from memory."""
    counting = CountingUv(tmp_path / "uv")
    monkeypatch.setenv(UV_ENV_VAR, str(counting.path))
    root = tmp_path / "venvs"
    bad = {"UV_HTTP_TIMEOUT": "soon"}
    for _ in range(2):  # the same sync again: from memory
        with pytest.raises(UvSyncError, match="Failed to parse environment variable"):
            ensure_venv(parse_spec({}), load_project(project), bad, root=root)
    assert counting.syncs() == 1
    good = {"UV_HTTP_TIMEOUT": "300"}
    outcome = ensure_venv(parse_spec({}), load_project(project), good, root=root)
    assert outcome.built and counting.syncs() == 2


def test_rays_tries_of_one_request_have_the_same_inputs(project):
    """Ray's working_dir plugin puts the working_dir first on a job's PYTHONPATH again on each
    try of a request (`wd`, `wd:wd`): its retries were built again, uv three times."""
    from ray_uv_plugin.env.key import make_request

    def inputs(env_vars: dict[str, str]) -> str:
        return failed_builds.sync_inputs(
            make_request(parse_spec({}), load_project(project), env_vars), Path("/venvs/k")
        )

    first = inputs({"X": "1", "PYTHONPATH": "/wd:/site"})
    assert inputs({"X": "1", "PYTHONPATH": "/wd:/wd:/site:/site"}) == first
    assert inputs({"X": "1", "PYTHONPATH": "/other:/wd:/site"}) != first
    assert inputs({"X": "2", "PYTHONPATH": "/wd:/site"}) != first


# --- a uv killed by a signal the plugin did not send --------------------------------------------


def test_a_uv_killed_by_someone_else_is_not_remembered(project, tmp_path, monkeypatch):
    """The OOM killer (here: a SIGKILL sent to the real uv as soon as it runs) is not a lasting
    failure: the error names the signal and the next request builds."""
    killed = tmp_path / "killed-once"
    wrapper = tmp_path / "uv-killed-once.sh"
    # `$$` in the subshell is the shell's pid, which `exec` hands to uv; it is killed once it
    # is uv (a sync takes ~0.2 s here), before it could finish.
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = sync ] && [ ! -e {killed} ]; then touch {killed}; '
        "(for _ in $(seq 2000); do case $(readlink /proc/$$/exe) in */uv) break;; esac; "
        "sleep 0.005; done; kill -KILL $$) & fi\n"
        f'exec {find_uv()} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv(UV_ENV_VAR, str(wrapper))
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError) as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert "uv was killed by SIGKILL (not by the plugin: the OOM killer or an operator?)" in str(
        info.value
    )
    assert info.value.transient and killed.exists()
    assert not [p for p in root.iterdir() if p.is_dir()]  # nothing half-built is used
    assert ensure_venv(parse_spec({}), load_project(project), root=root).built


def test_a_signal_is_named_and_tried_again_and_an_exit_code_is_not() -> None:
    killed = sync_failure(Path("/p"), UvResult(-signal.SIGTERM, "Resolved 9 packages\n", 1.0))
    assert "uv was killed by SIGTERM (not by the plugin" in str(killed) and killed.transient
    assert "Resolved 9 packages" in str(killed)
    odd = sync_failure(Path("/p"), UvResult(-200, "", 1.0))
    assert "uv was killed by signal 200" in str(odd) and odd.transient
    exited = sync_failure(Path("/p"), UvResult(2, "error: something\n", 1.0))
    assert "(exit 2)" in str(exited) and not exited.transient


# --- uv's child side loads nothing, and uv dies with its parent ---------------------------------


def test_the_child_side_of_run_uv_loads_no_library(monkeypatch):
    """Between fork() and exec() in the threaded agent, loading a library can deadlock on the
    dynamic loader's lock: the child only calls a function resolved at import."""

    def no_loading(*args, **kwargs):
        raise AssertionError("a library was loaded between fork() and exec()")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    result = run_uv(["--version"], env=dict(os.environ))
    assert result.returncode == 0 and result.output.startswith("uv ")


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_uv_dies_with_the_process_that_started_it(tmp_path):
    """A real uv waiting on an index that never answers; the process that ran it is SIGKILLed:
    the uv goes too, instead of writing on into a venv that the next request rebuilds."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections in the kernel, never answers
    (tmp_path / "req.in").write_text("six\n")
    args = [
        "pip",
        "compile",
        str(tmp_path / "req.in"),
        "--no-cache",
        "--no-config",
        "--python",
        sys.executable,
        "--index-url",
        f"http://127.0.0.1:{silent.getsockname()[1]}/simple",
    ]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "UV_HTTP_TIMEOUT": "300"}
    code = (
        "import json, sys; from ray_uv_plugin.env.uv import run_uv\n"
        "run_uv(json.loads(sys.argv[1]), env=json.loads(sys.argv[2]))\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args), json.dumps(env)], cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 60
        uv: list[int] = []
        while not uv and time.monotonic() < deadline:
            time.sleep(0.1)
            uv = [p for p in _children(parent.pid) if "compile" in _cmdline(p)]
        assert uv, "uv did not start"
        time.sleep(0.5)
        assert _alive(uv[0])  # waiting on the silent index
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        silent.close()
    deadline = time.monotonic() + 10
    while _alive(uv[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(uv[0])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# --- what the message promises about Ray's own cache of failures --------------------------------


def test_the_message_says_how_long_ray_keeps_the_failure_and_how_to_retry_now(
    tmp_path, monkeypatch
):
    from ray._private.runtime_env.agent import runtime_env_consts

    monkeypatch.setattr(runtime_env_consts, RAY_CACHE_ENV, 123)
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "45")
    venv = Venv(tmp_path / "venvs", "0123456789abcdef")
    failed_builds.remember(venv, "inputs", "uv_project: it failed")
    failure = failed_builds.recent(venv, "inputs")
    assert failure is not None and failure.first == "uv_project: it failed"
    message = str(failure)
    assert message.startswith("uv_project: it failed\n")
    # Plainly another request's failure, with its cause above it.
    assert (
        "(uv was not run again for this request: a request with the same build settings "
        "failed 0s ago with the error above" in message
    )
    assert f"a failed sync of {venv.key} is remembered for 45s." in message
    assert (
        "Ray answers an identical runtime_env with this error for 123s "
        "(BAD_RUNTIME_ENV_CACHE_TTL_SECONDS)" in message
    )
    assert 'change the runtime_env\'s env_vars (e.g. add "RETRY": "1")' in message
    assert "or lower it in the environment of `ray start`" in message
    assert failed_builds.recent(venv, "other inputs") is None
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "0")
    assert failed_builds.recent(venv, "inputs") is None


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_memo_setting_says_what_to_set(monkeypatch, value):
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, value)
    with pytest.raises(
        ValueError, match=f"{FAILED_BUILD_MEMO_ENV}='{value}' must be a number of seconds >= 0"
    ):
        failed_builds.recent(Venv(Path("/v"), "k"), "inputs")


# --- in Ray: both caches, and the two ways to try again -----------------------------------------

WINDOW = 8  # seconds, for Ray's cache of failures and for the memo


@pytest.fixture(scope="module")
def ray_with_short_memories(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-failed")
    names = (UV_ENV_VAR, VENV_DIR_ENV, FAILED_BUILD_MEMO_ENV, RAY_CACHE_ENV)
    saved = {k: os.environ.get(k) for k in names}
    uv = CountingUv(tmp / "uvbin")
    os.environ.update(
        {
            UV_ENV_VAR: str(uv.path),
            VENV_DIR_ENV: str(tmp / "venvs"),
            FAILED_BUILD_MEMO_ENV: str(WINDOW),
            RAY_CACHE_ENV: str(WINDOW),
        }
    )
    ray.init(address="local", num_cpus=2)
    yield uv
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@ray.remote(num_cpus=0)
def hello() -> str:
    return "hello"


@pytest.mark.slow
def test_an_identical_request_is_built_again_after_both_windows(ray_with_short_memories, tmp_path):
    uv = ray_with_short_memories
    project = write_project(tmp_path / "tampered", ["six"], name="tampered-twice")
    tamper_hashes(project, "six")
    env = {"uv_project": {"project": str(project)}}

    def fails(runtime_env: dict) -> str:
        with pytest.raises(RuntimeEnvSetupError) as info:
            ray.get(hello.options(runtime_env=runtime_env).remote(), timeout=120)
        assert "does not have the hash that uv.lock records" in str(info.value)
        return str(info.value)

    message = fails(env)
    failed_at = time.monotonic()
    assert uv.syncs() == 1  # Ray's retries were answered from memory
    # The user's first try reads its own failure: Ray's retries of it say nothing of a memo.
    assert "uv was not run again" not in message and "Ray answers an identical" not in message
    fails(env)  # Ray's agent answers it from its own cache
    assert uv.syncs() == 1
    fails({**env, "env_vars": {"RETRY": "1"}})  # as the message says: a new request
    assert uv.syncs() == 2
    time.sleep(max(0.0, failed_at + WINDOW + 2 - time.monotonic()))
    fails(env)
    assert uv.syncs() == 3


# --- the memo itself, without uv or Ray -------------------------------------------------------


def test_the_memo_holds_one_failure_per_venv_and_inputs_for_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failed_builds, "ray_failure_cache_seconds", lambda: 600)
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "60")
    venv = Venv(tmp_path, "0123456789abcdef")
    failed_builds.remember(venv, "inputs-a", "uv_project: it failed")
    failure = failed_builds.recent(venv, "inputs-a")
    said = str(failure)
    assert failure is not None and said.startswith("uv_project: it failed\n")
    assert "failed 0s ago" in said and "is remembered for 60s." in said
    assert "with this error for 600s" in said
    assert failed_builds.recent(venv, "inputs-b") is None  # other settings: built again
    assert failed_builds.recent(Venv(tmp_path, "fedcba9876543210"), "inputs-a") is None
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "0.05")
    time.sleep(0.1)
    assert failed_builds.recent(venv, "inputs-a") is None  # the window is over


def test_a_zero_memo_remembers_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "0")
    failed_builds.remember(Venv(tmp_path, "v"), "inputs", "uv_project: it failed")
    assert failed_builds.recent(Venv(tmp_path, "v"), "inputs") is None

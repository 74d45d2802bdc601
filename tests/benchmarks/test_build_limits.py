"""A slow or hung build cannot freeze the node: builds time out, lock waits are
bounded and cancellable, different keys never wait on each other. Real uv; Ray at the end."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import RuntimeEnvSetupError

from ray_uv_plugin.building.ensure import ensure_venv, ensure_venv_async
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError, find_uv
from ray_uv_plugin.settings import (
    BUILD_TIMEOUT_ENV,
    FAILED_BUILD_MEMO_ENV,
    UV_ENV_VAR,
    VENV_DIR_ENV,
)
from ray_uv_plugin.store.build_lock import LockTimeout
from tests.support.uvproject import (
    CountingUv,
    left_in,
    tamper_hashes,
    unreachable_index,
    write_project,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def projects(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("limits")
    return write_project(tmp / "slow", ["six"]), write_project(tmp / "small", ["tomli-w"])


def processes_running(needle: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(pid))
    return found


def test_a_build_past_its_timeout_is_killed_and_leaves_nothing(projects, tmp_path, monkeypatch):
    hung = CountingUv(tmp_path / "uv", sleep_after=47.25)  # uv syncs, then "hangs"
    monkeypatch.setenv(UV_ENV_VAR, str(hung.path))
    root = tmp_path / "venvs"
    start = time.monotonic()
    with pytest.raises(UvSyncError, match=r"uv sync for .*/slow ran past 6s and was killed"):
        ensure_venv(parse_spec({}), load_project(projects[0]), root=root, timeout=6)
    assert time.monotonic() - start < 30
    assert "synced" in hung.log.read_text()  # the venv had been written...
    # Only the key's lock: the build's ticket for its slot (`.build-...`) went with it.
    assert left_in(root) == [f"{p.name}" for p in root.glob("*.lock")]
    time.sleep(0.5)
    assert processes_running("sleep 47.25") == []  # ...and uv's whole process group is gone


def hold_lock(lock: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from pathlib import Path\n"
        "from ray_uv_plugin.store.build_lock import BuildLock\n"
        "assert BuildLock(Path(sys.argv[1])).try_acquire(); print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(lock)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def test_a_lock_held_by_another_process_is_waited_for_a_bounded_time(projects, tmp_path):
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    files = load_project(projects[1])
    key = make_request(parse_spec({}), files, {}).key
    holder = hold_lock(root / f"{key}.lock")
    try:
        with pytest.raises(LockTimeout) as info:
            ensure_venv(parse_spec({}), files, root=root, lock_timeout=2)
        assert f"waited 2s for another build of {key}" in str(info.value)
        assert f"pid {holder.pid} on " in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    assert ensure_venv(parse_spec({}), files, root=root).built  # the holder died: go on


def test_a_cancelled_wait_leaves_no_thread_and_no_lock(projects, tmp_path):
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    files = load_project(projects[1])
    request = make_request(parse_spec({}), files, {})
    holder = hold_lock(root / f"{request.key}.lock")
    try:
        before = threading.active_count()

        async def give_up_soon() -> None:
            await asyncio.wait_for(ensure_venv_async(request, root), timeout=1.0)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(give_up_soon())
        assert threading.active_count() == before
    finally:
        holder.kill()
        holder.wait()
    assert ensure_venv(parse_spec({}), files, root=root).built


def test_a_slow_build_does_not_hold_up_another_key(projects, tmp_path, monkeypatch):
    monkeypatch.setenv(UV_ENV_VAR, str(CountingUv(tmp_path / "uv").path))
    root = tmp_path / "venvs"
    # A job's variable reaches uv only where the job names it (and so keys it).
    slow_spec = parse_spec({"build_env_vars": ["SLOW_UV_SECONDS"]})
    slow = make_request(slow_spec, load_project(projects[0]), {"SLOW_UV_SECONDS": "15"})
    small = make_request(parse_spec({}), load_project(projects[1]), {})
    finished: dict[str, float] = {}

    async def both() -> None:
        start = time.monotonic()

        async def one(name, request) -> None:
            await ensure_venv_async(request, root)
            finished[name] = time.monotonic() - start

        await asyncio.gather(one("slow", slow), one("small", small))

    asyncio.run(both())
    assert finished["small"] < 10 < 15 <= finished["slow"]


def test_a_failed_build_is_answered_from_memory_for_a_while(tmp_path, monkeypatch):
    """Ray's agent runs a failed setup 3 times, 1 s apart: a build that failed for a reason a
    second does not fix is not run again at once, in the same venv dir; later it is."""
    counting = CountingUv(tmp_path / "uv")
    monkeypatch.setenv(UV_ENV_VAR, str(counting.path))
    project = write_project(tmp_path / "tampered", ["six"], name="tampered")
    tamper_hashes(project, "six")
    files = load_project(project)
    root = tmp_path / "venvs"
    hint = "does not have the hash that uv.lock records"
    with pytest.raises(UvSyncError, match=hint) as first:
        ensure_venv(parse_spec({}), files, root=root)
    start = time.monotonic()
    with pytest.raises(UvSyncError) as again:
        ensure_venv(parse_spec({}), files, root=root)
    assert time.monotonic() - start < 1 and counting.syncs() == 1
    assert str(again.value).startswith(str(first.value))
    assert again.value.first == str(first.value)  # what Ray's own retries show
    assert "uv was not run again for this request" in str(again.value)
    assert "same build settings failed 0s ago with the error above" in str(again.value)
    assert [Path(name).suffix for name in left_in(root)] == [".lock"]  # nothing half-built
    with pytest.raises(UvSyncError, match=hint):  # another venv dir: its own build
        ensure_venv(parse_spec({}), files, root=tmp_path / "other-venvs")
    assert counting.syncs() == 2
    monkeypatch.setenv(FAILED_BUILD_MEMO_ENV, "0")  # remembered for no time: built again
    with pytest.raises(UvSyncError, match=hint):
        ensure_venv(parse_spec({}), files, root=root)
    assert counting.syncs() == 3


def test_a_build_that_failed_on_the_network_is_tried_again(projects, tmp_path, monkeypatch):
    counting = CountingUv(tmp_path / "uv")
    monkeypatch.setenv(UV_ENV_VAR, str(counting.path))
    offline = unreachable_index()
    for _ in range(2):
        with pytest.raises(UvSyncError, match="the package index could not be reached"):
            ensure_venv(parse_spec({}), load_project(projects[1]), offline, root=tmp_path / "v")
    assert counting.syncs() == 2


def test_a_sync_whose_project_dir_was_replaced_is_tried_again(projects, tmp_path, monkeypatch):
    """Ray's working_dir plugin removes and unpacks again a working_dir that another raylet
    sharing the host's session dir unpacked: uv fails in the removed dir. Not remembered as
    failed: Ray's retry builds it."""
    project = shutil.copytree(projects[1], tmp_path / "proj")
    replaced = tmp_path / "replaced"
    wrapper = tmp_path / "replacing-uv.sh"
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$1" = sync ] && [ ! -e {replaced} ]; then touch {replaced}; '
        f"cp -r {project} {tmp_path}/unpacked && rm -rf {project} && "
        f'mv {tmp_path}/unpacked {project}; fi\nexec {find_uv()} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv(UV_ENV_VAR, str(wrapper))
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError, match="was removed while uv ran") as info:
        ensure_venv(parse_spec({}), load_project(project), root=root)
    assert info.value.transient and replaced.exists()
    assert ensure_venv(parse_spec({}), load_project(project), root=root).built


# --- in Ray: a request that Ray timed out leaves nothing parked --------------------------------


@pytest.fixture(scope="module")
def ray_with_slow_uv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-limits")
    saved = {k: os.environ.get(k) for k in (UV_ENV_VAR, VENV_DIR_ENV, BUILD_TIMEOUT_ENV)}
    uv = CountingUv(tmp / "uvbin")
    os.environ[UV_ENV_VAR] = str(uv.path)
    os.environ[VENV_DIR_ENV] = str(tmp / "venvs")
    os.environ[BUILD_TIMEOUT_ENV] = "40"
    ray.init(address="local", num_cpus=4)
    yield uv
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@ray.remote(num_cpus=0)
def packages() -> list[str]:
    import importlib.util

    return [m for m in ("six", "tomli_w") if importlib.util.find_spec(m)]


def test_timed_out_requests_do_not_stop_other_envs_from_building(ray_with_slow_uv, projects):
    """Ten requests for a slow env, each given up by Ray after 3 s (and retried by Ray's agent),
    then an unrelated env: it builds at once instead of queueing behind parked threads."""
    slow_env = {
        "uv_project": {"project": str(projects[0]), "build_env_vars": ["SLOW_UV_SECONDS"]},
        "env_vars": {"SLOW_UV_SECONDS": "30"},
        "config": {"setup_timeout_seconds": 3},
    }
    doomed = [packages.options(runtime_env=slow_env).remote() for _ in range(10)]
    for ref in doomed:
        with pytest.raises((RuntimeEnvSetupError, ray.exceptions.GetTimeoutError)):
            ray.get(ref, timeout=120)
    start = time.monotonic()
    small = {"uv_project": {"project": str(projects[1])}}
    assert ray.get(packages.options(runtime_env=small).remote(), timeout=120) == ["tomli_w"]
    assert time.monotonic() - start < 25


def test_rays_retries_of_a_failed_build_run_uv_once(ray_with_slow_uv, tmp_path):
    """Ray's agent sets up a failed env 3 times; uv runs once, and the caller gets uv's error."""
    project = write_project(tmp_path / "tampered", ["six"], name="tampered-in-ray")
    tamper_hashes(project, "six")
    before = ray_with_slow_uv.syncs()
    env = {"uv_project": {"project": str(project)}}
    with pytest.raises(RuntimeEnvSetupError) as info:
        ray.get(packages.options(runtime_env=env).remote(), timeout=120)
    assert "does not have the hash that uv.lock records" in str(info.value)
    assert "Hash mismatch for `six" in str(info.value)  # uv's own words
    assert ray_with_slow_uv.syncs() - before == 1

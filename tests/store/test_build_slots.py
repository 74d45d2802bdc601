"""A crowd of keys queues: at most RAY_UV_PLUGIN_MAX_BUILDS syncs at once per venv
dir, in order of arrival, across processes; waits are logged, bounded and cancellable; a reuse
takes no slot. Pure parts, then real uv (`CountingUv` counts the syncs that overlap), then Ray."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from benchmarks.log_lines import Lines, capturing_logger
from ray_uv_plugin.building.ensure import ensure_venv, ensure_venv_async
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.settings import MAX_BUILDS_ENV, UV_ENV_VAR, VENV_DIR_ENV, VenvDirError
from ray_uv_plugin.store import build_slots, outcomes
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.build_slots import SlotTimeout, Standing, usable_cores
from ray_uv_plugin.store.layout import Venv
from ray_uv_plugin.store.setup_state import read_setup
from tests.support.uvproject import CountingUv, project_variants, write_project

ROOT = Path(__file__).resolve().parents[2]

# --- pure parts ------------------------------------------------------------------------------


def test_the_default_limit_is_the_usable_cores() -> None:
    assert usable_cores(8, None) == 8
    assert usable_cores(8, "max 100000\n") == 8  # no quota
    assert usable_cores(8, "200000 100000\n") == 2  # a pod's 2 cores on a big host
    assert usable_cores(8, "150000 100000") == 2  # 1.5 cores: a second build may use the half
    assert usable_cores(2, "800000 100000") == 2  # the quota never adds cores
    assert usable_cores(4, "garbage") == usable_cores(4, "") == 4
    assert usable_cores(0, None) == 1


def test_the_limit_is_a_whole_number_of_builds(monkeypatch) -> None:
    monkeypatch.delenv(MAX_BUILDS_ENV, raising=False)
    assert build_slots.max_builds() == build_slots.default_max_builds() >= 1
    monkeypatch.setenv(MAX_BUILDS_ENV, " 3 ")
    assert build_slots.max_builds() == 3
    for bad in ("0", "-1", "2.5", "two"):
        monkeypatch.setenv(MAX_BUILDS_ENV, bad)
        with pytest.raises(VenvDirError, match=rf"{MAX_BUILDS_ENV}='{bad}' must be a whole"):
            build_slots.max_builds()


def test_a_standing_says_the_slots_in_use_and_the_place() -> None:
    assert Standing(ahead=0, limit=2).may_build and Standing(ahead=1, limit=2).may_build
    assert not Standing(ahead=2, limit=2).may_build
    assert Standing(ahead=2, limit=2).describe() == "2 of 2 in use; place 1 in queue"
    assert Standing(ahead=4, limit=2).describe() == "2 of 2 in use; place 3 in queue"


# --- real uv ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("slots") / "base", ["six"])


def request_for(project: Path):
    return make_request(parse_spec({}), load_project(project), {})


def setup_logger() -> tuple[logging.Logger, Lines]:
    return capturing_logger("test-slots")


@pytest.fixture
def slow_uv(tmp_path, monkeypatch) -> CountingUv:
    """The node's uv counts syncs and takes 2 s more for each; bytecode is not compiled (fast)."""
    uv = CountingUv(tmp_path / "uv")
    monkeypatch.setenv(UV_ENV_VAR, str(uv.path))
    monkeypatch.setenv("SLOW_UV_SECONDS", "2")
    monkeypatch.setenv("UV_COMPILE_BYTECODE", "0")
    return uv


def tickets(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if build_slots.TICKET.match(p.name))


def test_distinct_keys_build_at_most_the_limit_at_once(
    base_project, tmp_path, slow_uv, monkeypatch
):
    """Five keys at once, limit 2: two syncs run at a time, the others say they wait, all build."""
    monkeypatch.setenv(MAX_BUILDS_ENV, "2")
    root = tmp_path / "venvs"
    requests = [request_for(p) for p in project_variants(base_project, tmp_path, 5)]
    logger, lines = setup_logger()

    async def all_at_once():
        return await asyncio.gather(*(ensure_venv_async(r, root, logger) for r in requests))

    outcomes = asyncio.run(all_at_once())
    assert [o.built for o in outcomes] == [True] * 5
    assert slow_uv.syncs() == 5 and slow_uv.peak_syncs() == 2
    # Each waiting build says so once; a long wait (a loaded machine) adds progress lines
    # ("...; 12.3s so far)"), which are not new waiters.
    said = lines.having("waiting for a build slot (2 of 2 in use; place ")
    waiting = [w for w in said if not w.endswith("s so far)")]
    assert len(waiting) == 3 and len(lines.having(": got a build slot in ")) == 3
    assert {w.split("place ")[1] for w in waiting} == {"1 in queue)", "2 in queue)", "3 in queue)"}
    assert tickets(root) == []  # every build left its place


HOLD_SLOT = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from ray_uv_plugin.store.build_slots import BuildSlot
    slot = BuildSlot(Path(sys.argv[1]), limit=int(sys.argv[2]))
    asyncio.run(slot.acquire_async(600, "a test", print))
    print("held", flush=True)
    time.sleep(600)
    """
)


def hold_slot(root: Path, limit: int = 1) -> subprocess.Popen:
    """Another process that holds a build slot of `root` until it is killed."""
    root.mkdir(mode=0o700, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_SLOT, str(root), str(limit)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)  # no release: the kernel drops its flock
    child.wait()


def test_waiters_build_in_order_of_arrival_and_a_dead_holder_blocks_nobody(
    base_project, tmp_path, slow_uv, monkeypatch
):
    monkeypatch.setenv(MAX_BUILDS_ENV, "1")
    monkeypatch.setenv("SLOW_UV_SECONDS", "0")
    root = tmp_path / "venvs"
    holder = hold_slot(root)
    requests = [request_for(p) for p in project_variants(base_project, tmp_path, 4)]
    logger, lines = setup_logger()

    async def arrive_one_by_one():
        tasks = []
        for r in requests:
            tasks.append(asyncio.create_task(ensure_venv_async(r, root, logger)))
            while len(lines.having(f"{r.key}: waiting for a build slot")) < 1:
                await asyncio.sleep(0.05)
        assert len(tickets(root)) == 5  # the holder's and four waiters'
        kill(holder)  # dies holding the slot: its ticket must not block the queue
        return await asyncio.gather(*tasks)

    try:
        start = time.monotonic()
        outcomes = asyncio.run(arrive_one_by_one())
    finally:
        if holder.poll() is None:
            kill(holder)
    assert all(o.built for o in outcomes) and time.monotonic() - start < 60
    places = [line.split("place ")[1] for line in lines.having("waiting for a build slot (")]
    assert places[:4] == [f"{k} in queue)" for k in (1, 2, 3, 4)]
    built = [line.split(":")[0].split()[1] for line in lines.having(": building: ")]
    assert built == [r.key for r in requests]  # first come, first built
    assert slow_uv.peak_syncs() == 1 and tickets(root) == []


def test_a_cancelled_request_leaves_its_place_and_its_key(
    base_project, tmp_path, slow_uv, monkeypatch
):
    monkeypatch.setenv(MAX_BUILDS_ENV, "1")
    root = tmp_path / "venvs"
    holder = hold_slot(root)
    first, second = (request_for(p) for p in project_variants(base_project, tmp_path, 2))
    try:

        async def give_up_soon() -> None:  # as Ray's setup timeout does
            await asyncio.wait_for(ensure_venv_async(first, root), timeout=1.0)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(give_up_soon())
        assert len(tickets(root)) == 1  # the holder's alone
        key_lock = BuildLock(Venv(root, first.key).lock)
        assert key_lock.try_acquire()  # the key is free for the next request
        key_lock.release()
    finally:
        kill(holder)
    start = time.monotonic()
    assert ensure_venv(parse_spec({}), second.files, root=root).built
    assert time.monotonic() - start < 30 and slow_uv.syncs() == 1


def test_the_wait_for_a_slot_counts_against_the_build_timeout(
    base_project, tmp_path, slow_uv, monkeypatch
):
    monkeypatch.setenv(MAX_BUILDS_ENV, "1")
    root = tmp_path / "venvs"
    holder = hold_slot(root)
    holder.send_signal(signal.SIGSTOP)  # keeps its slot (docs/operations.md): the wait is bounded
    (project,) = project_variants(base_project, tmp_path, 1)
    try:
        start = time.monotonic()
        with pytest.raises(SlotTimeout) as info:
            ensure_venv(parse_spec({}), load_project(project), root=root, timeout=3)
        assert 3 <= time.monotonic() - start < 15
    finally:
        kill(holder)
    message = str(info.value)
    assert "waited 3s for a build slot for" in message and "place 1 in the queue" in message
    assert f"1 builds at once run in the venv dir {root}" in message
    assert MAX_BUILDS_ENV in message and "ray-uv prepare" in message
    assert slow_uv.syncs() == 0
    key = project_key(project)
    records = {f".phase-{key}", outcomes.OUTCOMES}  # why it failed, and that it did
    left = [p.name for p in root.iterdir() if p.name not in {*tickets(root), *records}]
    assert left == [f"{key}.lock"]  # and the killed holder's ticket
    failed = read_setup(root, key)
    assert (failed.state, failed.phase) == ("failed", "build-slot queue")
    assert "waited 3s for a build slot" in (failed.cause or "")


def project_key(project: Path) -> str:
    return request_for(project).key


def test_a_reuse_takes_no_slot_and_a_second_request_for_a_key_waits_on_its_lock(
    base_project, tmp_path, slow_uv, monkeypatch
):
    monkeypatch.setenv(MAX_BUILDS_ENV, "1")
    root = tmp_path / "venvs"
    ready, wanted = project_variants(base_project, tmp_path, 2)
    assert ensure_venv(parse_spec({}), load_project(ready), root=root).built
    holder = hold_slot(root)  # every slot taken
    logger, lines = setup_logger()
    try:
        start = time.monotonic()
        again = ensure_venv(parse_spec({}), load_project(ready), root=root, logger=logger)
        assert not again.built and time.monotonic() - start < 1 and lines.lines == []
        request = request_for(wanted)

        async def twice():
            tasks = [asyncio.create_task(ensure_venv_async(request, root, logger)) for _ in "ab"]
            while not lines.having("waiting for a build slot"):
                await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            assert len(tickets(root)) == 2  # the holder's and one build's: not one per request
            kill(holder)
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(twice())
    finally:
        if holder.poll() is None:
            kill(holder)
    assert sorted(o.built for o in outcomes) == [False, True]
    assert len(lines.having("waiting for a build slot")) == 1 and slow_uv.syncs() == 2


def test_a_limit_that_is_no_number_fails_before_anything_is_built(
    base_project, tmp_path, slow_uv, monkeypatch
):
    monkeypatch.setenv(MAX_BUILDS_ENV, "lots")
    (project,) = project_variants(base_project, tmp_path, 1)
    with pytest.raises(VenvDirError, match=f"{MAX_BUILDS_ENV}='lots' must be a whole number"):
        ensure_venv(parse_spec({}), load_project(project), root=tmp_path / "venvs")
    assert slow_uv.syncs() == 0


BUILD_THREE = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from ray_uv_plugin.building.ensure import ensure_venv_async
    from ray_uv_plugin.env.project import load_project
    from ray_uv_plugin.env.key import make_request
    from ray_uv_plugin.env.spec import parse_spec
    root, projects = Path(sys.argv[1]), sys.argv[2:]
    requests = [make_request(parse_spec({}), load_project(Path(p)), {}) for p in projects]
    async def main():
        return await asyncio.gather(*(ensure_venv_async(r, root) for r in requests))
    print(sum(o.built for o in asyncio.run(main())))
    """
)


def test_the_limit_holds_across_processes_sharing_a_venv_dir(
    base_project, tmp_path, slow_uv, monkeypatch
):
    """Two processes (two raylets, or two Ray sessions) build three keys each at once in one
    venv dir: two syncs at a time in all."""
    monkeypatch.setenv(MAX_BUILDS_ENV, "2")
    root = tmp_path / "venvs"
    projects = [str(p) for p in project_variants(base_project, tmp_path, 6)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_THREE, str(root), *part],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for part in (projects[:3], projects[3:])
    ]
    built = [int(c.communicate(timeout=300)[0]) for c in children]
    assert built == [3, 3]
    assert slow_uv.syncs() == 6 and slow_uv.peak_syncs() == 2
    assert tickets(root) == []


# --- in Ray ----------------------------------------------------------------------------------


def test_actors_of_many_keys_queue_in_ray_and_all_start(base_project, tmp_path):
    """Five actors with five envs at once on a node that builds two at a time: each gets its
    venv, two syncs ever ran together, and the setup log says who waited for a slot."""
    uv = CountingUv(tmp_path / "uv")
    settings = {
        UV_ENV_VAR: str(uv.path),
        VENV_DIR_ENV: str(tmp_path / "venvs"),
        MAX_BUILDS_ENV: "2",
        "SLOW_UV_SECONDS": "3",
        "UV_COMPILE_BYTECODE": "0",
    }
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    projects = project_variants(base_project, tmp_path, 5)

    @ray.remote(num_cpus=0)
    class Probe:
        def venv(self) -> str:
            return os.environ["RAY_UV_PLUGIN_VENV"]

    try:
        ray.init(address="local", num_cpus=2)
        actors = [
            Probe.options(runtime_env={"uv_project": {"project": str(p)}}).remote()
            for p in projects
        ]
        venvs = ray.get([a.venv.remote() for a in actors], timeout=300)
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    finally:
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert sorted(Path(v).name for v in venvs) == sorted(project_key(p) for p in projects)
    assert uv.syncs() == 5 and uv.peak_syncs() == 2
    setup = "".join(p.read_text() for p in Path(logs).glob("runtime_env_setup-*.log"))
    assert "waiting for a build slot (2 of 2 in use; place 1 in queue)" in setup
    assert ": got a build slot in " in setup


def test_what_a_dead_process_left_of_its_ticket_is_removed_by_the_next_waiter(tmp_path) -> None:
    """A ticket whose process died (its flock gone), and one it was still making, do not count
    and are removed by the next request that looks; a living one counts and stays."""
    root = tmp_path / "venvs"
    holder = hold_slot(root, limit=1)
    dead = root / f".build-{'0' * 20}-1-deadbeef"
    half_made = root / f".build-new-{'0' * 20}-2-deadbeef"
    for path in (dead, half_made):
        path.touch()
    old = time.time() - 2 * build_slots.STALE_NEW_SECONDS
    os.utime(half_made, (old, old))
    try:
        assert build_slots.living_tickets(root) == 1  # listed, not cleaned: `ray-uv list`
        assert dead.exists() and half_made.exists()
        slot = build_slots.BuildSlot(root, limit=2)
        waited = asyncio.run(slot.acquire_async(10, "a test", print))
        assert waited < 5 and slot.standing() == Standing(ahead=1, limit=2)
        assert not dead.exists() and not half_made.exists()
        slot.release()
        assert len(tickets(root)) == 1  # the holder's
    finally:
        kill(holder)

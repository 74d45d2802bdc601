"""The chaos run's invariants (`benchmarks.chaos_invariants`), its blame (`chaos_blame`) and
their wiring (`chaos.check_round`): each check is fed the breakage it names and must report it.
The planted violations: a venv missing a locked package (a real `uv sync
--no-install-package six`), a worker in the wrong venv, a worker outside every venv, a hung
setup under an actor driver, a lock leaked in the last round, a temp dir left by a killed
build. Rounds are data here; the venvs, locks, projects and `ray-uv gc` are real."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import chaos
from benchmarks.chaos_blame import blame, left_by_fault
from benchmarks.chaos_invariants import (
    Checks,
    asked_keys,
    collect_garbage,
    locks,
    locks_at_end,
    missing_workers,
    ran_in_ready,
    selected_packages,
    unowned,
    whole,
)
from benchmarks.chaos_jobs import GET_TIMEOUT_S, JOB_TIMEOUT_S, Job, verify_job
from benchmarks.raylets import BIN
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.store import manifest
from ray_uv_plugin.store.freezing import thaw
from ray_uv_plugin.store.layout import Venv
from tests.support.uvproject import write_project

KEY = "0123456789abcdef"
OTHER = "fedcba9876543210"
SITE = "lib/python3.11/site-packages"

LOCK = b"""
version = 1
requires-python = ">=3.11"

[[package]]
name = "proj"
version = "0.1.0"
source = { editable = "." }
dependencies = [
    { name = "a" },
    { name = "winonly", marker = "sys_platform == 'win32'" },
    { name = "c", extra = ["x"] },
]

[package.optional-dependencies]
opt = [{ name = "e" }]

[package.dev-dependencies]
dev = [{ name = "devtool" }]
lint = [{ name = "linter" }]

[[package]]
name = "a"
version = "1.0"
source = { registry = "https://pypi.org/simple" }
dependencies = [{ name = "b" }]

[[package]]
name = "b"
version = "2.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "c"
version = "3.0"
source = { registry = "https://pypi.org/simple" }

[package.optional-dependencies]
x = [{ name = "d" }]

[[package]]
name = "d"
version = "4.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "e"
version = "5.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "winonly"
version = "6.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "devtool"
version = "7.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "linter"
version = "8.0"
source = { registry = "https://pypi.org/simple" }
"""


def test_a_locks_selection_follows_markers_extras_and_groups() -> None:
    assert selected_packages(LOCK) == {
        "a": "1.0", "b": "2.0", "c": "3.0", "d": "4.0", "devtool": "7.0"
    }  # fmt: skip
    with_all = selected_packages(LOCK, extras=["opt"], groups=["lint"])
    assert with_all.keys() - selected_packages(LOCK).keys() == {"e", "linter"}
    assert "winonly" not in with_all and "proj" not in with_all


# --- whole --------------------------------------------------------------------------------


def ready_venv(root: Path, key: str = KEY, project: Path | None = None) -> Path:
    """A venv dir entry as a build leaves it: files, a manifest, a marker naming both."""
    venv = root / key
    (venv / "bin").mkdir(parents=True)
    (venv / SITE).mkdir(parents=True)
    (venv / SITE / "mod.py").write_text("x = 1\n")
    (venv / "bin/python").symlink_to(sys.executable)
    sha = manifest.write(venv, manifest.scan(venv))
    Venv.at(venv).write_marker({"format": 1, "key": key, "manifest": sha, "site_packages": SITE,
                        "project": str(project or root / "no-project")})  # fmt: skip
    return venv


def no_lock_project(root: Path) -> Path:
    """A project whose lock selects nothing (a ready venv of it is whole by its files alone)."""
    project = root / "project"
    project.mkdir()
    (project / "uv.lock").write_bytes(b'version = 1\n[[package]]\nname = "p"\nversion = "0"\n'
                                      b'source = { virtual = "." }\n')  # fmt: skip
    return project


def test_whole_reports_a_venv_changed_after_its_build_in_every_round(tmp_path: Path) -> None:
    """Checked on every round, not once per venv: a venv that passed is read again, and a
    write into a file it shares with uv's cache (the same size, hashed before) is seen."""
    venvs = tmp_path / "venvs"
    venvs.mkdir()
    venv = ready_venv(venvs, project=no_lock_project(tmp_path))
    checks = Checks()
    assert checks.whole([venvs]) == []
    assert checks.whole([venvs]) == []  # a second round, its hashes taken from the first
    thaw(venv)
    time.sleep(0.02)  # a later mtime than the one hashed (the filesystem's tick)
    (venv / SITE / "mod.py").write_text("x = 2\n")  # the same size: only the content differs
    found = checks.whole([venvs])
    assert len(found) == 1 and "mod.py has other content" in found[0], found


@pytest.fixture(scope="module")
def six_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("six-project")
    return write_project(where / "p", ["six"], with_ray=False, name="sixproj")


def built_venv(root: Path, project: Path, key: str, *uv_args: str) -> Path:
    """A real venv of `project` by `uv sync` (with `uv_args`), a manifest and a marker as a
    build writes them: ready and whole by its own manifest."""
    venv = root / key
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    subprocess.run(
        [find_uv(), "sync", "--locked", "--quiet", "--no-install-project", "--project",
         str(project), *uv_args], check=True, env=env, timeout=300,
    )  # fmt: skip
    sha = manifest.write(venv, manifest.scan(venv))
    Venv.at(venv).write_marker({"format": 1, "key": key, "manifest": sha, "project": str(project),
                        "extras": [], "groups": []})  # fmt: skip
    return venv


def test_whole_reports_a_ready_venv_missing_a_locked_package(
    tmp_path: Path, six_project: Path
) -> None:
    """Planted: a venv built with `--no-install-package six` is whole by its own manifest, and
    is reported against its lock; a full one is not."""
    built_venv(tmp_path, six_project, KEY)
    assert whole([tmp_path]) == []
    built_venv(tmp_path, six_project, OTHER, "--no-install-package", "six")
    found = whole([tmp_path])
    assert len(found) == 1 and OTHER in found[0] and "six" in found[0] and "missing" in found[0]


# --- ran_in_ready ---------------------------------------------------------------------------


def report(root: Path, key: str = KEY, **changes: object) -> dict:
    prefix = str(root / key)
    good = {"pid": 1, "job_id": "01000000", "prefix": prefix, "venv_env": prefix,
            "marker": {"format": 1, "key": key}, "asked_key": key,
            "dist_infos": ["six-1.17.0.dist-info"]}  # fmt: skip
    return {**good, **changes}


def test_ran_in_ready_reports_each_way_a_worker_can_be_in_the_wrong_place(tmp_path: Path) -> None:
    wanted = {KEY: {"six": "1.17.0"}}
    assert ran_in_ready([report(tmp_path)], [tmp_path], wanted) == []
    planted = {
        "wrong venv": report(tmp_path, OTHER, asked_key=KEY, marker={"format": 1, "key": OTHER}),
        "outside every venv": report(tmp_path, prefix=sys.base_prefix, venv_env=None),
        "env not its prefix": report(tmp_path, venv_env=str(tmp_path / OTHER)),
        "no marker": report(tmp_path, marker="unreadable: FileNotFoundError()"),
        "not whole": report(tmp_path, marker={"format": 1, "key": KEY, "not_whole": "drifted"}),
        "key unknown": report(tmp_path, asked_key="unknown: ProjectError: gone"),
        "package missing": report(tmp_path, dist_infos=[]),
    }
    said = {what: ran_in_ready([r], [tmp_path], wanted) for what, r in planted.items()}
    assert all(len(v) == 1 for v in said.values()), said
    assert f"asked for {KEY}, it ran in {OTHER}" in said["wrong venv"][0]
    assert "outside every venv" in said["outside every venv"][0]
    assert "six 1.17.0 missing" in said["package missing"][0]


def test_missing_workers_counts_reports_against_the_workers_each_job_started() -> None:
    """A worker that died before `__init__` wrote nothing: only the count shows it."""
    jobs = [{"name": "group", "job_id": "02000000", "workers_started": 3},
            {"name": "uv_run", "job_id": "03000000", "workers_started": 2}]  # fmt: skip
    reports = [{"job_id": "02000000"}] * 2 + [{"job_id": "03000000"}] * 2
    assert missing_workers(jobs, reports, set()) == ["group: 3 workers started, 2 reported"]
    assert missing_workers(jobs, reports, {"group"}) == []  # its failure has a fault to blame


def test_asked_keys_are_the_keys_the_plugin_gives_each_request(
    tmp_path: Path, six_project: Path
) -> None:
    variant = tmp_path / "variant"
    variant.mkdir()
    (variant / "pyproject.toml").write_text((six_project / "pyproject.toml").read_text() + "#\n")
    (variant / "uv.lock").write_bytes((six_project / "uv.lock").read_bytes())
    keys = asked_keys(
        [({"project": str(six_project)}, "", {}), ({}, str(six_project), {}),
         ({}, str(variant), {}), ({}, str(tmp_path / "gone"), {})],
        dict(os.environ),
    )  # fmt: skip
    assert keys[0] == keys[1] and len(keys[0]) == 16  # the project named, or the job's
    assert keys[2] != keys[0] and len(keys[2]) == 16  # another pyproject: another venv
    assert keys[3].startswith("unknown: ")


# --- no_hang --------------------------------------------------------------------------------


def test_a_hung_setup_under_an_actor_driver_is_a_hang_not_a_failed_job(tmp_path: Path) -> None:
    """The drivers' `ray.get` waits past the harness's bound, so the harness ends a driver
    whose setup hangs and calls it hung (with 360 s < 420 s it was an exit 1, counted
    nowhere)."""
    assert GET_TIMEOUT_S > JOB_TIMEOUT_S
    assert str(GET_TIMEOUT_S) in verify_job(0, "10.0.0.1:6379", [], [tmp_path]).argv
    # The driver as a hung setup leaves it: in `ray.get`, for as long as it is told to wait.
    waits = "import sys, time; time.sleep(float(sys.argv[1]))"
    job = Job("actors", 0, [sys.executable, "-c", waits, str(GET_TIMEOUT_S)], tmp_path, {})
    job.start(tmp_path)
    job.wait(time.monotonic() + 3)  # the harness's bound, shortened
    assert job.result["hung"] and job.result["rc"] != 0


# --- locks ----------------------------------------------------------------------------------


def hold(lock: Path) -> subprocess.Popen:
    """A process that takes the flock and keeps it (a leaked lock), until killed."""
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def test_locks_reports_one_held_past_its_bound(tmp_path: Path) -> None:
    lock = tmp_path / f"{KEY}.lock"
    lock.write_text(f"{os.getpid()} host\n")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert locks([tmp_path], bound_s=240) == []  # just taken
        os.utime(lock, (time.time() - 1000, time.time() - 1000))
        found = locks([tmp_path], bound_s=240)
        assert len(found) == 1 and "held" in found[0] and str(os.getpid()) in found[0]
    finally:
        os.close(fd)
    assert locks([tmp_path], bound_s=240) == []  # let go: nobody holds it


def test_a_lock_leaked_in_the_last_round_is_reported_after_the_wait(tmp_path: Path) -> None:
    """Taken in the last round, it is younger than the bound when that round is checked; the
    run then waits until it is past the bound, and reports it. One let go meanwhile is not."""
    leaked = hold(tmp_path / f"{KEY}.lock")
    brief = hold(tmp_path / f"{OTHER}.lock")
    try:
        assert locks([tmp_path], bound_s=1.0, margin_s=0.5) == []  # the round's check
        brief.kill()
        began = time.monotonic()
        found = locks_at_end([tmp_path], bound_s=1.0, margin_s=0.5, poll_s=0.2)
        assert 1.0 < time.monotonic() - began < 10
        assert len(found) == 1 and KEY in found[0] and str(leaked.pid) in found[0], found
    finally:
        for proc in (leaked, brief):
            proc.kill()
            proc.wait()


# --- leftovers ------------------------------------------------------------------------------


def test_leftovers_are_listed_before_gc_and_gc_keeps_idle_venvs(tmp_path: Path) -> None:
    """Planted: what a killed build and a killed receive leave (a venv with no marker, a
    `.ship-*` dir, a ticket nobody holds, their locks free). Each is listed once, before gc;
    then `ray-uv gc` removes what it may, and the ready venv, idle, stays for the next round."""
    venvs = tmp_path / "venvs"
    venvs.mkdir(mode=0o700)
    ready_venv(venvs, project=no_lock_project(tmp_path))
    (venvs / f"{KEY}.lock").write_text("1 host\n")
    os.utime(venvs / KEY, (time.time() - 3600, time.time() - 3600))  # idle for an hour
    (venvs / OTHER / "lib").mkdir(parents=True)  # a build killed in `uv sync`
    (venvs / f"{OTHER}.lock").write_text("1 host\n")
    (venvs / f"{KEY}.ship-abc123").mkdir()
    (venvs / ".build-00000000000000000001-1-abcd1234").write_text("")
    assert {p.name for p, _ in unowned(venvs)} == {
        OTHER, f"{KEY}.ship-abc123", ".build-00000000000000000001-1-abcd1234"
    }  # fmt: skip
    checks = Checks()
    found = checks.leftovers(venvs)
    assert len(found) == 3 and any("no marker, its lock free" in f for f in found), found
    assert checks.leftovers(venvs) == []  # each said once
    env = {**os.environ, "RAY_UV_PLUGIN_VENV_DIR": str(venvs)}
    assert collect_garbage(venvs, env, str(BIN / "ray-uv")) == []
    assert (venvs / KEY / ".ray-uv-ready").exists()  # `gc --all` removed it
    assert not (venvs / f"{KEY}.ship-abc123").exists()


def test_a_leftover_is_put_down_to_a_kill_on_its_node_only() -> None:
    faults = [fault("agent", "kill", 1, 5.0), fault("ship_receiver", "stop", 2, 5.0)]
    assert left_by_fault(1, faults, []) == ["agent:kill@1+5.0s"]
    assert left_by_fault(2, faults, []) == []
    assert left_by_fault(2, faults, [2]) == ["node 2 restarted"]


# --- blame ----------------------------------------------------------------------------------

IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def fault(kind: str, action: str, node: int, at_s: float, hold_s: float = 3.0, pid: int = 7):
    return {"kind": kind, "action": action, "node": node, "offset_s": at_s, "at_s": at_s,
            "hold_s": hold_s, "target": {"node": node, "pid": pid}}  # fmt: skip


def job(name: str, started: float, ended: float, rc: int = 1, error: str = "", **more: object):
    return {"name": name, "rc": rc, "hung": False, "started_s": started, "ended_s": ended,
            "error": error, "pids": [], **more}  # fmt: skip


def test_blame_matches_each_failed_job_to_a_fault_by_node_and_window() -> None:
    faults = [
        fault("raylet", "stop", 1, 10.0, hold_s=5.0),  # acts 10-15 s, effects until 45 s
        fault("driver", "kill", 0, 12.0, pid=4242),
        fault("agent", "kill", 2, 100.0),  # node 2 down until the round's end
    ]
    jobs = [
        job("actors", 0, 20, error="ActorDiedError: ... ip: 10.0.0.2 ..."),  # node 1, in it
        job("group", 50, 60, error="ActorDiedError: node 10.0.0.2"),  # after node 1's window
        job("uv_run", 0, 20, error="... 10.0.0.1 ...", pids=[4242]),  # its driver was killed
        job("prepare", 0, 20, error="error: 1 of 3 nodes failed: 10.0.0.1"),  # head, no fault
        job("cold0", 150, 160, error="ActorDiedError"),  # no node named; node 2 still down
        job("cold1", 0, 5, rc=0),  # succeeded: nothing to blame
    ]
    blamed, unexplained = blame(jobs, faults, restarted=[], ips=IPS)
    assert blamed == {
        "actors": ["raylet:stop@1+10.0s"],
        "uv_run": ["driver:kill@0+12.0s"],
        "cold0": ["agent:kill@2+100.0s"],
    }
    assert len(unexplained) == 2
    assert unexplained[0].startswith("unexplained failure of group (exit 1, 50-60s)")
    assert "1 of 3 nodes failed: 10.0.0.1" in unexplained[1]
    _, later = blame([job("group", 50, 60, error="node 10.0.0.2")], faults, [1], IPS)
    assert later == []  # node 1 had to be restarted: down until the round's end
    split = {**fault("node_split", "split", 1, 10.0), "target": {"nodes": [1, 2]}}
    head = {**fault("head_restart", "restart", 0, 40.0), "target": {"node": 0}}
    on_3 = job("cold2", 0, 20, error="not shipped: node 10.0.0.3: cut")
    after = job("cold3", 45, 90, error="ActorDiedError: node 10.0.0.2")
    blamed, unexplained = blame([on_3, after], [split, head], [], IPS)
    assert blamed == {"cold2": ["node_split:split@1,2+10.0s"],
                      "cold3": ["head_restart:restart@0,1,2+40.0s"]}  # fmt: skip


def test_an_error_that_names_its_cause_is_blamed_only_on_a_fault_of_that_kind() -> None:
    """A full disk is no link's doing, and a restart of node 2 after a full disk does not keep
    the fill acting to the round's end (a fill cannot get a node counted dead)."""
    fill = fault("disk_full", "fill", 2, 10.0, hold_s=5.0)
    drop = fault("link_drop", "drop", 2, 12.0, hold_s=5.0)
    full = job("cold0", 0, 30, error="error: failed to create directory ...: No space left")
    blamed, _ = blame([full], [fill, drop], [2], IPS)
    assert blamed == {"cold0": ["disk_full:fill@2+10.0s"]}
    late = job("cold1", 50, 90, error="ActorDiedError: node 10.0.0.3")  # past the fill's 45 s
    blamed, unexplained = blame([late], [fill, drop], [2], IPS)
    assert blamed == {"cold1": ["link_drop:drop@2+12.0s"]}  # a link can get it counted dead
    gone = job("cold2", 0, 30, error="error: failed: No space left on device")
    _, unexplained = blame([gone], [drop], [], IPS)
    assert len(unexplained) == 1 and "No space left" in unexplained[0]


def test_a_build_that_linked_the_file_cache_write_changed_is_blamed_on_it() -> None:
    """A file that differs from its RECORD fails the build (`building.record`): inside a
    `cache_write`'s window on its node that is the fault's doing, and no other fault's."""
    write = fault("cache_write", "write", 1, 10.0, hold_s=3.0)
    drop = fault("link_drop", "drop", 1, 11.0, hold_s=3.0)
    error = (
        "uv_project: the venv 0123456789abcdef holds 1 files that differ from their "
        "distribution's RECORD: lib/python3.11/site-packages/six.py (six-1.17.0.dist-info) "
        "[Node 10.0.0.2]"
    )
    blamed, unexplained = blame([job("cold0", 5, 30, error=error)], [write, drop], [], IPS)
    assert blamed == {"cold0": ["cache_write:write@1+10.0s"]} and unexplained == []
    _, unexplained = blame([job("cold1", 5, 30, error=error)], [drop], [], IPS)
    assert len(unexplained) == 1 and "differ from their distribution's RECORD" in unexplained[0]
    _, unexplained = blame([job("cold2", 60, 90, error=error)], [write], [], IPS)
    assert len(unexplained) == 1  # past its window (10 + 3 + GRACE_S)


# --- check_round: the wiring ----------------------------------------------------------------


def test_check_round_reports_each_planted_breakage_under_its_invariant(
    tmp_path: Path, six_project: Path
) -> None:
    """A round as data (two nodes, their venv dirs real, the jobs' results and workers'
    reports as the harness takes them): each breakage lands under its invariant, and a clean
    round has none."""
    key = asked_keys([({"project": str(six_project)}, "", {})], dict(os.environ))[0]
    nodes = []
    for i in range(2):
        venvs = tmp_path / f"node{i}"
        venvs.mkdir(mode=0o700)
        built_venv(venvs, six_project, key)
        env = {**os.environ, "RAY_UV_PLUGIN_VENV_DIR": str(venvs)}
        nodes.append(SimpleNamespace(index=i, venv_dir=venvs, env=lambda env=env: env,
                                     host=SimpleNamespace(ip=IPS[i])))  # fmt: skip
    cluster = SimpleNamespace(nodes=nodes)

    def round_of(jobs: list[dict], reports: list[dict]) -> dict[str, list[str]]:
        made = []
        verify = {"name": "verify", "rc": 0, "hung": False, "job_id": "09000000",
                  "workers_started": 2}  # fmt: skip
        for i, result in enumerate([*jobs, verify]):
            j = Job(result["name"], 0, [], tmp_path, {})
            j.started, j.ended = 100.0, 110.0
            j.result = {"job": j.kind, "error": "", "pids": [], "job_id": f"0{i}000000",
                        "project": str(six_project), **result}  # fmt: skip
            made.append(j)
        found, _ = chaos.check_round(cluster, made[:-1], made[-1], Checks(), reports, [], [], 100.0)
        return {name: v for name, v in found.items() if v}

    def worker(node: int, job_id: str = "00000000", **changes: object) -> dict:
        prefix = str(nodes[node].venv_dir / key)
        dists = [d.name for d in (Path(prefix) / SITE).glob("*.dist-info")]
        return {"pid": 1, "prefix": prefix, "venv_env": prefix, "job_id": job_id,
                "marker": {"format": 1, "key": key}, "asked": {"project": str(six_project)},
                "dist_infos": dists, **changes}  # fmt: skip

    ok = [{"name": "actors", "rc": 0, "hung": False, "workers_started": 2}]
    verify = [worker(0, "09000000"), worker(1, "09000000")]
    assert round_of(ok, [worker(0), worker(1), *verify]) == {}
    (nodes[1].venv_dir / f"{KEY}.ship-x1").mkdir()  # a receive killed with no fault named
    found = round_of(
        [{**ok[0], "rc": 1, "error": "RuntimeEnvSetupError: boom"},
         {"name": "group", "rc": -9, "hung": True, "workers_started": 3}],
        [worker(0, prefix=sys.base_prefix), *verify[:1]],
    )  # fmt: skip
    assert found.keys() == {"ran_in_ready", "blame", "no_hang", "next_round", "leftovers"}
    assert any("outside every venv" in v for v in found["ran_in_ready"])
    assert any("group: 3 workers started, 0 reported" in v for v in found["ran_in_ready"])
    assert found["blame"][0].startswith("unexplained failure of actors (exit 1")
    assert found["no_hang"] == [f"group hung past {JOB_TIMEOUT_S}s"]
    assert found["next_round"] == ["verify: 2 workers started, 1 reported"]
    assert "ship-x1" in found["leftovers"][0]

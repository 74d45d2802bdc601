"""The benchmark machinery: pure parts without Ray, and one real run of two cheap scenarios."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray

from benchmarks.envs import COMMITTED_SETS, PACKAGE_SETS, SETS_DIR, BenchProject
from benchmarks.report import Row, plot, plot_growth, summarize, targets
from benchmarks.runner import Case, Sample, rounds
from benchmarks.scenarios import BY_ID, Inputs, prepare
from benchmarks.startup import build_cases, main, parse_args


def _sample(scenario: str, seconds: float, actors: int = 1, syncs: int | None = None) -> Sample:
    return Sample("small", scenario, actors, "local", 0, True, seconds, [seconds], syncs)


def test_rounds_interleave_scenarios() -> None:
    a, b = Case("small", BY_ID["floor"]), Case("small", BY_ID["warm"])
    order = [(r, c.scenario.id) for r, c in rounds([a, b], {a: 2, b: 1})]
    assert order == [(0, "floor"), (0, "warm"), (1, "floor")]


def test_quick_defaults_and_overrides() -> None:
    quick = parse_args(["--quick"])
    assert (quick.sets, quick.repeats, quick.actors, quick.cluster) == ("small", 1, "8", False)
    full = parse_args(["--repeats", "7"])
    assert (full.sets, full.repeats, full.actors, full.cluster) == (
        "small,realistic",
        7,
        "8,32",
        True,
    )
    cases, repeats = build_cases(parse_args(["--quick", "--scenarios", "floor,cold-all"]))
    assert {(c.scenario.id, c.actors) for c in cases} == {
        ("floor", 1),
        ("cold-all", 1),
        ("hand-sync", 1),
        ("floor", 8),
    }


def test_targets_read_off_the_medians() -> None:
    samples = [
        _sample("floor", 1.0),
        _sample("floor", 1.2),
        _sample("warm", 1.05),
        _sample("hand-sync", 0.5),
        _sample("cold-venv", 2.5, syncs=1),
        _sample("ray-uv", 6.0),
        _sample("warm", 1.0, actors=8, syncs=0),
    ]
    rows = summarize(samples)
    floor = next(r for r in rows if r.scenario == "floor")
    assert (floor.median, floor.low, floor.high) == (pytest.approx(1.1), 1.0, 1.2)
    found = {t.name: t for t in targets(rows, {"median_ms": 0.2, "p99_ms": 0.4})}
    assert found["small: warm <= 1.05x the floor"].met is True  # 1.05 / 1.1
    # 2.5 s against 1.1 + 1.1 x 0.5 = 1.65 s
    assert found["small: cold venv <= floor + 1.1x hand-run uv sync"].met is False
    assert found["a ready venv costs the plugin < 5 ms"].met is True
    uv_field = next(t for n, t in found.items() if "Ray `uv` field" in n)
    assert uv_field.met is True  # -0.05s against +4.9s


def test_a_missed_many_actor_target_says_what_the_build_costs() -> None:
    samples = [
        _sample("hand-sync", 50.0),
        _sample("hand-sync-nobc", 4.0),
        *(_sample(s, t, actors=32) for s, t in [("floor", 100.0), ("uv-run", 120.0)]),
        _sample("warm", 99.0, actors=32, syncs=0),
        _sample("cold-venv", 150.0, actors=32, syncs=1),
    ]
    found = {t.name: t for t in targets(summarize(samples), {"median_ms": 1.0, "p99_ms": 2.0})}
    warm = found["small, 32 actors, local: warm's overhead <= 10% of `uv run`'s"]
    cold = found["small, 32 actors, local: cold-venv's overhead <= 10% of `uv run`'s"]
    assert (warm.met, warm.why) == (True, "")
    assert cold.met is False
    assert "uv sync by hand takes 50.00s, 4.00s without compiling bytecode" in cold.why
    assert "reused in" not in found["a ready venv costs the plugin < 5 ms"].measured


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [Row("small", 1, "local", "floor", 1.0, 0.9, 1.1, 1, 1, None, ())]
    plot(tmp_path / "chart.png", rows, "test")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_growth_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [
        Row(s, n, "local", sid, t * n, t * n, t * n, 1, 1, None, ())
        for s, t in (("small", 1.0), ("big", 2.0))
        for n in (1, 8)
        for sid in ("floor", "warm", "uv-run")
    ]
    plot_growth(tmp_path / "growth.png", rows, {"small": 24, "big": 425}, "test")
    assert (tmp_path / "growth.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("set_name", COMMITTED_SETS)
def test_committed_sets_are_locked_at_this_ray(set_name: str) -> None:
    """The big and torch sets: committed locks, ray pinned at the version under test, and
    Ray's `uv` field gets the lock's versions of the set's own packages (not Ray's closure)."""
    project = BenchProject(set_name, SETS_DIR / set_name)
    lock = (project.path / "uv.lock").read_text()
    assert f'name = "ray"\nversion = "{ray.__version__}"' in lock
    assert project.locked_packages() >= (400 if set_name == "big" else 20)
    pinned = project.pinned_requirements()
    names = {r.split("==")[0] for r in pinned}
    assert "ray" not in names and "click" not in names  # click: one of Ray's own
    asked = {re.split(r"[\[=<>]", p)[0].lower().replace("_", "-") for p in PACKAGE_SETS[set_name]}
    assert asked - names <= {"click", "requests"}  # Ray's own: the node's venv has them
    assert all("==" in r for r in pinned)
    if set_name == "big":
        assert {"boto3", "pandas", "apache-airflow", "transformers"} <= names
    else:
        assert "torch" in names


def test_build_setting_scenarios(tmp_path: Path) -> None:
    """Bytecode and link mode: the uv_project scenarios pass them as env_vars (no bytecode also
    means workers may not write `.pyc` files), hand syncs are 1-actor rows."""
    project = BenchProject("small", tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "uv.lock").write_text("")
    inputs = Inputs(project, tmp_path / "floor", tmp_path, ("httpx==0.1",))
    warm = prepare(BY_ID["warm-nobc"], inputs).runtime_env
    assert warm["env_vars"] == {"UV_COMPILE_BYTECODE": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    assert warm["uv_project"]["project"] == str(tmp_path)
    cold = prepare(BY_ID["cold-venv-copy"], inputs)
    assert cold.runtime_env["env_vars"] == {"UV_LINK_MODE": "copy"}
    assert cold.runtime_env["uv_project"]["project"] != str(tmp_path)
    assert "env_vars" not in prepare(BY_ID["warm"], inputs).runtime_env
    # An empty uv cache is the local Ray's, for one sample: a job's own cache is refused.
    cold_all = prepare(BY_ID["cold-all"], inputs)
    assert "env_vars" not in cold_all.runtime_env
    cache = Path(cold_all.node_env["UV_CACHE_DIR"])
    assert cache.is_dir() and not any(cache.iterdir()) and cache in cold_all.cleanup
    assert prepare(BY_ID["ray-uv"], inputs).runtime_env["uv"]["packages"] == ["httpx==0.1"]
    argv = ["--quick", "--scenarios", "warm-nobc,cold-venv-copy,hand-sync-nobc", "--actors", "2"]
    cases, _ = build_cases(parse_args(argv))
    assert {(c.scenario.id, c.actors) for c in cases} == {
        ("warm-nobc", 1),
        ("cold-venv-copy", 1),
        ("hand-sync-nobc", 1),
        ("hand-sync", 1),
        ("warm-nobc", 2),
        ("cold-venv-copy", 2),
    }


@pytest.mark.slow
def test_one_real_run(tmp_path: Path) -> None:
    """Floor and a ready venv built without bytecode, the set's imports in the first call, once
    each, with real uv and a real Ray per sample (about 45 s)."""
    out = tmp_path / "bench.json"
    argv = ["--sets", "small", "--scenarios", "floor,warm-nobc", "--repeats", "1", "--actors", ""]
    argv += ["--imports", "--no-cluster", "--timeout", "120", "--json", str(out)]
    assert main([*argv, "--growth-plot", str(tmp_path / "growth.png")]) == 0
    data = json.loads(out.read_text())
    by_scenario = {s["scenario"]: s for s in data["samples"]}
    assert by_scenario["floor"]["ok"] and by_scenario["warm-nobc"]["ok"]
    assert by_scenario["hand-sync"]["ok"]
    assert by_scenario["warm-nobc"]["syncs"] == 0
    assert "/venvs/" in by_scenario["warm-nobc"]["executables"][0]
    assert len(by_scenario["floor"]["import_s"]) == 1
    assert data["plugin_cost"]["median_ms"] < 50
    assert data["meta"]["sets"]["small"]["locked_packages"] > 10
    assert (tmp_path / "growth.png").exists()


@pytest.mark.torch
@pytest.mark.parametrize("set_name", COMMITTED_SETS)
def test_a_committed_set_runs(tmp_path: Path, set_name: str) -> None:
    """The big set (~1 GB of wheels, 2-3 GB installed) and the torch set (several GB): floor
    and uv run once each, one actor (minutes; deselected by default with the torch tests)."""
    out = tmp_path / "bench.json"
    argv = ["--sets", set_name, "--scenarios", "floor,uv-run", "--repeats", "1", "--actors", ""]
    assert main([*argv, "--no-cluster", "--imports", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(s["ok"] for s in data["samples"])


def test_the_shipping_benchmarks_index_serves_and_counts_real_wheels(tmp_path: Path) -> None:
    """`benchmarks.cluster_ship`'s index: uv locks against it from PEP 658 metadata alone
    (no wheel bytes), and installs count every wheel byte served."""
    import subprocess

    from benchmarks.counting_index import CountingIndex
    from benchmarks.package_set import make_wheel, write_project
    from ray_uv_plugin.env.uv import find_uv

    wheels = [make_wheel(tmp_path, i, 100_000) for i in range(2)]
    index = CountingIndex(wheels)
    try:
        project = write_project(tmp_path / "p", index.url, len(wheels))
        assert index.served == 0
        venv = tmp_path / "venv"
        subprocess.run([find_uv(), "venv", "-q", str(venv)], check=True)
        subprocess.run(
            [find_uv(), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
             "--index-url", index.url, "--cache-dir", str(tmp_path / "cache"),
             "benchpkg-00", "benchpkg-01"],
            check=True,
        )  # fmt: skip
        assert index.served == sum(w.stat().st_size for w in wheels)
        assert "benchpkg-01" in (project / "uv.lock").read_text()
    finally:
        index.server.shutdown()


def test_the_host_cpu_sampler_sees_a_busy_core_and_reads_a_window(tmp_path: Path) -> None:
    """`cluster_ship.HostCpu`: each interval's busy share of the host's cores, from
    /proc/stat; a window's mean; the simulated-cluster chart from a committed run."""
    import os
    import time

    from benchmarks.bounds import HostCpu
    from benchmarks.cluster_ship_report import plot_netns

    with HostCpu(every=0.1) as cpu:
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # one core busy: at least 1/cores of the host
            pass
    assert len(cpu.shares) >= 3 and all(0 <= s <= 1 for s in cpu.shares)
    assert max(cpu.shares) >= 0.9 / (os.cpu_count() or 1), cpu.shares
    seconds = HostCpu()  # every second, as the benchmark samples
    seconds.shares = [0.1, 0.5, 1.0, 1.0]
    assert seconds.mean(1.0, 3.0) == 0.75 and seconds.mean(10.0, 20.0) is None
    committed = Path(__file__).parents[2] / "benchmarks/results/cluster-ship-netns-node-disks.json"
    plot_netns(json.loads(committed.read_text()), tmp_path / "netns.png")
    assert (tmp_path / "netns.png").stat().st_size > 10_000


def wait_for(path: Path, timeout: float = 120) -> None:
    """Until `path` exists (a process that burns CPU on a loaded host says it is done)."""
    import time

    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear within {timeout}s"
        time.sleep(0.1)


def test_the_node_cpu_sampler_counts_a_process_tree_and_its_exited_children(
    tmp_path: Path,
) -> None:
    """`bounds.NodeCpu`: a root's CPU seconds include a child that burned CPU and exited (its
    parent reaped it: cutime); `used` reads a window off the samples."""
    import subprocess
    import sys

    from benchmarks.bounds import NodeCpu

    done = tmp_path / "done"
    burn = "import time\nend = time.process_time() + 0.8\nwhile time.process_time() < end: pass"
    child = f"subprocess.run([sys.executable, '-c', {burn!r}])"
    parent = f"import subprocess, sys, time; {child}; open({str(done)!r}, 'w'); time.sleep(600)"
    root = subprocess.Popen([sys.executable, "-c", parent])
    try:
        with NodeCpu([root.pid, 1 << 30], every=0.2) as cpu:  # the second: a pid that is none
            wait_for(done)  # the child burned and exited
    finally:
        root.kill()
        root.wait()
    whole, nothing = cpu.used(0.0)
    assert nothing == 0.0
    assert whole >= 0.7, cpu.samples  # the child's 0.8 s, from the parent's cutime
    assert cpu.used(cpu.samples[-1][0], None) == [0.0, 0.0]


def test_a_node_cgroup_counts_what_a_reparented_process_used(tmp_path: Path) -> None:
    """`bounds.NodeCgroups`: a process that its parent left (reparented to init, as a daemon
    is) is lost from its node's /proc tree, but not from the node's cpuacct cgroup."""
    import secrets
    import subprocess
    import sys
    import time

    from benchmarks.bounds import NodeCgroups, NodeCpu

    cgroups = NodeCgroups(f"ruvtest-{secrets.token_hex(3)}-", 1)
    if not cgroups.available:
        pytest.skip("no writable cgroup v1 cpuacct hierarchy here")
    done = tmp_path / "done"
    burn = (
        "import time\nend = time.process_time() + 0.8\nwhile time.process_time() < end: pass\n"
        f"open({str(done)!r}, 'w')"
    )
    daemon = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
    parent = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {daemon!r}])"
    root = subprocess.Popen(cgroups.wrap(0, [sys.executable, "-c", parent + "; time.sleep(600)"]))
    try:
        with NodeCpu([root.pid], every=0.2, read=cgroups.usage) as by_cgroup:
            with NodeCpu([root.pid], every=0.2) as by_tree:
                wait_for(done)  # the daemon burned (reparented to init, which reaps it)
                time.sleep(0.5)
    finally:
        root.kill()
        root.wait()
        cgroups.remove()
    assert by_cgroup.used(0.0)[0] >= 0.7, by_cgroup.samples
    assert by_tree.used(0.0)[0] < 0.5, by_tree.samples  # what the tree alone would say
    assert not any(d.exists() for d in cgroups.dirs)


def test_the_ship_is_judged_against_the_larger_of_the_link_bound_and_the_data_plane_floor(
    tmp_path: Path,
) -> None:
    """The floor is one build, then the larger of one pipe's wall time and one send plus each
    receiver's receive and worker start over the cores; a ship beyond 1.5 x the link bound but
    within 1.5 x the floor meets the target; the table's row and the chart carry both; an
    older run without a floor is judged against the link bound alone (its CPU bound, which
    measured the code it judged, is not read)."""
    from benchmarks.bounds import data_plane_floor, judge, link_bound
    from benchmarks.cluster_ship_report import plot_netns, summarize_netns

    assert link_bound(30.0, 125_000_000, 1000) == 31.0  # 1 Gbit/s: 125 MB in a second
    # 7 receivers: (2 + 7 * (3 + 1.5)) / 2 cores = 16.75 s, more than the pipe's 6 s
    assert data_plane_floor(30.0, 7, 6.0, 2.0, 3.0, 1.5, 2) == 46.75
    # 1 receiver: (2 + 4.5) / 2 = 3.25 s of CPU, but its bytes took 6 s to arrive
    assert data_plane_floor(30.0, 1, 6.0, 2.0, 3.0, 1.5, 2) == 36.0
    assert data_plane_floor(30.0, 7, 6.0, 2.0, 3.0, 1.5, 0) == 63.5  # no cores read: one
    assert judge(62.0, 31.0, 40.0) == {
        "larger_bound_seconds": 40.0, "ship_over_bound": 1.55, "within_1_5x_bound": False,
    }  # fmt: skip
    assert judge(62.0, 31.0, None)["larger_bound_seconds"] == 31.0

    def run(nodes: int, ready: float, floor: float | None) -> dict:
        return {
            "scenario": "ship", "nodes": nodes, "ready_seconds": ready, "index_bytes": 1,
            "builds": 1, "shipped": nodes - 1, "source_sent_bytes": 2, "stream_bytes": 2,
            "bound_seconds": 40.0, "floor_seconds": floor, "node_cpu_seconds": [1.0] * nodes,
        }  # fmt: skip

    older = {**run(4, 65.0, None), "cpu_bound_seconds": 60.0}
    rows = summarize_netns([run(2, 50.0, 35.0), run(8, 75.0, 55.0), older])
    by_n = {r["nodes"]: r for r in rows}
    assert (by_n[2]["ship_over_bound"], by_n[2]["within_1_5x_bound"]) == (1.25, True)
    assert (by_n[8]["larger_bound_seconds"], by_n[8]["ship_over_bound"]) == (55.0, 1.36)
    assert by_n[8]["within_1_5x_bound"]  # 1.88 x the link bound alone: missed
    assert by_n[4]["floor_seconds"] is None and by_n[4]["larger_bound_seconds"] == 40.0
    assert not by_n[4]["within_1_5x_bound"]  # 1.63 x the link bound; 1.08 x the CPU bound
    results = {
        "runs": [run(2, 50.0, 35.0), run(8, 75.0, 55.0)],
        "links": {"node_mbit": 1000, "index_uplink_mbit": 200},
        "wheels": {"bytes": 10**9}, "build_seconds": 30, "machine": "2 CPUs",
    }  # fmt: skip
    results["summary"] = summarize_netns(results["runs"])
    plot_netns(results, tmp_path / "bounds.png")
    assert (tmp_path / "bounds.png").stat().st_size > 10_000


def test_uv_run_driver_targets_read_off_the_medians() -> None:
    """Ours above the floor against Ray's hook above it, at the largest N of the set; one sync
    in the session that builds the venv and none later; no worker `uv run` of ours."""
    from benchmarks.uv_run_driver import Sample as DriverSample
    from benchmarks.uv_run_driver import markdown as driver_markdown
    from benchmarks.uv_run_driver import summarize as summarize_driver
    from benchmarks.uv_run_driver import targets as driver_targets

    def sample(way: str, n: int, seconds: float, syncs: int = 0, runs: int = 0) -> DriverSample:
        return DriverSample("big", way, n, 0, True, seconds, syncs=syncs, worker_uv_runs=runs)

    samples = [
        sample("floor", 32, 100.0),
        sample("ray-hook", 32, 130.0, runs=32),
        sample("ours-ready", 32, 102.0),
        sample("ours-first", 32, 150.0, syncs=1),
        sample("ours-ready", 1, 500.0),  # not the largest N: not the target's
    ]
    found = {t.name: t for t in driver_targets(summarize_driver(samples))}
    share = found["big, 32 actors: ours (venv ready) above the floor <= 10% of Ray's hook's"]
    assert (share.met, share.measured) == (True, "+2.00s against +30.00s (floor 100.00s)")
    assert not any("without the plugin" in name for name in found)  # no ray-env sample
    samples.append(sample("ray-env", 32, 101.5))
    found = {t.name: t for t in driver_targets(summarize_driver(samples))}
    ours_alone = found[
        "big, 32 actors: ours (venv ready) above a runtime_env without the plugin <= 10% of "
        "Ray's hook's above it"
    ]
    assert (ours_alone.met, ours_alone.measured) == (
        True,
        "+0.50s against +28.50s (ray-env 101.50s)",
    )
    assert found["one `uv sync` per node per env (first session 1, later sessions 0)"].met
    assert found["no `uv run` by any worker of ours"].met
    table = driver_markdown(summarize_driver(samples), list(found.values()))
    assert "| big | 32 | Ray's `uv run` hook: `uv run` per worker | 130.00 |" in table
    samples[2] = sample("ours-ready", 32, 105.0, syncs=1, runs=1)
    found = {t.name: t for t in driver_targets(summarize_driver(samples))}
    assert not any(t.met for t in found.values())


@pytest.mark.slow
def test_uv_run_after_change_reads_the_plugins_share_and_the_verdict() -> None:
    """After a change: the plugin's setup seconds come from the agent's `built in` line (ms
    or s), the rest after `ray.init` is Ray's; ours is judged below Ray's hook at each N."""
    from benchmarks.uv_run_after_change import plugin_share, verdicts
    from benchmarks.uv_run_driver import Sample as DriverSample
    from benchmarks.uv_run_driver import summarize as summarize_driver

    log = [
        "INFO ... uv_project 0123456789abcdef: seeded from fedcba9876543210: the bytecode of "
        "422 distributions (43862 files, 790 MB) in 11.70s",
        "INFO ... uv_project 0123456789abcdef: step sync took 0.91s",
        "INFO ... uv_project 0123456789abcdef: step seeding took 1.23s",
        "INFO ... uv_project 0123456789abcdef: built in 25.84s -> /v/0123456789abcdef",
        "INFO ... uv_project 0123456789abcdef: reused in 812.0ms -> /v/0123456789abcdef",
    ]
    ours = DriverSample("big", "ours-change", 8, 0, True, 60.0, after_init_s=40.0, setup_log=log)
    share = plugin_share(ours)
    assert share["setup_s"] == 25.84 and share["ray_rest_s"] == 14.16 and share["reused"] == 1
    assert share["seeded"].startswith("0123456789abcdef: seeded from fedcba9876543210")
    assert share["steps_s"] == {"sync": 0.91, "seeding": 1.23}
    assert plugin_share(DriverSample("big", "ray-hook", 8, 0, True, 50.0)) == {}
    rows = summarize_driver(
        [
            ours,
            DriverSample("big", "ray-hook", 8, 0, True, 50.0),
            DriverSample("big", "ours-change", 32, 0, True, 90.0),
            DriverSample("big", "ray-hook", 32, 0, True, 120.0),
            DriverSample("big", "ours-change", 1, 0, False, None),
        ]
    )
    assert verdicts(rows) == [
        "big x1: not measured",
        "big x8: ours 60.00s, Ray's hook 50.00s: missed",
        "big x32: ours 90.00s, Ray's hook 120.00s: met",
    ]


def test_the_after_change_bench_is_its_own_entry_point_without_an_import_circle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`benchmarks.uv_run_after_change` takes the driver bench's options and `--change`; the
    driver bench does not import it back."""
    import ast

    import benchmarks.uv_run_driver as driver
    from benchmarks.uv_run_after_change import main as after_change_main

    imported = set()
    for node in ast.walk(ast.parse(Path(driver.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not [name for name in imported if "uv_run_after_change" in name], imported
    with pytest.raises(SystemExit) as e:
        after_change_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--change SPEC" in out and "--actors" in out
    with pytest.raises(SystemExit) as e:
        after_change_main(["--sets", "big"])  # no change named
    assert e.value.code == 2


def test_edit_run_reads_each_build_step_s_seconds_from_the_setup_log() -> None:
    """`benchmarks.edit_run` keeps a build's lines (`build_steps`: the plugin's message after
    `uv_project `) and reads each step's seconds from them."""
    from benchmarks.edit_run import step_seconds

    lines = [
        "0123456789abcdef: step sync took 0.91s",
        "0123456789abcdef: seeded from fedcba9876543210: the bytecode of 422 distributions",
        "0123456789abcdef: step seeding took 1.05s",
        "0123456789abcdef: step freeze took 12.30s",
    ]
    assert step_seconds(lines) == {"sync": 0.91, "seeding": 1.05, "freeze": 12.3}


def test_edit_run_s_lstat_walk_counts_every_entry_below_the_venv(tmp_path: Path) -> None:
    """`benchmarks.edit_run.lstat_walk` counts each entry once, the venv's dir, a file whose name
    holds a space, and a link among them."""
    from benchmarks.edit_run import lstat_walk

    (tmp_path / "lib" / "a b").mkdir(parents=True)
    (tmp_path / "lib" / "a b" / "m.py").write_text("x = 1\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to("/nowhere")
    entries, seconds = lstat_walk(tmp_path)
    assert entries == 6 and seconds >= 0


def test_seed_work_s_new_venv_is_the_seed_s_own_inodes_less_bytecode(tmp_path: Path) -> None:
    """`benchmarks.seed_work` stands a hardlink copy of the seed, less its `__pycache__` dirs
    and the plugin's files, for uv's sync: the same inodes, as uv links them from its cache."""
    from benchmarks.seed_work import without_bytecode

    seed = tmp_path / "seed"
    (seed / "lib" / "pkg" / "__pycache__").mkdir(parents=True)
    (seed / "lib" / "pkg" / "m.py").write_text("X = 1\n")
    (seed / "lib" / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"pyc")
    (seed / ".ray-uv-ready").write_text("{}")
    (seed / "bin").mkdir()
    (seed / "bin" / "python").symlink_to("/usr/bin/python3")
    new = tmp_path / "new"
    without_bytecode(seed, new)
    found = sorted(str(p.relative_to(new)) for p in new.rglob("*"))
    assert found == ["bin", "bin/python", "lib", "lib/pkg", "lib/pkg/m.py"]
    assert (new / "lib/pkg/m.py").stat().st_ino == (seed / "lib/pkg/m.py").stat().st_ino
    assert (new / "bin" / "python").readlink() == Path("/usr/bin/python3")


@pytest.mark.slow  # the benchmark itself, with its Ray sessions
def test_uv_run_driver_benchmark_runs(tmp_path: Path) -> None:
    """`benchmarks.uv_run_driver` for real: drivers started with `uv run --extra small`, one
    actor, one sample per way (about 45 s). Each sample checks where its workers ran."""
    from benchmarks.uv_run_driver import main as driver_main

    out = tmp_path / "driver.json"
    argv = ["--sets", "small", "--actors", "1", "--repeats", "1", "--timeout", "120"]
    argv += ["--json", str(out), "--plot", str(tmp_path / "driver.png")]
    assert driver_main(argv) == 0
    data = json.loads(out.read_text())
    by_way = {s["way"]: s for s in data["samples"]}
    assert set(by_way) == {"floor", "ray-hook", "ours-ready", "ours-first", "ray-env"}
    assert all(s["ok"] for s in by_way.values()), by_way
    assert (by_way["ours-first"]["syncs"], by_way["ours-ready"]["syncs"]) == (1, 0)
    assert by_way["ray-hook"]["worker_uv_runs"] == 1
    assert by_way["ours-ready"]["worker_uv_runs"] == 0
    assert by_way["ours-ready"]["job_runtime_env"]["uv_project"]["extras"] == ["small"]
    assert "py_executable" in by_way["ray-hook"]["job_runtime_env"]
    assert by_way["ray-env"]["job_runtime_env"]["py_executable"].endswith("/.venv/bin/python")
    assert (tmp_path / "driver.png").read_bytes()[:4] == b"\x89PNG"


def test_ship_stream_measures_both_sides_of_a_real_stream(tmp_path: Path) -> None:
    from benchmarks.ship_stream import KEY, main, measure

    venv = tmp_path / "src" / KEY
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#")
    (venv / "lib" / "pkg").mkdir(parents=True)
    for n in range(50):
        (venv / "lib" / "pkg" / f"m{n}.py").write_bytes(bytes(1000 + n))
    sample = measure(venv, tmp_path)
    assert sample["members"] == 2 + 1 + 1 + 50  # bin, lib, bin/python, lib/pkg, 50 files
    assert sample["stream_bytes"] >= sum(1000 + n for n in range(50))
    for side in ("pack", "receive"):
        assert set(sample[side]) == {"user_s", "system_s", "wall_s"}
        assert sample[side]["wall_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # the receive left nothing
    assert main(["--venv", str(tmp_path / "nowhere")]) == 2


def test_build_limits_measures_the_limit_and_the_budget(tmp_path: Path) -> None:
    """benchmarks.build_limits on two keys: each way builds both, at most the limit at once."""
    from benchmarks.build_limits import main
    from ray_uv_plugin.store.build_slots import default_max_builds

    out = tmp_path / "limits.json"
    assert main(["--keys", "2", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    ways = ("one_after_another", "at_once_default_limit", "at_once_no_limit", "budget")
    assert all(run[way]["syncs"] == 2 and run[way]["failed"] == 0 for way in ways)
    assert run["one_after_another"]["peak_syncs"] == 1
    assert run["at_once_default_limit"]["peak_syncs"] <= default_max_builds()
    assert run["at_once_no_limit"]["peak_syncs"] == 2
    budget = run["budget"]
    assert budget["end_bytes"] <= budget["budget_bytes"] < budget["before_bytes"] * 2

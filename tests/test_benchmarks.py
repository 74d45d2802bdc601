"""The benchmark machinery: pure parts without Ray, and one real run of two cheap scenarios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.report import Row, plot, summarize, targets
from benchmarks.runner import Case, Sample, rounds
from benchmarks.scenarios import BY_ID
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
    assert found["small: warm within 10% of the floor"].met is True
    assert found["small: cold venv within 1.2x (floor + hand-run uv sync)"].met is False
    assert found["a ready venv costs the plugin < 5 ms"].met is True
    uv_field = next(t for n, t in found.items() if "Ray `uv` field" in n)
    assert uv_field.met is True  # -0.05s against +4.9s


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [Row("small", 1, "local", "floor", 1.0, 0.9, 1.1, 1, 1, None, ())]
    plot(tmp_path / "chart.png", rows, "test")
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_one_real_run(tmp_path: Path) -> None:
    """Floor and warm once each, with real uv and a real Ray per sample (about 30 s)."""
    out = tmp_path / "bench.json"
    argv = ["--sets", "small", "--scenarios", "floor,warm", "--repeats", "1", "--actors", ""]
    assert main([*argv, "--no-cluster", "--timeout", "120", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    by_scenario = {s["scenario"]: s for s in data["samples"]}
    assert by_scenario["floor"]["ok"] and by_scenario["warm"]["ok"]
    assert by_scenario["warm"]["syncs"] == 0
    assert "/venvs/" in by_scenario["warm"]["executables"][0]
    assert data["plugin_cost"]["median_ms"] < 50


def test_the_shipping_benchmarks_index_serves_and_counts_real_wheels(tmp_path: Path) -> None:
    """`benchmarks.cluster_ship`'s index: uv locks against it from PEP 658 metadata alone
    (no wheel bytes), and installs count every wheel byte served."""
    import subprocess

    from benchmarks.cluster_ship import CountingIndex, make_wheel, write_project
    from ray_uv_plugin.uv import find_uv

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

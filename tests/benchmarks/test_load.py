"""benchmarks.load's pure parts, without Ray: percentiles, the flatness verdict (a leak is
flagged, a warm-up is not), and how requests and errors are counted."""

from __future__ import annotations

import pytest

from benchmarks.load import error_kinds, latencies
from benchmarks.load_stats import FD_TOLERANCE, RSS_TOLERANCE, flatness, percentile, slope


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_slope_is_least_squares() -> None:
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope([5], [1]) == 0.0
    assert slope([2, 2], [1, 9]) == 0.0


def test_a_growing_series_is_flagged_and_a_flat_one_is_not() -> None:
    times = [float(t) for t in range(600)]
    # the agent's RSS in KiB: 100 KiB kept per request, 200 requests over 10 minutes
    leak = [100_000 + 100 * (t // 3) for t in times]
    assert flatness(times, leak, *RSS_TOLERANCE)["flat"] is False
    noisy = [100_000 + (t % 7) * 300 for t in times]
    verdict = flatness(times, noisy, *RSS_TOLERANCE)
    assert verdict["flat"] is True
    assert (verdict["first"], verdict["max"], verdict["samples"]) == (100_000, 101_800, 600)
    # grows while it warms up, then levels off: flat
    warm_up = [100_000 + min(t, 60) * 500 for t in times]
    assert flatness(times, warm_up, *RSS_TOLERANCE)["flat"] is True
    # a slow fd leak, one per 20 s, on a base of 30
    fds = [30 + t // 20 for t in times]
    assert flatness(times, fds, *FD_TOLERANCE)["flat"] is False
    assert flatness(times, [30 + t % 3 for t in times], *FD_TOLERANCE)["flat"] is True
    assert flatness([], [], 0.1, 5) == {"samples": 0, "flat": None}
    assert flatness(times[:60], leak[:60], *RSS_TOLERANCE)["flat"] is None  # too short to tell


def test_requests_are_split_by_key_and_by_what_they_found() -> None:
    records = [
        {"key": "a[x]", "requested": 10.0, "ready": 11.0, "built_at": 5.0},  # warm, found
        {"key": "a[x]", "requested": 10.0, "ready": 13.0, "built_at": 5.0},
        {"key": "b[y]", "requested": 10.0, "ready": 20.0, "built_at": 15.0},  # cold, built
        {"key": "b[y]", "requested": 30.0, "ready": 31.0, "built_at": 15.0},  # cold key, found
        {"key": "b[y]", "requested": 40.0, "error": "RuntimeEnvSetupError", "message": "m"},
    ]
    out = latencies(records, {"a[x]"})
    assert (out["warm_keys"]["n"], out["cold_keys"]["n"]) == (2, 2)
    assert out["warm_keys"]["p50_s"] == pytest.approx(2.0)
    assert (out["found_ready"]["n"], out["built_meanwhile"]["n"]) == (3, 1)
    assert out["built_meanwhile"]["max_s"] == pytest.approx(10.0)


def test_errors_are_counted_by_kind() -> None:
    message = "Failed to set up runtime environment.\nTraceback ...\nuv_project: over its budget\n"
    records = [
        {"key": "k", "error": "RuntimeEnvSetupError", "message": message},
        {"key": "k", "error": "RuntimeEnvSetupError", "message": message},
        {"key": "k", "error": "Hang", "message": "no answer within 900s"},
        {"key": "k", "ready": 1.0},
    ]
    kinds = error_kinds(records, [{"rc": 1, "stderr": ""}])
    assert kinds == {
        "RuntimeEnvSetupError: uv_project: over its budget": 2,
        "Hang: no answer within 900s": 1,
        "driver exited 1": 1,
    }

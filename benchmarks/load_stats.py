"""The pure figures of `benchmarks.load`: percentiles, a least-squares slope, and whether a
series sampled over a run stayed flat (a leak shows as a series that keeps growing)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# What a flat series may add over a run, fitted on its later half: (share of its median, units).
RSS_TOLERANCE = (0.05, 10 * 1024)  # KiB: 5% and 10 MiB (a Python process's caches settling)
FD_TOLERANCE = (0.10, 5)  # fds: 10% and 5 (connections to the raylet, the GCS, a log file)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) by linear interpolation between the closest ranks (what
    `numpy.percentile` gives by default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def slope(times: Sequence[float], values: Sequence[float]) -> float:
    """The least-squares slope of `values` against `times` (units per second); 0 for fewer than
    two distinct times."""
    if len(times) < 2:
        return 0.0
    mt, mv = statistics.fmean(times), statistics.fmean(values)
    spread = sum((t - mt) ** 2 for t in times)
    if spread == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / spread


def flatness(
    times: Sequence[float],
    values: Sequence[float],
    rel: float,
    absolute: float,
    min_seconds: float = 120.0,
) -> dict[str, Any]:
    """Whether a series sampled over a run stayed flat, and its figures. A process grows while
    it warms up (imports, caches, its first connections), then must level off: the slope is
    fitted over the later half of the run only, and the series is flat if that slope, held
    over the whole run, adds at most `absolute` plus `rel` times the series' median. A leak
    (something kept per request) keeps growing to the end and is flagged. A run shorter than
    `min_seconds` is all warm-up: no verdict (None)."""
    if not values:
        return {"samples": 0, "flat": None}
    middle = times[0] + (times[-1] - times[0]) / 2
    half = [(t, v) for t, v in zip(times, values, strict=True) if t >= middle]
    late = slope([t for t, _ in half], [v for _, v in half])
    duration = times[-1] - times[0]
    allowed = absolute + rel * statistics.median(values)
    return {
        "samples": len(values),
        "first": values[0],
        "last": values[-1],
        "max": max(values),
        "min": min(values),
        "slope_per_min": round(slope(times, values) * 60, 3),
        "late_slope_per_min": round(late * 60, 3),
        "late_growth_over_run": round(late * duration, 1),
        "allowed_growth": round(allowed, 1),
        "flat": late * duration <= allowed if duration >= min_seconds else None,
    }

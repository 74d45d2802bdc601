"""Sizes and ages for people, the way uv prints them: `412.0MiB`, `5m ago`."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """`412.0MiB`, the way uv prints sizes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_age(seconds_ago: float) -> str:
    """`12s ago`, `5m ago`, `3h ago`, `4d ago`."""
    s = max(0.0, seconds_ago)
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if s < limit:
            return f"{int(s // div)}{unit} ago"
    return f"{int(s // 86400)}d ago"

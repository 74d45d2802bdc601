"""For people: sizes and ages the way uv prints them (`412.0MiB`, `5m ago`), and how a venv
came to be."""

from __future__ import annotations

from typing import Any


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


def built_label(meta: Any) -> str:
    """The BUILT column: how the venv came to be, from its marker's `built` (`full`,
    `seeded from <key> (N dists)`, `shipped (<bytes> from <host>)`, with `; N files, <bytes>,
    from seed <key>` where the receiver took those from its seed), `-` where it says nothing
    (a venv of an earlier version)."""
    built = meta.get("built") if isinstance(meta, dict) else None
    if not isinstance(built, dict):
        return "-"
    how = built.get("how")
    if how == "seeded":
        return f"seeded from {built.get('seed')} ({built.get('distributions')} dists)"
    if how == "shipped":
        size = built.get("bytes")
        sent = format_bytes(size) if isinstance(size, int) else "?"
        seed = built.get("seed")
        if seed is None:
            return f"shipped ({sent} from {built.get('from')})"
        reused = built.get("reused_bytes")
        taken = format_bytes(reused) if isinstance(reused, int) else "?"
        return (
            f"shipped ({sent} from {built.get('from')}; {built.get('reused_files')} files, "
            f"{taken}, from seed {seed})"
        )
    return str(how or "-")

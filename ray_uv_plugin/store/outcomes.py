"""`.outcomes`: a line per setup of a key in this venv dir (reused, built, seeded, shipped,
failed), appended as each ends, for the node's setup metrics to count (`cluster.setup_metrics`).

Each line is one `write` to a file opened `O_APPEND` (`<key> <outcome> <bytes>`), so concurrent
writers never mix lines, and a setup pays a few microseconds for it. Nothing reads it but the
metrics exporter, which keeps its place (`read_from`) and, once the file passes `ROTATE_BYTES`,
renames it to `.outcomes.old` (replacing the last one) and starts again at 0: a setup that
appends just then to the renamed file goes uncounted. Recording never fails a setup: any error
(a full disk, a file that is not ours) drops the line.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections import Counter
from pathlib import Path

from ray_uv_plugin.store import trust
from ray_uv_plugin.store.layout import KEY_LENGTH

OUTCOMES = ".outcomes"
OLD = ".outcomes.old"
KINDS = ("reused", "built", "seeded", "shipped", "failed")
ROTATE_BYTES = 1 << 20
LINE = re.compile(rf"^(?P<key>[0-9a-f]{{{KEY_LENGTH}}}) (?P<outcome>[a-z]+) (?P<bytes>\d+)$")


def is_record(name: str) -> bool:
    """Whether an entry of the venv dir is the outcomes file (`inventory` lists it as no venv)."""
    return name in (OUTCOMES, OLD)


def record(root: Path, key: str, outcome: str, nbytes: int = 0) -> None:
    """Append that a setup of `key` ended with `outcome` (`KINDS`; `nbytes`: a receive's)."""
    assert outcome in KINDS, outcome
    mode = 0o640 if trust.trusted_gid() is not None else 0o600
    try:
        fd = trust.open_no_follow(root / OUTCOMES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.write(fd, f"{key} {outcome} {max(int(nbytes), 0)}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def read_from(root: Path, offset: int) -> tuple[Counter[tuple[str, str]], Counter[str], int]:
    """The (key, outcome) counts and each key's shipped bytes of the lines from `offset` on,
    and the offset to read from next (0 after a rotation). A line not of this form is skipped;
    a file that is not the user's regular file is not read."""
    counts: Counter[tuple[str, str]] = Counter()
    shipped: Counter[str] = Counter()
    path = root / OUTCOMES
    try:
        data = trust.read_own_file(path, 1 << 26, "the outcomes file")
    except OSError:
        return counts, shipped, 0
    if len(data) < offset:  # rotated, or truncated, by someone else: from the start
        offset = 0
    end = data.rfind(b"\n", offset) + 1  # whole lines only: the last may be being written
    for line in data[offset:end].decode(errors="replace").splitlines():
        if m := LINE.match(line):
            if m["outcome"] in KINDS:
                counts[(m["key"], m["outcome"])] += 1
                if m["outcome"] == "shipped":
                    shipped[m["key"]] += int(m["bytes"])
    if end >= ROTATE_BYTES and end == len(data):
        with contextlib.suppress(OSError):
            os.replace(path, root / OLD)
            return counts, shipped, 0
    return counts, shipped, max(end, offset)

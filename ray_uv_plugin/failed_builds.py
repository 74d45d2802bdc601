"""Builds that just failed, remembered for a minute by the process that ran them.

Ray's runtime-env agent runs a failed setup up to 3 times, 1 s apart (`RUNTIME_ENV_RETRY_TIMES`).
A `uv sync` that failed for a reason that a second does not fix (a package that does not build,
a hash mismatch, a full disk, a build past its time limit) would run three times, and the caller
would wait three builds (or fill the disk three times) for one error. Its retries get the same
error at once instead. A failure on the network, or in a project dir that was removed while uv
ran, is not remembered: the next try may get through.

Per process (the node's agent), per venv path (`<venv dir>/<key>`): the same inputs would fail
the same way there. After `REMEMBER_SECONDS` the next request builds again, e.g. once the disk
has been freed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

REMEMBER_SECONDS = 60.0

_failed: dict[Path, tuple[float, str]] = {}  # venv -> (when, the error's message)
_guard = threading.Lock()  # builds fail in threads of their own


def remember(venv: Path, message: str) -> None:
    now = time.monotonic()
    with _guard:
        for old in [v for v, (when, _) in _failed.items() if now - when >= REMEMBER_SECONDS]:
            del _failed[old]
        _failed[venv] = (now, message)


def recent(venv: Path) -> str | None:
    """The error of the last build of `venv` if it failed less than `REMEMBER_SECONDS` ago, with
    a line that says so; else None."""
    with _guard:
        when, message = _failed.get(venv, (float("-inf"), ""))  # `remember` drops expired ones
    ago = time.monotonic() - when
    if ago >= REMEMBER_SECONDS:
        return None
    return (
        f"{message}\n(This node's build of {venv} failed {ago:.0f}s ago, so it was not run "
        f"again: the next request after {REMEMBER_SECONDS:.0f}s builds it again.)"
    )

"""The chaos run's invariants, checked after every round, each a function that returns the
violations it found (in words; empty when it held).

- `whole`: every ready venv is what its build made: its files, entry for entry, the manifest
  its marker names (`store.manifest`); each venv is checked once per (inode, manifest);
- `ran_in_ready`: every worker that reported ran in a venv whose marker, as the worker read it
  at its start, named its key, no `not_whole`, and the venv is under a node's venv dir;
- `locks`: no build lock or build slot ticket is held past the bound (the nodes' build timeout
  and a margin, from the holder's record: it writes the file when it takes it), and none by a
  process that is stopped once the faults are let go;
- `leftovers`: after `ray-uv gc --all` (the operator's tool, as it is), the venv dir holds
  only ready venvs, venvs being built, their lock files and live tickets: nothing left that
  gc does not remove;
- `no_hang` and `next_round` are the jobs' own (chaos.py): each ended within its timeout, and
  the requests made once the faults were gone all succeeded.

Reading a marker here never touches it (`check_ready` would: a use, for gc).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import build_slots, manifest
from ray_uv_plugin.store.build_lock import is_held
from ray_uv_plugin.store.layout import BUDGET_LOCK, MARKER, MARKER_FORMAT, NOT_WHOLE, read_marker

KEY = re.compile(r"^[0-9a-f]{16}$")
LOCK = re.compile(r"^[0-9a-f]{16}\.lock$")
LOCK_MARGIN_S = 60.0


def ready(venv: Path) -> dict[str, Any] | None:
    """The marker of a ready venv (as `check_ready` takes it, without touching it); None if not
    ready."""
    meta = read_marker(venv)
    if meta is None or meta.get("key") != venv.name or meta.get("format") != MARKER_FORMAT:
        return None
    return None if meta.get(NOT_WHOLE) else meta


def check_whole(venv: Path, meta: Mapping[str, Any]) -> str | None:
    """Why the ready venv `venv` is not what its build made; None if it is."""
    try:
        built = manifest.load(venv, meta.get("manifest"))
        now = manifest.scan(venv)
    except (OSError, manifest.ManifestError) as e:
        return f"{venv}: {e}"
    diff = manifest.first_difference(built, now)
    return f"{venv}: {diff}" if diff else None


def whole(venv_dirs: Iterable[Path], checked: set[tuple[int, str]]) -> list[str]:
    """Every ready venv under `venv_dirs` whole; `checked` (inode, manifest) pairs are skipped
    and the newly checked added."""
    found = []
    for root in venv_dirs:
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if not KEY.match(entry.name) or not entry.is_dir() or entry.is_symlink():
                continue
            meta = ready(entry)
            if meta is None:
                continue
            seen = (entry.stat().st_ino, str(meta.get("manifest")))
            if seen in checked:
                continue
            why = check_whole(entry, meta)
            if why and ready(entry) is not None:  # not one removed or marked while read
                found.append(f"ready venv not whole: {why}")
            checked.add(seen)
    return found


def ran_in_ready(reports: Iterable[Mapping[str, Any]], venv_dirs: Iterable[Path]) -> list[str]:
    """Each worker's own report (`chaos.WORKER`): its venv ready when it started."""
    roots = [str(d) for d in venv_dirs]
    found = []
    for r in reports:
        prefix, marker = r.get("prefix", ""), r.get("marker")
        where = f"worker pid {r.get('pid')} in {prefix}"
        if os.path.dirname(prefix) not in roots:
            found.append(f"{where}: not a venv of a node's venv dir")
        elif not isinstance(marker, dict):
            found.append(f"{where}: no marker when it started ({marker!r})")
        elif marker.get("key") != os.path.basename(prefix) or marker.get(NOT_WHOLE):
            found.append(f"{where}: its marker was not a ready one: {marker}")
    return found


def flock_holders() -> dict[int, list[int]]:
    """{inode: [pid, ...]} of the host's flocks (`/proc/locks`)."""
    holders: dict[int, list[int]] = {}
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            holders.setdefault(int(parts[5].rsplit(":", 1)[1]), []).append(int(parts[4]))
        except (ValueError, IndexError):
            continue
    return holders


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def locks(venv_dirs: Iterable[Path], bound_s: float, now: float | None = None) -> list[str]:
    """No lock or ticket held past `bound_s` (+ a margin) since its holder took it, nor by a
    stopped process."""
    now = time.time() if now is None else now
    holders = flock_holders()
    found = []
    for root in venv_dirs:
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            name = entry.name
            if not (LOCK.match(name) or build_slots.is_queue_entry(name)):
                continue
            if is_held(entry) is not True:
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            pids = holders.get(st.st_ino, [])
            states = {pid: _state(pid) for pid in pids}
            age = now - st.st_mtime
            if age > bound_s + LOCK_MARGIN_S:
                found.append(f"{entry} held {age:.0f}s (bound {bound_s:.0f}s) by {states}")
            elif any(s == "T" for s in states.values()):
                found.append(f"{entry} held by a stopped process: {states}")
    return found


def leftovers(root: Path, gc_env: Mapping[str, str], ray_uv: str) -> list[str]:
    """`ray-uv gc --all` on the venv dir, then whatever is left that is no ready venv, no
    venv being built, no lock file and no live ticket."""
    out = subprocess.run(
        [ray_uv, "gc", "--all"], env=dict(gc_env), capture_output=True, text=True, timeout=300
    )
    found = []
    if out.returncode != 0:
        found.append(f"ray-uv gc --all on {root} failed ({out.returncode}): {out.stderr[-400:]}")
    found += unexpected_entries(root)
    return found


def unexpected_entries(root: Path) -> list[str]:
    """What `root` holds beyond ready venvs, venvs being built (lock held), lock files, the
    budget's lock and live tickets."""
    found = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        name = entry.name
        if LOCK.match(name) or name == BUDGET_LOCK:
            continue
        if build_slots.is_queue_entry(name) and is_held(entry) is not False:
            continue
        if KEY.match(name) and entry.is_dir() and not entry.is_symlink():
            if ready(entry) is not None or is_held(root / f"{name}.lock"):
                continue
            marker = "no marker" if not (entry / MARKER).exists() else "a marker not ready"
            found.append(f"left after gc: {entry} ({marker}, its lock free)")
            continue
        found.append(f"left after gc: {entry}")
    return found

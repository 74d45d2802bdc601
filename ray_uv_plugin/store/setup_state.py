"""Where one key stands in one venv dir: ready, queued, building, receiving, failed or absent.

Read from the venv dir and the plugin's own records alone, never guessed: the venv's marker
(`layout.Venv.check_ready`, without marking a use), the key's build lock (held while a build or a
receive runs), the phase record its holder keeps (`phases`), and that holder's build-slot
ticket. A record whose writer is gone (the lock free) says nothing, but a `failed` one, which
its writer left as it gave up. `cluster.readiness` asks every node; `ray-uv status` shows it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import phases
from ray_uv_plugin.store.build_slots import TICKET, flock_held
from ray_uv_plugin.store.layout import KEY_LENGTH, PHASE_PREFIX, Venv

# The names that show a key in a venv dir: its venv, its lock, its phase record.
KEYED = re.compile(rf"^(?:{re.escape(PHASE_PREFIX)})?(?P<key>[0-9a-f]{{{KEY_LENGTH}}})(?:\.lock)?$")
# The marker's `built.how` -> how a ready venv was made.
MADE = {"full": "built", "seeded": "seeded", "shipped": "shipped"}


@dataclass(frozen=True)
class SetupState:
    """One key in one venv dir. `seconds`: in the phase (or queued) so far, by the venv dir's
    host clock; `bytes`: so far (a receive's stream, a build's downloads as uv reports them)."""

    state: str  # ready | queued | building | receiving | failed | absent
    how: str | None = None  # ready: built, seeded, shipped (or what an older marker says)
    phase: str | None = None
    seconds: float | None = None
    bytes: int | None = None
    source: str | None = None  # receiving, or ready and shipped: the host it comes from
    cause: str | None = None  # failed: why; absent: what is wrong with a venv there

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def made_how(marker: Any) -> str | None:
    """How a ready venv was made, from its marker's `built` (None: an older marker's)."""
    built = marker.get("built") if isinstance(marker, dict) else None
    how = built.get("how") if isinstance(built, dict) else None
    return MADE.get(how, how) if isinstance(how, str) else None


def read_setup(root: Path, key: str, now: float | None = None) -> SetupState:
    """Where `key` stands in the venv dir `root`. Raises `trust`'s errors for a venv dir or
    venv we must not read, as every use of it does."""
    now = time.time() if now is None else now
    ready = Venv(root, key).check_ready(use=False)
    if ready:
        built = ready.marker.get("built") if ready.marker else None
        shipped = built if isinstance(built, dict) and built.get("how") == "shipped" else {}
        sent, source = shipped.get("bytes"), shipped.get("from")
        return SetupState(
            "ready",
            how=made_how(ready.marker),
            bytes=sent if isinstance(sent, int) else None,  # a shipped one's: the stream's
            source=source if isinstance(source, str) else None,
        )
    record = phases.read_record(root, key)
    if phases.writer_alive(root, key):
        if record is None:  # being written, or its writer could not write one
            return SetupState("building")
        return _live(root, record, now)
    if record is not None and record["state"] == "failed":
        return SetupState("failed", phase=record.get("phase"), cause=str(record.get("cause")))
    why = ready.why_not
    return SetupState("absent", cause=None if why == "absent" else why)


def _live(root: Path, record: dict[str, Any], now: float) -> SetupState:
    """A live writer's record: a queued one only while its build-slot ticket is held."""
    state = record["state"]
    if state == "failed":  # failed, and the lock taken again since: a new try
        return SetupState("building")
    ticket = record.get("ticket")
    queued = isinstance(ticket, str) and TICKET.match(ticket) and flock_held(root / ticket, False)
    if state == "queued" and not queued:
        state = "building"  # it got its slot: the builder writes its first phase next
        record = {**record, "phase": None}
    since = record.get("since")
    amount = record.get("bytes")
    source = record.get("source")
    return SetupState(
        state,
        phase=record.get("phase") if isinstance(record.get("phase"), str) else None,
        seconds=round(max(now - since, 0.0), 1) if isinstance(since, (int, float)) else None,
        bytes=amount if isinstance(amount, int) else None,
        source=source if isinstance(source, str) else None,
    )


def read_all(root: Path, now: float | None = None) -> dict[str, SetupState]:
    """Where every key the venv dir `root` shows (a venv, a lock or a phase record) stands,
    but the absent ones: what the node's setup metrics export. Empty where `root` is not
    there yet; a key that cannot be read (untrusted) is left out."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    found: dict[str, SetupState] = {}
    for key in sorted({m["key"] for m in map(KEYED.match, names) if m}):
        try:
            state = read_setup(root, key, now)
        except OSError:  # trust's refusals, a venv removed while we looked
            continue
        if state.state != "absent":
            found[key] = state
    return found

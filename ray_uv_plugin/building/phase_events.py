"""The phases of one build or receive of a key, as they happen: a line in the job's setup log
and the key's phase record (`store.phases`), which `ray-uv status` and worker groups read.

The phases: `lock wait` (another process builds or receives the key: that one's record says
what it does), `build-slot queue` (state `queued`), `download` (uv fetching and preparing),
`building <package>` (a source distribution that uv builds, from its `Building`/`Built` lines),
`install`, `bytecode` (the seed's, then what is left compiled), `manifest` (the record of what
was made, and the venv dir's budget), and, for a receive, `ship bytes` (from a node), then
`install`. A phase's log line comes at most once per second (`LOG_EVERY`), however often uv
enters it; the record is written at each change of phase, and for the bytes at most every
`WRITE_EVERY` seconds. The holder of the key's lock makes one `PhaseEvents` and tells it
`clear` (ready: the record goes) or `failed` (the record keeps the cause) before letting go.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_uv_plugin.store import phases
from ray_uv_plugin.store.units import format_bytes

LOG_EVERY = 1.0  # seconds between two log lines of one phase
WRITE_EVERY = 0.5  # seconds between two writes of the record for its bytes alone
CAUSE_CHARS = 2000  # of a failure's message, in the record

_BUILDING = re.compile(r"^\s*Building (?P<name>\S+)")
_BUILT = re.compile(r"^\s*Built (?P<name>\S+)")
_DOWNLOADING = re.compile(r"^\s*Downloading (?P<name>\S+) \((?P<size>[\d.]+)(?P<unit>[KMGT]?i?B)\)")
_DOWNLOADED = re.compile(r"^\s*Downloaded (?P<name>\S+)")
_PREPARED = re.compile(r"^\s*Prepared \d+ packages?")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class PhaseEvents:
    """One build's or receive's phases of `key` in the venv dir `root`; `say` puts a line in
    the setup log (None: the record alone, as for a ship receiver, which has no job)."""

    def __init__(self, root: Path, key: str, say: Callable[[str], None] | None = None) -> None:
        self.root, self.key, self.say = root, key, say
        self.state, self.phase = "building", ""
        self.fields: dict[str, Any] = {}
        self.since = time.time()
        self.bytes: int | None = None
        self._building: list[str] = []  # source distributions uv builds now, in order
        self._sizes: dict[str, int] = {}  # downloads uv announced, by name
        self._logged: dict[str, float] = {}  # phase -> when its last line was said
        self._written = 0.0

    def enter(self, phase: str, state: str = "building", **fields: Any) -> None:
        """The build or receive is in `phase` from now (`fields`: the record's `source`,
        `ticket`...); nothing is written for the phase it is in already."""
        if (phase, state) == (self.phase, self.state):
            return
        self.phase, self.state, self.since = phase, state, time.time()
        self.fields = {**self.fields, **fields}
        self._write()
        self._log(phase, "")

    def add_bytes(self, amount: int) -> None:
        """`amount` more bytes in this phase (received, or downloaded as uv says)."""
        self.bytes = (self.bytes or 0) + amount
        if time.monotonic() - self._written >= WRITE_EVERY:
            self._write()
        self._log(self.phase, f": {format_bytes(self.bytes)} so far")

    def uv_line(self, line: str) -> None:
        """A line of `uv sync`'s output: the phase it says uv is in, if any."""
        if match := _BUILDING.match(line):
            self._building.append(match["name"])
        elif match := _BUILT.match(line):
            if match["name"] in self._building:
                self._building.remove(match["name"])
        elif match := _DOWNLOADING.match(line):
            size = float(match["size"]) * _UNITS.get(match["unit"], 1)
            self._sizes[match["name"]] = int(size)
            return
        elif match := _DOWNLOADED.match(line):
            self.add_bytes(self._sizes.pop(match["name"], 0))
            return
        elif _PREPARED.match(line):
            self.enter("install")
            return
        else:
            return
        self.enter(f"building {', '.join(self._building)}" if self._building else "download")

    def failed(self, cause: str) -> None:
        """The build or receive gave up: the record keeps why, for the view, until the next."""
        self.state = "failed"
        self.fields["cause"] = cause[:CAUSE_CHARS]
        self._write()

    def clear(self) -> None:
        """No record left: the venv is ready (its marker says so), or the request was
        cancelled before it built anything."""
        phases.remove_record(self.root, self.key)

    def _write(self) -> None:
        self._written = time.monotonic()
        record = {"state": self.state, "phase": self.phase, "since": self.since, **self.fields}
        phases.write_record(self.root, self.key, {**record, "bytes": self.bytes})

    def _log(self, phase: str, detail: str) -> None:
        now = time.monotonic()
        if self.say is None or now - self._logged.get(phase, -LOG_EVERY) < LOG_EVERY:
            return
        self._logged[phase] = now
        self.say(f"phase: {phase}{detail}")

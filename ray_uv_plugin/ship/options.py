"""What a ship takes (`ShipOptions`: a frozen value) and whom it tells how it goes
(`ShipReporter`: a protocol), as `cluster.options` does for a prepare: one value and one object
instead of a dozen keywords and a callback per event. `QuietShipReporter` reports nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ray_uv_plugin.ship.archive import CHUNK_BYTES
from ray_uv_plugin.ship.messages import Progress, ShipSettings

STALL_TIMEOUT = 300.0  # a node that does not answer for this long is given up on, alone
SHIP_TIMEOUT = 1800.0  # the whole ship, at most


@dataclass(frozen=True)
class ShipOptions:
    """How to ship.

    `settings`: what the receivers key the venv with besides their node (default: no env_vars,
    locked). `runtime_env`: for the actors, whose interpreter must have this package (default:
    the job's, but the node's own Python where the job sets a `py_executable` or a job-default
    `uv_project`: `launch.node_python_env`). `timeout` bounds the whole ship; `stall_timeout`
    each node's wait for its next answer. `chunk_bytes`: the stream's chunks' size."""

    settings: ShipSettings = field(default_factory=ShipSettings)
    runtime_env: dict[str, Any] | None = None
    chunk_bytes: int = CHUNK_BYTES
    timeout: float = SHIP_TIMEOUT
    stall_timeout: float = STALL_TIMEOUT


class ShipReporter(Protocol):
    """Told how a ship goes, as it goes."""

    def decided(self, node: str, decision: str) -> None:
        """Once for each target, as soon as its part is known, before the stream: `take` (its
        receiver holds the key's build lock until it installed the venv or failed), `reused`,
        `refused` or `failed`: what waits for that node's venv may start."""

    def progress(self, progress: Progress) -> None:
        """A chunk was sent on to the receivers."""


class QuietShipReporter:
    """A `ShipReporter` that reports nothing: subclass it to hear only some events."""

    def decided(self, node: str, decision: str) -> None:
        pass

    def progress(self, progress: Progress) -> None:
        pass

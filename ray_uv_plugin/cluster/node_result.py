"""What a prepare says of each node: how it got the env (built, shipped, reused) or why it
failed, as a line, a table row and JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeResult:
    node_id: str
    address: str
    ok: bool
    # from submitting the probe task to its result: env setup (for a node that takes a shipped
    # venv: its receive, the probe is submitted once the node took the offer) and worker start
    seconds: float
    built: bool = False
    build_seconds: float | None = None  # uv sync time, from the venv's marker
    key: str | None = None
    python: str | None = None
    error: str | None = None
    shipped_bytes: int | None = None  # received from another node, this many stream bytes
    note: str | None = None  # why the venv was not shipped here, when it was built instead
    # shipped: seconds of each step of the ship (`ShipResult.phases`), then of the probe
    ship_phases: dict[str, float] | None = None

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"

    @property
    def summary(self) -> str:
        """`shipped 1.8GiB in 12.40s`, `built in 40.20s (not shipped: ...)`, `reused`, ..."""
        from ray_uv_plugin.env.uv import format_duration
        from ray_uv_plugin.store.units import format_bytes

        took = format_duration(self.seconds)
        if self.outcome == "shipped":
            return f"shipped {format_bytes(self.shipped_bytes or 0)} in {took}"
        if self.outcome == "failed":
            return f"failed: {self.error or 'unknown error'}"
        text = f"{self.outcome} in {took}"
        return f"{text} ({self.note})" if self.note else text

    @property
    def outcome(self) -> str:
        if not self.ok:
            return "failed"
        if self.built:
            return "built"
        return "shipped" if self.shipped_bytes is not None else "reused"

    def as_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "build_seconds": self.build_seconds,
            "bytes": self.shipped_bytes,
            "key": self.key,
            "note": self.note,
            "error": self.error,
            "ship_phases": self.ship_phases,
        }


def outcome_counts(results: Sequence[NodeResult]) -> str:
    """`2 built, 5 shipped, 1 reused`: how the nodes of a prepare got their venv."""
    counts = {o: sum(r.outcome == o for r in results) for o in ("built", "shipped", "reused")}
    return ", ".join(f"{n} {o}" for o, n in counts.items())


def lacks_plugin(address: str, python: str) -> str:
    """What to say of a node whose worker ran in the node's own Python despite `uv_project`."""
    return (
        f"uv_project: node {address} ran the worker in its own Python ({python}), not in a "
        "venv: its raylet does not load the uv_project plugin, so Ray ignored the field. "
        'Restart that node with the plugin registered: `eval "$(ray-uv plugin-config --shell)"` '
        "before `ray start` (and ray-uv-plugin installed in its Python)."
    )

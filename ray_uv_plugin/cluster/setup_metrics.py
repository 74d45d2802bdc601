"""Setup metrics through Ray's metrics pipeline: what each node's venv dir says of every key,
exported by an actor on the node.

The plugin runs inside Ray's runtime-env agent, which has no core worker: `ray.util.metrics`
cannot record there. So the plugin only writes what it does to the venv dir (markers and phase
records, `store.setup_state`), and one zero-CPU actor per node (`SetupMetrics`, detached, on the
node's own Ray Python) reads that every `interval` seconds and sets Ray gauges. Ray's metrics
agent on the node serves them with Ray's own, in Prometheus format on the node's metrics
endpoint (`ray start --metrics-export-port`), each name prefixed `ray_`:

- `uv_project_setup_state{key, state, how}`: 1 for each key's state on the node (ready,
  queued, building, receiving, failed; `how` for a ready one: built, seeded, shipped);
  a key that leaves a state goes to 0 there.
- `uv_project_setup_phase_seconds{key, state, phase}`: the time in the phase so far (0 once
  the key left it).
- `uv_project_setup_bytes{key, state}`: the bytes so far of a build (downloads) or a receive.
- `uv_project_shipped_bytes{key, source}`: the bytes a ready venv was shipped in, and from
  which host.
- `uv_project_venvs{how}`: the node's ready venvs, by how each was made.
- `uv_project_setups_total{key, outcome}`: a counter of the setups that ended on the node,
  by outcome (reused, built, seeded, shipped, failed), from the venv dir's `.outcomes`
  (`store.outcomes`); `uv_project_received_bytes_total{key}`: the bytes received for them.

`export_setup_metrics()` starts the actors (once per node: a second call finds them).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

NAMESPACE = "ray-uv"
ACTOR_PREFIX = "ray-uv-setup-metrics-"
DEFAULT_INTERVAL = 5.0
HOW = ("built", "seeded", "shipped")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(setups: dict[str, Any]) -> Samples:
    """(metric, its tags) -> value for the keys of one venv dir (`store.setup_state.read_all`):
    what one export sets. Pure."""
    out: Samples = {}

    def put(name: str, value: float, **tags: str) -> None:
        out[(name, tuple(sorted(tags.items())))] = value

    made: Counter[str] = Counter()
    for key, s in setups.items():
        put("uv_project_setup_state", 1, key=key, state=s.state, how=s.how or "")
        if s.state == "ready":
            made[s.how or "unknown"] += 1
            if s.how == "shipped" and s.bytes is not None:
                put("uv_project_shipped_bytes", s.bytes, key=key, source=s.source or "")
            continue
        if s.phase is not None and s.seconds is not None:
            put("uv_project_setup_phase_seconds", s.seconds, key=key, state=s.state, phase=s.phase)
        if s.bytes is not None:
            put("uv_project_setup_bytes", s.bytes, key=key, state=s.state)
    for how in {*HOW, *made}:
        put("uv_project_venvs", made[how], how=how)
    return out


DESCRIPTIONS = {
    "uv_project_setup_state": "1 for each uv_project key's state on this node",
    "uv_project_setup_phase_seconds": "seconds in the current phase of a build or receive",
    "uv_project_setup_bytes": "bytes so far of a build's downloads or a receive",
    "uv_project_shipped_bytes": "bytes a ready venv was shipped in",
    "uv_project_venvs": "ready venvs on this node, by how each was made",
}
TAGS = {
    "uv_project_setup_state": ("key", "state", "how"),
    "uv_project_setup_phase_seconds": ("key", "state", "phase"),
    "uv_project_setup_bytes": ("key", "state"),
    "uv_project_shipped_bytes": ("key", "source"),
    "uv_project_venvs": ("how",),
}


class SetupMetrics:
    """On one node: reads the venv dir every `interval` seconds and sets the gauges; a series
    that an export no longer has is set to 0 once, so that a panel shows it end."""

    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        from ray.util.metrics import Counter, Gauge

        self.interval = interval
        self.gauges = {n: Gauge(n, DESCRIPTIONS[n], TAGS[n]) for n in DESCRIPTIONS}
        self.setups = Counter(
            "uv_project_setups",
            "setups that ended on this node, by outcome",
            ("key", "outcome"),
        )
        self.received = Counter(
            "uv_project_received_bytes", "bytes received for shipped venvs", ("key",)
        )
        self.offset = 0  # in the venv dir's `.outcomes`
        self.last: Samples = {}
        self.exports = 0
        threading.Thread(target=self._run, name="setup metrics", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.export()
            except Exception:  # noqa: BLE001, S110 - the next round tries again
                pass
            time.sleep(self.interval)

    def export(self) -> int:
        """One read and export; how many series it set."""
        from ray_uv_plugin.store import outcomes, trust
        from ray_uv_plugin.store.layout import venv_root
        from ray_uv_plugin.store.setup_state import read_all

        root = venv_root()
        if not root.exists():
            return 0
        root = trust.check_root(root)
        counts, received, self.offset = outcomes.read_from(root, self.offset)
        for (key, outcome), n in counts.items():
            self.setups.inc(n, {"key": key, "outcome": outcome})
        for key, n in received.items():
            if n:
                self.received.inc(n, {"key": key})
        now = samples(read_all(root))
        for (name, tags), value in {**dict.fromkeys(self.last, 0.0), **now}.items():
            self.gauges[name].set(value, dict(tags))
        self.last = now
        self.exports += 1
        return len(now)

    def count(self) -> int:
        """How many exports it made: a caller can wait for the first."""
        return self.exports


def export_setup_metrics(
    nodes: Iterable[str] | None = None, interval: float = DEFAULT_INTERVAL
) -> dict[str, Any]:
    """Start a `SetupMetrics` actor on each of `nodes` (default: every alive node) unless one
    runs there; node id -> its actor. Detached: it outlives this driver, until the cluster
    stops or `ray.kill` ends it. Needs a connected driver."""
    import ray

    from ray_uv_plugin.cluster.prepare import alive_nodes
    from ray_uv_plugin.ship.launch import actors_env, pinned

    wanted = [n for n, _ in alive_nodes()] if nodes is None else list(nodes)
    actor = ray.remote(num_cpus=0, max_restarts=-1)(SetupMetrics)
    env = actors_env(None)
    return {
        node: actor.options(
            name=f"{ACTOR_PREFIX}{node}",
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            **pinned(node, env),
        ).remote(interval)
        for node in wanted
    }

"""Building a uv environment on every alive node of a running cluster, ahead of the jobs.

A zero-CPU probe task is pinned to a node (`NodeAffinitySchedulingStrategy`, hard) with the
`uv_project` runtime_env, so the node's own plugin builds the venv exactly as a job's worker
would later: same key, same log, same lock. The task then reports the venv it ran in, from
which we tell a build from a reuse.

With shipping (the default; `ship=False`, `--no-ship` or `RAY_UV_PLUGIN_SHIP=0` turn it off),
the probe runs on one node first; its venv is then sent to the other nodes through Ray's
object store (`ship`), and the probes that follow on those nodes find it ready. A node that
cannot take it (another interpreter, platform, uv or Ray; other hardware, for a venv holding
wheels built on the first node) or whose receive failed or stalled is built by its probe as
without shipping, and its result says why it was not shipped. A stalled node costs the others
nothing: `ship` gives up on it alone, so their probes keep their time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ray_uv_plugin.agent.project import load_project
from ray_uv_plugin.agent.spec import parse_spec
from ray_uv_plugin.cluster.connect import clean_error, connect

# Not shipped with the project: Ray's working_dir upload has a size limit and needs none of it.
EXCLUDES = [".venv", ".git", "__pycache__", "*.pyc", ".ruff_cache", ".pytest_cache"]


class PrepareError(RuntimeError):
    """`prepare` cannot start (no cluster, bad project); the message says what to do."""


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
        from ray_uv_plugin.agent.uv import format_duration
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


def job_runtime_env(project: Path, shared: bool) -> dict[str, Any] | None:
    """The driver's job-level runtime_env: the project is shipped as working_dir unless every
    node already sees it at the same path (`--shared`).

    Ray takes local directories only at the job level, and a shipped project gets the same
    venv key as a job that ships it with `ray job submit --working-dir`.
    """
    if shared:
        return None
    return {"working_dir": str(project), "excludes": EXCLUDES}


def uv_project_value(
    project: Path,
    shared: bool,
    extras: Sequence[str],
    groups: Sequence[str],
    flags: Mapping[str, bool],
) -> dict[str, Any]:
    """The `uv_project` value for the probe tasks, checked here before any node sees it."""
    from ray_uv_plugin.agent.spec import UvProject

    value = UvProject(
        project=str(project) if shared else None, extras=extras, groups=groups, **flags
    )
    return dict(value)


def check_locally(project: Path, value: Mapping[str, Any], shared: bool) -> None:
    """Fail on the operator's machine, not on every node, for what the project files show."""
    from ray_uv_plugin.agent.project import check_request

    if not project.is_dir():
        if shared:
            return  # it may exist only on the nodes
        raise PrepareError(
            f"project directory {project} does not exist: pass --project DIR, the directory "
            "holding pyproject.toml and uv.lock."
        )
    check_request(load_project(project), parse_spec(value))


def lacks_plugin(address: str, python: str) -> str:
    """What to say of a node whose worker ran in the node's own Python despite `uv_project`."""
    return (
        f"uv_project: node {address} ran the worker in its own Python ({python}), not in a "
        "venv: its raylet does not load the uv_project plugin, so Ray ignored the field. "
        'Restart that node with the plugin registered: `eval "$(ray-uv plugin-config --shell)"` '
        "before `ray start` (and ray-uv-plugin installed in its Python)."
    )


def alive_nodes() -> list[tuple[str, str]]:
    import ray

    return [(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"]]


def prepare_nodes(
    value: Mapping[str, Any],
    nodes: list[tuple[str, str]],
    timeout: float,
    on_result: Callable[[NodeResult], None] = lambda r: None,
    ship: bool | None = None,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int | None = None,
    on_progress: Callable[[Any], None] = lambda p: None,
    probe_env: dict[str, Any] | None = None,
) -> list[NodeResult]:
    """Make the env ready on each node (connected already), reporting as each finishes.

    `ship` (default: on unless RAY_UV_PLUGIN_SHIP=0): build on one node, send that venv to
    the others (the ship's actors start while it builds). `runtime_env`: for the shipping
    actors, which need the node's Ray Python. `probe_env`: the whole runtime_env the env's
    workers will have (its env_vars may shape the venv), default `{"uv_project": value}`."""
    from ray_uv_plugin.ship import transfer as shipping

    probes = Probes(probe_env or {"uv_project": dict(value)}, timeout)
    ship = shipping.shipping_enabled() if ship is None else ship
    if not ship or len(nodes) < 2:
        for node in nodes:
            probes.submit(node)
        return probes.collect(on_result)
    source, rest = _source_first(nodes)
    probes.submit(source)
    # The sender and the receivers start while the first node builds.
    actors = shipping.start_actors(source[0], [node_id for node_id, _ in rest], runtime_env)
    try:
        first = probes.collect(on_result)
    except BaseException:
        if actors is not None:
            actors.stop()
        raise
    if not first[0].ok or first[0].key is None:
        if actors is not None:
            actors.stop()
        note = f"not shipped: the first node {source[1]} failed"
        for node in rest:
            probes.submit(node)
        return first + probes.collect(on_result, note=note)
    return first + ship_and_probe(
        value,
        first[0],
        rest,
        probes.left(),
        on_result,
        runtime_env=runtime_env,
        chunk_bytes=chunk_bytes,
        on_progress=on_progress,
        probes=probes,
        actors=actors,
    )


def ship_and_probe(
    value: Mapping[str, Any],
    source: NodeResult,
    nodes: list[tuple[str, str]],
    timeout: float,
    on_result: Callable[[NodeResult], None] = lambda r: None,
    *,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int | None = None,
    on_progress: Callable[[Any], None] = lambda p: None,
    probes: Probes | None = None,
    actors: Any = None,
) -> list[NodeResult]:
    """Send the venv that `source` (a node's result with the env ready: its `key`) has to
    `nodes`, and probe each as soon as its part is decided: a node that took it finds it ready
    once installed (its probe's request waits for the receiver's lock), one that could not
    (another build target, other uv settings, a failed receive) builds its own and its result
    says why. `prepare` ships from the node it built on; `ray-uv prepare --watch` from any node
    that has the env, to the nodes that joined since. `probes`: the prepare's, whose runtime_env
    and time limit the probes share (default: new ones for `{"uv_project": value}` within
    `timeout`); `actors`: the ship's, started before (`transfer.start_actors`) from `source`'s
    node to `nodes`."""
    from ray_uv_plugin.ship import transfer as shipping

    if source.key is None:
        if actors is not None:
            actors.stop()
        raise ValueError(f"no venv to ship from {source.label}: {source}")
    probes = probes or Probes({"uv_project": dict(value)}, timeout)
    spec = parse_spec(value)
    addresses = dict(nodes)
    shipped = shipping.ship(
        source.key,
        source.node_id,
        [node_id for node_id, _ in nodes],
        settings={
            "env_vars": probes.env.get("env_vars") or {},
            "resolves": spec.resolves,
            "build_env_vars": list(spec.build_env_vars),
        },
        runtime_env=runtime_env,
        chunk_bytes=chunk_bytes or shipping.archive.CHUNK_BYTES,
        timeout=timeout,
        on_progress=on_progress,
        actors=actors,
        on_decided=lambda node_id, _: probes.submit((node_id, addresses[node_id])),
    )  # it decides on every node, each once
    return probes.collect(on_result, shipped)


def _left(timeout: float, start: float) -> float:
    return max(timeout - (time.perf_counter() - start), 1.0)


def _source_first(nodes: list[tuple[str, str]]) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """The node to build on: the driver's own if it is one of them, else the first."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    source = next((n for n in nodes if n[0] == here), nodes[0])
    return source, [n for n in nodes if n != source]


def _with_shipping(result: NodeResult, shipped: Any) -> NodeResult:
    """A probe's result with what shipping did on its node. The probe of a node that took the
    venv was submitted when it did, so its seconds cover the receive; what is left of them
    after the stream and the install is the probe's own (`ship_phases["probe"]`)."""
    if shipped is None:
        return result
    if shipped.outcome == "shipped" and result.ok and not result.built:
        receive = sum(shipped.phases.get(step, 0.0) for step in ("stream", "install"))
        phases = {**shipped.phases, "probe": round(max(result.seconds - receive, 0.0), 3)}
        return replace(result, shipped_bytes=shipped.bytes, ship_phases=phases)
    if result.built and shipped.outcome in ("refused", "failed"):
        return replace(result, note=f"not shipped: {shipped.why}")
    return result


class Probes:
    """The probe tasks of a prepare, each run with the runtime_env `env` on its node: submitted
    one by one (a node's as soon as its venv is built, shipped or being received there: its
    request waits for the receiver), collected as they finish, all within `timeout` seconds.

    Ray gives a runtime_env `setup_timeout_seconds` (600 by default) to be set up; a probe's
    may take as long as the whole prepare (a long build, a long ship), so it gets that, unless
    `env` sets its own."""

    def __init__(self, env: Mapping[str, Any], timeout: float) -> None:
        import ray

        from ray_uv_plugin.cluster import probe

        self.start = time.perf_counter()
        self.timeout = timeout
        config = dict(env.get("config") or {})
        config.setdefault("setup_timeout_seconds", max(int(timeout), 1))
        self.env = {**env, "config": config}
        probe.ship_by_value()
        self._remote = ray.remote(probe.environment_report)
        self._pending: dict[Any, tuple[str, str, float]] = {}  # ref -> node id, address, submitted

    def left(self) -> float:
        return _left(self.timeout, self.start)

    def submit(self, node: tuple[str, str]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ray_uv_plugin.store.layout import MARKER, VENV_ENV

        node_id, address = node
        ref = self._remote.options(
            num_cpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env=dict(self.env),
        ).remote((), VENV_ENV, MARKER)
        self._pending[ref] = (node_id, address, time.perf_counter())

    def collect(
        self,
        on_result: Callable[[NodeResult], None] = lambda r: None,
        shipped: Mapping[str, Any] | None = None,
        note: str | None = None,
    ) -> list[NodeResult]:
        """The result of every probe submitted and not collected yet, reported as each
        finishes (`shipped`: what shipping did per node id, folded into the results)."""
        import ray

        results = []

        def report(result: NodeResult) -> None:
            result = _with_shipping(result, (shipped or {}).get(result.node_id))
            if note and result.built:
                result = replace(result, note=note)
            results.append(result)
            on_result(result)

        while self._pending:
            left = self.timeout - (time.perf_counter() - self.start)
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(left, 0))
            now = time.perf_counter()
            if not ready:
                for ref, (node_id, address, since) in self._pending.items():
                    ray.cancel(ref, force=True)
                    error = f"timed out after {self.timeout:.0f}s"
                    report(NodeResult(node_id, address, False, now - since, error=error))
                self._pending.clear()
                break
            ref = ready[0]
            node_id, address, since = self._pending.pop(ref)
            report(self._result(ref, node_id, address, now - since))
        return results

    @staticmethod
    def _result(ref: Any, node_id: str, address: str, took: float) -> NodeResult:
        import ray

        from ray_uv_plugin.cluster import probe

        try:
            env_report = ray.get(ref)
        except Exception as e:  # RuntimeEnvSetupError, node died, ...
            return NodeResult(node_id, address, False, took, error=clean_error(e))
        if not env_report.get("venv"):  # the node ignored the field: no plugin there
            error = lacks_plugin(address, env_report["python"])
            return NodeResult(node_id, address, False, took, error=error)
        marker = env_report.get("marker") or {}
        built = probe.was_built_within(env_report, took + 1.0)
        return NodeResult(
            node_id,
            address,
            True,
            took,
            built=built,
            build_seconds=marker.get("build_seconds") if built else None,
            key=marker.get("key"),
            python=env_report["python"],
        )


def probe_nodes(
    probe_env: Mapping[str, Any],
    nodes: list[tuple[str, str]],
    timeout: float,
    on_result: Callable[[NodeResult], None] = lambda r: None,
) -> list[NodeResult]:
    """Run the probe, with the runtime_env `probe_env`, on each node and report as each
    finishes."""
    probes = Probes(probe_env, timeout)
    for node in nodes:
        probes.submit(node)
    return probes.collect(on_result)


def connect_for(
    project: str | Path,
    shared: bool,
    extras: Sequence[str],
    groups: Sequence[str],
    flags: dict[str, bool],
    address: str | None,
) -> dict[str, Any]:
    """The uv_project value these options make for `project`, checked here first, with this
    driver connected to the cluster at `address` (the project as the job's working_dir, as
    `prepare` ships it): how `prepare_env` and `watch_env` start."""
    project = Path(project).expanduser().resolve()
    value = uv_project_value(project, shared, extras, groups, flags)  # UvProject refuses a str
    check_locally(project, value, shared)
    connect(address, job_runtime_env(project, shared))
    return value


def prepare_env(
    project: str | Path = ".",
    *,
    extras: Sequence[str] = (),
    groups: Sequence[str] = (),
    address: str | None = None,
    shared: bool = False,
    ship: bool | None = None,
    timeout: float = 3600.0,
    on_start: Callable[[dict[str, Any], int], None] = lambda value, nodes: None,
    on_result: Callable[[NodeResult], None] = lambda r: None,
    on_progress: Callable[[Any], None] = lambda p: None,
    **flags: bool,
) -> list[NodeResult]:
    """Make a uv environment ready on every alive node of a running cluster, as `ray-uv
    prepare` does: build it on one node and ship it to the others (`ship`, default on unless
    RAY_UV_PLUGIN_SHIP=0), or let every node build it (`ship=False`).

    Connects to the cluster at `address` and disconnects after; `flags` are the uv_project
    flags (`locked`, `frozen`, `all_extras`, ...). Raises `ConnectError`, `PrepareError` (or
    the spec's and project's errors) for what keeps it from starting; each node's failure is in
    its result.
    `on_start(value, nodes)` is called once connected, with the uv_project value and how many
    nodes there are; `on_result` as each node is done; `on_progress` with each shipped chunk.
    """
    import ray

    value = connect_for(project, shared, extras, groups, flags, address)
    try:
        nodes = alive_nodes()
        on_start(value, len(nodes))
        return prepare_nodes(value, nodes, timeout, on_result, ship=ship, on_progress=on_progress)
    finally:
        ray.shutdown()

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

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray_uv_plugin.cluster.connect import connect
from ray_uv_plugin.cluster.node_result import NodeResult
from ray_uv_plugin.cluster.options import PrepareOptions, PrepareReporter, Quiet
from ray_uv_plugin.cluster.probe import Probes
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import ParsedUvProject, parse_spec
from ray_uv_plugin.settings import NodeSettings

# Not uploaded with the project: Ray's working_dir upload has a size limit and needs none of it.
EXCLUDES = [".venv", ".git", "__pycache__", "*.pyc", ".ruff_cache", ".pytest_cache"]


class PrepareError(RuntimeError):
    """`prepare` cannot start (no cluster, bad project); the message says what to do."""


def job_runtime_env(project: Path, shared: bool) -> dict[str, Any] | None:
    """The driver's job-level runtime_env: the project is uploaded as working_dir unless every
    node already sees it at the same path (`--shared`).

    Ray takes local directories only at the job level, and an uploaded project gets the same
    venv key as a job that uploads it with `ray job submit --working-dir`.
    """
    if shared:
        return None
    return {"working_dir": str(project), "excludes": EXCLUDES}


def env_spec(project: Path, shared: bool, selection: ParsedUvProject) -> ParsedUvProject:
    """The env the probe tasks ask for: `selection` with the project every node sees by its
    path (`shared`), or none (the job's working_dir, which `job_runtime_env` uploads)."""
    return replace(selection, project=str(project) if shared else None)


def check_locally(project: Path, spec: ParsedUvProject, shared: bool) -> None:
    """Fail on the operator's machine, not on every node, for what the project files show."""
    from ray_uv_plugin.env.project import check_request

    if not project.is_dir():
        if shared:
            return  # it may exist only on the nodes
        raise PrepareError(
            f"project directory {project} does not exist: pass --project DIR, the directory "
            "holding pyproject.toml and uv.lock."
        )
    check_request(load_project(project), spec)


def alive_nodes() -> list[tuple[str, str]]:
    import ray

    return [(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"]]


def prepare_nodes(
    spec: ParsedUvProject,
    nodes: list[tuple[str, str]],
    options: PrepareOptions,
    reporter: PrepareReporter | None = None,
    *,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int | None = None,
    probe_env: dict[str, Any] | None = None,
    ready: Iterable[str] = (),
) -> list[NodeResult]:
    """Make the env ready on each node (connected already), telling `reporter` of each node as
    it finishes and of each shipped chunk.

    `spec`: the env, parsed; its `as_value()` is the `uv_project` value the nodes get.
    `options.ship` (default: on unless RAY_UV_PLUGIN_SHIP=0): build on one node, send that venv
    to the others (the ship's actors start while it builds); `options.timeout` bounds it all.
    `runtime_env`: for the shipping actors, which need the node's Ray Python. `probe_env`: the
    whole runtime_env the env's workers will have (its env_vars may shape the venv), default
    `{"uv_project": spec.as_value()}`. `ready`: ids of nodes known to have the env ready
    already: the ship's source is one of them (no build), if any is in `nodes`."""
    from ray_uv_plugin.ship.launch import start_actors

    reporter = reporter or Quiet()
    probes = Probes(probe_env or {"uv_project": spec.as_value()}, options.timeout)
    ship = NodeSettings.read().ships() if options.ship is None else options.ship
    if not ship or len(nodes) < 2:
        for node in nodes:
            probes.submit(node)
        return probes.collect(reporter.result)
    import ray

    here = ray.get_runtime_context().get_node_id()
    source, rest = source_first(nodes, set(ready), here)
    probes.submit(source)
    # The sender and the receivers start while the first node builds.
    actors = start_actors(source[0], [node_id for node_id, _ in rest], runtime_env)
    try:
        first = probes.collect(reporter.result)
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
        return first + probes.collect(reporter.result, note=note)
    return first + ship_and_probe(
        spec,
        first[0],
        rest,
        options,
        reporter,
        runtime_env=runtime_env,
        chunk_bytes=chunk_bytes,
        probes=probes,
        actors=actors,
    )


def ship_and_probe(
    spec: ParsedUvProject,
    source: NodeResult,
    nodes: list[tuple[str, str]],
    options: PrepareOptions,
    reporter: PrepareReporter | None = None,
    *,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int | None = None,
    probes: Probes | None = None,
    actors: Any = None,
    probe_env: dict[str, Any] | None = None,
) -> list[NodeResult]:
    """Send the venv that `source` (a node's result with the env ready: its `key`) has to
    `nodes`, and probe each as soon as its part is decided: a node that took it finds it ready
    once installed (its probe's request waits for the receiver's lock), one that could not
    (another build target, other uv settings, a failed receive) builds its own and its result
    says why. `reporter` hears of each node as it finishes and of each shipped chunk.
    `prepare` ships from the node it built on; `ray-uv prepare --watch` from any node that has
    the env, to the nodes that joined since. `probes`: the prepare's, whose runtime_env and time
    limit the probes share (default: new ones for `probe_env`, as `prepare_nodes` takes it,
    within `options.timeout`); the ship gets what is left of their time. `actors`: the ship's,
    started before (`launch.start_actors`) from `source`'s node to `nodes`."""
    from ray_uv_plugin.ship import transfer as shipping
    from ray_uv_plugin.ship.messages import ShipSettings
    from ray_uv_plugin.ship.options import ShipOptions

    reporter = reporter or Quiet()
    if source.key is None:
        if actors is not None:
            actors.stop()
        raise ValueError(f"no venv to ship from {source.label}: {source}")
    probes = probes or Probes(probe_env or {"uv_project": spec.as_value()}, options.timeout)
    ship_options = ShipOptions(
        settings=ShipSettings(env_vars=probes.env.get("env_vars") or {}, spec=spec),
        runtime_env=runtime_env,
        chunk_bytes=chunk_bytes or ShipOptions.chunk_bytes,
        timeout=probes.left(),
    )
    shipped = shipping.ship(
        source.key,
        source.node_id,
        [node_id for node_id, _ in nodes],
        ship_options,
        _ProbeWhenDecided(probes, dict(nodes), reporter),
        actors,
    )  # it decides on every node, each once
    return probes.collect(reporter.result, shipped)


class _ProbeWhenDecided:
    """A ship's reporter (`ship.options.ShipReporter`) that probes each node as soon as its part is
    decided, and passes the chunks' progress on to the prepare's reporter."""

    def __init__(
        self, probes: Probes, addresses: dict[str, str], reporter: PrepareReporter
    ) -> None:
        self.probes, self.addresses, self.reporter = probes, addresses, reporter

    def decided(self, node: str, decision: str) -> None:
        self.probes.submit((node, self.addresses[node]))

    def progress(self, progress: Any) -> None:
        self.reporter.progress(progress)


def source_first(
    nodes: list[tuple[str, str]], ready: set[str], here: str
) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """The node to ship from: one with the env ready already if any, else the driver's own
    (`here`: built there) if it is one of them, else the first."""
    source = next(
        (n for n in nodes if n[0] in ready), next((n for n in nodes if n[0] == here), nodes[0])
    )
    return source, [n for n in nodes if n != source]


def connect_for(options: PrepareOptions) -> ParsedUvProject:
    """The env these options ask for, checked against the project's files first, with this
    driver connected to the cluster at `options.address` (the project as the job's
    working_dir, as `prepare` ships it): how `prepare` and `watch.watch_env` start."""
    project = Path(options.project).expanduser().resolve()
    spec = env_spec(project, options.shared, options.selection)
    check_locally(project, spec, options.shared)
    connect(options.address, job_runtime_env(project, options.shared))
    return spec


def prepare(options: PrepareOptions, reporter: PrepareReporter | None = None) -> list[NodeResult]:
    """Make the env of `options` ready on every alive node of a running cluster (`prepare_env`),
    telling `reporter` as it goes. Connects, and disconnects after."""
    import ray

    reporter = reporter or Quiet()
    spec = connect_for(options)
    try:
        nodes = alive_nodes()
        reporter.started(spec, len(nodes))
        return prepare_nodes(spec, nodes, options, reporter)
    finally:
        ray.shutdown()


def prepare_env(
    project: str | Path = ".",
    *,
    address: str | None = None,
    shared: bool = False,
    ship: bool | None = None,
    timeout: float = 3600.0,
    reporter: PrepareReporter | None = None,
    **selection: Any,
) -> list[NodeResult]:
    """Make a uv environment ready on every alive node of a running cluster, as `ray-uv
    prepare` does: build it on one node and ship it to the others (`ship`, default on unless
    RAY_UV_PLUGIN_SHIP=0), or let every node build it (`ship=False`).

    `selection`: the uv_project fields that pick the env, as `UvProject` takes them (`extras`,
    `groups`, `locked`, `frozen`, `all_extras`, `package`...), parsed here. Connects to the
    cluster at `address` and disconnects after. Raises `ConnectError`, `PrepareError` (or the
    spec's and project's errors) for what keeps it from starting; each node's failure is in
    its result.
    `reporter` (a `PrepareReporter`, e.g. a subclass of `Quiet`) hears of the start, of each
    node as it is done, and of each shipped chunk.
    """
    from ray_uv_plugin.env.spec import keyword_value

    spec = parse_spec(keyword_value(selection))
    options = PrepareOptions(project, spec, address, shared, ship, timeout)
    return prepare(options, reporter)

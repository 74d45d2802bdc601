"""Keeping the nodes that join a running cluster prepared: `ray-uv prepare --watch`.

On an autoscaling cluster nodes join after `prepare` ran, and the first job that lands on one
builds every env there from the package index. The watch prepares the alive nodes once, as
`prepare` does, then asks the GCS for the alive nodes every `interval` seconds (never more
often than every `MIN_INTERVAL`) and prepares each node it has not seen yet: the venv is
shipped to it from a node that has the env (`prepare.ship_and_probe`), and a node that cannot
take it (another build target, Python, uv or uv settings) builds its own, as with `prepare`.

It is a foreground process on purpose: its per-node lines go to the operator's terminal or
log, and it ends as any service does (Ctrl-C, SIGTERM, SIGHUP unless ignored as under
`nohup`: `stop_on_signals`), which also ends every actor and task it started. Nodes that join
during a round are prepared in the next one; a node that failed is reported and not tried
again (the next job there builds, as without the watch); a node that left the cluster before
its turn was over is reported as having left.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from threading import Event
from time import sleep
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.cluster import prepare
from ray_uv_plugin.cluster.connect import clean_error
from ray_uv_plugin.cluster.node_result import NodeResult
from ray_uv_plugin.cluster.options import (
    DEFAULT_INTERVAL,
    MIN_INTERVAL,
    Quiet,
    WatchOptions,
    WatchReporter,
)
from ray_uv_plugin.settings import NodeSettings

if TYPE_CHECKING:
    from ray_uv_plugin.env.spec import ParsedUvProject


def check_interval(interval: float) -> None:
    if not MIN_INTERVAL <= interval < math.inf:  # also NaN
        raise prepare.PrepareError(
            f"--interval {interval:g}: the watch asks the GCS for the node list every interval; "
            f"give a number of seconds, at least {MIN_INTERVAL:g} (default {DEFAULT_INTERVAL:g})."
        )


def pick_source(
    results: Mapping[str, NodeResult], alive: set[str], here: str | None
) -> NodeResult | None:
    """The node to ship from: one whose env is ready (built, shipped or reused there) and that
    is still alive (an autoscaler removes idle nodes), the driver's own if it is one of them;
    None if there is none, and the joining nodes then build."""
    ready = [r for r in results.values() if r.ok and r.key and r.node_id in alive]
    return next((r for r in ready if r.node_id == here), ready[0] if ready else None)


def _alive_ids() -> set[str]:
    return {node_id for node_id, _ in prepare.alive_nodes()}


def watch_nodes(
    spec: ParsedUvProject,
    seen: Sequence[NodeResult],
    options: WatchOptions,
    reporter: WatchReporter,
    stop: Event | None = None,
    probe_env: dict[str, Any] | None = None,
) -> None:
    """Prepare each node that joins (connected already), reporting each, until a
    KeyboardInterrupt ends it, or `stop` is set (a worker group that waits for its placement
    runs it in a thread: `worker_groups.readiness`). `seen`: the results of the nodes known
    before (those with the env ready are the sources to ship from; the others are not
    prepared). Before each round, `reporter.round(nodes, source)`: the nodes that joined, and
    the node they are shipped from (None: they build). `options.timeout` bounds each round.
    `probe_env`: the runtime_env the env's workers have, as `prepare.prepare_nodes` takes it
    (a group's env_vars may shape the venv, and so its key)."""
    import ray

    if options.ship is None:
        options = replace(options, ship=NodeSettings.read().ships())  # decided once
    here = ray.get_runtime_context().get_node_id()
    told = _Rounds(reporter, {r.node_id: r for r in seen})
    results = told.results

    while True:
        if stop is None:
            sleep(options.interval)
        elif stop.wait(options.interval):
            return
        nodes = prepare.alive_nodes()
        new = [n for n in nodes if n[0] not in results]
        if not new:
            continue
        source = pick_source(results, {n for n, _ in nodes}, here) if options.ship else None
        reporter.round(new, source)
        try:
            if source is None:
                prepare.prepare_nodes(spec, new, options, told, probe_env=probe_env)
            else:
                prepare.ship_and_probe(spec, source, new, options, told, probe_env=probe_env)
        except Exception as e:  # noqa: BLE001 - the round's nodes failed, not the watch
            error = f"{type(e).__name__}: {clean_error(e)}"
            for node_id, address in new:
                if node_id not in results:
                    told.result(NodeResult(node_id, address, False, 0.0, error=error))


class _Rounds(Quiet):
    """What a round tells the watch's reporter: each node's result, kept as the last known of
    its node (a failed node that left the cluster says so), and each shipped chunk."""

    def __init__(self, reporter: WatchReporter, results: dict[str, NodeResult]) -> None:
        self.reporter, self.results = reporter, results

    def result(self, result: NodeResult) -> None:
        if not result.ok and result.node_id not in _alive_ids():
            result = replace(result, error=f"the node left the cluster ({result.error})")
        self.results[result.node_id] = result
        self.reporter.result(result)

    def progress(self, progress: Any) -> None:
        self.reporter.progress(progress)


class _Collecting:
    """The caller's reporter, with every node's result kept for `watch_env` to return."""

    def __init__(self, reporter: WatchReporter) -> None:
        self.reporter = reporter
        self.results: list[NodeResult] = []

    def started(self, spec: ParsedUvProject, nodes: int) -> None:
        self.reporter.started(spec, nodes)

    def result(self, result: NodeResult) -> None:
        self.results.append(result)
        self.reporter.result(result)

    def progress(self, progress: Any) -> None:
        self.reporter.progress(progress)

    def watching(self) -> None:
        self.reporter.watching()

    def round(self, nodes: list[tuple[str, str]], source: NodeResult | None) -> None:
        self.reporter.round(nodes, source)


def watch_env(options: WatchOptions, reporter: WatchReporter | None = None) -> list[NodeResult]:
    """`prepare.prepare`, then keep every node that joins prepared (`watch_nodes`) until a
    KeyboardInterrupt (Ctrl-C; with `options.stop_signals`, SIGTERM and SIGHUP too:
    `stop_on_signals`, main thread only) ends it: stopping is its normal end. Returns the
    results of every node, those prepared first included; a ship under way is abandoned
    (nothing half-received is ever used). Disconnects after."""
    import ray

    check_interval(options.interval)
    spec = prepare.connect_for(options)
    told = _Collecting(reporter or Quiet())
    try:
        # After `ray.init`: Ray's core worker installs a SIGTERM handler of its own that ends
        # the process at once, and ours must replace it.
        with stop_on_signals() if options.stop_signals else nullcontext():
            nodes = prepare.alive_nodes()
            told.started(spec, len(nodes))
            first = prepare.prepare_nodes(spec, nodes, options, told)
            told.watching()
            watch_nodes(spec, first, options, told)
    except KeyboardInterrupt:
        pass
    finally:
        ray.shutdown()
    return told.results


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM (systemd, `kill`, a pod's end) and SIGHUP (the terminal closed) stop the watch as
    Ctrl-C does, so that it disconnects and its actors end; a SIGHUP ignored already (`nohup`)
    stays ignored. The previous handlers are back after (the default, for one installed
    outside Python, as Ray's)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _interrupt)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)

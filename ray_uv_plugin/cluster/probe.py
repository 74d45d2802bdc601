"""The probe: code that runs inside a worker's uv venv and reports it, for `prepare` and
`demo`, and the driver's tasks that run it on each node of a prepare (`Probes`).

Those venvs hold the user's project, not ray_uv_plugin, so Ray pickles this module by value
(`pickle_by_value`): it may import only the standard library at module level (the driver's
side imports the package inside its functions), and the names the worker's side needs from
the package (the venv variable, the marker's name) come as arguments. What it sends back is an
`EnvironmentReport`: a plain dict on the wire (nothing to unpickle by value), typed here, for
both ends, and made in one place (`_environment_report`).

A probe task is a zero-CPU task pinned to a node with the env's runtime_env, so that the
node's own plugin makes the env ready as a job's worker would; its report says whether the
venv was built there, reused or received.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from ray_uv_plugin.cluster.node_result import NodeResult


class EnvironmentReport(TypedDict):
    """What a probe finds in the worker it runs in."""

    python: str  # sys.executable: the venv's python, or the node's own without the plugin
    python_version: str
    venv: str | None  # the venv the plugin put the worker in (its `venv_env`), None without
    marker: dict[str, Any] | None  # the venv's ready-marker as read there (None: unreadable)
    packages: dict[str, str | None]  # the version of each package asked for (None: absent)
    hostname: str
    now: float  # the node's clock (`was_built_within` compares the marker's times with it)


def _environment_report(
    packages: tuple[str, ...], venv_env: str, marker_name: str
) -> EnvironmentReport:
    """What the worker runs in: interpreter, venv, its ready-marker, and package versions.
    `venv_env` and `marker_name` are `settings.VENV_ENV` and `store.layout.MARKER`."""
    venv = os.environ.get(venv_env)  # set by the plugin in every worker
    marker: dict[str, Any] | None = None
    if venv:
        try:
            with open(os.path.join(venv, marker_name)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            marker = None
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return EnvironmentReport(
        python=sys.executable,
        python_version=sys.version.split()[0],
        venv=venv,
        marker=marker,
        packages=versions,
        hostname=socket.gethostname(),
        now=time.time(),
    )


def was_built_within(report: EnvironmentReport, seconds: float) -> bool:
    """Whether the venv's build finished within the last `seconds` of the report's own clock
    (the node's clock, so that skew between driver and node does not matter); never for a
    venv received from another node (its `built_at` is the source's)."""
    marker = report["marker"] or {}
    if marker.get("received_at") is not None:
        return False
    built_at = marker.get("built_at")
    return built_at is not None and built_at >= report["now"] - seconds


class Probe:
    """An actor that reports its environment; `demo` starts one per uv environment."""

    def report(
        self, packages: tuple[str, ...], venv_env: str, marker_name: str
    ) -> EnvironmentReport:
        return _environment_report(packages, venv_env, marker_name)

    def banner(self, text: str) -> str:
        try:
            import pyfiglet  # only the `banner` extra of the demo project has it
        except ImportError:
            return ""
        return str(pyfiglet.figlet_format(text, font="small"))  # a str subclass: send a str

    def toml(self, data: dict[str, Any]) -> str:
        try:
            import tomli_w  # only the `toml` extra of the demo project has it
        except ImportError:
            return ""
        return tomli_w.dumps(data)


def pickle_by_value() -> None:
    """Make Ray pickle this module's functions and classes by value, not by import path."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _left(timeout: float, start: float) -> float:
    return max(timeout - (time.perf_counter() - start), 1.0)


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

        self.start = time.perf_counter()
        self.timeout = timeout
        config = dict(env.get("config") or {})
        config.setdefault("setup_timeout_seconds", max(int(timeout), 1))
        self.env = {**env, "config": config}
        pickle_by_value()
        self._remote = ray.remote(_environment_report)
        self._pending: dict[Any, tuple[str, str, float]] = {}  # ref -> node id, address, submitted

    def left(self) -> float:
        return _left(self.timeout, self.start)

    def submit(self, node: tuple[str, str]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ray_uv_plugin.settings import VENV_ENV
        from ray_uv_plugin.store.layout import MARKER

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

        from ray_uv_plugin.cluster.node_result import NodeResult

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

        from ray_uv_plugin.cluster.connect import clean_error
        from ray_uv_plugin.cluster.node_result import NodeResult, lacks_plugin

        try:
            env_report: EnvironmentReport = ray.get(ref)
        except Exception as e:  # RuntimeEnvSetupError, node died, ...
            return NodeResult(node_id, address, False, took, error=clean_error(e))
        if not env_report["venv"]:  # the node ignored the field: no plugin there
            error = lacks_plugin(address, env_report["python"])
            return NodeResult(node_id, address, False, took, error=error)
        marker = env_report["marker"] or {}
        built = was_built_within(env_report, took + 1.0)
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

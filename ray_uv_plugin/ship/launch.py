"""Starting and stopping a ship's actors (`actors`): a `VenvSender` on the source node and a
`VenvReceiver` on each target node, pinned there, on the node's own Ray Python: never the
driver's interpreter, nor a job's `py_executable` or job-default `uv_project`
(`node_python_env`). They may be started before the venv is ready (`start_actors`: `prepare`
starts them while the first node builds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_uv_plugin.ship.actors import VenvReceiver, VenvSender, is_ready
from ray_uv_plugin.ship.messages import ShipResult

# The actors' runtime_env where the job sets a `py_executable` or a job-default `uv_project`: an
# empty one overrides the job's (the plugin yields a job default to it), and Ray's worker setup
# then starts the node's own Python (`RuntimeEnvContext` falls back to the interpreter of the
# raylet's setup_worker for an empty py_executable).
NODE_PYTHON: dict[str, Any] = {"py_executable": ""}


def node_python_env(job_env: dict[str, Any]) -> dict[str, Any] | None:
    """The runtime_env that puts this package's own actors and tasks on each node's Ray
    Python under a job whose runtime_env is `job_env`; None where the job's own is that.

    A job `py_executable` (Ray's `uv run` hook's) may name a path that only the driver's
    machine has, and a job-default `uv_project` (our `uv run` driver hook's) would build the
    job's venv first: `NODE_PYTHON` overrides the one, and the plugin yields the other to it.
    """
    value = job_env.get("uv_project")
    job_default = isinstance(value, dict) and value.get("job_default") is True
    return dict(NODE_PYTHON) if job_env.get("py_executable") or job_default else None


def pinned(node_id: str, runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Ray options that run an actor or task on `node_id`, with `runtime_env` if given."""
    options: dict[str, Any] = {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    }
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    return options


def refused_by_job() -> str | None:
    """Why this job's actors cannot ship, or None."""
    job_env = ray.get_runtime_context().runtime_env
    if "uv_project" in job_env and node_python_env(job_env) is None:
        # Every actor of the job runs in that venv, and none may leave it for the node's Python.
        return "the job's own runtime_env has uv_project (ask for it per actor to ship it)"
    return None


def actors_env(runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
    """The actors' runtime_env: `runtime_env` if given, else what `node_python_env` says."""
    if runtime_env is None:
        return node_python_env(ray.get_runtime_context().runtime_env)
    return runtime_env


def already_there(
    key: str, targets: list[str], runtime_env: dict[str, Any] | None, timeout: float
) -> dict[str, ShipResult]:
    """The targets that have the ready venv already, found by a plain task on each (all at
    once: a node that does not answer in time is for the receiver to report)."""
    refs = {is_ready.options(**pinned(n, runtime_env)).remote(key): n for n in targets}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    for ref in pending:
        ray.cancel(ref, force=True)
    found = {}
    for ref in done:
        try:
            if ray.get(ref):
                found[refs[ref]] = ShipResult(refs[ref], "reused")
        except Exception:  # noqa: BLE001 - the receiver will say what is wrong there
            pass
    return found


@dataclass
class ShipActors:
    """The sender and the receivers of a ship, started ahead of it (`start_actors`), e.g.
    while the source node builds the venv: their worker processes start meanwhile. `ship`
    stops them when it is done."""

    source_node: str
    sender: Any
    receivers: dict[str, Any]  # node id -> its receiver

    @classmethod
    def start(
        cls, source_node: str, targets: list[str], runtime_env: dict[str, Any] | None
    ) -> ShipActors:
        sender = VenvSender.options(**pinned(source_node, runtime_env)).remote()
        receivers = {n: VenvReceiver.options(**pinned(n, runtime_env)).remote() for n in targets}
        return cls(source_node, sender, receivers)

    def stop(self) -> None:
        for actor in [self.sender, *self.receivers.values()]:
            ray.kill(actor)


def start_actors(
    source_node: str, targets: list[str], runtime_env: dict[str, Any] | None = None
) -> ShipActors | None:
    """The sender on `source_node` and a receiver on each of `targets` (node ids), for a
    `ship` to come; None where this job cannot ship (`ship` then says why). `runtime_env`: as
    `ShipOptions.runtime_env`."""
    if refused_by_job() is not None:
        return None
    return ShipActors.start(source_node, targets, actors_env(runtime_env))

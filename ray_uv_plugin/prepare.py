"""Building a uv environment on every alive node of a running cluster, ahead of the jobs.

One zero-CPU task is pinned to each node (`NodeAffinitySchedulingStrategy`, hard) with the
`uv_project` runtime_env, so the node's own plugin builds the venv exactly as a job's worker
would later: same key, same log, same lock. The task then reports the venv it ran in, from
which we tell a build from a reuse.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.project import load_project
from ray_uv_plugin.spec import parse_spec

# Not shipped with the project: Ray's working_dir upload has a size limit and needs none of it.
EXCLUDES = [".venv", ".git", "__pycache__", "*.pyc", ".ruff_cache", ".pytest_cache"]


class PrepareError(RuntimeError):
    """`prepare` cannot start (no cluster, bad project); the message says what to do."""


@dataclass(frozen=True)
class NodeResult:
    node_id: str
    address: str
    ok: bool
    seconds: float  # from submitting the task to its result: env setup plus worker start
    built: bool = False
    build_seconds: float | None = None  # uv sync time, from the venv's marker
    key: str | None = None
    python: str | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"

    @property
    def outcome(self) -> str:
        return "built" if self.built else "reused" if self.ok else "failed"


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
    project: Path, shared: bool, extras: list[str], groups: list[str], flags: Mapping[str, bool]
) -> dict[str, Any]:
    """The `uv_project` value for the probe tasks, checked here before any node sees it."""
    from ray_uv_plugin.spec import UvProject

    value = UvProject(
        project=str(project) if shared else None, extras=extras, groups=groups, **flags
    )
    return dict(value)


def check_locally(project: Path, value: Mapping[str, Any], shared: bool) -> None:
    """Fail on the operator's machine, not on every node, for what the project files show."""
    from ray_uv_plugin.project import check_request

    if not project.is_dir():
        if shared:
            return  # it may exist only on the nodes
        raise PrepareError(
            f"project directory {project} does not exist: pass --project DIR, the directory "
            "holding pyproject.toml and uv.lock."
        )
    check_request(load_project(project), parse_spec(value))


def clean_error(exc: BaseException) -> str:
    """The useful part of a Ray error: from our plugin's message on, without Ray's preamble."""
    text = str(exc)
    start = text.find("uv_project")
    if start > 0:
        text = text[start:]
    return text.strip()


def lacks_plugin(address: str, python: str) -> str:
    """What to say of a node whose worker ran in the node's own Python despite `uv_project`."""
    return (
        f"uv_project: node {address} ran the worker in its own Python ({python}), not in a "
        "venv: its raylet does not load the uv_project plugin, so Ray ignored the field. "
        "Restart that node with the plugin registered: `export RAY_RUNTIME_ENV_PLUGINS="
        "$(ray-uv plugin-config)` before `ray start` (and ray-uv-plugin installed in its Python)."
    )


def connect(address: str | None, runtime_env: dict[str, Any] | None) -> None:
    # The CLI's own environment is not what workers need: every probe asks for its uv env.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    hint = (
        "start one with `RAY_RUNTIME_ENV_PLUGINS=$(ray-uv plugin-config) ray start --head`, "
        "or pass --address (the GCS address `host:6379`, or set RAY_ADDRESS)."
    )
    reachable_or_die(target, hint)
    try:
        ray.init(
            address=target,
            runtime_env=runtime_env,
            log_to_driver=False,
            logging_level="WARNING",
            namespace="ray-uv-prepare",
        )
    except (ConnectionError, RuntimeError) as e:
        raise PrepareError(f"cannot connect to a Ray cluster at {target!r} ({e}): {hint}") from e


def reachable_or_die(address: str, hint: str, timeout: float = 5.0) -> None:
    """Ray retries an unreachable GCS for minutes; a `host:port` we can check at once."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "ray://...": Ray answers those quickly itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise PrepareError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): {hint}"
        ) from e


def alive_nodes() -> list[tuple[str, str]]:
    import ray

    return [(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"]]


def prepare_nodes(
    value: Mapping[str, Any],
    nodes: list[tuple[str, str]],
    timeout: float,
    on_result: Callable[[NodeResult], None] = lambda r: None,
) -> list[NodeResult]:
    """Run the probe on each node (connected already) and report as each finishes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_uv_plugin import _probe

    _probe.ship_by_value()
    probe = ray.remote(_probe.environment_report)
    start = time.perf_counter()
    pending: dict[Any, tuple[str, str]] = {}
    for node_id, address in nodes:
        ref = probe.options(
            num_cpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"uv_project": dict(value)},
        ).remote()
        pending[ref] = (node_id, address)
    results = []
    while pending:
        left = timeout - (time.perf_counter() - start)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0))
        took = time.perf_counter() - start
        if not ready:
            for ref, (node_id, address) in pending.items():
                ray.cancel(ref, force=True)
                result = NodeResult(
                    node_id, address, False, took, error=f"timed out after {timeout:.0f}s"
                )
                results.append(result)
                on_result(result)
            break
        ref = ready[0]
        node_id, address = pending.pop(ref)
        try:
            report = ray.get(ref)
        except Exception as e:  # RuntimeEnvSetupError, node died, ...
            result = NodeResult(node_id, address, False, took, error=clean_error(e))
        else:
            if not report.get("venv"):  # the node ignored the field: no plugin there
                result = NodeResult(
                    node_id, address, False, took, error=lacks_plugin(address, report["python"])
                )
                results.append(result)
                on_result(result)
                continue
            marker = report.get("marker") or {}
            built = _probe.was_built_within(report, took + 1.0)
            result = NodeResult(
                node_id,
                address,
                True,
                took,
                built=built,
                build_seconds=marker.get("build_seconds") if built else None,
                key=marker.get("key"),
                python=report["python"],
            )
        results.append(result)
        on_result(result)
    return results

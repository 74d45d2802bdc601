"""The environment of a group's workers: the driver's variables they get (`driver_env_vars`), the
job's default `uv_project` they run in (`job_default_uv_project`), and the check that a worker
that should run in a venv does (`runs_outside_its_venv`, `PluginNotLoadedError`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray

from ray_uv_plugin import registration
from ray_uv_plugin.env.uv_env import is_build_var
from ray_uv_plugin.settings import VENV_ENV
from worker_groups._initializer import PLUGIN_FIX, WorkerVenvReport
from worker_groups.credentials import is_ray_credential

# The driver's variables that workers do not get. NeMo RL drops these Ray ones too: they describe
# the driver's process, not the worker's.
DRIVER_RAY_VARS = frozenset(
    {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
        "RAY_CLIENT_MODE",
        "RAY_JOB_ID",
        "RAY_LD_PRELOAD",
        "RAY_RAYLET_PID",
        "RAY_USAGE_STATS_ENABLED",
    }
)
# The driver's own venv (NeMo RL sets the first two to the worker's venv; the plugin empties them),
# and the plugin's mark of a worker it started in a venv, which a copy would fake.
DRIVER_VENV_VARS = frozenset({"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", VENV_ENV})


def driver_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The driver's environment as every worker of a group gets it, over the worker class's
    ``@ray.remote`` ``env_vars`` and under the group's (NeMo RL's order). Left out: the
    variables above, and those that would reach the venv's build: uv's own (``UV``, ``UV_*``)
    and the build variables the plugin keys (``CC``, ``CMAKE_ARGS``, ``MAX_JOBS``...: see
    ``env.uv_env``). Here a runtime_env's ``env_vars`` also configure the venv's build on
    every node, and so its key, which NeMo RL's driver environment never did (it builds venvs in
    a task per node): a group's venv is the one the same selection gives a plain actor. A
    worker that needs one gets it through the group's ``env_vars`` (keyed). Nor the
    credentials Ray reads (``RAY_AUTH_TOKEN``...: see ``credentials``): a runtime_env shows in
    plain text in `ray list actors --detail` and in every node's runtime_env_agent.log. The
    proxy and CA variables are copied, for the workers: where the lock builds anything from
    source they are keyed (``env.uv_env.SOURCE_FETCH_VARS``)."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in environ.items()
        if k not in DRIVER_RAY_VARS
        and k not in DRIVER_VENV_VARS
        and k != "UV"
        and not k.startswith("UV_")
        and not is_build_var(k)
        and not is_ray_credential(k)
    }


def job_default_uv_project(runtime_env: dict[str, Any]) -> dict[str, Any] | None:
    """The job's default `uv_project` (our `uv run` driver hook's), which workers with
    `runtime_env` and no `uv_project` of their own run in; None where they run elsewhere."""
    from ray_uv_plugin.env.spec import parse_spec, yields_to

    value = ray.get_runtime_context().runtime_env.get("uv_project")
    if not isinstance(value, dict):
        return None
    spec = parse_spec(value)
    if not spec.job_default or yields_to(spec, runtime_env) is not None:
        return None
    return dict(value)


class PluginNotLoadedError(registration.PluginNotLoadedError):
    """Workers that should run in a ``uv_project`` venv run in their node's own Python: the
    node's raylet does not load the plugin. The group was shut down. The driver's own check's
    error (`ray_uv_plugin.PluginNotLoadedError`) catches it too."""


def initializer_outside_venv(error: BaseException) -> str | None:
    """The message of an initializer that `check_in_its_venv` stopped, found in the error of
    the worker it could not create (Ray wraps it in an `ActorDiedError`, with tracebacks)."""
    text = str(error) if isinstance(error, ray.exceptions.RayError) else ""
    start = text.find("uv_project: node ")
    end = text.find(PLUGIN_FIX, start)
    return text[start : end + len(PLUGIN_FIX)] if 0 <= start < end else None


def runs_outside_its_venv(report: WorkerVenvReport) -> bool:
    """Whether a worker (its `worker_venv_report`) has a ``uv_project`` that applies to it, the
    plugin's own reading, and yet no venv. A job default that yields to the worker's own
    interpreter (`yields_to`) applies to none; a value the plugin would refuse means that no
    plugin saw it."""
    from ray_uv_plugin.env.spec import parse_spec, yields_to

    if report["venv"]:
        return False
    runtime_env = report["runtime_env"]
    value = runtime_env.get("uv_project")
    if value is None:
        return False
    try:
        return yields_to(parse_spec(value), runtime_env) is None
    except (TypeError, ValueError):
        return True


def outside_venvs_error(fqn: str, outside: dict[int, WorkerVenvReport]) -> PluginNotLoadedError:
    """The error of a group whose workers (by rank) run outside the venv they should have."""
    by_node: dict[tuple[str, str, str], list[int]] = {}
    for rank, report in sorted(outside.items()):
        node = (report["node_ip"], report["node_id"], report["python"])
        by_node.setdefault(node, []).append(rank)
    nodes = "; ".join(
        f"node {ip} (id {node_id[:12]}) ran ranks {ranks} in its own Python ({python})"
        for (ip, node_id, python), ranks in by_node.items()
    )
    return PluginNotLoadedError(
        f"uv_project: workers of {fqn} are not in their venv: {nodes}: "
        f"{PLUGIN_FIX} The group has been shut down."
    )

"""The package's own small Ray tasks (a free port on a bundle's node, a bundle's GPU and
topology) and the interpreter they run on.

These tasks need Ray and nothing else, so they must not inherit a job-level ``py_executable``:
under a driver started with ``uv run``, Ray's hook makes that ``uv run ... python`` inside each
node's copy of the working_dir, which with ``--no-sync`` has no venv (``No module named 'ray'``,
retried for minutes). Nor should they wait for the job-default ``uv_project`` that our driver
hook gives such a job instead (its venv may be large and needed by no worker on the node). They
run on each node's own Ray Python instead (an empty ``py_executable`` overrides the job's, and
the plugin yields the job default to it, as for the plugin's shipping actors), or on the one
``WORKER_GROUPS_HELPER_PYTHON`` names, and a helper that cannot start fails after
`HELPER_TIMEOUT_S` with a message saying so.
"""

from __future__ import annotations

import os
import random
import shlex
import socket
import sys
from typing import Any

import ray
import ray.cloudpickle

# Pickled by value: a helper may run on a node's Ray Python, which lacks this package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HELPER_PYTHON_ENV = "WORKER_GROUPS_HELPER_PYTHON"
HELPER_TIMEOUT_S = 120.0
NVLINK_DOMAIN_PREFIX = "nvlink_domain_"
TOPO_RANK_KEY = "topo_rank"
NVLINK_DOMAIN_UNKNOWN = "unknown"
TOPO_RANK_UNKNOWN = -1


class HelperTaskError(RuntimeError):
    """A helper task of this package could not run (usually: its interpreter cannot start)."""


def job_py_executable() -> str | None:
    """The job-level ``py_executable`` (Ray's ``uv run`` hook sets one), if any."""
    return ray.get_runtime_context().runtime_env.get("py_executable") or None


def helper_runtime_env() -> dict[str, Any]:
    """A runtime_env whose interpreter has Ray: ``WORKER_GROUPS_HELPER_PYTHON`` if set, else
    the node's Ray Python: the job's default when it sets neither a ``py_executable`` nor a
    job-default ``uv_project``, else an empty ``py_executable``, which overrides the job's (the
    driver's own path may not exist on other nodes)."""
    from ray_uv_plugin.ship.launch import node_python_env

    chosen = os.environ.get(HELPER_PYTHON_ENV)
    if chosen:
        return {"py_executable": chosen}
    return node_python_env(ray.get_runtime_context().runtime_env) or {}


def run_helpers(refs: list[ray.ObjectRef], what: str, timeout_s: float = HELPER_TIMEOUT_S) -> list:
    """``ray.get`` with a deadline: a helper whose interpreter cannot start would otherwise be
    retried by the raylet for minutes with nothing but a log line to show for it."""
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        for ref in pending:
            ray.cancel(ref, force=True)
        exe = helper_runtime_env().get("py_executable") or "the node's Ray Python"
        raise HelperTaskError(
            f"{what}: {len(pending)} of {len(refs)} helper task(s) did not finish within "
            f"{timeout_s:g}s. They run on {exe}; if that path does not exist on every node, set "
            f"{HELPER_PYTHON_ENV} on the driver to a Python with Ray that does (the raylet log "
            "shows why a worker process did not start)."
        )
    return ray.get(refs)


def _free_port_in_range(low: int, high: int) -> int:
    """A port in ``[low, high)`` that nothing listens on here, tried in random order."""
    candidates = list(range(low, high))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {ray.util.get_node_ip_address()}")


@ray.remote(num_cpus=0)
def node_ip_and_free_port(low: int, high: int) -> tuple[str, int]:
    return ray.util.get_node_ip_address(), _free_port_in_range(low, high)


@ray.remote(num_cpus=0.01, num_gpus=0.01)
def gpu_and_topology() -> tuple[int, str, int]:
    """This bundle's GPU id, and its node's NVLink domain and topology rank (the custom
    resources ``nvlink_domain_<uuid>`` and ``topo_rank`` a cluster launcher may register)."""
    node_id = ray.get_runtime_context().get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
    domain = next((k for k in resources if k.startswith(NVLINK_DOMAIN_PREFIX)), None)
    rank = resources.get(TOPO_RANK_KEY)
    return (
        int(ray.get_gpu_ids()[0]),
        domain or NVLINK_DOMAIN_UNKNOWN,
        TOPO_RANK_UNKNOWN if rank is None else int(rank),
    )


def uv_run_no_sync_problem(fqn: str) -> str | None:
    """Why a worker class without ``uv_project`` cannot start under this job, if it cannot.

    Without ``uv_project`` a worker runs on the job's interpreter. Ray's ``uv run`` hook makes
    that ``uv run --no-sync ... python`` in each node's copy of the working_dir, which has no venv
    unless ``UV_PROJECT_ENVIRONMENT`` points uv at one: the worker would never start, and Ray
    would retry it for the whole startup timeout. Our driver hook gives such a job its
    project's venv as a job-default ``uv_project`` instead (no ``py_executable``: nothing to
    refuse); only a command line that it leaves to Ray's hook (an unmappable flag) gets here.
    """
    exe = job_py_executable()
    if exe is None:
        return None
    words = shlex.split(exe)
    is_uv_run = len(words) > 1 and os.path.basename(words[0]) == "uv" and words[1] == "run"
    if not is_uv_run or "--no-sync" not in words:
        return None
    job_vars = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    if job_vars.get("UV_PROJECT_ENVIRONMENT"):
        return None
    return (
        f"worker class {fqn} has no uv_project, so it would run on the job's interpreter "
        f"{exe!r} (Ray's `uv run` hook), which runs in each node's copy of the working_dir: "
        "with --no-sync that copy has no venv, and the worker would never start. Register the "
        f"class with a uv_project value, e.g. ACTOR_ENVIRONMENT_REGISTRY[{fqn!r}] = "
        "PY_EXECUTABLES.BASE (the driver's project, built once per node), or let the "
        "plugin's driver hook give the job its project's venv (`eval \"$(ray-uv plugin-config "
        "--shell)\"` in the driver's shell, and no `uv run` flag that it leaves to Ray: its "
        "warning names it), or start the driver with `uv run` without --no-sync, or with "
        "`python` directly."
    )

"""Which uv environment each worker class runs in, by fully qualified class name.

NeMo RL maps class names to ``py_executable`` strings (``uv run --locked --extra vllm``); here the
value is a ``uv_project`` runtime_env value, so the plugin builds the venv once per node from
``uv.lock`` instead of every worker running ``uv run``. ``None`` means no ``uv_project``: the worker
runs on the job's interpreter (the node's own Python unless the job's runtime_env picks another).
"""

from __future__ import annotations

import copy
from typing import Any

from ray_uv_plugin.env.spec import parse_spec

UvProjectValue = dict[str, Any] | None


class PY_EXECUTABLES:  # noqa: N801 - the name NeMo RL users know
    """Named presets for registry entries. Each is a fresh value: copy before editing.

    ``BASE`` and the extras use the project of the runtime_env's ``working_dir``; pass
    ``{"project": "/abs/dir", ...}`` for a project elsewhere (a path as seen on every node).
    """

    SYSTEM: UvProjectValue = None
    BASE: UvProjectValue = {}
    TORCH: UvProjectValue = {"extras": ["torch"]}
    VLLM: UvProjectValue = {"extras": ["vllm"]}
    # NeMo RL's other presets: the extra of the same name, of a project that defines it.
    FSDP: UvProjectValue = {"extras": ["fsdp"]}
    AUTOMODEL: UvProjectValue = {"extras": ["automodel"]}
    MCORE: UvProjectValue = {"extras": ["mcore"]}
    NEMO_GYM: UvProjectValue = {"extras": ["nemo_gym"]}
    SGLANG: UvProjectValue = {"extras": ["sglang"]}
    TRTLLM: UvProjectValue = {"extras": ["trtllm"]}


ACTOR_ENVIRONMENT_REGISTRY: dict[str, UvProjectValue] = {
    "examples.torch_worker.TorchWorker": copy.deepcopy(PY_EXECUTABLES.TORCH),
    "examples.vllm_worker.VllmGenerationWorker": copy.deepcopy(PY_EXECUTABLES.VLLM),
}


class UnregisteredWorkerError(KeyError, ValueError):
    """A worker class with no entry in `ACTOR_ENVIRONMENT_REGISTRY` and no override."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def check_uv_project(value: Any, where: str) -> UvProjectValue:
    """Validate on the driver, where a typo is cheap to fix, not in a worker on a far node."""
    if value is None:
        return None
    try:
        parse_spec(value)
    except ValueError as e:  # UvProjectSpecError / UvProjectTypeError: keep the type, add where
        raise type(e)(f"{where}: {e}") from None
    return copy.deepcopy(dict(value))


def register_actor_environment(fqn: str, uv_project: UvProjectValue) -> None:
    """Add or replace a class's entry (checked now, not when its workers start)."""
    _check_fqn(fqn)
    ACTOR_ENVIRONMENT_REGISTRY[fqn] = check_uv_project(uv_project, f"registry entry for {fqn}")


def get_actor_uv_project(fqn: str) -> UvProjectValue:
    """The registered ``uv_project`` value of a class; unregistered is an error, not a default,
    because silently running on the driver's Python is the bug this registry exists to prevent."""
    _check_fqn(fqn)
    if fqn not in ACTOR_ENVIRONMENT_REGISTRY:
        known = ", ".join(sorted(ACTOR_ENVIRONMENT_REGISTRY)) or "none"
        raise UnregisteredWorkerError(
            f"worker class {fqn!r} has no entry in worker_groups.ACTOR_ENVIRONMENT_REGISTRY "
            f"(registered: {known}). Add one, e.g. "
            f"ACTOR_ENVIRONMENT_REGISTRY[{fqn!r}] = PY_EXECUTABLES.BASE (or None for the node's "
            "Python), or give the builder its own with RayWorkerBuilder(...).with_uv_project(...)."
        )
    return check_uv_project(ACTOR_ENVIRONMENT_REGISTRY[fqn], f"registry entry for {fqn}")


def _check_fqn(fqn: Any) -> None:
    if not isinstance(fqn, str) or "." not in fqn.strip(".") or " " in fqn:
        raise TypeError(
            f"a worker class is named by its fully qualified name such as "
            f"'my_pkg.workers.PolicyWorker', got {fqn!r}"
        )

"""`RayWorkerBuilder`: names a worker class by its fully qualified name and creates it inside the
uv environment the registry gives it, so the driver never imports the class or its dependencies.

The work happens in `IsolatedWorkerInitializer` (see `_initializer`), a small actor started in the
target environment: it imports the class there and creates the real worker, which it owns. The
initializer must stay alive as long as its workers: `__call__` pins it to the returned handle and
`RayWorkerGroup` keeps its own.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import ray
import ray.cloudpickle
from ray.actor import ActorHandle
from ray.runtime_env import RuntimeEnvConfig
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from worker_groups import _initializer
from worker_groups._helper_tasks import uv_run_no_sync_problem
from worker_groups.registry import (
    UvProjectValue,
    _check_fqn,
    check_uv_project,
    get_actor_uv_project,
)

MethodSpecs = dict[str, tuple[list[tuple[str, int, bool]], bool]]


def restore_method_signatures(handle: ActorHandle, specs: MethodSpecs) -> None:
    """Give a handle the real signatures of its methods.

    Ray builds a handle's method table by importing the class; where the driver cannot (the
    point of this package), every method looks like ``(**kwargs)``, so positional arguments
    fail on the driver and generator methods lose their streaming default (NeMo RL's
    "use kwargs" workaround). The initializer, which can import the class, sends the truth.
    Uses Ray's private handle attributes (Ray is pinned); a mismatch leaves the handle as it is.
    """
    for name, (params, is_generator) in specs.items():
        shell = getattr(handle, "_method_shells", {}).get(name)
        if shell is None or name not in getattr(handle, "_ray_method_signatures", {}):
            continue
        signature = [
            inspect.Parameter(
                n,
                inspect._ParameterKind(kind),
                default=None if has_default else inspect.Parameter.empty,
            )
            for n, kind, has_default in params
        ]
        handle._ray_method_signatures[name] = signature
        handle._ray_method_is_generator[name] = is_generator
        shell._signature = signature
        if is_generator and not shell._is_generator and name not in handle._ray_method_num_returns:
            shell._num_returns = "streaming"
        shell._is_generator = is_generator


def check_runtime_env_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A runtime_env ``config`` (``{"setup_timeout_seconds": 1800}``), checked on the driver
    by Ray's own `RuntimeEnvConfig`: a typo fails here, not in every worker."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(f"runtime_env_config must be a dict, got {type(config).__name__}")
    try:
        RuntimeEnvConfig(**config)
    except (TypeError, ValueError) as e:
        raise type(e)(f"runtime_env_config={config!r}: {e}") from None
    return copy.deepcopy(config)


# Pickled by value: the initializer runs in environments that lack this package.
ray.cloudpickle.register_pickle_by_value(_initializer)

_UNSET: Any = object()


class RayWorkerBuilder:
    """``RayWorkerBuilder("pkg.workers.Policy", *init_args, **init_kwargs)``."""

    IsolatedWorkerInitializer = ray.remote(_initializer.IsolatedWorkerInitializer)

    def __init__(self, ray_actor_class_fqn: str, *args: Any, **kwargs: Any) -> None:
        _check_fqn(ray_actor_class_fqn)
        self.ray_actor_class_fqn = ray_actor_class_fqn
        self.args = args
        self.kwargs = kwargs
        self._uv_project: UvProjectValue = _UNSET

    def with_uv_project(self, uv_project: UvProjectValue) -> RayWorkerBuilder:
        """A copy of this builder whose workers use ``uv_project`` instead of the registry's
        entry (``None``: the node's own Python). A method, not an argument, because every
        keyword argument of the constructor belongs to the worker's ``__init__``."""
        other = copy.copy(self)
        other._uv_project = check_uv_project(
            uv_project, f"uv_project of {self.ray_actor_class_fqn}"
        )
        return other

    @property
    def uv_project(self) -> UvProjectValue:
        """The override if set, else the registry's entry (unregistered: an error)."""
        if self._uv_project is not _UNSET:
            return copy.deepcopy(self._uv_project)
        return get_actor_uv_project(self.ray_actor_class_fqn)

    def runtime_env(self, runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
        """The caller's runtime_env with this class's ``uv_project`` added; a ``uv_project`` the
        caller put there explicitly wins, as NeMo RL lets ``__call__`` override the executable."""
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise TypeError(f"runtime_env must be a dict, got {type(runtime_env).__name__}")
        env = copy.deepcopy(runtime_env or {})
        if "uv_project" in env:
            env["uv_project"] = check_uv_project(env["uv_project"], "runtime_env['uv_project']")
        else:
            uv_project = self.uv_project
            if uv_project is not None:
                env["uv_project"] = uv_project
        return env

    def make_initializer(
        self,
        runtime_env: dict[str, Any],
        placement_group: PlacementGroup | None = None,
        placement_group_bundle_index: int = 0,
    ) -> ActorHandle:
        """Start an initializer (no CPU) on the worker's bundle: its node builds the venv that
        the worker then reuses. A class whose interpreter can never start under this job (no
        ``uv_project`` under ``uv run --no-sync``) fails here, before any actor exists."""
        if runtime_env.get("uv_project") is None:
            problem = uv_run_no_sync_problem(self.ray_actor_class_fqn)
            if problem:
                raise RuntimeError(problem)
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "runtime_env": runtime_env}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=placement_group_bundle_index
            )
        return self.IsolatedWorkerInitializer.options(**options).remote(
            self.ray_actor_class_fqn, *self.args, **self.kwargs
        )

    def worker_options(self, extra_options: dict[str, Any]) -> dict[str, Any]:
        """The caller's actor options with the class's environment added."""
        options = copy.deepcopy(extra_options)
        options["runtime_env"] = self.runtime_env(options.get("runtime_env"))
        return options

    def create_worker_async(
        self,
        placement_group: PlacementGroup,
        placement_group_bundle_index: int,
        num_gpus: float | int,
        bundle_indices: tuple[int, list[int]] | None = None,
        **extra_options: Any,
    ) -> tuple[ray.ObjectRef, ActorHandle]:
        """Start creating a worker; returns ``(worker_future, initializer)`` at once. Keep the
        initializer alive while the worker runs: it owns the worker."""
        options = self.worker_options(extra_options)
        initializer = self.make_initializer(
            options["runtime_env"], placement_group, placement_group_bundle_index
        )
        future = initializer.create_worker.remote(
            placement_group, placement_group_bundle_index, num_gpus, bundle_indices, **options
        )
        return future, initializer

    def create_worker(
        self,
        placement_group: PlacementGroup,
        placement_group_bundle_index: int,
        num_gpus: float | int,
        bundle_indices: tuple[int, list[int]] | None = None,
        **extra_options: Any,
    ) -> ActorHandle:
        """Create a worker and wait for its handle (see `__call__`)."""
        return self(
            placement_group, placement_group_bundle_index, num_gpus, bundle_indices, **extra_options
        )

    def __call__(
        self,
        placement_group: PlacementGroup,
        placement_group_bundle_index: int,
        num_gpus: float | int,
        bundle_indices: tuple[int, list[int]] | None = None,
        **extra_options: Any,
    ) -> ActorHandle:
        """Create a worker. Option precedence, lowest to highest: ``extra_options``; the class's
        ``configure_worker`` (warns where it overrides); the placement set here."""
        future, initializer = self.create_worker_async(
            placement_group, placement_group_bundle_index, num_gpus, bundle_indices, **extra_options
        )
        worker = ray.get(future)
        restore_method_signatures(worker, ray.get(initializer.method_specs.remote()))
        # The initializer owns the worker: dropping it would kill the worker.
        worker._RAY_INITIALIZER_ACTOR_REF_TO_AVOID_GC = initializer
        return worker

    def __repr__(self) -> str:
        return f"RayWorkerBuilder({self.ray_actor_class_fqn!r})"

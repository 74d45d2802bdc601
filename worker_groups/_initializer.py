"""The body of `RayWorkerBuilder.IsolatedWorkerInitializer`, an actor that runs in the worker's own
uv environment, imports the worker class there by name, and creates the real worker actor.

This module imports only Ray and the standard library, and the builder has Ray pickle it by value:
the target environment needs Ray and the worker's own packages, not this package.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os
import sys
from typing import Any, TypedDict

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger("worker_groups.initializer")


def _load_worker_class(fqn: str) -> Any:
    """Import ``pkg.module.Class`` here, in the worker's environment, with an error that says
    where it looked."""
    module_name, _, class_name = fqn.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"cannot import module {module_name!r} of worker class {fqn!r} with {sys.executable}: "
            f"{e}. The module must be on the worker's path (working_dir, py_modules or "
            "PYTHONPATH) and its dependencies in the class's uv_project environment."
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ImportError(f"module {module_name!r} has no class {class_name!r} (from {fqn!r})")
    return cls


def _call_configure(cls: Any, **available: Any) -> tuple[dict, dict, dict, dict]:
    """Call ``configure_worker`` with the arguments it accepts; 3 or 4 return values."""
    params = inspect.signature(cls.configure_worker).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    result = cls.configure_worker(
        **{k: v for k, v in available.items() if takes_all or k in params}
    )
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise TypeError(
            f"{cls.__name__}.configure_worker must return (resources, env_vars, init_kwargs) or "
            f"(resources, env_vars, init_kwargs, runtime_env), got {result!r}"
        )
    resources, env_vars, init_kwargs, *rest = result
    return resources or {}, env_vars or {}, init_kwargs or {}, (rest[0] if rest else None) or {}


# Set by the plugin in every process it starts in a venv: `ray_uv_plugin.store.layout.VENV_ENV`,
# written out because this module runs where ray_uv_plugin may not be (tests/test_layout.py
# checks that the two agree).
PLUGIN_VENV_ENV = "RAY_UV_PLUGIN_VENV"
# How a node gets the plugin: the `--shell` form adds it to the plugins the node registers already.
PLUGIN_FIX = (
    "its raylet does not load the uv_project plugin, so Ray ignored the field (it only warns in "
    "that node's runtime_env setup log). On that node, with ray-uv-plugin installed in its "
    'Python, run `eval "$(ray-uv plugin-config --shell)"` before `ray start`, and restart it.'
)
# What of a worker's runtime_env decides whether the plugin applies to it (`worker_venv_report`):
# `uv_project` and `spec.OWN_CHOICE_FIELDS`, written out since this module runs where the
# plugin may not be installed (tests/test_layout.py checks that the two agree).
PLUGIN_FIELDS = ("uv_project", "py_executable", "pip", "uv", "conda")


def check_in_its_venv() -> None:
    """A `uv_project` actor on a node whose raylet lacks the plugin runs in the node's own
    Python: say so before anything imports."""
    asked = "uv_project" in (ray.get_runtime_context().runtime_env or {})
    if asked and not os.environ.get(PLUGIN_VENV_ENV):
        node = ray.util.get_node_ip_address()
        raise RuntimeError(
            f"uv_project: node {node} ran this worker in its own Python ({sys.executable}), "
            f"not in a venv: {PLUGIN_FIX}"
        )


class WorkerVenvReport(TypedDict):
    """What a started worker says of where it runs (`worker_venv_report`): a plain dict on the
    wire (Ray pickles this module by value), typed here for both ends."""

    node_ip: str
    node_id: str
    python: str  # the worker's sys.executable
    venv: str | None  # the venv the plugin put it in, None without the plugin
    runtime_env: dict[str, Any]  # its `PLUGIN_FIELDS`, those it has


def worker_venv_report(_worker: Any) -> WorkerVenvReport:
    """Run in a started worker through `__ray_call__` (instead of `__ray_ready__`, so it costs
    no extra call): where it runs, the venv the plugin put it in (None without the plugin), and
    the runtime_env fields the driver needs to decide whether it should have one."""
    runtime_env = ray.get_runtime_context().runtime_env or {}
    return WorkerVenvReport(
        node_ip=ray.util.get_node_ip_address(),
        node_id=ray.get_runtime_context().get_node_id(),
        python=sys.executable,
        venv=os.environ.get(PLUGIN_VENV_ENV) or None,
        runtime_env={k: runtime_env[k] for k in PLUGIN_FIELDS if k in runtime_env},
    )


class IsolatedWorkerInitializer:
    def __init__(self, ray_actor_class_fqn: str, *init_args: Any, **init_kwargs: Any) -> None:
        check_in_its_venv()
        self.ray_actor_class_fqn = ray_actor_class_fqn
        self.init_args = init_args
        self.init_kwargs = init_kwargs
        loaded = _load_worker_class(ray_actor_class_fqn)
        if isinstance(loaded, ray.actor.ActorClass):
            self.actor_class, self.user_class = loaded, loaded.__ray_actor_class__
        elif inspect.isclass(loaded):
            self.actor_class, self.user_class = ray.remote(loaded), loaded
        else:
            raise TypeError(f"{ray_actor_class_fqn!r} is a {type(loaded).__name__}, not a class")

    def python_executable(self) -> str:
        return sys.executable

    def method_specs(self) -> dict[str, tuple[list[tuple[str, int, bool]], bool]]:
        """Each method's parameters as (name, kind, has_default) and whether it is a generator.

        A driver that cannot import the class gets handles whose methods Ray only knows as
        ``(**kwargs)``; these plain values (no defaults: they may need the worker's packages)
        let the driver restore the real signatures."""
        specs = {}
        for name, member in inspect.getmembers(self.user_class, inspect.isfunction):
            if name.startswith("__") and name != "__call__":
                continue
            params = list(inspect.signature(member).parameters.values())
            if not isinstance(inspect.getattr_static(self.user_class, name), staticmethod):
                params = params[1:]
            gen = inspect.isgeneratorfunction(member) or inspect.isasyncgenfunction(member)
            specs[name] = ([(p.name, int(p.kind), p.default is not p.empty) for p in params], gen)
        return specs

    def create_worker(
        self,
        placement_group: Any,
        placement_group_bundle_index: int,
        num_gpus: float,
        bundle_indices: tuple[int, list[int]] | None = None,
        num_gpus_per_node: int | None = None,
        **extra_options: Any,
    ) -> Any:
        """Create the worker. Options, lowest to highest precedence: the class's own
        ``@ray.remote(...)`` options; the caller's ``extra_options`` (merged into them key by key,
        so the decorator's ``runtime_env.env_vars`` survive under the group's); what the class's
        ``configure_worker`` asks for (with a warning where it overrides the caller); the
        placement (scheduling strategy, ``num_gpus``)."""
        defaults = getattr(self.actor_class, "_default_options", None) or {}
        options = _merge_options(_ray_decorator_options(defaults), extra_options)
        init_kwargs = dict(self.init_kwargs)
        if hasattr(self.user_class, "configure_worker"):
            resources, env_vars, extra_kwargs, runtime_env = _call_configure(
                self.user_class,
                num_gpus=num_gpus,
                bundle_indices=bundle_indices,
                num_gpus_per_node=num_gpus_per_node,
            )
            name = self.user_class.__name__
            for key, value in resources.items():
                if key == "num_gpus":
                    num_gpus = value
                    continue
                if key in options and options[key] != value:
                    logger.warning(
                        "%s.configure_worker sets %s=%r over %r", name, key, value, options[key]
                    )
                options[key] = value
            env = options.setdefault("runtime_env", {})
            merged_vars = env.setdefault("env_vars", {})
            for key, value in env_vars.items():
                if key in merged_vars and merged_vars[key] != str(value):
                    logger.warning(
                        "%s.configure_worker sets env %s=%r over %r",
                        name,
                        key,
                        value,
                        merged_vars[key],
                    )
                merged_vars[key] = str(value)
            options["runtime_env"] = _merge_options(env, runtime_env)
            init_kwargs.update(extra_kwargs)
        # One CPU of the bundle unless someone chose: a predictable share when groups colocate.
        options.setdefault("num_cpus", 1)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=placement_group_bundle_index,
            placement_group_capture_child_tasks=True,
        )
        options["num_gpus"] = num_gpus
        return self.actor_class.options(**options).remote(*self.init_args, **init_kwargs)


def _merge_options(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` merged into a copy of ``base``: dicts key by key, anything else replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_options(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _ray_decorator_options(defaults: dict[str, Any]) -> dict[str, Any]:
    """A decorator's options as ``.options()`` takes them: Ray keeps ``nsight`` as ``_nsight``."""
    options = copy.deepcopy(dict(defaults))
    env = options.get("runtime_env")
    if isinstance(env, dict) and "_nsight" in env:
        env = dict(env)
        env.setdefault("nsight", env.pop("_nsight"))
        env.pop("_nsight", None)
        options["runtime_env"] = env
    return options

"""ray-uv-plugin: every Ray actor gets the exact environment of a uv project, built once per node.

Register the plugin on every node (and on a driver that starts a local Ray) with
``eval "$(ray-uv plugin-config --shell)"`` (or ``setup_driver()`` before ``ray.init()``), then
ask for an environment with ``runtime_env={"uv_project": {"extras": ["vllm"]}}``; a driver
started with ``uv run`` gives its whole job its project's environment.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.settings import PLUGIN_CLASS, PLUGINS_ENV, plugin_config, plugins_setting

# The errors a user can catch, by the module that raises them: imported on first use, so that
# `import ray_uv_plugin` stays cheap (no Ray). On the driver, a node's setup failure is Ray's
# `RuntimeEnvSetupError`, whose text is a `UvProjectSetupError`'s.
EXCEPTIONS = {
    "ConnectError": "ray_uv_plugin.cluster.connect",  # no cluster at `address`
    "LockTimeout": "ray_uv_plugin.store.build_lock",  # another build of the key held on
    "PluginNotLoadedError": "ray_uv_plugin.registration",  # this driver's Ray lacks the plugin
    "PrepareError": "ray_uv_plugin.cluster.prepare",  # `prepare_env` could not start
    "ProjectError": "ray_uv_plugin.env.project",  # the project cannot give the env asked for
    "ReadinessError": "ray_uv_plugin.cluster.readiness",  # `node_setups` cannot ask from this job
    "SlotTimeout": "ray_uv_plugin.store.build_slots",  # no build slot in time
    "TokenAuthError": "ray_uv_plugin.cluster.auth",  # the cluster's token is missing or wrong
    "UntrustedPathError": "ray_uv_plugin.store.trust",  # a venv dir path we must not touch
    "UvEnvError": "ray_uv_plugin.env.uv_env",  # a job variable uv cannot be given
    "UvNotFoundError": "ray_uv_plugin.env.uv",  # no usable uv binary
    "UvProjectSetupError": "ray_uv_plugin.agent.setup_error",  # as the driver reads a setup
    "UvProjectSpecError": "ray_uv_plugin.env.spec",  # a bad `uv_project` value
    "UvProjectTypeError": "ray_uv_plugin.env.spec",  # a field of the wrong type
    "UvSyncError": "ray_uv_plugin.env.uv",  # `uv sync` gave no usable venv
    "VenvDirError": "ray_uv_plugin.settings",  # RAY_UV_PLUGIN_VENV_DIR cannot be used
}

__all__ = [
    "PLUGIN_CLASS",
    "PLUGINS_ENV",
    "UvProject",
    "UvProjectPlugin",
    "plugin_config",
    "plugins_setting",
    "NodeSetup",
    "node_setups",
    "prepare_env",
    "setup_driver",
    # the errors (`EXCEPTIONS`, which a test keeps equal to these)
    "ConnectError",
    "LockTimeout",
    "PluginNotLoadedError",
    "PrepareError",
    "ProjectError",
    "ReadinessError",
    "SlotTimeout",
    "TokenAuthError",
    "UntrustedPathError",
    "UvEnvError",
    "UvNotFoundError",
    "UvProjectSetupError",
    "UvProjectSpecError",
    "UvProjectTypeError",
    "UvSyncError",
    "VenvDirError",
]

if TYPE_CHECKING:
    from ray_uv_plugin.agent.plugin import UvProjectPlugin
    from ray_uv_plugin.agent.setup_error import UvProjectSetupError
    from ray_uv_plugin.cluster.auth import TokenAuthError
    from ray_uv_plugin.cluster.connect import ConnectError
    from ray_uv_plugin.cluster.prepare import PrepareError, prepare_env
    from ray_uv_plugin.cluster.readiness import NodeSetup, ReadinessError, node_setups
    from ray_uv_plugin.env.project import ProjectError
    from ray_uv_plugin.env.spec import UvProjectSpecError, UvProjectTypeError
    from ray_uv_plugin.env.uv import UvNotFoundError, UvSyncError
    from ray_uv_plugin.env.uv_env import UvEnvError
    from ray_uv_plugin.registration import PluginNotLoadedError, UvProject
    from ray_uv_plugin.settings import VenvDirError
    from ray_uv_plugin.store.build_lock import LockTimeout
    from ray_uv_plugin.store.build_slots import SlotTimeout
    from ray_uv_plugin.store.trust import UntrustedPathError


def setup_driver() -> None:
    """What `eval "$(ray-uv plugin-config --shell)"` sets, for a driver that starts a local Ray:
    call it before `ray.init()`. It registers the plugin and its schema and makes a `uv run`
    driver's job use the node's cached venv (our runtime_env hook instead of Ray's `uv run`
    one, which Ray reads from the environment when it is imported, so it is also turned off in
    an already imported Ray). Called after `ray.init()`, where that Ray does not load the
    plugin, it raises `PluginNotLoadedError` (`registration`): too late for it."""
    from ray_uv_plugin.driver.hook import hook_settings
    from ray_uv_plugin.registration import watch
    from ray_uv_plugin.schema import SCHEMAS_ENV, schemas_setting

    os.environ[PLUGINS_ENV] = plugins_setting(os.environ.get(PLUGINS_ENV))
    os.environ[SCHEMAS_ENV] = schemas_setting(os.environ.get(SCHEMAS_ENV))
    os.environ.update(hook_settings(os.environ, portable=False))
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    watch()


def __getattr__(name: str) -> Any:
    # Imported lazily: `ray-uv plugin-config` and the spec helpers need no Ray import.
    if name == "UvProjectPlugin":
        from ray_uv_plugin.agent.plugin import UvProjectPlugin

        return UvProjectPlugin
    if name == "prepare_env":
        from ray_uv_plugin.cluster.prepare import prepare_env

        return prepare_env
    if name in ("node_setups", "NodeSetup"):  # where each node's setup of an env stands
        from ray_uv_plugin.cluster import readiness

        return getattr(readiness, name)
    if name == "UvProject":  # the builder that also checks that the driver's Ray loads us
        from ray_uv_plugin.registration import UvProject

        return UvProject
    if name in EXCEPTIONS:
        import importlib

        return getattr(importlib.import_module(EXCEPTIONS[name]), name)
    raise AttributeError(f"module 'ray_uv_plugin' has no attribute {name!r}")

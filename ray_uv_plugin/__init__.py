"""ray-uv-plugin: every Ray actor gets the exact environment of a uv project, built once per node.

Register the plugin on every node (and on a driver that starts a local Ray) with
``eval "$(ray-uv plugin-config --shell)"`` (or ``setup_driver()`` before ``ray.init()``), then
ask for an environment with ``runtime_env={"uv_project": {"extras": ["vllm"]}}``; a driver
started with ``uv run`` gives its whole job its project's environment.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

PLUGIN_CLASS = "ray_uv_plugin.UvProjectPlugin"
PLUGINS_ENV = "RAY_RUNTIME_ENV_PLUGINS"

__all__ = [
    "PLUGIN_CLASS",
    "PLUGINS_ENV",
    "PluginNotLoadedError",
    "UvProject",
    "UvProjectPlugin",
    "plugin_config",
    "plugins_setting",
    "prepare_env",
    "setup_driver",
]

if TYPE_CHECKING:
    from ray_uv_plugin.agent.plugin import UvProjectPlugin
    from ray_uv_plugin.agent.spec import UvProject
    from ray_uv_plugin.cluster.prepare import prepare_env
    from ray_uv_plugin.registration import PluginNotLoadedError


def plugin_config() -> str:
    """The value of ``RAY_RUNTIME_ENV_PLUGINS`` that registers the ``uv_project`` field."""
    return json.dumps([{"class": PLUGIN_CLASS}])


def plugins_setting(current: str | None) -> str:
    """The `RAY_RUNTIME_ENV_PLUGINS` value that registers this plugin beside those already in
    `current` (the variable as set): a site may register plugins of its own, which a plain
    replacement would drop. Ray refuses a plugin listed twice, so ours stays single however
    often `eval "$(ray-uv plugin-config --shell)"` runs; an entry of ours already there (with
    the `priority` an operator gave it) is kept as it is. A value Ray cannot read is a
    ValueError that says what to do."""
    if current is None or not current.strip():
        return plugin_config()
    try:
        plugins = json.loads(current)
    except ValueError:
        plugins = None
    if not isinstance(plugins, list) or not all(
        isinstance(p, dict) and isinstance(p.get("class"), str) for p in plugins
    ):
        raise ValueError(
            f"{PLUGINS_ENV}={current!r} is not what Ray reads there, a JSON list of "
            '{"class": "module.Class"} objects: fix or unset it, then run `ray-uv '
            "plugin-config` again."
        )
    ours = [i for i, p in enumerate(plugins) if p["class"] == PLUGIN_CLASS]
    if len(ours) == 1:
        return current
    if not ours:
        return json.dumps([*plugins, {"class": PLUGIN_CLASS}])
    return json.dumps([p for i, p in enumerate(plugins) if i not in ours[1:]])


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
    if name == "UvProject":  # the builder that also checks that the driver's Ray loads us
        from ray_uv_plugin.registration import UvProject

        return UvProject
    if name == "PluginNotLoadedError":
        from ray_uv_plugin.registration import PluginNotLoadedError

        return PluginNotLoadedError
    raise AttributeError(f"module 'ray_uv_plugin' has no attribute {name!r}")

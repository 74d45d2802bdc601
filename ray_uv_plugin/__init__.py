"""ray-uv-plugin: every Ray actor gets the exact environment of a uv project, built once per node.

Register the plugin on every node (and on a driver that starts a local Ray) with
``export RAY_RUNTIME_ENV_PLUGINS=$(ray-uv plugin-config)``, then ask for an environment with
``runtime_env={"uv_project": {"extras": ["vllm"]}}``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

PLUGIN_CLASS = "ray_uv_plugin.UvProjectPlugin"

__all__ = ["PLUGIN_CLASS", "UvProject", "UvProjectPlugin", "plugin_config", "prepare_env"]

if TYPE_CHECKING:
    from ray_uv_plugin.plugin import UvProjectPlugin
    from ray_uv_plugin.prepare import prepare_env
    from ray_uv_plugin.spec import UvProject


def plugin_config() -> str:
    """The value of ``RAY_RUNTIME_ENV_PLUGINS`` that registers the ``uv_project`` field."""
    return json.dumps([{"class": PLUGIN_CLASS}])


def __getattr__(name: str) -> Any:
    # Imported lazily: `ray-uv plugin-config` and the spec helpers need no Ray import.
    if name == "UvProjectPlugin":
        from ray_uv_plugin.plugin import UvProjectPlugin

        return UvProjectPlugin
    if name == "prepare_env":
        from ray_uv_plugin.prepare import prepare_env

        return prepare_env
    if name == "UvProject":
        from ray_uv_plugin.spec import UvProject

        return UvProject
    raise AttributeError(f"module 'ray_uv_plugin' has no attribute {name!r}")

"""The `uv_project` plugin for tests only, on a Ray that lacks one internal the plugin uses:
what a newer Ray that moved a piece of `ray._private` looks like to the plugin."""

from __future__ import annotations

from ray_uv_plugin.agent.plugin import UvProjectPlugin
from ray_uv_plugin.agent.ray_compat import AGENT, RayInternal

GONE = RayInternal(
    "ray._private.runtime_env.context.RuntimeEnvContext.gone_in_a_newer_ray",
    "a piece a newer Ray dropped (a test)",
)
PLUGIN = {"class": "tests.support.changed_ray_plugin.PluginOnAChangedRay"}


class PluginOnAChangedRay(UvProjectPlugin):
    ray_internals = (*AGENT, GONE)

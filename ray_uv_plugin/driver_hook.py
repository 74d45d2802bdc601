"""The hook's public name: `RAY_RUNTIME_ENV_HOOK=ray_uv_plugin.driver_hook.hook`.

Operators write this name into cluster configs, KubeRay manifests and job scripts, so it stays
where it was when the code moved to `ray_uv_plugin.driver`; the hook itself is
`ray_uv_plugin.driver.hook`.
"""

from ray_uv_plugin.driver.hook import check_hook_dir, hook, hook_settings

__all__ = ["check_hook_dir", "hook", "hook_settings"]

"""`RAY_RUNTIME_ENV_HOOK=ray_uv_plugin_hook.hook`, importable from any Python that runs Ray.

`ray-uv plugin-config --shell` puts only this file's directory on PYTHONPATH: a driver started
with `uv run` runs in its project's venv, which has Ray but not necessarily ray-uv-plugin, and
`ray.init` fails when it cannot import the hook. There the plugin is loaded from the install
this file belongs to (what it imports, packaging and psutil, comes with Ray).
"""

import importlib.util
import sys
from pathlib import Path

try:
    from ray_uv_plugin.driver_hook import hook
except ImportError:  # not in this Python, or a version without the hook
    for _name in [m for m in sys.modules if m == "ray_uv_plugin" or m.startswith("ray_uv_plugin.")]:
        del sys.modules[_name]
    _package = Path(__file__).resolve().parent.parent
    _spec = importlib.util.spec_from_file_location(
        "ray_uv_plugin", _package / "__init__.py", submodule_search_locations=[str(_package)]
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules["ray_uv_plugin"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["ray_uv_plugin"])
    from ray_uv_plugin.driver_hook import hook

__all__ = ["hook"]

"""The JSON schema of the `uv_project` field, shipped in the package for driver-side checks.

Ray validates every runtime_env field whose name matches a schema `title` in the files named by
`RAY_RUNTIME_ENV_PLUGIN_SCHEMAS` (`RuntimeEnvPluginSchemaManager`, called from
`RuntimeEnv.__setitem__`). Drivers build a `RuntimeEnv` at `.options()` / `.remote()` time and
`ray job submit` does so before it sends the job, so a typo fails there instead of on a node
after scheduling. The node-side parse (`spec.parse_spec`) stays the authority: the schema only
repeats its field names, types and cross-field rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMAS_ENV = "RAY_RUNTIME_ENV_PLUGIN_SCHEMAS"
SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "uv_project.json"


def schema_path() -> Path:
    """Where the installed package keeps the schema (a plain file: Ray opens it by path)."""
    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(
            f"{SCHEMA_PATH} is missing: the ray-uv-plugin install is incomplete; reinstall it "
            "(the wheel ships ray_uv_plugin/schemas/uv_project.json)."
        )
    return SCHEMA_PATH


def load_schema() -> dict[str, Any]:
    return json.loads(schema_path().read_text())


def schemas_setting(existing: str | None) -> str:
    """`RAY_RUNTIME_ENV_PLUGIN_SCHEMAS` (a comma list) with our schema added to what is set."""
    ours = str(schema_path())
    parts = [p for p in (existing or "").split(",") if p]
    return ",".join(parts if ours in parts else [*parts, ours])

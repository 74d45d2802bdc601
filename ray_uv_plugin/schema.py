"""The JSON schema of the `uv_project` field, packaged with the plugin for driver-side checks.

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


_NAMES = {"type": "string", "minLength": 1, "pattern": "\\S"}
_TYPES: dict[str, dict[str, Any]] = {
    "path": {"type": ["string", "null"], "minLength": 1},
    "name": {"type": ["string", "null"], "minLength": 1, "pattern": "\\S"},
    "names": {"type": "array", "items": _NAMES},
    "env_names": {
        "type": "array",
        "items": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
    },
    "bool": {"type": "boolean"},
}


def _exclusive(description: str, required: list[str], **properties: Any) -> dict[str, Any]:
    return {"not": {"description": description, "required": required, "properties": properties}}


# What `parse_spec` refuses across fields, as JSON schema.
_RULES: list[dict[str, Any]] = [
    _exclusive(
        "`locked: true` and `frozen: true` are exclusive: set only one of them.",
        ["locked", "frozen"],
        locked={"const": True},
        frozen={"const": True},
    ),
    _exclusive(
        "`all_extras: true` already installs every extra: drop `extras` or set `all_extras` "
        "to false.",
        ["all_extras", "extras"],
        all_extras={"const": True},
        extras={"minItems": 1},
    ),
    {
        "not": {
            "description": "`only_groups` installs just those groups: it cannot go with "
            "`groups` or `all_groups`.",
            "required": ["only_groups"],
            "properties": {"only_groups": {"minItems": 1}},
            "anyOf": [
                {"required": ["groups"], "properties": {"groups": {"minItems": 1}}},
                {"required": ["all_groups"], "properties": {"all_groups": {"const": True}}},
            ],
        }
    },
    {
        "not": {
            "description": "`from_image` needs the lock as it is: not with `locked: false` "
            "(but with `frozen: true`).",
            "required": ["from_image", "locked"],
            "properties": {"from_image": {"minItems": 1}, "locked": {"const": False}},
            "not": {"required": ["frozen"], "properties": {"frozen": {"const": True}}},
        }
    },
]


def make_schema() -> dict[str, Any]:
    """The schema, made from the table of fields (`env.fields`): the packaged file is this,
    written by `uv run python -m ray_uv_plugin.schema` (a test keeps them equal)."""
    from ray_uv_plugin.env.fields import FIELDS, NAMES

    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": "https://github.com/ray-uv-plugin/ray-uv-plugin/ray_uv_plugin/schemas/"
        "uv_project.json",
        "title": "uv_project",
        "description": "The runtime_env field of ray-uv-plugin: give the worker the "
        "environment of a uv project (`uv sync --locked` of its uv.lock), built once per node. "
        f"Fields: {', '.join(NAMES)}.",
        "type": "object",
        "additionalProperties": False,
        "properties": {f.name: {"description": f.doc, **_TYPES[f.kind]} for f in FIELDS},
        "allOf": _RULES,
    }


def schema_text() -> str:
    return json.dumps(make_schema(), indent=2) + "\n"


if __name__ == "__main__":  # regenerate the packaged file from the table
    SCHEMA_PATH.write_text(schema_text())


def schemas_setting(existing: str | None) -> str:
    """`RAY_RUNTIME_ENV_PLUGIN_SCHEMAS` (a comma list) with our schema added to what is set."""
    ours = str(schema_path())
    parts = [p for p in (existing or "").split(",") if p]
    return ",".join(parts if ours in parts else [*parts, ours])

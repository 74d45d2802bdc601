"""The shipped JSON schema agrees with `spec`, and Ray applies it where Ray 2.60 applies schemas."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import typing
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import ray_uv_plugin
from ray_uv_plugin.env.spec import (
    FIELD,
    FIELD_NAMES,
    ParsedUvProject,
    UvProjectSpecError,
    parse_spec,
)
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.schema import SCHEMAS_ENV, load_schema, schema_path, schemas_setting

ROOT = Path(__file__).resolve().parents[1]


def _json_types(annotation: Any) -> set[str]:
    """JSON types that a dataclass field annotation admits."""
    if isinstance(annotation, types.UnionType):
        return set().union(*(_json_types(a) for a in typing.get_args(annotation)))
    origin = typing.get_origin(annotation) or annotation
    return {
        bool: {"boolean"},
        str: {"string"},
        type(None): {"null"},
        tuple: {"array"},
        list: {"array"},
    }[origin]


def test_schema_names_the_field_and_lists_exactly_the_spec_fields() -> None:
    schema = load_schema()
    assert schema["title"] == FIELD  # Ray matches schemas to fields by title
    assert schema["additionalProperties"] is False
    assert tuple(schema["properties"]) == FIELD_NAMES


def test_schema_types_match_the_spec_dataclass() -> None:
    props = load_schema()["properties"]
    hints = typing.get_type_hints(ParsedUvProject)
    for field in dataclasses.fields(ParsedUvProject):
        declared = props[field.name]["type"]
        declared = set(declared) if isinstance(declared, list) else {declared}
        assert declared == _json_types(hints[field.name]), field.name
        if "array" in declared:
            assert props[field.name]["items"]["type"] == "string"


VALUES = [
    {},
    {"extras": ["vllm"], "groups": ["dev"]},
    {"project": "/srv/proj", "all_extras": True},
    {"project": None},
    {"frozen": True},
    {"frozen": True, "locked": False},
    {"locked": False, "install_project": True, "no_default_groups": True},
    {"all_extras": True, "extras": []},
    # bad ones
    {"extra": ["vllm"]},
    {"extras": "vllm"},
    {"extras": ["vllm", 3]},
    {"extras": [""]},
    {"groups": ["  "]},
    {"locked": "yes"},
    {"locked": 1},
    {"project": ""},
    {"project": 7},
    {"locked": True, "frozen": True},
    {"all_extras": True, "extras": ["a"]},
    ["vllm"],
    "vllm",
]


@pytest.mark.parametrize("value", VALUES, ids=[json.dumps(v) for v in VALUES])
def test_schema_accepts_exactly_what_parse_spec_accepts(value: Any) -> None:
    try:
        parse_spec(value)
        spec_ok = True
    except UvProjectSpecError:
        spec_ok = False
    schema_ok = jsonschema.Draft7Validator(load_schema()).is_valid(value)
    assert schema_ok == spec_ok


def test_schemas_setting_appends_once() -> None:
    ours = str(schema_path())
    assert schemas_setting(None) == ours
    assert schemas_setting("/x/other.json") == f"/x/other.json,{ours}"
    assert schemas_setting(f"/x/other.json,{ours}") == f"/x/other.json,{ours}"


def _driver(code: str, schemas: bool = True) -> subprocess.CompletedProcess[str]:
    """A fresh driver process: Ray loads schemas once per process, from its environment."""
    env = {k: v for k, v in __import__("os").environ.items() if k != SCHEMAS_ENV}
    if schemas:
        env[SCHEMAS_ENV] = str(schema_path())
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_ray_applies_the_schema_on_the_driver() -> None:
    """Ray runs plugin schemas in `RuntimeEnv.__setitem__` / `.set()`: a typo fails there."""
    code = (
        "from ray.runtime_env import RuntimeEnv\n"
        "env = RuntimeEnv()\n"
        "env.set('uv_project', {'extras': ['a']})\n"
        "try:\n"
        "    env.set('uv_project', {'extrass': ['a']})\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, str(e).splitlines()[0])\n"
    )
    out = _driver(code)
    assert out.returncode == 0, out.stderr
    assert "ValidationError Additional properties are not allowed ('extrass'" in out.stdout
    # Without the setting, Ray has no schema for the field and lets the typo through.
    assert "ValidationError" not in _driver(code, schemas=False).stdout


def test_plain_dicts_in_options_skip_ray_schemas_so_use_uv_project() -> None:
    """Ray 2.60's `RuntimeEnv(**dict)` fills itself with `dict.update`, so `.options()` with a
    plain dict never reaches the schema: the typed `UvProject` helper is what fails on the
    driver then. If this test starts failing, Ray began validating plugin fields in the
    constructor: update docs/operations.md."""
    code = (
        "import ray\n"
        "from ray_uv_plugin import UvProject\n"
        "@ray.remote\n"
        "def f(): pass\n"
        "f.options(runtime_env={'uv_project': {'extrass': ['a']}})\n"
        "print('plain dict passed')\n"
        "try:\n"
        "    f.options(runtime_env={'uv_project': UvProject(extrass=['a'])})\n"
        "except TypeError as e:\n"
        "    print('UvProject:', e)\n"
        "try:\n"
        "    UvProject(locked=True, frozen=True)\n"
        "except ValueError as e:\n"
        "    print('UvProject:', e)\n"
        "f.options(runtime_env={'uv_project': UvProject(extras=['a'])})\n"
        "print('good value passed')\n"
    )
    out = _driver(code)
    assert out.returncode == 0, out.stderr
    assert "plain dict passed" in out.stdout
    said = "UvProject: uv_project has unknown field(s) 'extrass' (did you mean 'extras'?)"
    assert said in out.stdout
    assert "'locked' and 'frozen' are exclusive" in out.stdout
    assert "good value passed" in out.stdout


def test_uv_project_is_exported_and_the_package_import_stays_light() -> None:
    assert ray_uv_plugin.UvProject(extras=["b", "a"]) == {"extras": ["b", "a"]}
    code = (
        "import sys, ray_uv_plugin\n"
        "ray_uv_plugin.plugin_config()\n"
        "print(sorted(m for m in ('ray', 'rich', 'packaging') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_wheel_ships_the_schema(tmp_path: Path) -> None:
    subprocess.run(
        [find_uv(), "build", "--wheel", "--out-dir", str(tmp_path), "--quiet", str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("ray_uv_plugin-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "ray_uv_plugin/schemas/uv_project.json" in names
        assert json.loads(zf.read("ray_uv_plugin/schemas/uv_project.json")) == load_schema()
        assert "ray_uv_plugin/ops/cli.py" in names
        # The empty uv config dir that keeps user and system uv.toml files out of builds.
        assert "ray_uv_plugin/env/uv_config/uv/uv.toml" in names
        # No generic top-level `benchmarks` package in users' site-packages.
        assert not [n for n in names if n.startswith("benchmarks/")]

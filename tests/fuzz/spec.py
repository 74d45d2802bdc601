"""The `uv_project` value: `parse_spec` (the node's parse), the JSON schema (the driver's
check, through Ray) and `UvProject` (the typed builder)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from hypothesis import strategies as st

from ray_uv_plugin.env.spec import FIELD_NAMES, ParsedUvProject, parse_spec
from ray_uv_plugin.env.uv_env import UvEnvError
from ray_uv_plugin.registration import UvProject
from ray_uv_plugin.schema import load_schema
from tests.fuzz.harness import Case, Target, Violation, refused_clearly, seeded

_SCHEMA = load_schema()
_VALIDATOR = jsonschema.Draft7Validator(_SCHEMA)
_LISTS = ("extras", "no_extras", "groups", "only_groups", "no_groups", "build_env_vars")
_BOOLS = ("all_extras", "no_default_groups", "all_groups", "locked", "frozen", "install_project")

# Words a user writes, and what trips a parser: blanks, unicode blanks, case, separators.
names = st.one_of(
    st.sampled_from(["vllm", "dev", "Fig", "fig", "a_b", "a-b", "A.B", "PATH", "CMAKE_ARGS"]),
    st.sampled_from(["", " ", "\t", "\u00a0", "\x1c", "\u2028", " dev ", "PYTHONPATH"]),
    st.sampled_from(["UV_LINK_MODE", "XDG_CONFIG_HOME", "LD_PRELOAD", "1ABC", "A=B", "é"]),
    st.text(max_size=8),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), names)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(names, inner, max_size=3)),
    max_leaves=8,
)


def _field_value(field: str) -> st.SearchStrategy[Any]:
    if field in _LISTS:
        return st.one_of(st.lists(names, max_size=4), json_values)
    if field in _BOOLS or field == "job_default":
        return st.one_of(st.booleans(), json_values)
    return st.one_of(names, st.none(), json_values)  # project, package


fields = st.sampled_from(FIELD_NAMES)
values = st.one_of(
    st.dictionaries(fields, st.none()).flatmap(
        lambda keys: st.fixed_dictionaries({k: _field_value(k) for k in keys})
    ),
    st.dictionaries(st.one_of(fields, names), json_values, max_size=4),
    json_values,
)
fresh = st.one_of(
    st.builds(lambda v: {"kind": "value", "value": v}, values),
    st.builds(
        lambda v: {"kind": "UvProject", "value": v},
        st.dictionaries(fields, st.none()).flatmap(
            lambda keys: st.fixed_dictionaries({k: _field_value(k) for k in keys})
        ),
    ),
)


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    value = seed["value"]
    if not isinstance(value, dict):
        return st.just(seed)
    return st.builds(
        lambda field, new, drop: {
            "kind": seed["kind"],
            "value": {k: v for k, v in {**value, field: new}.items() if k != drop},
        },
        fields,
        json_values,
        st.one_of(st.none(), fields),
    )


def _use(parsed: ParsedUvProject) -> None:
    """What the plugin does with a parsed value: its flags, its key's part, its label."""
    args = parsed.sync_args()
    if not all(isinstance(a, str) and a for a in args):
        raise Violation(f"sync_args gave {args!r}")
    json.dumps(parsed.selection(), sort_keys=True)
    if not isinstance(parsed.describe(), str):
        raise Violation("describe gave no str")


def _parse(value: Any, what: str) -> ParsedUvProject | None:
    try:
        parsed = parse_spec(value)
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (ValueError,), what)
        return None
    _use(parsed)
    return parsed


def check(case: Case) -> None:
    value = case["value"]
    if case["kind"] == "UvProject":
        _check_builder(value)
        return
    parsed = _parse(value, f"parse_spec({value!r})")
    schema_ok = _VALIDATOR.is_valid(value)
    if parsed is not None and not schema_ok:
        error = next(iter(_VALIDATOR.iter_errors(value)))
        raise Violation(
            f"{value!r}: the node takes it, but the schema (checked on the driver) refuses it: "
            f"{error.message}"
        )
    if parsed is None and schema_ok:
        try:
            parse_spec(value)
        except UvEnvError:
            return  # the build variables the plugin refuses: a list the schema does not repeat
        except ValueError as e:
            raise Violation(
                f"{value!r}: the schema takes it, but the node refuses it ({e}): a job "
                "passes the driver's check and fails on every node"
            ) from e


def _as_given(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The dict a user would write for these `UvProject` arguments (defaults left out)."""
    return {k: v for k, v in kwargs.items() if v is not None and not (k in _LISTS and v == [])}


def _check_builder(kwargs: dict[str, Any]) -> None:
    what = f"UvProject(**{kwargs!r})"
    try:
        built = UvProject(**kwargs)
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (ValueError,), what)
        return
    if not isinstance(built, dict):
        raise Violation(f"{what} is no dict")
    json.loads(json.dumps(built))  # Ray sends runtime_envs as JSON
    parsed = _parse(dict(built), f"parse_spec({what})")
    if parsed is None:
        raise Violation(f"{what} made {built!r}, which parse_spec refuses")
    try:
        direct = parse_spec(_as_given(kwargs))
    except ValueError as e:
        raise Violation(
            f"{what} made {built!r}, but the same value as a dict is refused: {e}"
        ) from e
    if direct != parsed:
        raise Violation(f"{what} made {built!r}: {parsed}, not the dict's {direct}")


TARGET = Target(
    name="spec",
    cases=seeded("spec", fresh, _mutate),
    check=check,
    modules=("ray_uv_plugin.env.spec", "ray_uv_plugin.schema"),
    properties=(
        "parse_spec gives a ParsedUvProject whose sync_args, selection and describe work, or "
        "raises a ValueError subclass with a message",
        "the schema and parse_spec agree on every JSON value (bar the build variables only "
        "the node refuses)",
        "UvProject(...) raises a ValueError subclass, or makes a JSON dict that parse_spec "
        "reads as the same value written as a dict",
    ),
)

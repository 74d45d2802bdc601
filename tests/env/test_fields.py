"""One table of `uv_project` fields (`env/fields.py`): the shipped JSON schema, the
README's field table, `UvProject`, `ParsedUvProject`, the key, `uv sync`'s options, the `uv
run` hook's options and `ray-uv prepare`/`check`'s flags all agree with it. No Ray."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from ray_uv_plugin.driver import uv_run_options
from ray_uv_plugin.driver.uv_run import _Selection
from ray_uv_plugin.env.fields import (
    FIELDS,
    NAMES,
    SELECTION,
    TABLE_BEGIN,
    Field,
    readme_table,
    table_in,
    uv_options,
)
from ray_uv_plugin.env.spec import (
    FIELD_NAMES,
    ParsedUvProject,
    UvProjectSpecError,
    UvProjectTypeError,
    parse_spec,
    value_class,
)
from ray_uv_plugin.ops import cli
from ray_uv_plugin.ops.cli_common import UsageError, selection
from ray_uv_plugin.registration import UvProject
from ray_uv_plugin.schema import load_schema, make_schema, schema_path, schema_text
from tests.driver.test_uv_run import make_project, value_of

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = {"path": "/srv/p", "name": "member", "names": ["x"], "env_names": ["MYLIB_FLAVOR"]}


def sample(f: Field) -> Any:
    """A value of the field other than its default."""
    return (not f.default) if f.kind == "bool" else SAMPLE[f.kind]


def test_the_shipped_schema_is_the_one_made_from_the_table() -> None:
    regen = "the schema file is not the table's: run `uv run python -m ray_uv_plugin.schema`"
    assert load_schema() == make_schema(), regen
    assert schema_path().read_text() == schema_text(), regen
    assert tuple(make_schema()["properties"]) == NAMES


def test_the_readme_table_is_the_one_made_from_the_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert TABLE_BEGIN in readme, "the README lost its field table's markers"
    assert table_in(readme) == readme_table(), (
        "the README's field table is not the table's: run "
        "`uv run python -m ray_uv_plugin.env.fields README.md`"
    )


def test_the_parsed_value_and_the_builder_have_the_tables_fields_and_defaults() -> None:
    assert FIELD_NAMES == NAMES
    assert tuple(f.name for f in dataclasses.fields(ParsedUvProject)) == NAMES
    params = inspect.signature(UvProject.__init__).parameters
    assert tuple(name for name in params if name != "self") == NAMES
    default = ParsedUvProject()
    for f in FIELDS:
        assert getattr(default, f.name) == (tuple(f.default) if f.is_list else f.default), f.name
        given = params[f.name].default
        # `locked=None` is "not given": the table's default then holds.
        assert given == f.default or (f.name == "locked" and given is None), f.name
    assert UvProject() == {} and parse_spec(UvProject()) == default


@pytest.mark.parametrize("f", FIELDS, ids=NAMES)
def test_each_field_is_checked_by_its_kind_the_builder_as_the_dict(f: Field) -> None:
    wrong = {"bool": "yes", "path": 3, "name": 3}.get(f.kind, "table")  # a str for a list
    with pytest.raises(UvProjectTypeError) as parsed:
        parse_spec({f.name: wrong})
    with pytest.raises(UvProjectTypeError) as built:
        UvProject(**{f.name: wrong})
    assert str(built.value) == str(parsed.value)
    assert str(parsed.value).startswith(f"uv_project.{f.name} must be ")
    assert parse_spec({f.name: sample(f)}) == parse_spec(UvProject(**{f.name: sample(f)}))


@pytest.mark.parametrize("f", FIELDS, ids=NAMES)
def test_the_key_records_exactly_the_keyed_fields(f: Field) -> None:
    default = parse_spec({}).selection()
    assert set(default) <= {g.name for g in FIELDS if g.keyed}
    changed = parse_spec({f.name: sample(f)}).selection()
    assert (changed != default) == f.keyed, f.name


@pytest.mark.parametrize("f", [f for f in FIELDS if f.uv and f.name != "project"], ids=str)
def test_uv_sync_gets_each_fields_uv_option(f: Field) -> None:
    """`project` is where uv runs (`--project DIR`), the rest are `uv sync` options."""
    flag = f.uv.split()[0]
    if f.kind == "bool":
        for value in (True, False):
            args = parse_spec({f.name: value}).sync_args()
            assert (flag in args) == (value == f.uv_when), (f.name, value, args)
    else:
        args = parse_spec({f.name: sample(f)}).sync_args()
        assert args[args.index(flag) + 1] == (sample(f)[0] if f.is_list else sample(f))


def test_the_uv_run_hook_knows_each_fields_uv_option(tmp_path: Path) -> None:
    """Each field's uv option is one the hook reads as selecting (never ignores or refuses),
    and a `uv run` with it gives the job that field."""
    options = {f.uv.split()[0] for f in FIELDS if f.uv}
    assert options <= set(uv_run_options.SELECTING)
    assert not options & (set(uv_run_options.IGNORED) | set(uv_run_options.UNMAPPABLE))
    app = make_project(tmp_path / "app")
    for f in FIELDS:
        if not f.uv or f.name in ("project", "package", "locked", "install_project"):
            continue  # the project's dir, a workspace member, the defaults: test_uv_run's
        flag, *metavar = f.uv.split()
        value = value_of(app, flag, *(["x"] if metavar else []))
        assert value is not None and value[f.name] == (["x"] if f.is_list else True), f.name


def test_prepare_and_check_take_every_selection_field() -> None:
    """`ray-uv prepare` can warm the key of any job: every field that selects packages is a
    flag (the project has `--project`; a build's env vars and the hook's mark are not
    selections a prepare makes)."""
    assert {f.name for f in FIELDS} - {f.name for f in SELECTION} == {
        "project",
        "build_env_vars",
        "job_default",
    }
    parser = cli.build_parser()
    for command in ("prepare", "check"):
        for f in SELECTION:
            given = [f.flag, *([sample(f)[0]] if f.is_list else [sample(f)] * bool(f.metavar))]
            chosen = selection(parser.parse_args([command, *given]))
            assert chosen == parse_spec(UvProject(**{f.name: sample(f)})), (command, f.name)
        both = parser.parse_args([command, "--only-group", "a", "--only-group", "b"])
        assert selection(both) == parse_spec({"only_groups": ["a", "b"]})
        assert selection(parser.parse_args([command])) == ParsedUvProject()


def test_selection_flags_no_value_can_hold_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = cli.build_parser()
    for flags in (["--extra", "a", "--all-extras"], ["--only-group", "g", "--all-groups"]):
        with pytest.raises(UsageError) as info:
            selection(parser.parse_args(["check", *flags]))
        assert isinstance(info.value.__cause__, UvProjectSpecError)
        for command in ("check", "prepare"):
            assert cli.main([command, "--project", "examples/demo_project", *flags]) == 2
            assert capsys.readouterr().err.startswith("error: uv_project: ")


def test_a_field_added_to_the_table_reaches_uv_sync_the_key_and_the_uv_run_hook() -> None:
    """Adding a field is a row of the table: the parsed value's field (with its row as
    metadata), its `uv sync` flag, its part of the key (only where set: every venv keyed before
    keeps its key) and the `uv run` hook's reading of its option all come from it."""
    no_build = Field("no_build", "bool", False, "Build nothing.", uv="--no-build", cli="--no-build")
    no_binary = Field("no_binary", "names", (), "Build these.", uv="--no-binary-package P")
    table = (*FIELDS, no_build, no_binary)
    more = value_class(table, "ParsedWithMore")
    assert [f.metadata["field"] for f in dataclasses.fields(more)] == list(table)
    assert more().selection() == ParsedUvProject().selection()
    assert more().sync_args() == ParsedUvProject().sync_args()
    value = more(extras=("x",), no_build=True, no_binary=("Torch",))
    before = ParsedUvProject(extras=("x",))
    assert value.sync_args() == [*before.sync_args(), "--no-build", "--no-binary-package", "Torch"]
    assert value.selection() == {**before.selection(), "no_build": True, "no_binary": ["torch"]}
    assert value.as_value() == {"extras": ["x"], "no_build": True, "no_binary": ["Torch"]}
    assert uv_options(table)["--no-build"] == (no_build, True)
    assert uv_options(table)["--no-binary-package"] == (no_binary, None)
    read = _Selection(table)
    for option, given in (("--extra", "x"), ("--no-build", None), ("--no-binary-package", "Torch")):
        read.apply(option, given)
    assert read.value(install_project=False, package=None) == {
        "extras": ["x"],
        "no_build": True,
        "no_binary": ["Torch"],
        "locked": True,  # a `uv run` driver's lock: checked on the nodes
    }

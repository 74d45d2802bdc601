"""The settings module: every node setting read at once into a frozen value, each parsed where it
is used, booleans read one way (as uv reads its own). No Ray."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from ray_uv_plugin import settings
from ray_uv_plugin.settings import NodeSettings, VenvDirError, boolish

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["1", "true", "True", " yes ", "y", "t", "ON"])
def test_boolish_reads_true_as_uv_does(value: str) -> None:
    assert boolish(value) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "n", "f", " off "])
def test_boolish_reads_false_as_uv_does(value: str) -> None:
    assert boolish(value) is False


@pytest.mark.parametrize("value", [None, "", " ", "auto", "2", "nope"])
def test_boolish_is_none_for_anything_else(value: str | None) -> None:
    assert boolish(value) is None


def test_the_settings_are_read_at_once_and_frozen() -> None:
    environ = {name: f"value of {field}" for field, name in settings.VARIABLES.items()}
    node = NodeSettings.read(environ)
    assert dataclasses.asdict(node) == {f: f"value of {f}" for f in settings.VARIABLES}
    assert NodeSettings.read({}) == NodeSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.venv_dir = "/elsewhere"  # type: ignore[misc]


def test_every_field_has_its_variable() -> None:
    names = [f.name for f in dataclasses.fields(NodeSettings)]
    assert names == list(settings.VARIABLES)
    assert len(set(settings.VARIABLES.values())) == len(names)


def test_defaults_where_unset() -> None:
    node = NodeSettings()
    assert node.venv_dir_path() == settings.DEFAULT_VENV_DIR.expanduser()
    assert node.uv_binary() is None
    assert node.build_timeout_s() == settings.DEFAULT_BUILD_TIMEOUT
    assert node.max_builds_at_once(lambda: 3) == 3
    assert node.budget_bytes() is None
    assert node.trusted_group_name() is None
    assert node.failed_build_memo_s() == settings.DEFAULT_FAILED_BUILD_MEMO
    assert node.ships() and node.ships_seeds()


def test_values_as_set() -> None:
    node = NodeSettings(
        venv_dir="/venvs",
        uv="/bin/uv",
        build_timeout="90",
        max_builds="2",
        venv_dir_max_bytes="1.5G",
        trusted_group=" ray ",
        failed_build_memo="0",
        ship="off",
        ship_seeds="no",
    )
    assert node.venv_dir_path() == Path("/venvs")
    assert node.uv_binary() == "/bin/uv"
    assert node.build_timeout_s() == 90.0
    assert node.max_builds_at_once(lambda: 3) == 2
    assert node.budget_bytes() == int(1.5 * 1024**3)
    assert node.trusted_group_name() == "ray"
    assert node.failed_build_memo_s() == 0.0
    assert not node.ships() and not node.ships_seeds()


def test_a_bad_setting_fails_only_what_reads_it() -> None:
    node = NodeSettings(build_timeout="soon", venv_dir="venvs", max_builds="lots")
    assert node.budget_bytes() is None  # the others are still read
    with pytest.raises(VenvDirError, match="RAY_UV_PLUGIN_BUILD_TIMEOUT_S='soon' must be"):
        node.build_timeout_s()
    with pytest.raises(VenvDirError, match="RAY_UV_PLUGIN_VENV_DIR='venvs' is relative"):
        node.venv_dir_path()
    with pytest.raises(VenvDirError, match=r"'lots' must be a whole number .* cores \(3\)"):
        node.max_builds_at_once(lambda: 3)
    with pytest.raises(ValueError, match="RAY_UV_PLUGIN_FAILED_BUILD_MEMO_S='-1' must be"):
        NodeSettings(failed_build_memo="-1").failed_build_memo_s()


def _truth_words(node: ast.AST) -> bool:
    """A literal collection that spells out boolean words: a parser of its own."""
    if not isinstance(node, ast.Tuple | ast.List | ast.Set):
        return False
    words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return bool(words & {"true", "false"})


SPELLED_OUT: set[str] = set()


def test_booleans_are_parsed_only_here() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for root in (ROOT / "ray_uv_plugin", ROOT / "worker_groups")
        for path in sorted(root.rglob("*.py"))
        if path.name != "settings.py" and path.relative_to(ROOT).as_posix() not in SPELLED_OUT
        for node in ast.walk(ast.parse(path.read_text()))
        if _truth_words(node)
    ]
    assert not found, found

"""The keys of the committed benchmark sets and of representative selections, pinned: a change
to how the selection is written or parsed must key every venv as before, or venvs built before
it are never found again. The node's inputs (interpreter, uv, the image's packages) are fixed;
the rest is the sets' bytes and the values as a user writes them. No Ray, no uv run."""

import json
import shutil
from pathlib import Path

import pytest

from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec

SETS = Path(__file__).resolve().parents[2] / "benchmarks" / "sets"
INTERPRETER = "cpython-3.11.9 (main) [GCC 12]-x86_64-linux-/usr/bin/python3.11"
UV = "uv 0.9.0"
JOB_ENV = {"MYLIB_FLAVOR": "cuda", "MAX_JOBS": "2"}

# (set, the uv_project value, its key), computed before the selection was derived from the
# field table.
PINNED = [
    ("big", {}, "087919c6160ee006"),
    ("big", {"extras": ["big"]}, "7a5b4e5862082584"),
    ("torch", {}, "0f1656f18a105f00"),
    ("torch", {"extras": ["torch"]}, "7562859bc6db4b72"),
    ("torch", {"extras": ["Torch"], "groups": ["Dev", "docs"]}, "c2e0367ddcb62047"),
    ("big", {"all_extras": True}, "df7ecb5b4e38a5ff"),
    ("big", {"all_extras": True, "no_extras": ["big"]}, "aae5e4a28d447aff"),
    (
        "big",
        {"no_default_groups": True, "all_groups": True, "no_groups": ["dev"]},
        "e770d57c0138ff69",
    ),
    ("big", {"only_groups": ["lint"]}, "83c00166b1824929"),
    ("big", {"frozen": True, "no_default_groups": True}, "6df297dbe92cdf84"),
    ("big", {"locked": False}, "5d5ea41453280d7c"),
    ("big", {"package": "Bench_Big", "extras": ["big"]}, "e9ed237d9364e81f"),
    ("torch", {"extras": ["torch"], "from_image": ["Torch", "numpy"]}, "27abe7aff9fe6526"),
    ("torch", {"extras": ["torch"], "build_env_vars": ["MYLIB_FLAVOR"]}, "12fd9719263f78ef"),
    (
        "torch",
        {"extras": ["torch"], "job_default": True, "project": "elsewhere"},
        "7562859bc6db4b72",
    ),
]


def _fingerprint(named, dirs=None):
    """The image's packages as a fixed node has them."""
    return [
        [name, "1.0", "/usr/lib/python3/dist-packages", f"sha-{name}"] for name in sorted(named)
    ]


@pytest.fixture
def pinned_node(tmp_path, monkeypatch):
    """Each set copied to a fixed place, with no uv or keyed variable of the node's own."""
    from ray_uv_plugin.env.uv_env import BUILD_VARS

    for name in list(__import__("os").environ):
        if name.startswith("UV_") or name in BUILD_VARS:
            monkeypatch.delenv(name)
    monkeypatch.setattr("ray_uv_plugin.env.key.interpreter_tag", lambda: INTERPRETER)
    monkeypatch.setattr("ray_uv_plugin.env.key.uv_version", lambda: UV)
    monkeypatch.setattr("ray_uv_plugin.env.image.fingerprint", _fingerprint)
    for one in SETS.iterdir():
        shutil.copytree(one, tmp_path / one.name)
    return tmp_path


@pytest.mark.parametrize(("name", "value", "key"), PINNED, ids=[f"{n}-{v}" for n, v, _ in PINNED])
def test_the_key_of_a_set_and_selection_is_pinned(pinned_node, name, value, key):
    request = make_request(parse_spec(value), load_project(pinned_node / name), JOB_ENV)
    assert request.key == key


def test_every_committed_set_is_pinned():
    assert {name for name, _, _ in PINNED} == {p.name for p in SETS.iterdir() if p.is_dir()}


# The selection's JSON, as the key and the marker record it, for values that set every field
# (`install_project` keys the project's path too, so its key is not pinned above).
SELECTIONS = [
    (
        {},
        (
            '{"extras": [], "all_extras": false, "groups": [], "no_default_groups": false, '
            '"locked": true, "frozen": false, "install_project": false}'
        ),
    ),
    (
        {"extras": ["Fig", "b_c"], "no_extras": ["X"], "groups": ["Dev"], "no_groups": ["t"]},
        (
            '{"extras": ["b-c", "fig"], "all_extras": false, "groups": ["dev"], '
            '"no_default_groups": false, "locked": true, "frozen": false, '
            '"install_project": false, "no_extras": ["x"], "no_groups": ["t"]}'
        ),
    ),
    (
        {"all_extras": True, "all_groups": True, "no_default_groups": True},
        (
            '{"extras": [], "all_extras": true, "groups": [], "no_default_groups": true, '
            '"locked": true, "frozen": false, "install_project": false, "all_groups": true}'
        ),
    ),
    (
        {"only_groups": ["lint", "Docs"], "package": "My_Pkg", "frozen": True},
        (
            '{"extras": [], "all_extras": false, "groups": [], "no_default_groups": false, '
            '"locked": false, "frozen": true, "install_project": false, '
            '"only_groups": ["docs", "lint"], "package": "my-pkg"}'
        ),
    ),
    (
        {"locked": False, "install_project": True, "project": "p", "job_default": True},
        (
            '{"extras": [], "all_extras": false, "groups": [], "no_default_groups": false, '
            '"locked": false, "frozen": false, "install_project": true}'
        ),
    ),
    (
        {"from_image": ["Torch"], "build_env_vars": ["PATH", "CMAKE_ARGS", "PATH"]},
        (
            '{"extras": [], "all_extras": false, "groups": [], "no_default_groups": false, '
            '"locked": true, "frozen": false, "install_project": false, '
            '"build_env_vars": ["CMAKE_ARGS", "PATH"], "from_image": ["torch"]}'
        ),
    ),
]


@pytest.mark.parametrize(("value", "expected"), SELECTIONS, ids=[str(v) for v, _ in SELECTIONS])
def test_the_selection_json_is_pinned(value, expected):
    assert json.dumps(parse_spec(value).selection()) == expected

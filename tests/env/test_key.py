"""The content key: what changes it, and what must not. No Ray."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ray_uv_plugin.env.key import KeyInputs, make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.env.uv_env import UvEnvError
from ray_uv_plugin.settings import UV_ENV_VAR
from tests.support.uvproject import write_project


def venv_key(spec, files, env_vars=None) -> str:
    return make_request(spec, files, env_vars or {}).key


def test_key_follows_content_not_location(tmp_path):
    a = write_project(tmp_path / "a", ["six"], extras={"fig": ["pyfiglet"]})
    b = tmp_path / "b"
    shutil.copytree(a, b)
    key = venv_key(parse_spec({}), load_project(a))
    assert len(key) == 16
    # Same bytes elsewhere (another Ray session's working_dir copy): the same venv.
    assert venv_key(parse_spec({}), load_project(b)) == key
    # Code that is not installed changes nothing.
    (b / "train.py").write_text("print('hi')\n")
    assert venv_key(parse_spec({}), load_project(b)) == key
    # What is installed changes the key.
    assert venv_key(parse_spec({"extras": ["fig"]}), load_project(a)) != key
    assert venv_key(parse_spec({"no_default_groups": True}), load_project(a)) != key
    assert venv_key(parse_spec({"frozen": True}), load_project(a)) != key
    (b / "uv.lock").write_bytes((b / "uv.lock").read_bytes() + b"\n")
    assert venv_key(parse_spec({}), load_project(b)) != key


def test_installed_project_pins_its_path(tmp_path):
    a = write_project(tmp_path / "a", ["six"])
    b = tmp_path / "b"
    shutil.copytree(a, b)
    spec = parse_spec({"install_project": True})
    assert venv_key(spec, load_project(a)) != venv_key(spec, load_project(b))


# --- Every input that changes what is installed: keyed, controlled, or refused. ---

KEYED_VARS = {
    "UV_NO_DEV": "1",  # drops the dev group
    "UV_NO_INSTALL_PROJECT": "1",
    "UV_NO_EDITABLE": "1",  # editable sources become copies
    "MAX_JOBS": "3",  # a build variable of packages built from source
}
# They change where and how packages are fetched, never what a locked install of wheels holds
# (the uv cache is the node's alone: tests/env/test_uv_cache.py).
NOT_KEYED_VARS = {
    "UV_INDEX_URL": "https://example.invalid/simple",
    "HTTPS_PROXY": "http://proxy.invalid:3128",
    "UV_HTTP_TIMEOUT": "5",
    "UV_INDEX_MYIDX_PASSWORD": "s3cret-password",
    "UV_LINK_MODE": "copy",
    "UV_RUN_RECURSION_DEPTH": "2",
}


@pytest.fixture(scope="module")
def six_project(tmp_path_factory) -> Path:
    return write_project(tmp_path_factory.mktemp("k") / "proj", ["six"])


@pytest.fixture
def clean_env(monkeypatch) -> pytest.MonkeyPatch:
    """No variable under test in the node environment (`uv run` sets some of them)."""
    for name in [*KEYED_VARS, *NOT_KEYED_VARS, "UV_CONFIG_FILE", UV_ENV_VAR]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def key_with(files, where: str, monkeypatch, env: dict[str, str], spec=None) -> str:
    """The key with `env` given as runtime_env env_vars, or set in the node's environment."""
    spec = spec or parse_spec({})
    if where == "env_vars":
        return venv_key(spec, files, env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return venv_key(spec, files)


@pytest.mark.parametrize("where", ["env_vars", "node"])
@pytest.mark.parametrize("name", sorted(KEYED_VARS))
def test_vars_that_steer_the_install_are_keyed(six_project, clean_env, where, name):
    """A job setting UV_NO_DEV=1 (or MAX_JOBS for a source build) gets a venv of its own instead
    of building the one that every job without it reuses."""
    files = load_project(six_project)
    plain = venv_key(parse_spec({}), files)
    assert key_with(files, where, clean_env, {name: KEYED_VARS[name]}) != plain


@pytest.mark.parametrize("where", ["env_vars", "node"])
@pytest.mark.parametrize("name", sorted(NOT_KEYED_VARS))
def test_fetch_settings_are_not_keyed(six_project, clean_env, where, name):
    """Indexes, proxies, timeouts, credentials and link mode give the same files from a lock of
    wheels: the same venv (tests/env/test_key_inputs.py shows the index case with real
    builds; tests/env/test_source_builds.py a lock that builds from source)."""
    files = load_project(six_project)
    plain = venv_key(parse_spec({}), files)
    value = NOT_KEYED_VARS[name]
    assert key_with(files, where, clean_env, {name: value}) == plain
    # A credential must not even reach the inputs recorded in the venv's marker.
    inputs = make_request(parse_spec({}), files, {name: value}).inputs.as_json()
    assert "s3cret" not in json.dumps(inputs)


@pytest.mark.parametrize("where", ["env_vars", "node"])
def test_uv_config_file_is_keyed_by_content(six_project, clean_env, tmp_path, where):
    """The same UV_CONFIG_FILE path with other content installs differently: another key."""
    files = load_project(six_project)
    plain = venv_key(parse_spec({}), files)
    config = tmp_path / "extra-uv.toml"
    config.write_text("no-binary-package = ['six']\n")
    first = key_with(files, where, clean_env, {"UV_CONFIG_FILE": str(config)})
    assert first != plain
    config.write_text("no-build-isolation = true\n")
    assert key_with(files, where, clean_env, {"UV_CONFIG_FILE": str(config)}) != first


def test_relative_uv_config_file_is_keyed_by_the_file_uv_reads(six_project, clean_env, tmp_path):
    """uv runs in the project dir, so a relative UV_CONFIG_FILE names the project's file: the
    key must follow that file (or the value must be refused), not a file of the same name in
    whatever directory the plugin runs in."""
    proj = tmp_path / "proj"
    shutil.copytree(six_project, proj)
    (proj / "uv-extra.toml").write_text("no-binary-package = ['six']\n")
    elsewhere = tmp_path / "agent-cwd"
    elsewhere.mkdir()
    (elsewhere / "uv-extra.toml").write_text("# a decoy of the same name\n")
    clean_env.chdir(elsewhere)

    def key() -> str:
        return venv_key(parse_spec({}), load_project(proj), {"UV_CONFIG_FILE": "uv-extra.toml"})

    try:
        before = key()
    except UvEnvError as e:  # refusing a relative path is a fine decision too
        assert "UV_CONFIG_FILE" in str(e)
        return
    (proj / "uv-extra.toml").write_text("no-build-isolation = true\n")
    assert key() != before


@pytest.mark.parametrize("where", ["env_vars", "node"])
def test_symlink_link_mode_is_refused(six_project, clean_env, where):
    """A venv of symlinks into a (private, cleanable) uv cache would break under every later
    job that shares its key."""
    with pytest.raises(UvEnvError, match=r"UV_LINK_MODE='symlink'.*hardlink, copy, clone"):
        key_with(load_project(six_project), where, clean_env, {"UV_LINK_MODE": "symlink"})


def test_uv_toml_beside_the_project_is_keyed_by_content(six_project, tmp_path):
    """uv reads a uv.toml beside pyproject.toml before [tool.uv]; by its bytes, not its path."""
    a = tmp_path / "a" / "proj"
    shutil.copytree(six_project, a)
    plain = venv_key(parse_spec({}), load_project(a))
    (a / "uv.toml").write_text("no-binary-package = ['six']\n")
    with_toml = venv_key(parse_spec({}), load_project(a))
    assert with_toml != plain
    # The same project and uv.toml elsewhere (another session's working_dir): the same venv.
    b = tmp_path / "b" / "proj"
    shutil.copytree(a, b)
    assert venv_key(parse_spec({}), load_project(b)) == with_toml
    (b / "uv.toml").write_text("no-build-isolation = true\n")
    assert venv_key(parse_spec({}), load_project(b)) != with_toml


def test_uv_toml_above_is_keyed_only_where_uv_reads_it(six_project, tmp_path):
    """uv walks up from the project to the first uv.toml or pyproject.toml with [tool.uv]: a
    project without [tool.uv] takes the uv.toml above it; one with [tool.uv] stops there."""
    parent = tmp_path / "parent"
    with_tool_uv = parent / "with"
    shutil.copytree(six_project, with_tool_uv)
    without = parent / "without"
    shutil.copytree(six_project, without)
    text = (without / "pyproject.toml").read_text()
    (without / "pyproject.toml").write_text(text.split("\n[tool.uv]")[0] + "\n")
    assert "[tool" not in (without / "pyproject.toml").read_text()
    keys = {p: venv_key(parse_spec({}), load_project(p)) for p in (with_tool_uv, without)}

    (parent / "uv.toml").write_text("no-binary-package = ['six']\n")
    assert venv_key(parse_spec({}), load_project(with_tool_uv)) == keys[with_tool_uv]
    above = venv_key(parse_spec({}), load_project(without))
    assert above != keys[without]
    (parent / "uv.toml").write_text("no-build-isolation = true\n")
    assert venv_key(parse_spec({}), load_project(without)) not in (above, keys[without])


@pytest.mark.parametrize("where", ["beside", "above"])
def test_the_scratch_project_of_locked_false_gets_the_keyed_uv_toml(six_project, tmp_path, where):
    """`locked: false` re-locks in a private copy (`build.scratch_project`): the uv.toml that
    the key holds, beside the project or above it, goes with the copy, by the file's path."""
    from ray_uv_plugin.building.steps import scratch_project

    proj = tmp_path / "parent" / "proj"
    shutil.copytree(six_project, proj)
    text = (proj / "pyproject.toml").read_text()
    (proj / "pyproject.toml").write_text(text.split("\n[tool.uv]")[0] + "\n")
    config = (proj if where == "beside" else proj.parent) / "uv.toml"
    config.write_text("no-binary-package = ['six']\n")
    request = make_request(parse_spec({"locked": False}), load_project(proj), {})
    assert [c.path for c in request.config_files] == [config]
    scratch = scratch_project(request, tmp_path)
    assert (scratch / "uv.toml").read_text() == config.read_text()
    assert (scratch / "uv.lock").read_bytes() == (proj / "uv.lock").read_bytes()


def _uv_wrapper(path: Path, version: str | None) -> Path:
    """A uv that answers `--version` with `version` (the real one if None) and is the real uv
    otherwise. A fresh file: `uv_version` caches per binary path, mtime and size."""
    answer = f'[ "$1" = --version ] && echo "uv {version}" && exit 0\n' if version else ""
    path.write_text(f'#!/bin/sh\n{answer}exec {find_uv()} "$@"\n')
    path.chmod(0o755)
    return path


def test_uv_version_is_keyed(six_project, clean_env, tmp_path):
    """Another uv may install the same lock differently (layout, scripts, metadata)."""
    files = load_project(six_project)
    real = venv_key(parse_spec({}), files)
    same = _uv_wrapper(tmp_path / "uv-same", None)
    clean_env.setenv(UV_ENV_VAR, str(_uv_wrapper(tmp_path / "uv-99", "99.0.0")))
    assert venv_key(parse_spec({}), files) != real
    # By version, not by the binary's path: a wrapper around the same uv keeps the key.
    clean_env.setenv(UV_ENV_VAR, str(same))
    assert venv_key(parse_spec({}), files) == real


MYLIB_PYPROJECT = """\
[project]
name = "mylib"
version = "0.1.0"
requires-python = ">=3.11"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"
"""


def write_with_mylib(directory: Path, editable: bool, value: int = 1) -> Path:
    """`directory/proj` (ray + six) depending on `directory/mylib` as `path = "../mylib"`."""
    lib = directory / "mylib"
    (lib / "mylib").mkdir(parents=True)
    (lib / "pyproject.toml").write_text(MYLIB_PYPROJECT)
    (lib / "mylib" / "__init__.py").write_text(f"VALUE = {value}\n")
    proj = write_project(directory / "proj", ["six", "mylib"], lock=False)
    with open(proj / "pyproject.toml", "a") as f:
        flag = str(editable).lower()
        f.write(f'\n[tool.uv.sources]\nmylib = {{ path = "../mylib", editable = {flag} }}\n')
    subprocess.run([find_uv(), "lock", "--project", str(proj), "--quiet"], check=True, timeout=300)
    return proj


def test_non_editable_directory_source_is_keyed_by_content(tmp_path):
    """uv copies (builds) a non-editable path source into the venv: an edit in ../mylib needs a
    new venv, though uv.lock and pyproject.toml do not change."""
    proj = write_with_mylib(tmp_path, editable=False)
    assert 'source = { directory = "../mylib" }' in (proj / "uv.lock").read_text()
    before = venv_key(parse_spec({}), load_project(proj))
    (tmp_path / "mylib" / "mylib" / "__init__.py").write_text("VALUE = 2\n")
    assert venv_key(parse_spec({}), load_project(proj)) != before
    # Bytecode and VCS noise are not part of what a build reads.
    (tmp_path / "mylib" / ".git").mkdir()
    (tmp_path / "mylib" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    after = venv_key(parse_spec({}), load_project(proj))
    (tmp_path / "mylib" / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    assert venv_key(parse_spec({}), load_project(proj)) == after


def test_editable_source_is_keyed_by_path_not_content(tmp_path):
    """An editable source is read live from ../mylib: edits need no new venv, but the venv
    points at that path, so the path is in the key."""
    proj = write_with_mylib(tmp_path, editable=True)
    assert 'source = { editable = "../mylib" }' in (proj / "uv.lock").read_text()
    request = make_request(parse_spec({}), load_project(proj), {})
    assert request.inputs.project_path == str(proj.resolve())
    assert request.inputs.copied_sources == ()
    (tmp_path / "mylib" / "mylib" / "__init__.py").write_text("VALUE = 2\n")
    assert venv_key(parse_spec({}), load_project(proj)) == request.key


# --- The key and the marker's record of its inputs, pinned: a venv built before a
# change of this code must be found again after it. The node-dependent inputs (interpreter, uv)
# are fixed here, the rest is the project's bytes and the request's settings. ---

PINNED_PYPROJECT = b"""\
[project]
name = "pinned"
version = "0.1.0"
requires-python = ">=3.11"
dependencies = ["six"]

[project.optional-dependencies]
fig = ["pyfiglet"]
"""
PINNED_LOCK = b"""\
version = 1
requires-python = ">=3.11"

[[package]]
name = "six"
version = "1.17.0"
source = { registry = "https://pypi.org/simple" }
"""
PINNED_UV_TOML = b"no-build-isolation-package = ['six']\n"
PINNED_INTERPRETER = "cpython-3.12.0 (main) [GCC 12]-x86_64-linux-/usr/bin/python3.12"
PINNED_UV = "uv 0.9.0"
PINNED_KEY = "58c34c57c3f60838"
PINNED_MARKER_INPUTS = """\
{
 "selection": {
  "extras": [
   "fig"
  ],
  "all_extras": false,
  "groups": [
   "dev"
  ],
  "no_default_groups": true,
  "locked": true,
  "frozen": false,
  "install_project": false
 },
 "pyproject": "3622d80d0bb63d212507855f0625c0f6f58b14990941ebeed8634e0d0bd65c84",
 "lock": "de0a4bd2b65bc5f9b157d6cbdcbc8056b460f9273a31fead7d06a9242d25b82f",
 "config": [
  [
   "uv.toml",
   "ee7e6d4b5c55df6bbfbf5987c86fe2de2dbacb62de11dd5d5d45c57ea133547f"
  ]
 ],
 "copied_sources": [],
 "interpreter": "cpython-3.12.0 (main) [GCC 12]-x86_64-linux-/usr/bin/python3.12",
 "uv": "uv 0.9.0",
 "env": [
  [
   "MAX_JOBS",
   "2"
  ],
  [
   "UV_COMPILE_BYTECODE",
   "1"
  ],
  [
   "UV_NO_DEV",
   "1"
  ]
 ],
 "project_path": null
}"""


@pytest.fixture
def pinned_request(tmp_path, monkeypatch):
    """A request with fixed inputs: no uv or keyed variable from the node's environment."""
    from ray_uv_plugin.env.uv_env import BUILD_VARS

    for name in list(os.environ):
        if name.startswith("UV_") or name in BUILD_VARS:
            monkeypatch.delenv(name)
    monkeypatch.setattr("ray_uv_plugin.env.key.interpreter_tag", lambda: PINNED_INTERPRETER)
    monkeypatch.setattr("ray_uv_plugin.env.key.uv_version", lambda: PINNED_UV)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_bytes(PINNED_PYPROJECT)
    (proj / "uv.lock").write_bytes(PINNED_LOCK)
    (proj / "uv.toml").write_bytes(PINNED_UV_TOML)
    spec = parse_spec({"extras": ["Fig"], "groups": ["dev"], "no_default_groups": True})
    return make_request(spec, load_project(proj), {"UV_NO_DEV": "1", "MAX_JOBS": "2"})


def test_the_key_of_fixed_inputs_is_pinned(pinned_request):
    assert pinned_request.key == PINNED_KEY


def test_the_marker_records_the_key_inputs_as_before(pinned_request):
    """`inputs` of the marker: the same JSON, field order included (`write_marker`)."""
    assert json.dumps(pinned_request.inputs.as_json(), indent=1) == PINNED_MARKER_INPUTS


def test_a_marker_written_before_gives_its_key_again():
    """A ship receiver reads the inputs of markers that older plugins wrote: they must give the
    venv's key (`KeyInputs.from_json`), or every venv built before would be refused."""
    recorded = KeyInputs.from_json(json.loads(PINNED_MARKER_INPUTS))
    assert recorded is not None and recorded.key == PINNED_KEY
    assert recorded.interpreter == PINNED_INTERPRETER and recorded.uv == PINNED_UV

"""The content key: what changes it, and what must not. No Ray."""

import shutil
from pathlib import Path

from ray_uv_plugin.project import load_project
from ray_uv_plugin.request import make_request
from ray_uv_plugin.spec import parse_spec
from tests.uvproject import write_project


def venv_key(spec, files, env_vars=None, root=Path("/nonexistent/venvs")) -> str:
    return make_request(spec, files, env_vars or {}, root).key


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

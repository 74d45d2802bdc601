"""A driver's `uv run` command line read as a `uv_project` value, the new spec fields, the
job-default rule and the setup's variables. No Ray; real uv where it proves the mapping exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from ray_uv_plugin.driver.hook import (
    HOOK_PATH,
    PORTABLE_HOOK,
    RAY_UV_HOOK,
    THIS_HOOK,
    hook_settings,
)
from ray_uv_plugin.driver.uv_run import read_uv_run
from ray_uv_plugin.driver.uv_run_options import IGNORED, UNMAPPABLE, split_options
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import (
    UvProjectSpecError,
    is_uv_run_interpreter,
    parse_spec,
    yields_to,
)
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.registration import UvProject
from ray_uv_plugin.schema import load_schema
from ray_uv_plugin.settings import PREVIOUS_HOOK_ENV

PY = "3.11.7"
ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = """\
[project]
name = "{name}"
version = "0.1.0"
requires-python = ">=3.11"
dependencies = {deps}

[project.optional-dependencies]
x = ["six"]
y = ["idna"]

[dependency-groups]
dev = ["pyfiglet"]
g = ["tabulate"]
"""
PACKAGE = '\n[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'


def make_project(path: Path, package: bool = True, name: str = "app", extra: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = PYPROJECT.format(name=name, deps='["packaging"]') + (PACKAGE if package else "")
    (path / "pyproject.toml").write_text(text + extra)
    if package:
        (path / "src" / name).mkdir(parents=True, exist_ok=True)
        (path / "src" / name / "__init__.py").write_text("")
    return path


def value_of(cwd: Path, *flags: str, environ: dict[str, str] | None = None) -> dict | None:
    driver = read_uv_run(["uv", "run", *flags, "python", "x.py"], cwd, environ or {}, PY)
    assert (driver.value is None) == (driver.unmappable is not None)
    return driver.value


@pytest.fixture
def app(tmp_path: Path) -> Path:
    return make_project(tmp_path / "app")


def test_no_flags_is_the_locked_project_with_itself_installed(app: Path) -> None:
    assert value_of(app) == {"project": str(app), "locked": True, "install_project": True}
    assert value_of(app / "src") == value_of(app)  # found by walking up, as uv does


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--extra", "x", "--extra=y"], {"extras": ["x", "y"]}),
        (["--all-extras", "--no-extra", "y"], {"all_extras": True, "no_extras": ["y"]}),
        (["--all-extras", "--no-all-extras"], {}),
        (["--group", "g", "--no-group", "dev"], {"groups": ["g"], "no_groups": ["dev"]}),
        (["--no-dev"], {"no_groups": ["dev"]}),  # uv: an alias of `--no-group dev`
        (["--dev"], {}),
        (["--all-groups", "--no-default-groups"], {"all_groups": True, "no_default_groups": True}),
        # --only-group / --only-dev leave the project out, so it is not installed either
        (["--only-group", "g"], {"only_groups": ["g"], "install_project": False}),
        (["--only-dev"], {"only_groups": ["dev"], "install_project": False}),
        (["--frozen"], {"frozen": True, "locked": None}),
        (["--no-sync"], {"frozen": True, "locked": None}),  # uv: --no-sync implies --frozen
        (["--locked"], {}),
        (["--locked", "--no-locked", "--frozen", "--no-frozen"], {}),
        (["--no-install-project"], {"install_project": False}),
        (["--exact"], {}),
        (["--inexact"], {}),
    ],
)
def test_selection_flags_map_exactly(app: Path, flags: list[str], expected: dict) -> None:
    base = {"project": str(app), "locked": True, "install_project": True}
    want = {k: v for k, v in {**base, **expected}.items() if v is not None and v is not False}
    assert value_of(app, *flags) == want
    parse_spec(value_of(app, *flags))  # a value the plugin takes


def test_the_groups_that_hold_the_plugin_stay_the_drivers(tmp_path: Path) -> None:
    """README "Install": the plugin in a driver group, which `uv run --group driver` syncs for
    the driver; its workers' job default leaves the group out, a default group too."""
    app = tmp_path / "app"
    app.mkdir()
    project = PYPROJECT.format(name="app", deps='["packaging"]').split("\n[dependency-groups]")[0]
    groups = '\n[dependency-groups]\ndriver = ["ray-uv-plugin", "rich"]\ndev = ["pytest"]\n'
    (app / "pyproject.toml").write_text(project + groups)
    base = {"project": str(app), "locked": True}
    assert value_of(app, "--group", "driver") == {**base, "no_groups": ["driver"]}
    assert value_of(app) == {**base, "no_groups": ["driver"]}
    assert value_of(app, "--no-group", "driver", "--group", "dev") == {
        **base,
        "groups": ["dev"],
        "no_groups": ["driver"],
    }
    (app / "pyproject.toml").write_text(
        project + '\n[dependency-groups]\ndev = ["ray-uv-plugin @ file:///wheels/x.whl"]\n'
    )
    assert value_of(app, "--all-groups") == {**base, "all_groups": True, "no_groups": ["dev"]}
    parse_spec(value_of(app, "--all-groups"))


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_options_that_do_not_change_a_locked_sync_are_ignored(app: Path, name: str) -> None:
    takes_value = IGNORED[name]
    assert value_of(app, *([name, "v"] if takes_value else [name])) == value_of(app)


@pytest.mark.parametrize("name", sorted(UNMAPPABLE))
def test_every_unmappable_option_is_named_with_why(app: Path, name: str) -> None:
    takes_value, why = UNMAPPABLE[name]
    flags = [name, "v"] if takes_value else [name]
    driver = read_uv_run(["uv", "run", "-q", *flags, "python"], app, {}, PY)
    assert driver.value is None and driver.unmappable == (" ".join(flags), why)
    assert driver.warning is not None and f"`uv run {' '.join(flags)}`" in driver.warning
    assert "keep Ray's own per-worker `uv run`" in driver.warning and "\n" not in driver.warning


def test_short_options_clusters_equals_and_the_command_start(app: Path) -> None:
    assert split_options(["uv", "run", "-qqp3.11", "-w=six", "--", "-m", "x"]) == (
        [("--quiet", None), ("--quiet", None), ("--python", "3.11"), ("--with", "six")],
        ["-m", "x"],
    )
    # uv's `-m` is a flag; the module is the command's first word.
    assert split_options(["/usr/bin/uv", "run", "-m", "pytest", "--with", "x"])[1] == [
        "pytest",
        "--with",
        "x",
    ]
    # What follows the command is the command's: `--with` there is the script's own argument.
    assert (
        value_of(app, "--extra", "x")
        == read_uv_run(
            ["uv", "run", "--extra", "x", "python", "train.py", "--with", "six"], app, {}, PY
        ).value
    )
    assert read_uv_run(["uv", "run", "-w", "six", "python"], app, {}, PY).unmappable[0] == (
        "--with six"
    )


@pytest.mark.parametrize("flags", [["--bogus"], ["-Z"], ["--extra"], ["--locked=yes"]])
def test_an_option_we_cannot_read_is_unmappable(app: Path, flags: list[str]) -> None:
    driver = read_uv_run(["uv", "run", *flags], app, {}, PY)
    assert driver.value is None and "cannot be read" in driver.unmappable[1]
    assert driver.unmappable[0] == flags[0]


@pytest.mark.parametrize(
    ("request_", "same"),
    [
        ("3.11", True),
        ("3.11.7", True),
        ("cpython@3.11.7", True),
        ("python3.11", True),
        ("3.12", False),
        ("3.11.8", False),
        ("pypy3.11", False),
        (">=3.11", False),
        ("/usr/bin/python3.11", False),
    ],
)
def test_python_maps_only_when_it_names_the_drivers_version(
    app: Path, request_: str, same: bool
) -> None:
    driver = read_uv_run(["uv", "run", "--python", request_, "python"], app, {}, PY)
    assert (driver.value == value_of(app)) is same
    if not same:
        assert driver.unmappable == (f"--python {request_}", driver.unmappable[1])
        assert "driver's Python 3.11.7" in driver.unmappable[1]


def test_the_drivers_uv_env_vars_count_as_options_and_flags_win(app: Path, tmp_path: Path) -> None:
    env = {"UV_NO_DEV": "1", "UV_FROZEN": "true", "UV_OFFLINE": "1"}
    assert value_of(app, environ=env) == {
        "project": str(app),
        "no_groups": ["dev"],
        "frozen": True,
        "install_project": True,
    }
    assert value_of(app, "--no-frozen", environ={"UV_FROZEN": "1"}) == value_of(app)
    assert value_of(app, environ={"UV_FROZEN": "0"}) == value_of(app)
    other = make_project(tmp_path / "other", package=False)
    assert value_of(app, environ={"UV_PROJECT": str(other)})["project"] == str(other)
    driver = read_uv_run(["uv", "run", "python"], app, {"UV_ISOLATED": "1"}, PY)
    assert driver.unmappable[0] == "--isolated"
    driver = read_uv_run(["uv", "run", "python"], app, {"UV_PYTHON": "3.12"}, PY)
    assert driver.unmappable[0] == "--python 3.12"


def test_project_directory_and_the_projects_own_install(tmp_path: Path) -> None:
    plain = make_project(tmp_path / "plain", package=False)
    assert value_of(plain) == {"project": str(plain), "locked": True}  # a non-package
    forced = make_project(tmp_path / "forced", package=False, extra="[tool.uv]\npackage = true\n")
    assert value_of(forced)["install_project"] is True
    off = make_project(tmp_path / "off", extra="[tool.uv]\npackage = false\n")
    assert "install_project" not in value_of(off)
    # --project, relative to where the driver runs (after --directory, which uv applied)
    assert value_of(tmp_path, "--project", "plain", "--directory", "ignored") == value_of(plain)
    assert read_uv_run(["uv", "run", "python"], Path("/"), {}, PY).unmappable[0] == "(no project)"


def test_workspace_members_map_to_the_root_and_a_package(tmp_path: Path) -> None:
    root = make_project(
        tmp_path / "ws",
        extra='[tool.uv.workspace]\nmembers = ["packages/*"]\nexclude = ["packages/skip"]\n',
    )
    member = make_project(root / "packages" / "member", name="member")
    skipped = make_project(root / "packages" / "skip", name="skip")
    in_member = value_of(member / "src")
    assert in_member == {
        "project": str(root),
        "package": "member",
        "locked": True,
        "install_project": True,
    }
    assert value_of(root, "--package", "member") == in_member
    assert value_of(root) == {"project": str(root), "locked": True, "install_project": True}
    assert value_of(skipped)["project"] == str(skipped)  # excluded: a project of its own
    driver = read_uv_run(["uv", "run", "--package", "nope", "python"], root, {}, PY)
    assert driver.unmappable == ("--package nope", f"names no member of the workspace {root}")


def _installed(venv: Path) -> list[str]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(d.metadata['Name'] for d in m.distributions())))"
    )
    out = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    ("where", "flags"),
    [
        ("app", []),
        ("app", ["--extra", "x", "--no-dev"]),
        ("app", ["--all-extras", "--no-extra", "y", "--group", "g"]),
        ("app", ["--only-group", "g"]),
        ("app", ["--all-groups", "--no-group", "dev", "--no-default-groups"]),
        ("member", ["--only-dev"]),
        ("member", []),
        ("root", ["--package", "member", "--extra", "y"]),
    ],
)
def test_the_mapped_value_syncs_what_uv_run_synced(
    tmp_path: Path, where: str, flags: list[str]
) -> None:
    """Real uv on both sides: the driver's `uv run <flags>` env and `uv sync` of the value."""
    app = make_project(tmp_path / "app")
    root = make_project(tmp_path / "root", extra='[tool.uv.workspace]\nmembers = ["member"]\n')
    make_project(root / "member", name="member")
    cwd = {"app": app, "member": root / "member", "root": root}[where]
    uv = find_uv()
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "driver-venv")}
    env.pop("VIRTUAL_ENV", None)
    ran = subprocess.run(
        [uv, "run", "-q", *flags, "--python", sys.executable, "true"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    value = read_uv_run(["uv", "run", *flags, "true"], cwd, {}, PY).value
    spec = parse_spec(value)
    env["UV_PROJECT_ENVIRONMENT"] = str(tmp_path / "plugin-venv")
    synced = subprocess.run(
        [
            uv,
            "sync",
            "-q",
            "--project",
            spec.project,
            *spec.sync_args(),
            "--python",
            sys.executable,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert synced.returncode == 0, synced.stderr
    assert _installed(tmp_path / "plugin-venv") == _installed(tmp_path / "driver-venv")


# --- the spec fields -------------------------------------------------------------------------


def test_new_fields_reach_uv_sync_and_the_key_but_job_default_does_not(tmp_path: Path) -> None:
    spec = parse_spec(
        {
            "no_extras": ["Y"],
            "all_extras": True,
            "only_groups": ["g"],
            "no_groups": ["dev"],
            "package": "Member",
            "job_default": True,
        }
    )
    assert spec.sync_args() == [
        "--all-extras",
        "--no-extra",
        "Y",
        "--only-group",
        "g",
        "--no-group",
        "dev",
        "--package",
        "Member",
        "--locked",
        "--no-install-project",
    ]
    assert parse_spec({"all_groups": True}).sync_args() == [
        "--all-groups",
        "--locked",
        "--no-install-project",
    ]
    project = make_project(tmp_path / "p", package=False)
    (project / "uv.lock").write_text("version = 1\n")
    files = load_project(project)

    def key(value: dict) -> str:
        return make_request(parse_spec(value), files, {}).key

    keys = {
        key(v)
        for v in (
            {},
            {"no_extras": ["y"]},
            {"all_groups": True},
            {"only_groups": ["g"]},
            {"no_groups": ["dev"]},
            {"package": "member"},
        )
    }
    assert len(keys) == 6  # each new field is part of the key
    assert key({"package": "Member"}) == key({"package": "member"})  # normalised
    assert key({"job_default": True}) == key({})  # the same venv, default or asked for
    # Old values keep their keys: the new fields appear in the key only when set.
    assert set(parse_spec({}).selection()) == {
        "extras",
        "all_extras",
        "groups",
        "no_default_groups",
        "locked",
        "frozen",
        "install_project",
    }


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"only_groups": ["g"], "groups": ["x"]}, "'only_groups' installs just those groups"),
        ({"only_groups": ["g"], "all_groups": True}, "cannot go with 'groups' or 'all_groups'"),
        ({"package": ""}, "uv_project.package must be the name of a workspace member"),
        ({"package": 3}, "uv_project.package must be the name"),
        ({"no_groups": "dev"}, "no_groups must be a list of strings"),
        ({"all_groups": "yes"}, "all_groups must be true or false"),
        ({"job_default": 1}, "job_default must be true or false"),
    ],
)
def test_bad_new_fields_are_refused_by_spec_and_schema(value: dict, words: str) -> None:
    with pytest.raises(UvProjectSpecError) as info:
        parse_spec(value)
    assert words in str(info.value)
    assert not jsonschema.Draft7Validator(load_schema()).is_valid(value)


@pytest.mark.parametrize(
    "value",
    [
        {"no_extras": ["y"], "all_extras": True},
        {"only_groups": ["g"], "groups": []},
        {"all_groups": True, "no_groups": ["dev"]},
        {"package": "member", "job_default": True},
    ],
)
def test_good_new_fields_pass_spec_schema_and_builder(value: dict) -> None:
    parse_spec(value)
    jsonschema.Draft7Validator(load_schema()).validate(value)
    assert UvProject(**value) == {k: v for k, v in value.items() if v}


def test_uv_run_interpreter_is_read_as_a_shell_would() -> None:
    assert is_uv_run_interpreter("uv run --extra x python")
    assert is_uv_run_interpreter("'/opt/my tools/uv' run --python 3.11 python")
    assert is_uv_run_interpreter('"/opt/my tools/uv" run python')
    assert not is_uv_run_interpreter("/opt/my tools/uv run python")  # unquoted: `/opt/my`
    assert not is_uv_run_interpreter("'uv run python")  # unbalanced
    assert not is_uv_run_interpreter("/venv/bin/python")


@pytest.mark.parametrize(
    ("runtime_env", "yields"),
    [
        ({}, None),
        ({"py_executable": ""}, "py_executable"),  # the plugin's own node-Python actors
        ({"py_executable": "/opt/py/bin/python"}, "py_executable"),
        ({"py_executable": "uv run --extra x python"}, None),  # Ray's hook: replaced
        ({"py_executable": None}, None),
        ({"pip": ["six"]}, "pip"),
        ({"uv": ["six"]}, "uv"),
        ({"conda": {"dependencies": ["six"]}}, "conda"),
        ({"pip": []}, None),
    ],
)
def test_a_job_default_yields_to_an_actors_own_interpreter(runtime_env: dict, yields) -> None:
    job_default = parse_spec({"job_default": True})
    assert yields_to(job_default, runtime_env) == yields
    assert yields_to(parse_spec({}), runtime_env) is None  # an actor's own value never yields


# --- the setup -------------------------------------------------------------------------------


def test_setup_settings_turn_rays_hook_off_and_chain_a_previous_hook() -> None:
    shell = hook_settings({}, portable=True)
    assert shell == {
        "RAY_RUNTIME_ENV_HOOK": PORTABLE_HOOK,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "PYTHONPATH": str(HOOK_PATH),
    }
    assert sorted(p.name for p in HOOK_PATH.iterdir() if p.suffix == ".py") == [
        "ray_uv_plugin_hook.py"
    ]  # PYTHONPATH adds this one module, nothing else
    again = hook_settings({**shell, "PYTHONPATH": f"{HOOK_PATH}:/mine"}, portable=True)
    assert "PYTHONPATH" not in again and PREVIOUS_HOOK_ENV not in again  # eval'd twice: same
    assert hook_settings({"PYTHONPATH": "/mine"}, portable=True)["PYTHONPATH"] == (
        f"{HOOK_PATH}:/mine"
    )
    assert hook_settings({"RAY_RUNTIME_ENV_HOOK": "my.hook"}, portable=False) == {
        "RAY_RUNTIME_ENV_HOOK": THIS_HOOK,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        PREVIOUS_HOOK_ENV: "my.hook",
    }
    # Ray's own `uv run` hook (how Ray < 2.47 turned it on) is replaced, not chained.
    assert PREVIOUS_HOOK_ENV not in hook_settings({"RAY_RUNTIME_ENV_HOOK": RAY_UV_HOOK}, True)


def test_plugin_config_shell_and_setup_driver_set_the_hook(tmp_path: Path) -> None:
    ray_uv = str(Path(sys.executable).parent / "ray-uv")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_RUNTIME_ENV_HOOK", "PYTHONPATH")}
    env["RAY_RUNTIME_ENV_HOOK"] = "my_hooks.add_tag"
    script = (
        f'eval "$({ray_uv} plugin-config --shell)" && python -c "import json, os; print(json.dumps('
        "{k: os.environ.get(k) for k in ('RAY_RUNTIME_ENV_HOOK', 'RAY_ENABLE_UV_RUN_RUNTIME_ENV', "
        "'RAY_UV_PLUGIN_PREVIOUS_HOOK', 'PYTHONPATH')}))\""
    )
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "RAY_RUNTIME_ENV_HOOK": PORTABLE_HOOK,
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_UV_PLUGIN_PREVIOUS_HOOK": "my_hooks.add_tag",
        "PYTHONPATH": str(HOOK_PATH),
    }
    # setup_driver: the same in os.environ, and Ray's constant, which Ray read at import.
    code = textwrap.dedent(
        """
        import json, os, ray, ray_uv_plugin
        from ray._private import ray_constants
        # Ray 2.44 has no `uv run` hook of its own to turn off (nor the constant).
        assert getattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)
        ray_uv_plugin.setup_driver()
        assert not ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
        assert os.environ["RAY_RUNTIME_ENV_HOOK"] == "ray_uv_plugin.driver_hook.hook"
        assert os.environ["RAY_UV_PLUGIN_PREVIOUS_HOOK"] == "my_hooks.add_tag"
        # A plugin the site registers stays, beside ours.
        assert [p["class"] for p in json.loads(os.environ["RAY_RUNTIME_ENV_PLUGINS"])] == [
            "site_plugins.Audit", "ray_uv_plugin.UvProjectPlugin"]
        """
    )
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "1"
    env["RAY_RUNTIME_ENV_PLUGINS"] = '[{"class": "site_plugins.Audit"}]'
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_portable_hook_imports_in_a_python_without_the_plugin(tmp_path: Path) -> None:
    """A `uv run` driver's venv has Ray but maybe not ray-uv-plugin: the hook still imports."""
    venv = tmp_path / "venv"
    subprocess.run([find_uv(), "venv", "-q", "--python", sys.executable, venv], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    own = Path(sys.executable).parent.parent / "lib"
    # Only packaging (Ray brings it) from this env; psutil is imported when the hook runs.
    packaging_dir = next(own.glob("python3*/site-packages/packaging"))
    (site / "packaging").symlink_to(packaging_dir)
    code = (
        "import ray_uv_plugin_hook, ray_uv_plugin; print(ray_uv_plugin_hook.hook.__module__, "
        "ray_uv_plugin.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(HOOK_PATH)}
    out = subprocess.run(
        [venv / "bin" / "python", "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "ray_uv_plugin.driver.hook",
        str(ROOT / "ray_uv_plugin" / "__init__.py"),
    ]


# --- found by the uv_run fuzzer (tests/fuzz/uv_run.py) -----------------------------------------


@pytest.mark.parametrize(
    "flags", [["--group="], ["--extra", " "], ["--only-group", ""], ["--package="]]
)
def test_a_blank_name_keeps_rays_uv_run_instead_of_a_value_every_worker_refuses(
    app: Path, flags: list[str]
) -> None:
    """`--group=` once mapped to {'groups': ['']}, which parse_spec refuses on every node."""
    driver = read_uv_run(["uv", "run", *flags, "python", "x.py"], app, {}, PY)
    assert driver.value is None
    assert driver.unmappable is not None and "names no extra, group or package" in driver.warning


WORKSPACE = 'tool = {uv = {workspace = {members = ["packages/*"]}}}\n'


@pytest.mark.parametrize(
    ("root", "member"),
    [
        (WORKSPACE, 'project = ["x"]\n'),
        ('[project]\nname = "app"\n[tool]\nuv = ["x"]\n', None),
        ('tool = {uv = {workspace = ["x"]}}\n', None),
        ('tool = {uv = {workspace = {members = ["", "/abs", "packages/*"]}}}\n', None),
        ('tool = {uv = {workspace = {members = [3], exclude = "x"}}}\n', None),
        ('tool = {uv = {workspace = {exclude = [{"" = {}}]}}}\n', None),
    ],
    ids=[
        "member-project-list",
        "tool-uv-list",
        "workspace-list",
        "bad-globs",
        "glob-types",
        "glob-table",
    ],
)
def test_a_pyproject_of_any_shape_never_fails_the_drivers_hook(
    tmp_path: Path, root: str, member: str | None
) -> None:
    """Each once raised AttributeError, ValueError (an empty glob) or NotImplementedError (an
    absolute one) out of the driver's hook, which stopped the driver."""
    (tmp_path / "pyproject.toml").write_text(root)
    member_dir = make_project(tmp_path / "packages" / "m", name="m")
    if member is not None:
        (member_dir / "pyproject.toml").write_text(member)
    for cwd in (tmp_path, member_dir):
        driver = read_uv_run(["uv", "run", "python", "x.py"], cwd, {}, PY)
        assert (driver.value is None) != (driver.unmappable is None)


@pytest.mark.parametrize(
    "flags", [["--only-dev", "--group", "g"], ["--only-group", "g", "--all-groups"]]
)
def test_a_selection_no_uv_project_value_holds_keeps_rays_uv_run(
    app: Path, flags: list[str]
) -> None:
    """`--only-dev --group g` once mapped to {'groups': ['g'], 'only_groups': ['dev']}, which
    parse_spec refuses on every node; found by the uv_run fuzzer's long run."""
    driver = read_uv_run(["uv", "run", *flags, "python", "x.py"], app, {}, PY)
    assert driver.value is None
    assert f"`uv run {' '.join(flags)}` selects what no uv_project value can" in driver.warning

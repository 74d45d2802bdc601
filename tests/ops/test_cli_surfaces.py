"""What an operator meets at the `ray-uv` prompt: other plugins kept
in `RAY_RUNTIME_ENV_PLUGINS`, advice that never deletes a shared directory, clear errors instead
of tracebacks, `--version`, closed pipes, `gc` amounts, `check --dry-run`, and a `list` that a
user can read. The real console script in a subprocess, real files; no Ray is started."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ray_uv_plugin.ops import check, demo
from ray_uv_plugin.settings import PLUGIN_CLASS, plugins_setting
from ray_uv_plugin.store import trust
from ray_uv_plugin.store.layout import MARKER, Venv
from ray_uv_plugin.store.units import format_bytes
from tests.ops.test_cli import RAY_UV, fake_venv, ray_uv
from tests.store.test_gc import du_bytes, made_by_plugin

OURS = {"class": PLUGIN_CLASS}
SITE = {"class": "site_plugins.QuotaPlugin", "priority": 5}


def venv_dir(tmp_path: Path) -> Path:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    return root


def no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr and "Error:" not in out.stderr, out.stderr


# --- plugin-config keeps the plugins a site registers ----------------------------------------


def test_plugin_config_keeps_other_plugins_and_lists_ours_once() -> None:
    """`eval "$(ray-uv plugin-config --shell)"` run twice (a profile sourced again) on a node
    whose site registers a plugin of its own: both stay, ours once (Ray refuses a plugin listed
    twice), theirs with its priority."""
    site = json.dumps([SITE])
    out = ray_uv("plugin-config", env={"RAY_RUNTIME_ENV_PLUGINS": site})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [SITE, OURS]
    script = (
        f'eval "$({RAY_UV} plugin-config --shell)" && eval "$({RAY_UV} plugin-config --shell)" '
        '&& printf %s "$RAY_RUNTIME_ENV_PLUGINS"'
    )
    env = {**os.environ, "RAY_RUNTIME_ENV_PLUGINS": site}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [SITE, OURS]


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (None, [OURS]),
        ("", [OURS]),
        (json.dumps([SITE]), [SITE, OURS]),
        (json.dumps([{**OURS, "priority": 3}, SITE]), [{**OURS, "priority": 3}, SITE]),
        (json.dumps([OURS, SITE, OURS]), [OURS, SITE]),  # listed twice: Ray would refuse it
        (json.dumps([{"class": PLUGIN_CLASS + "V2"}]), [{"class": PLUGIN_CLASS + "V2"}, OURS]),
    ],
)
def test_one_merge_for_plugin_config_and_the_demo(current: str | None, expected: list) -> None:
    """`ray-uv plugin-config` and `ray-uv demo` (its `register_plugin`) merge alike."""
    assert json.loads(plugins_setting(current)) == expected
    environ = {} if current is None else {"RAY_RUNTIME_ENV_PLUGINS": current}
    demo.register_plugin(environ)
    demo.register_plugin(environ)
    assert json.loads(environ["RAY_RUNTIME_ENV_PLUGINS"]) == expected


@pytest.mark.parametrize("value", ["not json", '{"class": "x"}', '["x"]', '[{"priority": 1}]'])
def test_plugin_config_refuses_a_value_ray_cannot_read(value: str) -> None:
    for args in (["plugin-config"], ["plugin-config", "--shell"]):
        out = ray_uv(*args, env={"RAY_RUNTIME_ENV_PLUGINS": value})
        assert out.returncode == 1 and out.stdout == ""  # `eval` gets nothing half-made
        assert out.stderr.startswith(f"error: RAY_RUNTIME_ENV_PLUGINS={value!r} is not what Ray")
        assert "fix or unset it" in out.stderr
        no_traceback(out)


# --- trust advice: fix modes, remove only what the plugin makes again ------------------------


def test_a_world_writable_parent_gets_chmod_advice_not_remove(tmp_path: Path) -> None:
    """`/shared` (or any parent) others can write: chmod it; removing it would delete a mount."""
    shared = tmp_path / "wwp"
    shared.mkdir()
    shared.chmod(0o777)
    root = shared / "venvs"
    root.mkdir(mode=0o700)
    out = ray_uv("list", env={"RAY_UV_PLUGIN_VENV_DIR": str(root)})
    assert out.returncode == 1
    assert f"refusing a directory above the venv dir {root}: {shared}: others can write it" in (
        out.stderr
    )
    assert f"`chmod o-w {shared}`" in out.stderr and f"`chmod +t {shared}`" in out.stderr
    assert f"remove {shared}" not in out.stderr and "rebuilt" not in out.stderr
    shared.chmod(0o775)
    with pytest.raises(trust.UntrustedPathError) as info:
        trust.check_root(root)
    assert "its group can write it" in str(info.value)
    assert f"`chmod g-w {shared}`" in str(info.value)
    assert f"remove {shared}" not in str(info.value)


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_an_open_venv_dir_gets_chmod_700_not_remove(tmp_path: Path, mode: int) -> None:
    root = venv_dir(tmp_path)
    root.chmod(mode)
    with pytest.raises(trust.UntrustedPathError) as info:
        trust.check_root(root)
    message = str(info.value)
    assert f"refusing the venv dir {root}" in message
    assert f"`chmod 700 {root}`" in message
    assert "remove" not in message


def test_a_venv_dir_that_is_a_file_is_not_to_be_removed(tmp_path: Path) -> None:
    """RAY_UV_PLUGIN_VENV_DIR set to a file by mistake (a config file, say): never "remove it"."""
    precious = tmp_path / "settings.toml"
    precious.write_text("x = 1\n")
    out = ray_uv("list", env={"RAY_UV_PLUGIN_VENV_DIR": str(precious)})
    assert out.returncode == 1
    assert f"the venv dir {precious} is not a directory" in out.stderr
    assert "set RAY_UV_PLUGIN_VENV_DIR to a directory" in out.stderr
    assert "remove" not in out.stderr


def test_only_a_venv_of_the_dir_is_to_be_removed(tmp_path: Path) -> None:
    """A `<key>` venv or its marker that others can write: remove that venv (the plugin builds
    it again), never the marker alone (the venv would be used without it being checked)."""
    root = venv_dir(tmp_path)
    venv = fake_venv(root, "0" * 16, "/srv/p", [], 1)
    venv.chmod(0o777)
    with pytest.raises(trust.UntrustedPathError) as info:
        Venv(root, venv.name).check_ready()
    assert f"refusing the venv {venv}: others can write it" in str(info.value)
    assert f"remove {venv} (one venv or build lock: the plugin makes it again)" in str(info.value)
    venv.chmod(0o755)
    (venv / MARKER).chmod(0o666)
    with pytest.raises(trust.UntrustedPathError) as info:
        Venv(root, venv.name).check_ready()
    assert f"refusing the venv's marker {venv / MARKER}" in str(info.value)
    assert f"remove {venv} (one venv" in str(info.value)


# --- clear errors instead of tracebacks ------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["list"],
        ["list", "--json"],
        ["gc"],
        ["gc", "--older-than", "1", "--dry-run"],
        ["check", "--project", "examples/demo_project", "--dry-run"],
        ["check", "--project", "examples/demo_project"],
    ],
)
def test_a_venv_dir_below_a_file_is_a_clear_error(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "sub"
    out = ray_uv(*args, env={"RAY_UV_PLUGIN_VENV_DIR": str(root)})
    assert out.returncode == 1, out.stdout + out.stderr
    no_traceback(out)
    file = tmp_path / "file"
    assert f"error: uv_project: {file}, on the way to the venv dir {root}, is not a directory" in (
        out.stderr
    )
    assert "set RAY_UV_PLUGIN_VENV_DIR to a directory" in out.stderr


def test_a_venv_dir_name_too_long_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / ("x" * 300)
    for args in (["list"], ["gc"]):
        out = ray_uv(*args, env={"RAY_UV_PLUGIN_VENV_DIR": str(root)})
        assert out.returncode == 1
        no_traceback(out)
        assert f"error: cannot use the venv dir {root} (File name too long)" in out.stderr


def test_a_missing_uv_is_a_clear_error() -> None:
    for args in (["--dry-run"], []):
        out = ray_uv(
            "check",
            "--project",
            "examples/demo_project",
            *args,
            env={"RAY_UV_PLUGIN_UV": "/nonexistent/uv"},
        )
        assert out.returncode == 1
        no_traceback(out)
        assert out.stderr.startswith("error: uv_project: RAY_UV_PLUGIN_UV='/nonexistent/uv' does ")


# --- --version -------------------------------------------------------------------------------


def test_version_names_the_plugin_ray_uv_and_python_without_importing_ray() -> None:
    import ray

    from ray_uv_plugin.env.uv import find_uv, uv_version

    out = ray_uv("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"ray-uv-plugin {importlib.metadata.version('ray-uv-plugin')}",
        f"ray {ray.__version__}",
        f"{uv_version(find_uv())} at {find_uv()}",
        f"python {'.'.join(map(str, sys.version_info[:3]))} at {sys.executable}",
    ]
    code = (
        "import sys; from ray_uv_plugin.ops.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'ray' not in sys.modules, 'ray-uv --version imported ray'\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_version_says_when_uv_is_not_usable() -> None:
    out = ray_uv("--version", env={"RAY_UV_PLUGIN_UV": "/nonexistent/uv"})
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].startswith("ray-uv-plugin ")
    assert "uv: not usable: uv_project: RAY_UV_PLUGIN_UV='/nonexistent/uv' does not exist" in (
        out.stdout
    )


# --- a reader that goes away -----------------------------------------------------------------


@pytest.mark.parametrize("args", [["list"], ["list", "--json"], ["--version"], ["plugin-config"]])
def test_a_closed_pipe_ends_quietly(tmp_path: Path, args: list[str]) -> None:
    """`ray-uv list | head -1`: the reader is gone before `ray-uv` writes (here at once)."""
    fake_venv(venv_dir(tmp_path), "0" * 16, "/srv/p", [], 1)
    env = {**os.environ, "RAY_UV_PLUGIN_VENV_DIR": str(tmp_path / "venvs")}
    proc = subprocess.Popen(
        [RAY_UV, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert err == ""


# --- gc amounts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--older-than", "nan"),
        ("--older-than", "inf"),
        ("--older-than", "-1"),
        ("--older-than", "1e400"),
        ("--max-size", "nan"),
        ("--max-size", "inf"),
        ("--older-than", "two"),
    ],
)
def test_gc_refuses_amounts_that_mean_nothing(tmp_path: Path, flag: str, value: str) -> None:
    """`--older-than nan` compared false with every age: it looked accepted and kept all."""
    venv = fake_venv(venv_dir(tmp_path), "0" * 16, "/srv/old", [], days_idle=40)
    out = ray_uv("gc", flag, value, env={"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path / "venvs")})
    assert out.returncode == 2
    what = "a number" if value == "two" else "a finite number >= 0"
    assert f"ray-uv gc: error: argument {flag}: {value!r} is not {what}" in out.stderr
    assert out.stdout == "" and venv.exists()


# --- check --dry-run -------------------------------------------------------------------------


def test_check_dry_run_builds_nothing(tmp_path: Path) -> None:
    root = tmp_path / "venvs"  # not there: a dry run must not create it
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    args = ["check", "--project", "examples/demo_project", "--extra", "banner", "--dry-run"]
    out = ray_uv(*args, env=env)
    assert out.returncode == 0, out.stderr
    key = re.fullmatch(
        rf"uv_project (\w{{16}}): not built -> {re.escape(str(root))}/(\w{{16}})",
        out.stdout.splitlines()[0],
    )
    assert key is not None and key.group(1) == key.group(2)
    assert "Nothing built (--dry-run)" in out.stdout
    assert not root.exists()
    out = ray_uv(*args, "--library", "serve", env=env)
    assert out.returncode == 1
    assert "error: the env is not built here to check what serve needs" in out.stderr
    assert not root.exists()
    root.mkdir(mode=0o700)
    made_by_plugin(root, key.group(1))  # a build that died: `list` calls it incomplete
    out = ray_uv(*args, env=env)
    assert out.returncode == 0
    assert out.stdout.startswith(f"uv_project {key.group(1)}: incomplete -> {root}/")
    assert "Nothing built (--dry-run)" in out.stdout


@pytest.fixture(scope="module")
def plain_ray_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.uvproject import write_project

    return write_project(tmp_path_factory.mktemp("dry") / "proj", [])


def test_check_dry_run_reports_a_ready_env_without_touching_it(
    plain_ray_project: Path, tmp_path: Path
) -> None:
    """The same key and libraries as the check that built it; its last use stays as it was."""
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path / "venvs")}
    built = ray_uv("check", "--project", str(plain_ray_project), env=env, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    venv = Path(built.stdout.splitlines()[1].split(" -> ")[1])
    old = venv.stat().st_mtime - 3600
    os.utime(venv / MARKER, (old, old))
    dry = ray_uv("check", "--project", str(plain_ray_project), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == f"uv_project {venv.name}: ready -> {venv}"
    assert dry.stdout.splitlines()[1:] == built.stdout.splitlines()[2:]
    assert (venv / MARKER).stat().st_mtime == old
    args = ["check", "--project", str(plain_ray_project), "--dry-run", "--library", "data"]
    dry = ray_uv(*args, env=env)
    assert dry.returncode == 1 and "error: the env lacks what data needs" in dry.stderr


def test_check_dry_run_in_process_finds_the_same_key(plain_ray_project: Path) -> None:
    found = check.find_env(plain_ray_project, libraries=["serve"])
    assert found.venv.name == found.key and found.wanted == ("serve",)


# --- list: a project a user recognises, sizes that say why they do not add up, JSON ----------


SESSION = "/tmp/ray/session_2026-11-22_07-20-24_123456_4242/runtime_resources/working_dir_files"
PACKAGE = "_ray_pkg_0123456789abcdef0123456789abcdef"


def test_list_names_rays_working_dirs_by_package_and_wide_shows_the_path(tmp_path: Path) -> None:
    root = venv_dir(tmp_path)
    fake_venv(root, "1" * 16, f"{SESSION}/{PACKAGE}", ["vllm"], 1, name="rl")
    fake_venv(root, "2" * 16, f"{SESSION}/{PACKAGE}/sub/proj", [], 2, name="sub")
    fake_venv(root, "3" * 16, "/srv/mine", [], 3, name="mine")
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    rows = ray_uv("list", env=env).stdout.splitlines()
    assert [row.split()[:5] for row in rows[1:4]] == [
        ["1" * 16, "rl", "(Ray", "working_dir", "_ray_pkg_01234567)"],
        ["2" * 16, "sub", "(Ray", "working_dir", "_ray_pkg_01234567)/sub/proj"],
        ["3" * 16, "mine", "/srv/mine", "-", "-"],
    ]
    assert SESSION not in "\n".join(rows)
    wide = ray_uv("list", "--wide", env=env).stdout.splitlines()
    assert wide[1].split()[:3] == ["1" * 16, "rl", f"{SESSION}/{PACKAGE}"]
    listed = json.loads(ray_uv("list", "--json", env=env).stdout)
    assert listed["venvs"][-1]["project"] == f"{SESSION}/{PACKAGE}"


def test_list_says_why_sizes_do_not_add_up(tmp_path: Path) -> None:
    """Venvs of one project share most files as hardlinks (from uv's cache): each SIZE counts
    them, the total once, as `du` does."""
    root = venv_dir(tmp_path)
    a = fake_venv(root, "1" * 16, "/srv/a", [], 1)
    b = fake_venv(root, "2" * 16, "/srv/b", [], 2)
    os.link(a / "lib" / "blob", b / "lib" / "shared")
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(root)}
    lines = ray_uv("list", env=env).stdout.splitlines()
    footer = next(line for line in lines if line.startswith("2 venvs, "))  # then Budget, Builds
    assert footer == (
        f"2 venvs, {format_bytes(du_bytes(a, b))} in {root} (the SIZEs add up to "
        f"{format_bytes(du_bytes(a) + du_bytes(b))}: files that venvs share as hardlinks count "
        "in each SIZE, once here)"
    )
    listed = json.loads(ray_uv("list", "--json", env=env).stdout)
    assert listed["total_bytes"] == du_bytes(a, b)
    assert sum(v["size_bytes"] for v in listed["venvs"]) == du_bytes(a) + du_bytes(b)


def test_list_json_uses_null_for_unknowns_and_utc_times(tmp_path: Path) -> None:
    root = venv_dir(tmp_path)
    ready = fake_venv(root, "1" * 16, "/srv/a", ["x"], 1, name="a")
    broken = root / ("2" * 16)
    (broken / "lib").mkdir(parents=True)
    (broken / MARKER).write_text("[]")
    Venv(root, broken.name).lock.write_text("")
    listed = json.loads(ray_uv("list", "--json", env={"RAY_UV_PLUGIN_VENV_DIR": str(root)}).stdout)
    by_key = {v["key"]: v for v in listed["venvs"]}
    unknown = by_key[broken.name]
    assert unknown["state"] == "broken marker"
    assert [unknown[k] for k in ("name", "project", "extras", "groups")] == [None] * 4
    assert "?" not in json.dumps(listed)
    known = by_key[ready.name]
    assert (known["name"], known["project"], known["extras"]) == ("a", "/srv/a", ["x"])
    mtime = (ready / MARKER).stat().st_mtime
    assert known["last_used_unix"] == mtime
    assert known["last_used"] == datetime.datetime.fromtimestamp(int(mtime), datetime.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    assert known["last_used"].endswith("Z")

"""`ray-uv` as an operator runs it: a real console script in a subprocess, real files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import ray_uv_plugin
from ray_uv_plugin import cli
from ray_uv_plugin.inventory import format_bytes
from ray_uv_plugin.schema import SCHEMAS_ENV, schema_path
from ray_uv_plugin.venv_cache import MARKER
from tests.test_gc import du_bytes

RAY_UV = str(Path(sys.executable).parent / "ray-uv")
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["plugin-config", "prepare", "list", "gc", "demo"]


def ray_uv(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [RAY_UV, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_plugin_config_prints_the_value_alone_without_importing_ray() -> None:
    out = ray_uv("plugin-config")
    assert out.returncode == 0
    assert out.stdout == ray_uv_plugin.plugin_config() + "\n"
    assert json.loads(out.stdout) == [{"class": "ray_uv_plugin.UvProjectPlugin"}]
    code = (
        "import sys; from ray_uv_plugin.cli import main; main(['plugin-config'])\n"
        "assert 'ray' not in sys.modules, 'plugin-config imported ray'\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_plugin_config_shell_exports_both_settings_for_eval() -> None:
    script = (
        f'eval "$({RAY_UV} plugin-config --shell)" && '
        "python -c 'import os, json; print(json.dumps({k: os.environ[k] for k in "
        '("RAY_RUNTIME_ENV_PLUGINS", "RAY_RUNTIME_ENV_PLUGIN_SCHEMAS")}))\''
    )
    env = {k: v for k, v in os.environ.items() if k != SCHEMAS_ENV}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "RAY_RUNTIME_ENV_PLUGINS": ray_uv_plugin.plugin_config(),
        SCHEMAS_ENV: str(schema_path()),
    }
    # An operator's own schemas stay.
    env[SCHEMAS_ENV] = "/etc/ray/other.json"
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert json.loads(out.stdout)[SCHEMAS_ENV] == f"/etc/ray/other.json,{schema_path()}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    out = ray_uv(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: ray-uv {command}")
    expected = {
        "plugin-config": "--shell",
        "prepare": "--extra X",
        "list": "--json",
        "gc": "--older-than DAYS",
        "demo": "--project DIR",
    }[command]
    assert expected in out.stdout


def test_top_level_help_lists_the_commands() -> None:
    out = ray_uv("--help")
    assert out.returncode == 0
    for command in [*COMMANDS, "bench"]:
        assert command in out.stdout


def test_bench_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("benchmarks.startup")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.startup", fake)
    assert cli.main(["bench", "--help", "--repeat", "2"]) == 3
    assert seen == [["--help", "--repeat", "2"]]


def test_bench_without_the_benchmarks_says_where_they_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "benchmarks.startup", None)  # as if absent
    assert cli.main(["bench"]) == 2
    assert "run `uv run ray-uv bench` from the repository root" in capsys.readouterr().err


def fake_venv(root: Path, key: str, project: str, extras: list[str], days_idle: float) -> Path:
    venv = root / key
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "blob").write_bytes(os.urandom(200_000))
    (venv / MARKER).write_text(
        json.dumps({"key": key, "project": project, "extras": extras, "groups": []})
    )
    t = time.time() - days_idle * 86400
    os.utime(venv / MARKER, (t, t))
    return venv


def test_list_and_gc_on_a_venv_dir(tmp_path: Path) -> None:
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)}
    out = ray_uv("list", env=env)
    assert out.returncode == 0 and out.stdout.strip() == f"No venvs in {tmp_path}"
    old = fake_venv(tmp_path, "0" * 16, "/srv/old", ["vllm"], days_idle=40)
    new = fake_venv(tmp_path, "1" * 16, "/srv/new", [], days_idle=1)
    out = ray_uv("list", env=env)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "KEY",
        "PROJECT",
        "EXTRAS",
        "GROUPS",
        "SIZE",
        "LAST",
        "USE",
        "STATE",
    ]
    assert lines[1].split()[:4] == [new.name, "/srv/new", "-", "-"]  # most recent first
    assert lines[2].split()[:4] == [old.name, "/srv/old", "vllm", "-"]
    assert "40d ago" in lines[2]
    assert lines[-1] == f"2 venvs, {format_bytes(du_bytes(old, new))} in {tmp_path}"
    listed = json.loads(ray_uv("list", "--json", env=env).stdout)
    assert [v["size_bytes"] for v in listed["venvs"]] == [du_bytes(old), du_bytes(new)]

    dry = ray_uv("gc", "--older-than", "30", "--dry-run", env=env)
    assert dry.returncode == 0
    assert f"Would remove {old.name} (/srv/old): unused for 40.0 days" in dry.stdout
    assert old.exists()
    du_before = du_bytes(tmp_path)
    real = ray_uv("gc", "--older-than", "30", env=env)
    assert f"Removed {old.name} (/srv/old): unused for 40.0 days" in real.stdout
    assert f"Kept {new.name} (/srv/new): used 1d ago" in real.stdout
    assert not old.exists() and new.exists()
    freed = re.search(r"^Freed (\S+) in ", real.stdout, re.M)
    assert freed is not None
    assert freed.group(1) == format_bytes(du_before - du_bytes(tmp_path))

    bare = ray_uv("gc", env=env)
    assert new.exists()
    assert "hint: only unfinished builds and leftovers go without limits" in bare.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["gc", "--older-than", "-1"], "error: --older-than must be >= 0 days"),
        (["gc", "--max-size", "-5"], "error: --max-size must be >= 0 GB"),
        (["prepare", "--project", "/nonexistent/proj"], "does not exist: pass --project DIR"),
        (
            ["prepare", "--project", "examples/demo_project", "--extra", "banner", "--all-extras"],
            "'all_extras' already installs every extra",
        ),
        (
            ["prepare", "--project", "examples/demo_project", "--address", "127.0.0.1:1"],
            "no Ray cluster answers at 127.0.0.1:1",
        ),
        (["demo", "--project", "/nonexistent"], "cannot find examples/demo_project"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    out = ray_uv(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_demo_builds_then_reuses(tmp_path: Path) -> None:
    """The README's main job, twice, from the repo root, in a fresh venv dir."""
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path / "venvs")}
    first = ray_uv("demo", env=env, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"uv_project \w{16} \(extras=banner\): built", first.stdout)
    assert re.search(r"uv_project \w{16} \(extras=toml\): built", first.stdout)
    start = time.perf_counter()
    second = ray_uv("demo", env=env, timeout=600)
    took = time.perf_counter() - start
    assert second.returncode == 0, second.stdout + second.stderr
    assert re.search(r"uv_project \w{16} \(extras=banner\): reused", second.stdout)
    assert re.search(r"uv_project \w{16} \(extras=toml\): reused", second.stdout)
    assert took < 60
    pythons = re.findall(r"^    python: (\S+)$", second.stdout, re.M)
    packages = re.findall(r"^    packages: (.*)$", second.stdout, re.M)
    assert len(set(pythons)) == 2 and all(p.startswith(str(tmp_path / "venvs")) for p in pythons)
    by_extra = dict(zip(re.findall(r"\(extras=(\w+)\)", second.stdout), packages, strict=True))
    assert re.fullmatch(
        r"pyfiglet 1\S+, tomli-w \(not installed\), ray 2\.60\.0", by_extra["banner"]
    )
    assert re.fullmatch(r"pyfiglet \(not installed\), tomli-w 1\S+, ray 2\.60\.0", by_extra["toml"])
    assert "Ray is shut down" in second.stdout

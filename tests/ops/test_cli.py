"""`ray-uv` as an operator runs it: a real console script in a subprocess, real files."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ray_uv_plugin
from ray_uv_plugin.ops import cli, cli_make_ready
from ray_uv_plugin.schema import SCHEMAS_ENV, schema_path
from ray_uv_plugin.store.layout import MARKER, MARKER_FORMAT, Venv
from ray_uv_plugin.store.units import format_bytes
from tests.store.test_gc import du_bytes, made_by_plugin

REPO = Path(__file__).resolve().parents[2]

RAY_UV = str(Path(sys.executable).parent / "ray-uv")
ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["plugin-config", "prepare", "status", "list", "gc", "demo"]


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
        "import sys; from ray_uv_plugin.ops.cli import main; main(['plugin-config'])\n"
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
        "status": "--key KEY",
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


def test_bench_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """From anywhere in the checkout: `python -m benchmarks.startup` in a process of its own,
    the cwd kept, the checkout on the path."""
    seen: list[tuple[list[str], str]] = []

    def run(command: list[str], env: dict[str, str], check: bool) -> subprocess.CompletedProcess:
        seen.append((command, env["PYTHONPATH"]))
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.chdir(REPO / "docs")
    assert cli.main(["bench", "--help", "--repeat", "2"]) == 3
    command, path = seen[0]
    assert command == [sys.executable, "-m", "benchmarks.startup", "--help", "--repeat", "2"]
    assert path.split(os.pathsep)[0] == str(REPO)


def test_bench_without_the_benchmarks_says_where_they_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no checkout here or above
    assert cli.main(["bench"]) == 2  # no such command here: not listed either
    assert "in the source checkout only, not in the wheel" in capsys.readouterr().err


def fake_venv(
    root: Path, key: str, project: str, extras: list[str], days_idle: float, name: str = "p"
) -> Path:
    venv = root / key
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "blob").write_bytes(os.urandom(200_000))
    meta = {"key": key, "name": name, "project": project, "extras": extras, "groups": []}
    Venv.at(venv).write_marker({"format": MARKER_FORMAT, **meta})
    t = time.time() - days_idle * 86400
    os.utime(venv / MARKER, (t, t))
    return venv


def test_list_and_gc_on_a_venv_dir(tmp_path: Path) -> None:
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)}
    out = ray_uv("list", env=env)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == f"No venvs in {tmp_path}"
    old = fake_venv(tmp_path, "0" * 16, "/srv/old", ["vllm"], days_idle=40)
    new = fake_venv(tmp_path, "1" * 16, "/srv/new", [], days_idle=1)
    out = ray_uv("list", env=env)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "KEY",
        "NAME",
        "PROJECT",
        "EXTRAS",
        "GROUPS",
        "SIZE",
        "LAST",
        "USE",
        "BUILT",
        "STATE",
    ]
    assert lines[1].split()[:5] == [new.name, "p", "/srv/new", "-", "-"]  # most recent first
    assert lines[2].split()[:5] == [old.name, "p", "/srv/old", "vllm", "-"]
    assert "40d ago" in lines[2]
    assert lines[-3] == f"2 venvs, {format_bytes(du_bytes(old, new))} in {tmp_path}"
    assert lines[-2].startswith("Budget: none") and lines[-1].startswith("Builds: 0 running")
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


def test_list_piped_cuts_neither_key_nor_name_nor_path(tmp_path: Path) -> None:
    """`ray-uv list --wide | grep myproj` finds it, however long the session's working_dir
    path (without --wide, the PROJECT column names Ray's package: test_cli_surfaces)."""
    session = "/tmp/ray/session_2026-11-22_07-20-24_123456_4242/runtime_resources"
    project = f"{session}/working_dir_files/_ray_pkg_0123456789abcdef0123456789abcdef"
    venv = fake_venv(tmp_path, "2" * 16, project, ["vllm"], 1, name="my-rl-project")
    out = ray_uv("list", "--wide", env={"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)})
    (row,) = [line for line in out.stdout.splitlines() if "my-rl-project" in line]
    assert row.split()[:3] == [venv.name, "my-rl-project", project]
    listed = json.loads(
        ray_uv("list", "--json", env={"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)}).stdout
    )
    assert listed["venvs"][0]["name"] == "my-rl-project"


def test_list_and_gc_report_odd_entries_instead_of_crashing(tmp_path: Path) -> None:
    """Markers that are a directory, binary, a JSON list, another key's, or a symlink: `list`
    and `gc` report them as broken, and gc removes one only if the plugin provably made it."""
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)}
    odd = {"1" * 16: "a directory", "2" * 16: "binary", "3" * 16: "a JSON list"}
    odd |= {"4" * 16: "another key's", "5" * 16: "a symlink"}
    for key in odd:
        (tmp_path / key / "lib").mkdir(parents=True)
    (tmp_path / ("1" * 16) / MARKER).mkdir()
    (tmp_path / ("2" * 16) / MARKER).write_bytes(b"\x00\xff\xfe{")
    (tmp_path / ("3" * 16) / MARKER).write_text("[1, 2]")
    (tmp_path / ("4" * 16) / MARKER).write_text(json.dumps({"format": 1, "key": "f" * 16}))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-marker"
    elsewhere.write_text(json.dumps({"format": 1, "key": "5" * 16, "project": "/p"}))
    (tmp_path / ("5" * 16) / MARKER).symlink_to(elsewhere)
    ours = made_by_plugin(tmp_path, "6" * 16, hours=2)  # the plugin's, unchanged for 2 hours
    (ours / MARKER).write_text("[]")
    os.utime(ours, (0, 0))
    (tmp_path / "experiment.csv").write_text("run,loss\n")

    out = ray_uv("list", "--json", env=env)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    states = {v["key"]: v["state"] for v in listed["venvs"]}
    assert states == {key: "broken marker" for key in [*odd, ours.name]}
    notes = {v["key"]: v["note"] for v in listed["venvs"]}
    assert notes == {
        "1" * 16: "its marker is a directory",
        "2" * 16: "its marker is not a JSON object",
        "3" * 16: "its marker is not a JSON object",
        "4" * 16: f"its marker names key {'f' * 16!r}",
        "5" * 16: "its marker is a symlink (never followed)",
        "6" * 16: "its marker is not a JSON object",
    }
    not_ours = {v["key"]: v["not_ours"] for v in listed["venvs"]}
    assert not_ours == {
        **{key: f"no build lock {key}.lock of the plugin beside it" for key in odd},
        ours.name: None,
    }
    assert listed["others"] == [
        {"path": str(tmp_path / "experiment.csv"), "why": "not named like a venv (16 hex digits)"}
    ]
    table = ray_uv("list", env=env)
    assert table.returncode == 0, table.stderr
    assert "experiment.csv: not ours, left alone: not named like a venv" in table.stdout

    out = ray_uv("gc", "--older-than", "0", env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"Removed {'6' * 16}: broken marker: its marker is not a JSON object" in out.stdout
    assert (
        f"Kept {'1' * 16}: broken marker: its marker is a directory; not ours, left alone: "
        f"no build lock {'1' * 16}.lock of the plugin beside it"
    ) in out.stdout
    assert "experiment.csv: not ours, left alone: not named like a venv" in out.stdout
    assert sorted(os.listdir(tmp_path)) == sorted([*odd, "experiment.csv"])
    assert elsewhere.exists()


def test_list_and_gc_refuse_home_and_slash(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made_by_plugin(home, "0123456789abcdef")  # an old gc took this for a dead build
    env = {"HOME": str(home), "RAY_UV_PLUGIN_VENV_DIR": str(home)}
    for args in (["gc", "--older-than", "0"], ["list"]):
        out = ray_uv(*args, env=env)
        assert out.returncode == 1
        assert out.stderr == (
            f"error: the venv dir {home} is your home ({home}), which holds your own files: set "
            "RAY_UV_PLUGIN_VENV_DIR to the directory that holds only venvs (default "
            "~/.cache/ray-uv-plugin/venvs).\n"
        )
    assert (home / "0123456789abcdef" / "pyvenv.cfg").exists()
    out = ray_uv("list", env={"HOME": str(home), "RAY_UV_PLUGIN_VENV_DIR": "/"})
    assert out.returncode == 1 and "error: the venv dir / is above your home" in out.stderr


def test_a_failed_nodes_error_keeps_its_brackets() -> None:
    """`ray-uv prepare` prints each node's error through rich: `[default]` must survive."""
    from rich.console import Console

    from ray_uv_plugin.cluster.node_result import NodeResult

    error = "uv_project: ray[default]==2.60.0 is not in [project] dependencies: [bold]x"
    failed = NodeResult("3f2a9c1d00ff", "10.0.0.7", ok=False, seconds=1.5, error=error)
    built = NodeResult("77aa00", "10.0.0.8", ok=True, seconds=2.0, built=True, key="[red]k")
    console = Console(file=io.StringIO(), width=300, color_system=None, soft_wrap=True)
    console.print(cli_make_ready.node_line(failed))
    console.print(cli_make_ready.node_line(built))
    assert console.file.getvalue().splitlines() == [
        f"10.0.0.7 (3f2a9c1d): failed: {error}",
        "10.0.0.8 (77aa00): uv_project [red]k: built in 2.00s",
    ]


@pytest.mark.parametrize(
    ("raised", "message"),
    [
        (
            RuntimeError("Version mismatch: the cluster runs Ray 2.44.1"),
            "ray.init(address='auto') failed: RuntimeError: Version mismatch: the cluster runs "
            "Ray 2.44.1",
        ),
        (
            ConnectionError("Could not find any running Ray instance"),
            "cannot connect to a Ray cluster at 'auto' (Could not find any running Ray instance)"
            ": start one with",
        ),
    ],
)
def test_prepare_reports_a_failing_ray_init_as_what_it_is(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, message: str
) -> None:
    """Only a connection failure is called one; `prepare`'s own job runs no driver hook (Ray's
    `uv run` one is off for its `ray.init` only: a caller's own later `ray.init` keeps it)."""
    import ray
    from ray._private import ray_constants

    from ray_uv_plugin.cluster import connect

    seen: dict[str, object] = {}

    def init(**kwargs: object) -> None:
        seen.update(kwargs, ray_uv_hook=ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV)
        raise raised

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True, raising=False)
    monkeypatch.setattr(connect, "local_gcs_address", lambda target: None)  # no token check
    with pytest.raises(connect.ConnectError) as e:
        connect.connect("auto", {"working_dir": "/p"})
    assert str(e.value).startswith(message)
    assert seen["_skip_env_hook"] is True and seen["ray_uv_hook"] is False
    assert seen["runtime_env"] == {"working_dir": "/p"}
    assert ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV is True


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        # 2: the command line is wrong (argparse's, and options that do not go together)
        (["gc", "--older-than", "-1"], 2, "error: argument --older-than: '-1' is not a finite"),
        (["gc", "--max-size", "-5"], 2, "error: argument --max-size: '-5' is not a finite"),
        (["gc", "--all", "--older-than", "1"], 2, "--all removes every venv of ours"),
        (
            ["prepare", "--project", "examples/demo_project", "--extra", "banner", "--all-extras"],
            2,
            "'all_extras' already installs every extra",
        ),
        # 1: it failed while running (the project, the cluster, the venv dir)
        (["prepare", "--project", "/nonexistent/proj"], 1, "does not exist: pass --project DIR"),
        (
            ["prepare", "--project", "examples/demo_project", "--address", "127.0.0.1:1"],
            1,
            "no Ray cluster answers at 127.0.0.1:1",
        ),
        (["demo", "--project", "/nonexistent"], 1, "cannot find examples/demo_project"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], status: int, message: str) -> None:
    out = ray_uv(*args)
    assert out.returncode == status, out.stderr
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
    # Ray's own WARNING that it turned token authentication on came between the demo's lines;
    # the demo says it once, last, with what it means for a later `ray start`.
    for run in (first, second):
        assert "Token authentication is enabled" not in run.stdout + run.stderr
        if "RAY_AUTH_MODE" not in os.environ:  # Ray's default, the demo's note
            last = run.stdout.strip().splitlines()[-1]
            assert last.startswith("Ray ran this local Ray with token authentication"), last


# --- check -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain `ray==X` by default; the extra `serve` pins `ray[serve]==X`."""
    import ray

    from tests.support.uvproject import write_project

    pin = f"ray=={ray.__version__}"
    return write_project(
        tmp_path_factory.mktemp("check") / "proj",
        [pin],
        extras={"serve": [f"ray[serve]=={ray.__version__}"]},
        with_ray=False,
    )


def test_check_lists_what_each_library_misses(serve_project: Path) -> None:
    """A plain `ray` lock: every library is listed with the line to add; exit 0 unless a
    library the job uses (`--library`) is missing."""
    import ray

    out = ray_uv("check", "--project", str(serve_project), timeout=600)
    assert out.returncode == 0, out.stderr
    for lib in ("data", "serve", "tune", "train", "client"):
        assert re.search(rf"^  {lib} +MISSING", out.stdout, re.M), out.stdout
    assert f'"ray[serve]=={ray.__version__}"' in out.stdout
    assert f'"ray[train]=={ray.__version__}"' in out.stdout
    assert "hint: pass --library" in out.stdout
    # Train retries a worker group that cannot start for ever: the check fails first.
    out = ray_uv("check", "--project", str(serve_project), "--library", "train", timeout=600)
    assert out.returncode == 1
    assert "reused" in out.stdout
    assert re.search(r"^  train +MISSING \(asked for\)", out.stdout, re.M), out.stdout
    assert "error: the env lacks what train needs" in out.stderr


def test_check_passes_for_the_extra_that_has_the_library(serve_project: Path) -> None:
    out = ray_uv(
        "check",
        "--project",
        str(serve_project),
        "--extra",
        "serve",
        "--library",
        "serve",
        "--library",
        "client",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^  serve +ok \(asked for\)", out.stdout, re.M), out.stdout
    assert re.search(r"^  client +ok \(asked for\)", out.stdout, re.M), out.stdout
    assert re.search(r"^  data +MISSING", out.stdout, re.M), out.stdout
    # In-process, through main(): the same answer, by exit status.
    assert cli.main(["check", "--project", str(serve_project), "--extra", "serve"]) == 0
    assert cli.main(["check", "--project", str(serve_project), "--library", "data,serve"]) == 1


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--library", "rllib"], 2, "unknown library 'rllib': pass --library with one of"),
        (["--extra", "nope"], 1, "nope"),  # the project has no such extra: found when run
    ],
)
def test_check_bad_input_says_what_to_pass(
    serve_project: Path, args: list[str], status: int, message: str
) -> None:
    out = ray_uv("check", "--project", str(serve_project), *args, timeout=600)
    assert out.returncode == status, out.stdout + out.stderr
    assert out.stderr.startswith("error: ")
    assert message in out.stderr


def test_check_without_a_project_says_what_to_pass(tmp_path: Path) -> None:
    out = ray_uv("check", "--project", str(tmp_path))
    assert out.returncode == 1
    assert "has no pyproject.toml: pass --project DIR" in out.stderr
    help_out = ray_uv("check", "--help")
    assert help_out.returncode == 0
    assert "--library" in help_out.stdout


def test_list_says_how_each_venv_was_built(tmp_path: Path) -> None:
    """Full, seeded from which key with how many distributions, shipped with how many bytes:
    from each marker's `built`; `-` for a venv of an earlier version."""
    env = {"RAY_UV_PLUGIN_VENV_DIR": str(tmp_path)}
    how = {
        "a" * 16: {"how": "full"},
        "b" * 16: {"how": "seeded", "seed": "a" * 16, "distributions": 424, "files": 9, "bytes": 1},
        "c" * 16: {"how": "shipped", "from": "10.0.0.2", "bytes": 3 * 1024**3},
        "d" * 16: None,
    }
    for i, (key, built) in enumerate(how.items()):
        venv = fake_venv(tmp_path, key, f"/srv/p{i}", [], days_idle=i)
        if built is not None:
            Venv.at(venv).write_marker({**(Venv.at(venv).read_marker() or {}), "built": built})
    out = ray_uv("list", env=env).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line[:16] in how}
    assert " full " in rows["a" * 16]
    assert f"seeded from {'a' * 16} (424 dists)" in rows["b" * 16]
    assert "shipped (3.0GiB from 10.0.0.2)" in rows["c" * 16]
    listed = json.loads(ray_uv("list", "--json", env=env).stdout)
    assert {v["key"]: v["built"] for v in listed["venvs"]} == how

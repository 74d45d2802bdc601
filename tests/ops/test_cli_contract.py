"""`ray-uv` as `ray` and `uv` users expect it: exit status 2 for a wrong command line
and 1 for a failure while running, `--json` on `check` and `gc` as on `list`, `bench` listed
only where it runs, help that says where the docs are from a wheel, and defaults shown. The
real console script in a subprocess where the exit status is the point; no Ray is started."""

from __future__ import annotations

import email.message
import json
import os
import re
from pathlib import Path

import pytest

from ray_uv_plugin.ops import cli, cli_help
from tests.ops.test_cli import ray_uv
from tests.store.test_gc import made_by_plugin

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "examples" / "demo_project")


def venv_dir(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700, exist_ok=True)
    return {"RAY_UV_PLUGIN_VENV_DIR": str(root)}


# --- exit status -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["prepare", "--no-such-option"],  # argparse's own
        ["gc", "--older-than", "soon"],
        ["prepare", "--project", DEMO, "--interval", "5"],  # --interval without --watch
        ["prepare", "--project", DEMO, "--watch", "--json"],
        ["check", "--project", DEMO, "--dry-run", "--library", "rllib"],
        ["check", "--project", DEMO, "--dry-run", "--extra", "a", "--all-extras"],
        ["check", "--project", DEMO, "--dry-run", "--only-group", "g", "--group", "h"],
        ["gc", "--all", "--max-size", "1"],
        ["status", "--key", "0123456789abcdef", "--extra", "a"],  # a key is the env itself
    ],
)
def test_a_wrong_command_line_exits_2(tmp_path: Path, args: list[str]) -> None:
    out = ray_uv(*args, env=venv_dir(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: " in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["check", "--project", "NOPROJECT", "--dry-run"], {}, "has no pyproject.toml"),
        (["list"], {"RAY_UV_PLUGIN_VENV_DIR": "FILE"}, "is not a directory"),
        (["gc"], {"RAY_UV_PLUGIN_VENV_DIR": "FILE"}, "is not a directory"),
        (["plugin-config"], {"RAY_RUNTIME_ENV_PLUGINS": "not json"}, "is not what Ray"),
        (["check", "--project", DEMO], {"RAY_UV_PLUGIN_UV": "/nonexistent/uv"}, "does not"),
    ],
)
def test_a_failure_while_running_exits_1(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    """Before, these exited 2 as a usage error does: a script could not tell them apart."""
    (tmp_path / "file").write_text("")
    paths = {"NOPROJECT": str(tmp_path), "FILE": str(tmp_path / "file")}
    args = [paths.get(a, a) for a in args]
    env = {k: paths.get(v, v) for k, v in env.items()}
    out = ray_uv(*args, env={**venv_dir(tmp_path), **env})
    assert out.returncode == 1, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


# --- --json on check and gc ------------------------------------------------------------------

CHECK_KEYS = {
    "project",
    "key",
    "venv",
    "state",
    "note",
    "built",
    "seconds",
    "libraries",
    "wanted",
    "missing",
    "notes",
}


def test_check_dry_run_json_carries_the_key_and_state(tmp_path: Path) -> None:
    env = venv_dir(tmp_path)
    text = ray_uv("check", "--project", DEMO, "--extra", "banner", "--dry-run", env=env)
    assert text.returncode == 0, text.stderr
    out = ray_uv("check", "--project", DEMO, "--extra", "banner", "--dry-run", "--json", env=env)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)  # stdout is the JSON alone
    assert set(found) == CHECK_KEYS
    assert text.stdout.splitlines()[0] == f"uv_project {found['key']}: not built -> {found['venv']}"
    assert found["state"] == "not built" and found["project"] == DEMO
    assert (found["built"], found["seconds"], found["libraries"]) == (None, None, None)
    out = ray_uv("check", "--project", DEMO, "--dry-run", "--json", "--library", "serve", env=env)
    assert out.returncode == 1
    assert json.loads(out.stdout)["missing"] == ["serve"]


@pytest.fixture(scope="module")
def plain_ray_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.uvproject import write_project

    return write_project(tmp_path_factory.mktemp("json") / "proj", [])


def test_check_json_lists_each_library_of_the_built_env(
    plain_ray_project: Path, tmp_path: Path
) -> None:
    env = venv_dir(tmp_path)
    args = ["check", "--project", str(plain_ray_project), "--json", "--library", "serve"]
    out = ray_uv(*args, env=env, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr  # a plain `ray` lacks ray[serve]
    checked = json.loads(out.stdout)
    assert set(checked) == CHECK_KEYS
    assert checked["state"] == "ready" and isinstance(checked["built"], bool)
    assert Path(checked["venv"]).name == checked["key"] and checked["seconds"] >= 0
    serve = next(lib for lib in checked["libraries"] if lib["name"] == "serve")
    assert serve["asked"] and not serve["ok"] and serve["missing"]
    assert re.fullmatch(r"ray\[serve\]==[\d.]+", serve["requirement"])
    assert checked["missing"] == ["serve"] and checked["wanted"] == ["serve"]
    dry = json.loads(ray_uv(*args, "--dry-run", env=env).stdout)
    assert (dry["key"], dry["state"], dry["libraries"]) == (
        checked["key"],
        "ready",
        checked["libraries"],
    )


GC_KEYS = {
    "venv_dir",
    "dry_run",
    "removed",
    "kept",
    "removed_leftovers",
    "kept_leftovers",
    "others",
    "freed_bytes",
    "remaining_bytes",
}


def test_gc_json_says_what_went_and_what_stayed(tmp_path: Path) -> None:
    env = venv_dir(tmp_path)
    root = Path(env["RAY_UV_PLUGIN_VENV_DIR"])
    old = made_by_plugin(root, "a" * 16, {"project": "/srv/old"}, hours=24 * 30)
    (old / "blob").write_bytes(os.urandom(100_000))
    new = made_by_plugin(root, "b" * 16, {"project": "/srv/new"}, hours=1)
    (root / "notes.txt").write_text("mine")
    dry = ray_uv("gc", "--older-than", "7", "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert set(plan) == GC_KEYS and plan["dry_run"] is True
    assert [(v["key"], v["project"]) for v in plan["removed"]] == [(old.name, "/srv/old")]
    assert [v["key"] for v in plan["kept"]] == [new.name] and plan["kept"][0]["why"]
    assert [o["path"] for o in plan["others"]] == [str(root / "notes.txt")]
    assert plan["freed_bytes"] >= 100_000 and old.exists()
    done = json.loads(ray_uv("gc", "--older-than", "7", "--json", env=env).stdout)
    assert done["dry_run"] is False and done["removed"] == plan["removed"]
    assert not old.exists() and new.exists()


# --- bench: listed where it runs -------------------------------------------------------------


def test_bench_is_listed_only_where_the_benchmarks_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A wheel has no benchmarks (they stay in the checkout): from outside a
    checkout, as from an installed wheel, `bench` is not in the help, and `bench --help` says
    where it runs instead of failing as a listed command would."""
    monkeypatch.chdir(REPO)
    assert re.search(r"^\s+bench\s", cli.build_parser().format_help(), re.M)
    # A tree with the package but no benchmarks/ beside it: what a wheel's user stands in.
    (tmp_path / "ray_uv_plugin").mkdir()
    monkeypatch.chdir(tmp_path)
    helped = cli.build_parser().format_help()
    assert "bench" not in helped and "demo" in helped
    assert cli.main(["bench", "--help"]) == 2
    assert "in the source checkout only, not in the wheel" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["bench"])
    assert info.value.code == 2


# --- help: the docs, the defaults ------------------------------------------------------------


def test_help_says_where_the_docs_are_without_a_checkout_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    out = ray_uv("--help")
    assert out.returncode == 0
    assert "Docs: " in out.stdout and "docs/operations.md" not in out.stdout
    assert "Exit status: 0 done, 1 a failure while running" in " ".join(out.stdout.split())
    assert cli_help.docs_line() == cli_help.NO_DOCS_URL  # no [project.urls] yet

    def metadata(name: str) -> email.message.Message:
        meta = email.message.Message()
        meta["Name"] = name
        meta["Project-URL"] = "Source, https://example.org/src"
        meta["Project-URL"] = "Documentation, https://example.org/docs"
        return meta

    monkeypatch.setattr("importlib.metadata.metadata", metadata)
    assert cli_help.docs_line() == "Docs: https://example.org/docs"
    assert "Docs: https://example.org/docs" in cli.build_parser().format_help()


def test_help_shows_the_defaults() -> None:
    prepare = " ".join(ray_uv("prepare", "--help").stdout.split())
    assert "give up after S seconds (default: 3600.0)" in prepare
    assert prepare.count("(default: .)") == 1  # said once, where the help says it itself
    assert "(default: None)" not in prepare and "(default: False)" not in prepare
    check = " ".join(ray_uv("check", "--help").stdout.split())
    assert "--package P `package`: The workspace member to install" in check

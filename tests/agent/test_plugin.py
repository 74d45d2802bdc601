"""The plugin in a real local Ray: what workers get, reuse, one sync under load, bad input."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import RuntimeEnvSetupError

from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.settings import UV_ENV_VAR, VENV_DIR_ENV
from ray_uv_plugin.store.layout import MARKER
from tests.support.uvproject import CountingUv, unreachable_index, write_project


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A local Ray whose agent counts uv calls and keeps venvs in a dir of this module's own."""
    tmp = tmp_path_factory.mktemp("plugin")
    uv = CountingUv(tmp / "uvbin")
    saved = {k: os.environ.get(k) for k in (UV_ENV_VAR, VENV_DIR_ENV)}
    os.environ[UV_ENV_VAR] = str(uv.path)
    os.environ[VENV_DIR_ENV] = str(tmp / "venvs")
    project = write_project(
        tmp / "proj", ["six"], extras={"fig": ["pyfiglet"]}, groups={"lint": ["tomli-w"]}
    )
    ray.init(address="local", num_cpus=4)
    yield {"uv": uv, "project": project, "venvs": tmp / "venvs", "tmp": tmp}
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@ray.remote(num_cpus=0)
class Probe:
    def where(self) -> dict:
        import importlib.util
        import os
        import sys

        return {
            "executable": sys.executable,
            "prefix": sys.prefix,
            "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV"),
            "UV_PROJECT_ENVIRONMENT": os.environ.get("UV_PROJECT_ENVIRONMENT"),
            "RAY_UV_PLUGIN_VENV": os.environ.get("RAY_UV_PLUGIN_VENV"),
            "PATH": os.environ["PATH"],
            "has": {
                m: importlib.util.find_spec(m) is not None
                for m in ("six", "pyfiglet", "tomli_w", "pytest", "rich")
            },
        }


def probe(value) -> dict:
    actor = Probe.options(runtime_env={"uv_project": value}).remote()
    try:
        return ray.get(actor.where.remote(), timeout=180)
    finally:
        ray.kill(actor)


def ready_venvs(root: Path) -> set[str]:
    return {p.parent.name for p in root.glob(f"*/{MARKER}")}


def test_extras_and_groups_select_packages_and_the_driver_env_is_invisible(env):
    project = str(env["project"])
    with_fig = probe({"project": project, "extras": ["fig"]})
    venv = Path(with_fig["executable"]).parent.parent
    assert venv.parent == env["venvs"]
    assert with_fig["prefix"] == with_fig["RAY_UV_PLUGIN_VENV"] == str(venv)
    # Nothing invites uv in the worker to write into the shared venv.
    assert with_fig["VIRTUAL_ENV"] == with_fig["UV_PROJECT_ENVIRONMENT"] == ""
    assert with_fig["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert with_fig["has"] == {
        "six": True,
        "pyfiglet": True,
        "tomli_w": False,  # `lint` is not a default group
        "pytest": False,  # the driver has it; the worker must not
        "rich": False,
    }
    plain = probe({"project": project, "groups": ["lint"]})
    assert plain["has"]["tomli_w"] and not plain["has"]["pyfiglet"]
    assert plain["executable"] != with_fig["executable"]
    assert sys.executable != with_fig["executable"]


def test_same_spec_one_venv_two_specs_two(env):
    project = str(env["project"])
    before_syncs, before = env["uv"].syncs(), ready_venvs(env["venvs"])
    a = probe({"project": project, "extras": ["fig"], "groups": ["lint"]})
    b = probe({"project": project, "groups": ["lint"], "extras": ["FIG"]})  # same meaning
    c = probe({"project": project, "no_default_groups": True})
    assert a["executable"] == b["executable"] != c["executable"]
    assert len(ready_venvs(env["venvs"]) - before) == 2
    assert env["uv"].syncs() - before_syncs == 2


def test_sixteen_actors_at_once_cause_one_sync(env):
    project = write_project(env["tmp"] / "sixteen", ["tomli-w"])
    before = env["uv"].syncs()
    actors = [
        Probe.options(runtime_env={"uv_project": {"project": str(project)}}).remote()
        for _ in range(16)
    ]
    results = ray.get([a.where.remote() for a in actors], timeout=300)
    for a in actors:
        ray.kill(a)
    assert len({r["executable"] for r in results}) == 1
    assert all(r["has"]["tomli_w"] for r in results)
    assert env["uv"].syncs() - before == 1


def test_a_half_built_venv_is_rebuilt(env):
    project = write_project(env["tmp"] / "half", ["pyfiglet"])
    key = make_request(parse_spec({}), load_project(project), {}).key
    half = env["venvs"] / key
    (half / "bin").mkdir(parents=True)
    (half / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # what a killed build leaves
    before = env["uv"].syncs()
    got = probe({"project": str(project)})
    assert got["executable"] == str(half / "bin" / "python") and got["has"]["pyfiglet"]
    assert (half / MARKER).exists() and env["uv"].syncs() - before == 1


def _bad_projects(tmp: Path) -> dict[str, Path]:
    empty = tmp / "bad-empty"
    empty.mkdir()
    stale = write_project(tmp / "bad-stale", ["six"])
    write_project(stale, ["six", "pyfiglet"], lock=False)
    old_python = write_project(tmp / "bad-python", ["six"])
    text = (old_python / "pyproject.toml").read_text()
    (old_python / "pyproject.toml").write_text(text.replace(">=3.11", ">=3.99"))
    return {
        "empty": empty,
        "nolock": write_project(tmp / "bad-nolock", ["six"], lock=False),
        "stale": stale,
        "noray": write_project(tmp / "bad-noray", ["six"], with_ray=False),
        "oldray": write_project(tmp / "bad-oldray", ["ray==2.59.0"], with_ray=False),
        "python": old_python,
        "offline": write_project(tmp / "bad-offline", ["pyfiglet", "tomli-w", "six"]),
    }


def test_every_bad_input_fails_the_actor_clearly_and_builds_nothing(env):
    p = _bad_projects(env["tmp"])
    good = str(env["project"])
    unreachable = unreachable_index()
    cases = {
        "not a dict": ({"uv_project": ["fig"]}, "must be a dict"),
        "unknown field": ({"uv_project": {"extra": ["fig"]}}, "unknown field(s) 'extra'"),
        "wrong type": ({"uv_project": {"extras": "fig"}}, "must be a list of strings"),
        "wrong bool": ({"uv_project": {"frozen": "yes"}}, "must be true or false"),
        "locked+frozen": ({"uv_project": {"locked": True, "frozen": True}}, "exclusive"),
        "missing dir": ({"uv_project": {"project": "/nonexistent/x"}}, "does not exist"),
        "no pyproject": ({"uv_project": {"project": str(p["empty"])}}, "no pyproject.toml"),
        "no lock": ({"uv_project": {"project": str(p["nolock"])}}, "has no uv.lock"),
        "stale lock": ({"uv_project": {"project": str(p["stale"])}}, "run `uv lock`"),
        "unknown extra": (
            {"uv_project": {"project": good, "extras": ["gpu"]}},
            "unknown extra(s) gpu",
        ),
        "unknown group": (
            {"uv_project": {"project": good, "groups": ["docs"]}},
            "unknown group(s) docs",
        ),
        "no ray": ({"uv_project": {"project": str(p["noray"])}}, "holds no ray"),
        "other ray": (
            {"uv_project": {"project": str(p["oldray"])}},
            f"pins ray 2.59.0 but this node runs ray {ray.__version__}",
        ),
        "python": ({"uv_project": {"project": str(p["python"])}}, "requires-python '>=3.99'"),
        "offline": (
            {"uv_project": {"project": str(p["offline"])}, "env_vars": unreachable},
            "package index could not be reached",
        ),
        "no project": ({"uv_project": {}}, "set runtime_env 'working_dir'"),
        "project is a file": (
            {"uv_project": {"project": str(p["nolock"] / "pyproject.toml")}},
            "is a file, not a directory",
        ),
        "extra as given": (
            {"uv_project": {"project": good, "extras": ["Flash_Attn"]}},
            "unknown extra(s) Flash_Attn",
        ),
        "with pip": (
            {"uv_project": {"project": good}, "pip": ["six"]},
            "cannot be combined with runtime_env 'pip'",
        ),
        "with uv": (
            {"uv_project": {"project": good}, "uv": ["six"]},
            "cannot be combined with runtime_env 'uv'",
        ),
        "with conda": (
            {"uv_project": {"project": good}, "conda": {"dependencies": ["six"]}},
            "cannot be combined with runtime_env 'conda'",
        ),
        "with py_executable": (
            {"uv_project": {"project": good}, "py_executable": "/usr/bin/python3"},
            "cannot be combined with runtime_env 'py_executable' ('/usr/bin/python3')",
        ),
        "symlink link mode": (
            {"uv_project": {"project": good}, "env_vars": {"UV_LINK_MODE": "symlink"}},
            "UV_LINK_MODE='symlink' is not allowed",
        ),
        "refused build variable": (
            {"uv_project": {"project": good, "build_env_vars": ["PYTHONPATH"]}},
            "uv_project.build_env_vars names PYTHONPATH",
        ),
        "typo": (
            {"uv_project": {"project": good, "extra": ["fig"]}},
            "unknown field(s) 'extra' (did you mean 'extras'?)",
        ),
    }
    # The handles are kept: older Rays (2.44) lose an actor whose handle is dropped at once.
    actors = {name: Probe.options(runtime_env=env).remote() for name, (env, _) in cases.items()}
    refs = {name: actor.where.remote() for name, actor in actors.items()}
    before = ready_venvs(env["venvs"])
    start = time.monotonic()
    for name, (_, words) in cases.items():
        with pytest.raises(RuntimeEnvSetupError) as info:
            ray.get(refs[name], timeout=120)
        # The cause where the user looks: in the first 3 lines, with no traceback before it
        # (`validate`'s errors were on line 19-24, after Ray's agent's frames).
        first_lines = "\n".join(str(info.value).splitlines()[:3])
        assert words in first_lines, f"{name}: {info.value}"
        assert "Traceback" not in str(info.value), f"{name}: {info.value}"
    # Refused before Ray's pip/uv/conda set-ups spend time (a pip one used to take 50 s).
    assert time.monotonic() - start < 45
    assert ready_venvs(env["venvs"]) == before
    unfinished = [d for d in env["venvs"].iterdir() if d.is_dir() and not (d / MARKER).exists()]
    assert unfinished == []


def test_a_slow_build_does_not_hold_up_other_environments(env):
    slow_project = write_project(env["tmp"] / "slow", ["pyfiglet", "six"])
    slow = Probe.options(
        runtime_env={
            # Named in build_env_vars, so the sync sees it: the wrapper sleeps.
            "uv_project": {"project": str(slow_project), "build_env_vars": ["SLOW_UV_SECONDS"]},
            "env_vars": {"SLOW_UV_SECONDS": "10"},
        }
    ).remote()
    slow_ref = slow.where.remote()
    fast = probe({"project": str(env["project"])})  # ready since the first test
    still_building, _ = ray.wait([slow_ref], timeout=0)
    assert fast["has"]["six"] and still_building == []
    assert ray.get(slow_ref, timeout=180)["has"]["pyfiglet"]
    ray.kill(slow)


def test_a_venv_planted_by_another_user_fails_the_actor_clearly(env, other_user):
    from tests.store.test_trust import chown_tree, plant

    name, uid, gid = other_user
    project = write_project(env["tmp"] / "planted", ["tabulate"])
    key = make_request(parse_spec({}), load_project(project), {}).key
    pwned = env["tmp"] / "pwned"
    chown_tree(plant(env["venvs"], key, pwned), uid, gid)
    with pytest.raises(RuntimeEnvSetupError) as info:
        probe({"project": str(project)})
    assert f"refusing the venv {env['venvs'] / key}" in str(info.value)
    assert f"owner {name} (uid {uid})" in str(info.value)
    assert not pwned.exists()


@ray.remote(num_cpus=0)
def try_to_change_my_venv(uv: str, project: str) -> dict:
    import os
    import subprocess
    import sys
    import tempfile

    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    before = sorted(os.listdir(site))
    attempts = {
        "pip install": [uv, "pip", "install", "tabulate"],
        "sync": [uv, "sync", "--project", project, "--extra", "fig"],
    }
    with tempfile.TemporaryDirectory() as cwd:  # not inside a project that has a .venv
        rcs = {
            name: subprocess.run(cmd, capture_output=True, cwd=cwd).returncode
            for name, cmd in attempts.items()
        }
    return {"prefix": sys.prefix, "rcs": rcs, "changed": sorted(os.listdir(site)) != before}


def test_a_worker_cannot_change_the_shared_venv(env):
    """A worker's `uv pip install` finds no venv to install into, and `uv sync` of its project
    makes the project's own .venv: the shared venv, and the next worker, stay as built."""
    project = write_project(env["tmp"] / "guarded", ["six"], extras={"fig": ["pyfiglet"]})
    runtime_env = {"uv_project": {"project": str(project)}}
    got = ray.get(
        try_to_change_my_venv.options(runtime_env=runtime_env).remote(
            str(env["uv"].path), str(project)
        ),
        timeout=180,
    )
    assert got["rcs"]["pip install"] != 0 and not got["changed"]
    assert not (Path(got["prefix"]) / "lib" / "python3.11" / "site-packages" / "pyfiglet").exists()
    after = probe({"project": str(project)})
    assert after["prefix"] == got["prefix"] and not after["has"]["pyfiglet"]


def test_the_jobs_own_path_survives_after_the_venv(env):
    """env_vars={"PATH": "/opt/x:${PATH}"} works without uv_project; with it, the venv's bin
    comes first and the job's own entries stay."""
    runtime_env = {
        "uv_project": {"project": str(env["project"])},
        "env_vars": {"PATH": "/opt/job-tools:${PATH}"},
    }
    actor = Probe.options(runtime_env=runtime_env).remote()
    try:
        got = ray.get(actor.where.remote(), timeout=180)
    finally:
        ray.kill(actor)
    path = got["PATH"].split(os.pathsep)
    assert path[0] == str(Path(got["executable"]).parent)
    assert path[1] == "/opt/job-tools" and "/usr/bin" in path  # and the node's PATH after it

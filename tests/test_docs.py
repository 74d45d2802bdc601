"""The user docs stay true: the messages docs/troubleshooting.md quotes are the ones the code
raises, the runtime_envs of docs/migration.md pass the plugin's validation, the KubeRay examples
set what `ray-uv plugin-config --shell` prints and validate against KubeRay's CRDs, and the
commands of the README's install section and of the Dockerfile install the plugin into a fresh
Python."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SOURCES = (REPO / "ray_uv_plugin", REPO / "worker_groups")
# A message the page quotes from Ray itself, not from this package.
RAYS_OWN = ("Failed to install runtime_env within the timeout of <N> seconds",)

# --- docs/troubleshooting.md: every message it quotes is one the code can produce -----------

PLACEHOLDER = re.compile(r"<[^<>]+>")
HOLE = "\x00"  # where a source string interpolates a value


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level `NAME = "text"` of the sources, by name (names bound to two texts dropped),
    so that an f-string's `{VENV_DIR_ENV}` reads as the variable's name, as users see it."""
    found: dict[str, set[str]] = {}
    for tree in trees:
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.setdefault(node.targets[0].id, set()).add(node.value.value)
    return {name: texts.pop() for name, texts in found.items() if len(texts) == 1}


def _render(node: ast.AST, constants: dict[str, str]) -> str | None:
    """A string literal or f-string as text, with HOLE for each value it interpolates."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    parts = []
    for part in node.values:
        if isinstance(part, ast.Constant):
            parts.append(str(part.value))
        elif (
            isinstance(part, ast.FormattedValue)
            and isinstance(part.value, ast.Name)
            and part.value.id in constants
            and part.conversion == -1
            and part.format_spec is None
        ):
            parts.append(constants[part.value.id])
        else:
            parts.append(HOLE)
    return "".join(parts)


def source_strings(roots: tuple[Path, ...]) -> list[str]:
    """Every string literal and f-string of the Python files under `roots`, rendered."""
    trees = [
        ast.parse(path.read_text(), str(path)) for root in roots for path in root.rglob("*.py")
    ]
    constants = _constants(trees)
    rendered = (_render(node, constants) for tree in trees for node in ast.walk(tree))
    return [text for text in rendered if text]


@functools.cache
def _package_strings() -> tuple[str, ...]:
    return tuple(source_strings(SOURCES))


@functools.cache
def _ray_strings() -> tuple[str, ...]:
    import ray

    return tuple(
        source_strings((Path(ray.__file__).parent / "_private" / "runtime_env" / "agent",))
    )


def quoted_messages(page: str) -> list[str]:
    """What the page quotes as messages: each `###` heading in backticks, and each `> ` line."""
    quotes = []
    for line in page.splitlines():
        if line.startswith("### "):
            text = line[4:].strip()
            if text.startswith("`"):
                quotes.append(text.strip("`").strip())
        elif line.startswith("> "):
            quotes.append(line[2:].strip())
    return quotes


def message_pattern(quote: str) -> re.Pattern[str]:
    """The quote's own text must appear as written, and each `<...>` where the source puts a
    value (so `<path> has no uv.lock` is not found in `(<path>) has no uv.lock`)."""
    pieces = PLACEHOLDER.split(quote)
    return re.compile(HOLE.join(re.escape(p) for p in pieces))


def occurs(quote: str, strings: tuple[str, ...]) -> bool:
    pattern = message_pattern(quote)
    longest = max(PLACEHOLDER.split(quote), key=len)  # a plain search first: fast
    return any(pattern.search(text) for text in strings if longest in text)


def test_the_matcher_tells_a_message_from_a_changed_one() -> None:
    strings = tuple(source_strings(SOURCES))
    assert occurs("uv_project: <path> has no uv.lock", strings)
    assert occurs("uv_project: RAY_UV_PLUGIN_VENV_DIR=<dir> is relative", strings)
    assert not occurs("uv_project: <path> lacks a uv.lock", strings)
    # A placeholder stands for one value the code fills in, not for any text.
    assert not occurs(
        "uv_project: <path> has no pyproject.toml", ("uv_project: (\x00) has no pyproject.toml",)
    )
    assert not occurs("uv_project: RAY_UV_PLUGIN_VENV_DIRS=<dir> is relative", strings)


def test_every_message_the_troubleshooting_page_quotes_is_in_the_source() -> None:
    quotes = quoted_messages((DOCS / "troubleshooting.md").read_text())
    assert len(quotes) >= 60, quotes
    for quote in quotes:
        # Enough of the message's own text that the check means something.
        assert max(len(p.strip()) for p in PLACEHOLDER.split(quote)) >= 12, quote
    missing = [
        q for q in quotes if not occurs(q, _ray_strings() if q in RAYS_OWN else _package_strings())
    ]
    assert not missing, (
        "docs/troubleshooting.md quotes messages the code no longer produces; update the page:\n"
        + "\n".join(missing)
    )


# --- docs/migration.md: its runtime_envs are real, its `uv run` table maps as it says -------


def _code_blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page, re.S | re.M)


def runtime_envs(page: str) -> list[dict]:
    """Each runtime_env the page shows: `runtime_env=` arguments and `runtime_env = ...` in its
    Python blocks, `--runtime-env-json '...'` in its shell blocks."""
    found = []
    for block in _code_blocks(page, "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.keyword) and node.arg == "runtime_env":
                found.append(ast.literal_eval(node.value))
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "runtime_env" for t in node.targets
            ):
                found.append(ast.literal_eval(node.value))
    for block in _code_blocks(page, "bash"):
        for words in (shlex.split(line, comments=True) for line in block.splitlines()):
            found += [
                json.loads(words[i + 1])
                for i, w in enumerate(words[:-1])
                if w == "--runtime-env-json"
            ]
    return found


def test_migration_runtime_envs_pass_ray_and_the_plugin() -> None:
    from ray.runtime_env import RuntimeEnv

    from ray_uv_plugin.agent.plugin import UvProjectPlugin

    envs = runtime_envs((DOCS / "migration.md").read_text())
    before = [env for env in envs if "uv_project" not in env]
    after = [env for env in envs if "uv_project" in env]
    assert len(before) >= 5 and len(after) >= 7, envs
    for env in envs:
        RuntimeEnv(**env)  # Ray's own checks of its fields
    for env in before:
        assert {"pip", "uv", "py_executable"} & set(env), env
    for env in after:
        UvProjectPlugin.validate(env)  # what the node checks first: the value, and its siblings


def uv_run_table(page: str) -> list[tuple[str, dict]]:
    rows = re.findall(r"^\| `(uv run [^`]*)` \| `(\{.*\})` \|$", page, re.M)
    return [(command, json.loads(value)) for command, value in rows]


def test_migration_uv_run_table_is_what_the_driver_hook_maps(tmp_path: Path) -> None:
    from ray_uv_plugin.driver.uv_run import read_uv_run
    from ray_uv_plugin.env.spec import parse_spec

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "job"\nversion = "0"\n')
    rows = uv_run_table((DOCS / "migration.md").read_text())
    assert len(rows) >= 10, rows
    for command, value in rows:
        driver = read_uv_run(shlex.split(command), tmp_path, {}, "3.11.7")
        assert driver.value is not None, (command, driver.unmappable)
        mapped = {k: v for k, v in driver.value.items() if k != "project"}
        assert parse_spec(mapped) == parse_spec(value), command


# --- examples/kuberay and examples/docker ------------------------------------------------------

KUBERAY = REPO / "examples" / "kuberay" / "raycluster.yaml"
KUBERAY_JOB = REPO / "examples" / "kuberay" / "rayjob.yaml"
DOCKERFILE = REPO / "examples" / "docker" / "Dockerfile"
INSTALL_SCRIPT = REPO / "examples" / "docker" / "install-plugin.sh"
# Node settings of the example beyond the plugin's own registration: both in the one volume.
STORAGE_VARS = ("RAY_UV_PLUGIN_VENV_DIR", "UV_CACHE_DIR")
# What `ray-uv plugin-config --shell` reads from the environment it runs in.
SET_UP_VARS = (
    "RAY_RUNTIME_ENV_PLUGINS",
    "RAY_RUNTIME_ENV_PLUGIN_SCHEMAS",
    "RAY_RUNTIME_ENV_HOOK",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV",
    "RAY_UV_PLUGIN_PREVIOUS_HOOK",
    "PYTHONPATH",
)


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, f"no ARG {name}= in {DOCKERFILE}"
    return match.group(1)


def cluster_specs() -> Iterator[tuple[str, dict]]:
    """The RayCluster specs of the examples: the RayCluster's, and the one a RayJob makes."""
    import yaml

    cluster = yaml.safe_load(KUBERAY.read_text())
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    yield "raycluster", cluster["spec"]
    job = yaml.safe_load(KUBERAY_JOB.read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    yield "rayjob", job["spec"]["rayClusterSpec"]


def pod_specs() -> Iterator[tuple[str, dict]]:
    for example, spec in cluster_specs():
        yield f"{example} head", spec["headGroupSpec"]["template"]["spec"]
        for group in spec["workerGroupSpecs"]:
            yield f"{example} {group['groupName']}", group["template"]["spec"]


def plugin_config_shell() -> dict[str, str]:
    """`ray-uv plugin-config --shell` in a clean environment, as `{name: value}`."""
    env = {k: v for k, v in os.environ.items() if k not in SET_UP_VARS}
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ray-uv"), "plugin-config", "--shell"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exports = [shlex.split(line) for line in out.splitlines() if line.strip()]
    assert all(words[0] == "export" and len(words) == 2 for words in exports), out
    return dict(words[1].split("=", 1) for words in exports)


def test_kuberay_example_sets_what_plugin_config_prints() -> None:
    """Every Ray container gets exactly the plugin's set-up, with the paths it has in the image
    (the Dockerfile's PLUGIN_DIR for this checkout's package dir), and the venv dir and the uv
    cache in one mounted volume."""
    import ray

    import ray_uv_plugin

    here = str(Path(ray_uv_plugin.__file__).resolve().parent)
    in_image = dockerfile_arg("PLUGIN_DIR")
    expected = {k: v.replace(here, in_image) for k, v in plugin_config_shell().items()}
    assert "RAY_RUNTIME_ENV_PLUGINS" in expected
    specs = list(pod_specs())
    assert [name for name, _ in specs] == [
        "raycluster head", "raycluster gpu", "rayjob head", "rayjob gpu"
    ]  # fmt: skip
    for name, spec in specs:
        volumes = {v["name"] for v in spec["volumes"]}
        for container in spec["containers"]:
            env = {e["name"]: e["value"] for e in container["env"]}
            assert {k: env[k] for k in env if k not in STORAGE_VARS} == expected, name
            mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in volumes]
            for var in STORAGE_VARS:
                holding = [m for m in mounts if env[var].startswith(m.rstrip("/") + "/")]
                assert len(holding) == 1, (name, var, env[var], mounts)
            assert {m for m in mounts if env["UV_CACHE_DIR"].startswith(m + "/")} == {
                m for m in mounts if env["RAY_UV_PLUGIN_VENV_DIR"].startswith(m + "/")
            }, f"{name}: the uv cache and the venv dir must be on one volume (hardlinks)"
    # One Ray version throughout: the image's, the cluster's and the one the tests run.
    import yaml

    ray_version = yaml.safe_load(KUBERAY.read_text())["spec"]["rayVersion"]
    assert ray_version == ray.__version__
    assert {spec["rayVersion"] for _, spec in cluster_specs()} == {ray_version}
    assert dockerfile_arg("RAY_IMAGE").startswith(f"rayproject/ray:{ray_version}-")
    assert "python3.11" in in_image and dockerfile_arg("RAY_IMAGE").split("-")[1] == "py311"


@pytest.mark.parametrize(("path", "kind"), [(KUBERAY, "RayCluster"), (KUBERAY_JOB, "RayJob")])
def test_kuberay_examples_are_valid_objects_of_kuberays_crd(path: Path, kind: str) -> None:
    """Each example validates against its CRD's schema (KubeRay 1.6.0, the oldest with the
    token auth they use: tests/support/kuberay_crd.py), with no field the schema lacks; a
    misspelt field and a mode KubeRay does not know fail the same check."""
    import yaml

    from tests.support.kuberay_crd import KUBERAY_VERSION, validator

    check = validator(kind)
    example = yaml.safe_load(path.read_text())
    assert [e.message for e in check.iter_errors(example)] == []
    spec = example["spec"] if kind == "RayCluster" else example["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token"}
    spec["authOptions"]["mode"] = "tokens"
    spec["headGroupSpec"]["rayStartParam"] = {}
    errors = [e.message for e in check.iter_errors(example)]
    assert any("'tokens' is not one of" in e for e in errors), errors
    assert any("'rayStartParam' was unexpected" in e for e in errors), errors
    readme = (REPO / "examples" / "kuberay" / "README.md").read_text()
    assert f"KubeRay {KUBERAY_VERSION.lstrip('v')} or later" in readme
    assert f"KubeRay {KUBERAY_VERSION.lstrip('v')} or later" in path.read_text()


def test_kuberay_rayjob_runs_on_the_example_cluster_with_a_valid_uv_project() -> None:
    """The RayJob's cluster is the RayCluster example's; its runtime_env passes the plugin."""
    import yaml

    from ray_uv_plugin.env.spec import parse_spec

    (_, cluster), (_, job_cluster) = cluster_specs()
    assert job_cluster == cluster
    job = yaml.safe_load(KUBERAY_JOB.read_text())
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert parse_spec(runtime_env["uv_project"]).extras == ("vllm",)
    assert set(runtime_env) == {"working_dir", "uv_project", "config"}


def _as_user(uid: int, gid: int, action) -> int:
    """Run `action()` in a forked child with this uid and gid; its exit status: 0 done,
    3 refused as untrusted, 4 another error."""
    from ray_uv_plugin.store.trust import UntrustedPathError

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 4
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            action()
            status = 0
        except UntrustedPathError:
            status = 3
        except BaseException:  # noqa: BLE001 - reported as a status
            status = 4
        finally:
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _use_volume(venv_dir: Path, uv_cache: Path) -> None:
    """What the plugin and uv do first in the volume: make the venv dir, and uv's cache."""
    from ray_uv_plugin.store import trust

    trust.make_root(venv_dir)
    uv_cache.mkdir(parents=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="changes owners and switches users: needs root")
def test_kuberay_init_container_makes_the_volume_one_the_plugin_trusts(tmp_path: Path) -> None:
    """An emptyDir is mode 0777: the plugin refuses a venv dir in it. The example's init
    container (its command, run here on such a dir) makes it one the pod's user may use."""
    import tempfile

    for name, spec in pod_specs():
        uid, gid = spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]
        assert uid != 0 and "fsGroup" not in spec["securityContext"], name
        (init,) = spec["initContainers"]
        assert init["securityContext"]["runAsUser"] == 0
        (mount,) = init["volumeMounts"]
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        # A parent the pod's user can enter, as `/` is in the pod.
        base = Path(tempfile.mkdtemp(prefix="ray-uv-kuberay-", dir="/tmp"))
        try:
            os.chmod(base, 0o755)
            volume = base / mount["mountPath"].strip("/")
            volume.mkdir()
            os.chmod(volume, 0o777)  # as the kubelet makes an emptyDir
            venv_dir = Path(env["RAY_UV_PLUGIN_VENV_DIR"].replace(mount["mountPath"], str(volume)))
            uv_cache = Path(env["UV_CACHE_DIR"].replace(mount["mountPath"], str(volume)))
            use_volume = functools.partial(_use_volume, venv_dir, uv_cache)
            assert _as_user(uid, gid, use_volume) == 3, f"{name}: a 0777 volume was trusted"
            command = [word.replace(mount["mountPath"], str(volume)) for word in init["command"]]
            subprocess.run(command, check=True)
            assert _as_user(uid, gid, use_volume) == 0, name
            st = venv_dir.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o700), name
            assert uv_cache.stat().st_uid == uid
        finally:
            shutil.rmtree(base)


# --- installing: the README's commands and the Dockerfile's script, into a fresh Python -------


def _fresh_ray_python(where: Path, pip: bool = True) -> Path:
    """A new venv of this Python with the Ray these tests run (from uv's cache), as a node's Ray
    Python is: nothing of this project in it. Made by `python -m venv`, with pip, or, without
    `pip`, by `uv venv`, which has none."""
    import ray

    venv = where / "node-python"
    if pip:
        subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    else:
        subprocess.run(
            ["uv", "venv", "--quiet", "--python", sys._base_executable, str(venv)], check=True
        )
    python = venv / "bin" / "python"
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            str(python),
            f"ray[default]=={ray.__version__}",
        ],
        check=True,
        timeout=600,
    )
    return python


def _checkout_copy(where: Path) -> Path:
    """The repository's files as a clone has them (tracked and new, not ignored)."""
    files = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    copy = where / "ray-uv-plugin"
    for name in filter(None, files):
        source = REPO / name
        if source.is_file() and not name.startswith(("benchmarks/results/", "benchmarks/sets/")):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def readme_install_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    (block,) = _code_blocks(section, "bash")[:1]
    return [line for line in block.splitlines() if line.strip()]


def _check_installed(python: Path) -> None:
    """The CLI runs, and the plugin imports from site-packages (from `/`: not this checkout)."""
    import ray

    out = subprocess.run(
        [str(python.parent / "ray-uv"), "plugin-config"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == [{"class": "ray_uv_plugin.UvProjectPlugin"}]
    check = (
        "import ray, ray_uv_plugin.agent.plugin, worker_groups, sysconfig; "
        "assert ray_uv_plugin.__file__.startswith(sysconfig.get_paths()['purelib']); "
        "print(ray.__version__)"
    )
    out = subprocess.run(
        [str(python), "-c", check], cwd="/", capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ray.__version__  # pip kept the node's Ray


def test_readme_install_commands_install_the_plugin(tmp_path: Path) -> None:
    """Into the active venv, one made by `uv venv`: it has no pip, where `python -m pip
    install` failed."""
    commands = readme_install_commands()
    assert any("uv build" in c for c in commands)
    assert any(c.startswith("uv pip install dist/") for c in commands)
    python = _fresh_ray_python(tmp_path, pip=False)
    no_pip = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True)
    assert no_pip.returncode != 0
    checkout = _checkout_copy(tmp_path)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
    env["VIRTUAL_ENV"] = str(python.parent.parent)  # activated
    for command in commands:
        subprocess.run(["bash", "-c", command], cwd=checkout, env=env, check=True, timeout=600)
    _check_installed(python)


def test_dockerfile_install_script_installs_the_plugin(tmp_path: Path) -> None:
    """What the Dockerfile runs after its FROM, on a fresh Ray Python instead of the image's."""
    dockerfile = DOCKERFILE.read_text()
    assert "install-plugin.sh /tmp/ray-uv-dist" in dockerfile
    python = _fresh_ray_python(tmp_path)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            "uv",
            "build",
            "--wheel",
            "--quiet",
            "--out-dir",
            str(dist),
            str(_checkout_copy(tmp_path)),
        ],
        check=True,
        timeout=600,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = {**os.environ, "PYTHON": str(python), "EXPECT_PLUGIN_DIR": f"{site}/ray_uv_plugin"}
    subprocess.run(["sh", str(INSTALL_SCRIPT), str(dist)], env=env, check=True, timeout=600)
    _check_installed(python)
    # The directory check is real: a wrong PLUGIN_DIR fails the image's build.
    env["EXPECT_PLUGIN_DIR"] = "/home/ray/anaconda3/lib/python3.11/site-packages/ray_uv_plugin"
    wrong = subprocess.run(["sh", str(INSTALL_SCRIPT), str(dist)], env=env, capture_output=True)
    assert wrong.returncode == 1 and b"update PLUGIN_DIR" in wrong.stderr


def readme_did_it_work_line() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n### Did it work\n", 1)[1].split("\n### ", 1)[0]
    (block,) = _code_blocks(section, "bash")
    (line,) = block.strip().splitlines()
    return line


def test_readme_did_it_work_line_tells_a_venv_from_the_nodes_python(tmp_path: Path) -> None:
    """Run as the README says, in a project's directory: a venv's python where the plugin is
    registered, the node's own Python where it is not."""
    from tests.support.uvproject import write_project

    project = write_project(tmp_path / "proj", ["six"])
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "RAY_ADDRESS": "local",  # a Ray of its own, not one that another test started
    }

    def printed(env: dict[str, str]) -> str:
        out = subprocess.run(
            ["bash", "-c", readme_did_it_work_line()],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    venvs = Path(os.environ["RAY_UV_PLUGIN_VENV_DIR"])
    assert Path(printed(env)).parent.parent.parent == venvs
    env.pop("RAY_RUNTIME_ENV_PLUGINS")
    assert printed(env) == sys.executable


# --- the README and the docs: the quickstart's commands, links between pages -----------------

PAGES = (
    REPO / "README.md",
    *sorted(DOCS.glob("*.md")),
    REPO / "benchmarks" / "RESULTS.md",
    REPO / "benchmarks" / "HISTORY.md",
    REPO / "examples" / "kuberay" / "README.md",
)


def test_results_is_one_page_of_current_figures() -> None:
    """benchmarks/RESULTS.md holds the current figures on one page (earlier runs live in
    HISTORY.md), and each benchmark's section names the JSON in benchmarks/results/ they come
    from, so every figure there can be traced to a file that exists."""
    page = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert len(page.splitlines()) <= 350, "RESULTS.md: move earlier runs to HISTORY.md"
    for section in page.split("\n## ")[1:]:
        heading = section.splitlines()[0]
        names = re.findall(r"results/([\w.-]+\.json)", section)
        assert names, f"RESULTS.md, {heading!r}: name the JSON its figures come from"
        missing = [n for n in names if not (REPO / "benchmarks" / "results" / n).exists()]
        assert not missing, (heading, missing)


def test_readme_quickstart_keeps_its_two_commands() -> None:
    """The main job and the test command, first in the quickstart (`.ci/run` runs the latter)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    block = _code_blocks(section, "bash")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["uv run ray-uv demo", "uv run pytest"]
    assert re.search(r"^uv run pytest$", (REPO / ".ci" / "run").read_text(), re.M)


def test_readme_is_a_first_page() -> None:
    """At most 200 lines: the rest lives once in docs/, linked from it."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"


ENV_NAME = re.compile(r"`((?:RAY|UV|BAD)_[A-Z0-9_]+)`")


def _operations_node_settings() -> list[str]:
    """The variables of docs/operations.md's node-settings table, in its order."""
    page = (DOCS / "operations.md").read_text()
    table = page.split("\nNode settings (", 1)[1].split("\n\n", 2)[1]
    return [m.group(1) for m in (ENV_NAME.match(row[2:]) for row in table.splitlines()) if m]


def test_node_settings_are_one_table_that_the_code_reads() -> None:
    """docs/operations.md holds the table; the README names the first few and links it; each
    is a name the code reads or sets, and every `RAY_UV_PLUGIN_*` setting of the code is in
    the table."""
    table = _operations_node_settings()
    assert len(table) == len(set(table)) >= 15, table
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n### Node settings\n", 1)[1].split("\n### ", 1)[0]
    listed = ENV_NAME.findall(section)
    assert "|" not in section  # not a second table
    assert listed and set(listed) <= set(table), (listed, table)
    assert "(docs/operations.md#1-set-up-one-line-per-node)" in section
    code = "\n".join(_package_strings())
    assert [name for name in table if name not in code] == []
    settings = set(re.findall(r"\bRAY_UV_PLUGIN_[A-Z_]+\b", code)) - {"RAY_UV_PLUGIN_VENV"}
    assert settings <= set(table), settings - set(table)


def anchors(page: Path) -> set[str]:
    """The `#fragment`s GitHub gives the page's headings."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_between_pages_resolve(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


# --- exit statuses and counts: each one the docs state is the one the code gives -------------

STATED_IN = (REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "examples/kuberay/README.md")
EXIT_WORDS = re.compile(r"\bexit(?:s)?(?: code| status)? (\d)\b")
DEMO = str(REPO / "examples" / "demo_project")

# Command lines of `ray-uv` (arguments, env, cwd; None: an empty dir) that show each status.
SHOWN_BY: dict[str, tuple[list[str], dict[str, str], str | None]] = {
    "done": (["plugin-config"], {}, None),
    "a dry run": (["check", "--dry-run"], {}, DEMO),
    "no pyproject.toml": (["check"], {}, None),
    "an unknown extra": (["check", "--extra", "nosuch"], {}, DEMO),
    "a library it cannot check": (["check", "--dry-run", "--library", "train"], {}, DEMO),
    # The path of every failure to connect, a refused token's included (that one, with a
    # real token cluster: tests/cluster/test_token_auth.py).
    "no cluster to connect to": (
        ["prepare", "--address", "127.0.0.1:1", "--project", DEMO],
        {},
        None,
    ),
    "a bad plugins setting": (["plugin-config", "--shell"], {"RAY_RUNTIME_ENV_PLUGINS": "x"}, None),
    "a venv dir that is /": (["list"], {"RAY_UV_PLUGIN_VENV_DIR": "/"}, None),
    "an unknown option": (["gc", "--no-such-option"], {}, None),
    "an unknown library": (["check", "--library", "nosuch"], {}, DEMO),
    "a nan amount": (["gc", "--older-than", "nan"], {}, None),
    "bench outside a checkout": (["bench"], {}, "/"),
}

# Each statement of an exit status in the docs (as the page says it, whitespace aside) and the
# command lines that show the statuses it states.
EXIT_STATEMENTS: list[tuple[str, str, list[tuple[int, str]]]] = [
    ("README.md", "`ray-uv prepare` (exit 1)", [(1, "no cluster to connect to")]),
    (
        "README.md",
        "exit 1 on a failure, 2 on a wrong command line",
        [(1, "no pyproject.toml"), (2, "an unknown option")],
    ),
    (
        "docs/libraries.md",
        "It exits 1 if a library named by `--library` (repeatable, or comma-separated: "
        "`data,train`) is missing or the project cannot give the env (no `pyproject.toml`, an "
        "unknown extra), 0 otherwise, and 2 on a wrong command line (an unknown library)",
        [
            (1, "a library it cannot check"),
            (1, "no pyproject.toml"),
            (1, "an unknown extra"),
            (0, "a dry run"),
            (2, "an unknown library"),
        ],
    ),
    (
        "docs/libraries.md",
        "`ray-uv check --extra <the workers' extras> --library train` (exit 1 if the env lacks",
        [(1, "a library it cannot check")],  # a built env that lacks it: tests/ops/test_cli.py
    ),
    ("docs/operations.md", "is an error (exit 1, nothing printed", [(1, "a bad plugins setting")]),
    (
        "docs/operations.md",
        "Every `ray-uv` command exits 0 when done, 1 for a failure while running",
        [(0, "done"), (1, "no pyproject.toml")],
    ),
    ("docs/operations.md", "one message and exit code 1", [(1, "no cluster to connect to")]),
    (
        "docs/operations.md",
        "With `--library NAME` it exits 1 when that library is missing or, with no ready venv, "
        "cannot be checked",
        [(1, "a library it cannot check")],
    ),
    ("docs/operations.md", "It exits 1 and names the nodes", [(1, "no cluster to connect to")]),
    ("docs/operations.md", "exits 1 if any failed", [(1, "no cluster to connect to")]),
    ("docs/operations.md", "refuse (exit 1, with what to do)", [(1, "a venv dir that is /")]),
    ("docs/operations.md", "are usage errors, exit 2", [(2, "a nan amount")]),
    ("docs/operations.md", "`ray-uv bench` exits 2", [(2, "bench outside a checkout")]),
    (
        "docs/troubleshooting.md",
        "(exit status 1; 2 for a wrong command line)",
        [(1, "no pyproject.toml"), (2, "an unknown option")],
    ),
]


def _flat(path: Path) -> str:
    return " ".join(path.read_text().split())


def test_every_exit_status_the_docs_state_is_listed_here() -> None:
    """A new statement of an exit status gets a line in EXIT_STATEMENTS, and so a check."""
    unlisted = []
    for page in STATED_IN:
        text, name = _flat(page), str(page.relative_to(REPO))
        spans = []
        for where, words, _ in EXIT_STATEMENTS:
            if where == name:
                assert words in text, f"{name} no longer says {words!r}"
                start = text.index(words)
                spans.append(range(start, start + len(words)))
        for found in EXIT_WORDS.finditer(text):
            if not any(found.start() in span for span in spans):
                unlisted.append(f"{name}: ...{text[found.start() - 60 : found.end() + 20]}...")
    assert not unlisted, "add these to EXIT_STATEMENTS:\n" + "\n".join(unlisted)


def test_every_exit_status_the_docs_state_is_the_commands(tmp_path: Path) -> None:
    ray_uv = Path(sys.executable).parent / "ray-uv"
    empty = tmp_path / "empty"
    empty.mkdir()
    base = {k: v for k, v in os.environ.items() if k != "RAY_RUNTIME_ENV_PLUGINS"}
    base["RAY_UV_PLUGIN_VENV_DIR"] = str(tmp_path / "venvs")
    measured: dict[str, subprocess.CompletedProcess[str]] = {}
    for case, (args, env, cwd) in SHOWN_BY.items():
        measured[case] = subprocess.run(
            [str(ray_uv), *args], env={**base, **env}, cwd=cwd or empty,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    wrong = []
    for page, words, shown in EXIT_STATEMENTS:
        for status, case in shown:
            assert str(status) in words, (words, status)
            out = measured[case]
            if out.returncode != status:
                wrong.append(f"{page}: {words!r} says {status}; {case}: {out.returncode}")
    assert not wrong, "\n".join(wrong)
    assert measured["a bad plugins setting"].stdout == ""  # nothing for `eval` to run


def _ray_agent_consts() -> object:
    from ray._private.runtime_env.agent import runtime_env_consts

    return runtime_env_consts


def _counts() -> list[tuple[str, str, tuple[float, ...]]]:
    """(page, its words with `{}` for each count, the counts as the code has them)."""
    from ray._private import ray_constants

    from ray_uv_plugin.settings import DEFAULT_BUILD_TIMEOUT, DEFAULT_FAILED_BUILD_MEMO
    from ray_uv_plugin.store.build_lock import LOCK_MARGIN

    ray_agent = _ray_agent_consts()
    tries = ray_agent.RUNTIME_ENV_RETRY_TIMES  # type: ignore[attr-defined]
    apart = ray_agent.RUNTIME_ENV_RETRY_INTERVAL_MS / 1000  # type: ignore[attr-defined]
    ray_cache = ray_agent.BAD_RUNTIME_ENV_CACHE_TTL_SECONDS  # type: ignore[attr-defined]
    setup = ray_constants.DEFAULT_RUNTIME_ENV_TIMEOUT_SECONDS
    build, memo, margin = DEFAULT_BUILD_TIMEOUT, DEFAULT_FAILED_BUILD_MEMO, LOCK_MARGIN
    return [
        ("docs/guarantees.md", "tries a failing setup {} times, {} s apart", (tries, apart)),
        ("docs/troubleshooting.md", "Ray's agent tries a failing setup {} times", (tries,)),
        ("docs/guarantees.md", "is not run again for {} s", (memo,)),
        ("docs/guarantees.md", "`BAD_RUNTIME_ENV_CACHE_TTL_SECONDS` ({} s by", (ray_cache,)),
        ("docs/operations.md", "`BAD_RUNTIME_ENV_CACHE_TTL_SECONDS` | `{}` (Ray's)", (ray_cache,)),
        ("docs/operations.md", "| `RAY_UV_PLUGIN_BUILD_TIMEOUT_S` | `{}` |", (build,)),
        ("docs/operations.md", "waiting for the lock waits that plus {} s", (margin,)),
        ("docs/troubleshooting.md", "(defaults: {} and {};", (build, memo)),
        ("docs/troubleshooting.md", "within the build timeout plus {} s", (margin,)),
        ("docs/troubleshooting.md", "`setup_timeout_seconds` ({} by default)", (setup,)),
        ("docs/troubleshooting.md", "`RAY_UV_PLUGIN_BUILD_TIMEOUT_S`, {} s by default", (build,)),
        ("README.md", "Ray's `setup_timeout_seconds` ({})", (setup,)),
        ("docs/migration.md", "longer than Ray's {} s setup timeout", (setup,)),
    ]  # fmt: skip


def test_every_count_the_docs_state_is_the_codes() -> None:
    """Ray's retries and caches, the plugin's memo, timeouts and margins, as the docs give them
    and as Ray and the plugin have them."""
    wrong = []
    for page, words, counts in _counts():
        pattern = re.escape(words).replace(re.escape("{}"), r"(\d+(?:\.\d+)?)")
        found = re.search(pattern, _flat(REPO / page))
        assert found, f"{page} no longer says {words!r}"
        stated = tuple(float(n) for n in found.groups())
        if stated != tuple(float(c) for c in counts):
            wrong.append(f"{page}: {found.group(0)!r}, but the code has {counts}")
    assert not wrong, "\n".join(wrong)

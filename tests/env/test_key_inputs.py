"""What reaches a real build and what the key makes of it: real uv, real PyPI. No Ray."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import ProjectError, load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError, find_uv
from tests.env.test_key import write_with_mylib
from tests.support.uvproject import left_in, tamper_hashes, write_project

NOBODY_LISTENS = "http://127.0.0.1:9/simple"  # the discard port: connection refused at once
# uv tries every request 3 more times by default; once is enough to know nothing is there.
NO_RETRIES = {"UV_HTTP_RETRIES": "0"}


def venv_key(spec, files, env_vars=None) -> str:
    return make_request(spec, files, env_vars or {}).key


def run_python(venv: Path, code: str) -> str:
    return subprocess.run(
        [venv / "bin" / "python", "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def installed_versions(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    return {canonicalize_name(k): v for k, v in json.loads(run_python(venv, code)).items()}


def locked_versions(project: Path) -> dict[str, str]:
    """The registry packages of uv.lock, by name (the project itself is not installed)."""
    lock = tomllib.loads((project / "uv.lock").read_text())
    return {
        canonicalize_name(p["name"]): p["version"]
        for p in lock["package"]
        if "registry" in p["source"]
    }


def fake_wheel(directory: Path, name: str = "tomli_w", version: str = "99.0.0") -> Path:
    """A wheel of `name` at a version PyPI does not have: would uv pick it, we would see it."""
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "FAKE = True\n",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record += f"{path},sha256={digest.decode()},{len(text.encode())}\n"
    files[f"{dist_info}/RECORD"] = record + f"{dist_info}/RECORD,,\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_user_uv_config_of_the_node_does_not_reach_the_build(tmp_path, monkeypatch):
    """A `~/.config/uv/uv.toml` of whoever started Ray (here `no-binary = true`, which would
    make uv build Ray from source and fail) is not read: uv is pointed at config dirs that hold
    none, so the venv is the one the key says, and the key does not depend on it."""
    proj = write_project(tmp_path / "proj", ["six"])
    files = load_project(proj)
    plain = venv_key(parse_spec({}), files)
    config_home = tmp_path / "xdg"
    (config_home / "uv").mkdir(parents=True)
    (config_home / "uv" / "uv.toml").write_text("no-binary = true\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    # That this config would break a build: plain `uv sync` with it fails.
    bare = subprocess.run(
        [find_uv(), "sync", "--locked", "--no-install-project", "--dry-run"],
        cwd=proj,
        capture_output=True,
        text=True,
        env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "bare-venv")},
    )
    assert bare.returncode != 0 and "no-binary" in bare.stderr, bare.stdout + bare.stderr
    out = ensure_venv(parse_spec({}), files, root=tmp_path / "venvs")
    assert out.built and out.key == plain
    assert run_python(out.path, "import six, ray; print('ok')") == "ok"


def _can_overlay_etc() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run(
            [
                "unshare", "-m", "--propagation", "private", "sh", "-c",
                f"mount -t overlay overlay -o lowerdir={d}:/etc /etc",
            ],
            capture_output=True,
        )  # fmt: skip
    return probe.returncode == 0


@pytest.mark.skipif(not _can_overlay_etc(), reason="needs root and overlay mounts in unshare -m")
def test_system_uv_config_of_the_node_does_not_reach_the_build(tmp_path):
    """Nor does `/etc/uv/uv.toml`. uv falls back to it when `$XDG_CONFIG_DIRS` holds no
    `uv/uv.toml` (seen with `uv sync -v`: "Found system configuration in: /etc/uv/uv.toml"),
    so pointing XDG_CONFIG_DIRS at a dir without one is not enough. The /etc/uv/uv.toml here
    exists only in a private mount namespace of the build's process: nothing else sees it."""
    proj = write_project(tmp_path / "proj", ["six"])
    plain = venv_key(parse_spec({}), load_project(proj))
    layer = tmp_path / "etc-layer"
    (layer / "uv").mkdir(parents=True)
    (layer / "uv" / "uv.toml").write_text("no-binary = true\n")
    script = (
        "import sys; from pathlib import Path; "
        "from ray_uv_plugin.env.project import load_project; "
        "from ray_uv_plugin.env.spec import parse_spec; "
        "from ray_uv_plugin.building.ensure import ensure_venv; "
        f"out = ensure_venv(parse_spec({{}}), load_project(Path({str(proj)!r})), "
        f"root=Path({str(tmp_path / 'venvs')!r})); print('KEY', out.key)"
    )
    build = subprocess.run(
        [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f"mount -t overlay overlay -o lowerdir={layer}:/etc /etc && "
            f'exec "$0" -c "$1"', sys.executable, script,
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert f"KEY {plain}" in build.stdout


def test_index_urls_cannot_change_a_locked_install(tmp_path, monkeypatch):
    """Why index settings stay out of the key. Tried by hand with uv 0.13 first:

    - `uv sync --frozen` with an empty UV_CACHE_DIR and UV_INDEX_URL at a port where nothing
      listens installs the lock as it is: it downloads each file from the URL in uv.lock
      (files.pythonhosted.org) and never asks the index. A UV_FIND_LINKS dir offering a newer
      tomli-w changes nothing either.
    - `uv sync --locked` checks the lock against the configured indexes: with an unreachable
      index it fails ("Failed to fetch: http://127.0.0.1:9/simple/ray/"); with a reachable
      mirror that the lock does not name it fails with "The lockfile at `uv.lock` needs to be
      updated, but `--locked` was provided" (uv -v: "Resolving despite existing lockfile due
      to missing remote index"). An added find-links or extra index keeps the lock valid, and
      the install is then the lock's, not the newer fake.
    So an index setting gives the lock's files or an error, never another venv under the key.
    (A lock that builds from source keys them: tests/env/test_source_builds.py.)
    """
    proj = write_project(tmp_path / "proj", ["six", "tomli-w"])
    files = load_project(proj)
    locked = locked_versions(proj)
    assert {"ray", "six", "tomli-w"} <= set(locked)
    links = tmp_path / "links"
    fake_wheel(links)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "empty-cache"))  # the node's: empty
    env = {
        "UV_INDEX_URL": NOBODY_LISTENS,
        "UV_FIND_LINKS": str(links),
        **NO_RETRIES,
    }
    root = tmp_path / "venvs"
    try:
        frozen = parse_spec({"frozen": True})
        assert venv_key(frozen, files, env) == venv_key(frozen, files)
        out = ensure_venv(frozen, files, env, root=root)
        assert out.built
        installed = installed_versions(out.path)
        assert installed == {name: locked[name] for name in installed}
        assert installed["tomli-w"] == locked["tomli-w"] != "99.0.0"
        assert {"ray", "six", "tomli-w"} <= set(installed)

        strict = parse_spec({})
        assert venv_key(strict, files, env) == venv_key(strict, files)
        with pytest.raises(UvSyncError, match="could not be reached") as info:
            ensure_venv(strict, files, env, root=root)
        assert "127.0.0.1:9" in str(info.value)
        assert not (root / venv_key(strict, files)).exists()
        # Find-links alone (PyPI still there) leaves the lock valid: the lock's versions again.
        out = ensure_venv(strict, files, {"UV_FIND_LINKS": str(links)}, root=root)
        assert installed_versions(out.path)["tomli-w"] == locked["tomli-w"]
    finally:
        shutil.rmtree(tmp_path / "empty-cache", ignore_errors=True)  # ~200 MiB with Ray


def test_a_job_cannot_turn_off_the_locks_hash_check(tmp_path):
    """`UV_NO_VERIFY_HASHES` is `uv pip`'s setting: `uv sync` checks every file against the
    lock's hash whatever it says (docs/key.md), so it only keys a venv of its own."""
    project = write_project(tmp_path / "tampered", ["six"], name="tampered")
    tamper_hashes(project, "six")
    root = tmp_path / "venvs"
    with pytest.raises(UvSyncError, match="does not have the hash that uv.lock records"):
        ensure_venv(parse_spec({}), load_project(project), {"UV_NO_VERIFY_HASHES": "1"}, root=root)
    assert [Path(name).suffix for name in left_in(root)] == [".lock"]  # nothing half-built


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(directory.rglob("*"))
    }


def test_unlocked_build_never_rewrites_the_project(tmp_path):
    """`locked: false` lets uv re-lock a stale lock; it must do so outside the project (a job's
    working_dir, or a shared dir other jobs read), leaving no file changed or added there."""
    proj = write_project(tmp_path / "proj", ["six"])
    write_project(proj, ["six", "tomli-w"], lock=False)  # pyproject changed, the lock did not
    assert "tomli-w" not in (proj / "uv.lock").read_text()
    before = _snapshot(proj)
    spec = parse_spec({"locked": False})
    out = ensure_venv(spec, load_project(proj), root=tmp_path / "venvs")
    assert out.built
    assert run_python(out.path, "import tomli_w, six; print('ok')") == "ok"
    assert _snapshot(proj) == before
    # The private copy it re-locked in is gone too; it lived in the venv dir, not in /tmp,
    # where anyone's /tmp/uv.toml would have applied to it.
    assert not list((tmp_path / "venvs").glob(f"{out.key}.locked-false-*"))


def test_unlocked_build_with_editable_source_is_refused(tmp_path):
    """An editable (or relative path) source only resolves in place, so re-locking would mean
    rewriting the project's uv.lock: refused before uv runs, saying to run `uv lock`."""
    proj = write_with_mylib(tmp_path, editable=True)
    write_project(proj, ["six", "mylib", "tomli-w"], lock=False)
    with open(proj / "pyproject.toml", "a") as f:
        f.write('\n[tool.uv.sources]\nmylib = { path = "../mylib", editable = true }\n')
    before = _snapshot(proj)
    root = tmp_path / "venvs"
    with pytest.raises(ProjectError, match=r"run `uv lock`"):
        ensure_venv(parse_spec({"locked": False}), load_project(proj), root=root)
    assert _snapshot(proj) == before
    assert not [p for p in root.iterdir() if p.is_dir()]


def test_unlocked_build_keys_the_index_settings_it_resolves_with(tmp_path):
    """With `locked: false` and a stale lock uv resolves what the lock lacks, from the indexes
    it is given: here a find-links dir offering tomli-w 99.0.0 (by hand: `uv sync` with it
    installs `tomli-w==99.0.0`). A job without that setting must not get that venv."""
    proj = write_project(tmp_path / "proj", ["six"])
    write_project(proj, ["six", "tomli-w"], lock=False)
    links = tmp_path / "links"
    fake_wheel(links)
    spec, root = parse_spec({"locked": False}), tmp_path / "venvs"
    with_links = ensure_venv(spec, load_project(proj), {"UV_FIND_LINKS": str(links)}, root=root)
    assert installed_versions(with_links.path)["tomli-w"] == "99.0.0"
    plain = ensure_venv(spec, load_project(proj), root=root)
    assert installed_versions(plain.path)["tomli-w"] != "99.0.0"


def test_edited_non_editable_source_gives_a_venv_with_the_edit(tmp_path):
    """A new key is not enough: uv caches the wheel it built from ../mylib, keyed by the mtime
    of mylib/pyproject.toml only, and would put the old build into the new venv (by hand: a
    second `uv sync` into a fresh venv after editing mylib/__init__.py still sees VALUE = 1;
    `--refresh-package mylib` rebuilds it)."""
    proj = write_with_mylib(tmp_path, editable=False, value=1)
    root = tmp_path / "venvs"
    first = ensure_venv(parse_spec({}), load_project(proj), root=root)
    assert run_python(first.path, "import mylib; print(mylib.VALUE)") == "1"
    (tmp_path / "mylib" / "mylib" / "__init__.py").write_text("VALUE = 2\n")
    second = ensure_venv(parse_spec({}), load_project(proj), root=root)
    assert second.built and second.key != first.key
    assert run_python(second.path, "import mylib; print(mylib.VALUE)") == "2"
    assert run_python(first.path, "import mylib; print(mylib.VALUE)") == "1"  # a copy

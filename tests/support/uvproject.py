"""Small uv projects that tests build for themselves: real pyproject.toml, real `uv lock`."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import textwrap
import zipfile
from pathlib import Path

import ray

from ray_uv_plugin.env.uv import find_uv

RAY_PIN = f"ray=={ray.__version__}"


def write_project(
    path: Path,
    dependencies: list[str] | None = None,
    extras: dict[str, list[str]] | None = None,
    groups: dict[str, list[str]] | None = None,
    name: str = "testproj",
    requires_python: str = ">=3.11",
    with_ray: bool = True,
    lock: bool = True,
    files: dict[str, str] | None = None,
) -> Path:
    """Write a uv project at `path` (ray pinned to the node's version) and lock it."""
    path.mkdir(parents=True, exist_ok=True)
    deps = ([RAY_PIN] if with_ray else []) + list(dependencies or [])

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(f'"{i}"' for i in items) + "]"

    text = textwrap.dedent(
        f"""\
        [project]
        name = "{name}"
        version = "0.1.0"
        requires-python = "{requires_python}"
        dependencies = {toml_list(deps)}
        """
    )
    if extras:
        text += "\n[project.optional-dependencies]\n"
        text += "".join(f"{k} = {toml_list(v)}\n" for k, v in extras.items())
    if groups:
        text += "\n[dependency-groups]\n"
        text += "".join(f"{k} = {toml_list(v)}\n" for k, v in groups.items())
    text += "\n[tool.uv]\nenvironments = [\"sys_platform == 'linux'\"]\n"
    (path / "pyproject.toml").write_text(text)
    for rel, content in (files or {}).items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(content)
    if lock:
        subprocess.run(
            [find_uv(), "lock", "--project", str(path), "--quiet"], check=True, timeout=300
        )
    return path


def project_variants(base: Path, where: Path, n: int) -> list[Path]:
    """`n` copies of the project `base` that differ by a comment in pyproject.toml: `n` keys
    from one `uv lock`, each a venv of the same packages."""
    out = []
    for i in range(n):
        variant = where / f"variant-{i}"
        variant.mkdir(parents=True, exist_ok=True)
        (variant / "pyproject.toml").write_text(f"{(base / 'pyproject.toml').read_text()}# {i}\n")
        shutil.copyfile(base / "uv.lock", variant / "uv.lock")
        out.append(variant)
    return out


class CountingUv:
    """A uv wrapper for `RAY_UV_PLUGIN_UV` that logs each call, then runs the real uv.

    `SLOW_UV_SECONDS` in its environment (the node's, or a job's that names it in the
    uv_project's `build_env_vars`) delays it. Each sync's
    start and end times go to `spans`, from which `peak_syncs` tells how many ran at once.
    """

    def __init__(self, directory: Path, sleep_after: float = 0.0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "uv-calls.log"
        self.spans = directory / "sync-spans.log"
        self.path = directory / "uv-wrapper.sh"
        self.log.touch()
        self.spans.touch()
        # Only `sync` is slowed down: the plugin also asks `uv --version` for its keys.
        after = (
            f'[ "$1" = sync ] && echo synced >> {self.log} && sleep {sleep_after}'
            if sleep_after
            else ""
        )
        delay = '[ "$1" = sync ] && sleep "${SLOW_UV_SECONDS:-0}"'
        span = '[ "$1" = sync ] && echo "%s $(date +%%s.%%N)" >> ' + str(self.spans)
        self.path.write_text(
            f'#!/bin/sh\necho "$1" >> {self.log}\n{span % "start"}\n{delay}\n'
            f'{find_uv()} "$@"\nrc=$?\n{span % "end"}\n{after}\nexit $rc\n'
        )
        self.path.chmod(0o755)

    def syncs(self) -> int:
        return sum(1 for line in self.log.read_text().splitlines() if line == "sync")

    def peak_syncs(self) -> int:
        """The most syncs that ran at the same time (a sync killed before its end counts as
        running from then on)."""
        events = sorted(
            (float(when), 1 if what == "start" else -1)
            for what, when in (line.split() for line in self.spans.read_text().splitlines())
        )
        running = peak = 0
        for _, step in events:  # at one instant an end sorts before a start: not overlapping
            running += step
            peak = max(peak, running)
        return peak


def tamper_hashes(project: Path, package: str) -> None:
    """Make uv.lock record hashes for `package`'s files that the registry's files do not have,
    as a hand-edited lock or an index serving other files under the same names would."""
    lock = project / "uv.lock"
    blocks = lock.read_text().split("[[package]]")
    for i, block in enumerate(blocks):
        if f'\nname = "{package}"\n' in block:
            blocks[i] = re.sub(r"sha256:[0-9a-f]{8}", "sha256:00000000", block)
            break
    else:
        raise AssertionError(f"{package} is not in {lock}")
    lock.write_text("[[package]]".join(blocks))


def unreachable_index() -> dict[str, str]:
    """A job's env vars for an index behind a proxy that refuses connections: `uv sync --locked`
    checks the lock against that index and fails at once on the network, whatever the node's uv
    cache holds (a job may not choose its own cache: `env.uv_cache`)."""
    return {
        "UV_INDEX_URL": "http://127.0.0.1:9/simple",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "UV_HTTP_RETRIES": "0",
    }


def write_wheel(
    directory: Path,
    name: str,
    version: str,
    files: dict[str, bytes],
    requires: tuple[str, ...] = (),
) -> Path:
    """A pure-Python wheel `name-version-py3-none-any.whl` in `directory` holding `files`
    (paths relative to site-packages), with the metadata and RECORD a build backend writes;
    `requires`: its `Requires-Dist` lines."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    members = {
        **files,
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        return f"sha256={encoded.decode()}"

    record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data in members.items())
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in members.items():
            archive.writestr(path, data)
        archive.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return wheel


def left_in(root: Path) -> list[str]:
    """What the venv dir `root` holds beside the plugin's records of its setups (a key's
    `.phase-<key>`, which keeps a failure's cause for the readiness view, and `.outcomes`, which
    the node's metrics count): a failed or refused setup leaves nothing else."""
    from ray_uv_plugin.store import outcomes, phases

    names = os.listdir(root)
    return sorted(n for n in names if not (phases.is_record(n) or outcomes.is_record(n)))

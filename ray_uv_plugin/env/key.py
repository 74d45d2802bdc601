"""One request for a venv: every input that shapes it, gathered once at the edge, keyed once.

What is in the key, and why (docs/key.md says the same):
- `uv.lock` and `pyproject.toml` bytes, and the selection (extras, groups, flags);
- the project's uv config beyond pyproject.toml (a `uv.toml` beside it or above it);
- the content of non-editable `path`/`directory` sources (uv copies them into the venv);
- the interpreter (implementation, version, build, platform, and its path, which the venv
  links to) and the uv version;
- the env vars that steer what uv installs (`uv_env.keyed_settings`), among them the job's
  variables it names in `build_env_vars`, and, where the lock builds anything from source, the
  indexes, proxies and CAs that build fetches with (`source_builds`); the job's other variables
  never reach uv, and its choice of uv cache is refused (`uv_cache`);
- the project's path, only where the venv points into it (editable sources, install_project);
- with `from_image`, each named package as the node's interpreter has it (`image.fingerprint`),
  in the selection as `image`: a changed image is another venv, never shipped to that node.

`KeyInputs` holds them: the key is its digest, the marker records it, and a node offered a
venv built elsewhere takes it only where its own inputs give the venv's key (`on_this_node`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ray_uv_plugin.env import image
from ray_uv_plugin.env import project as project_files
from ray_uv_plugin.env.project import ConfigFile, LockedSources, ProjectFiles
from ray_uv_plugin.env.source_builds import builds_from_source
from ray_uv_plugin.env.spec import ParsedUvProject
from ray_uv_plugin.env.uv import uv_version
from ray_uv_plugin.env.uv_cache import project_cache_refusal
from ray_uv_plugin.env.uv_env import (
    RESOLVE_VARS,
    SOURCE_FETCH_VARS,
    job_variables,
    keyed_settings,
    sync_environment,
)
from ray_uv_plugin.store.layout import KEY_LENGTH

Pairs = tuple[tuple[str, str], ...]


def interpreter_tag() -> str:
    """The interpreter the venv is made from: version, build, platform and where it lives."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return f"{sys.implementation.name}-{sys.version}-{platform.machine()}-{sys.platform}-{base}"


@dataclass(frozen=True)
class KeyInputs:
    """Everything that shapes a venv: equal inputs, the same venv. The key is their digest
    (`key`), the marker records them (`as_json`), and nothing else decides "the same venv".

    The fields, their order and their JSON are what venvs on the nodes were keyed and marked
    with: a change makes every venv built before unfindable (tests/env/test_key.py pins them).
    """

    selection: Mapping[str, Any]  # `ParsedUvProject.selection()`
    pyproject: str  # sha256 of pyproject.toml
    lock: str  # sha256 of uv.lock
    config: Pairs  # (label, sha256) of the uv config beyond pyproject.toml (`ConfigFile`)
    copied_sources: Pairs  # (source as in uv.lock, content digest): `project.copied_sources`
    interpreter: str  # `interpreter_tag()`
    uv: str  # `uv_version()`
    env: Pairs  # the uv settings that shape the venv: `uv_env.keyed_settings`
    project_path: str | None  # where the venv points into the project dir, else None

    def as_json(self) -> dict[str, Any]:
        """The inputs as the marker records them, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @cached_property
    def key(self) -> str:
        blob = json.dumps(self.as_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:KEY_LENGTH]

    @classmethod
    def from_json(cls, data: object) -> KeyInputs | None:
        """The inputs a marker recorded (`as_json`, through JSON), or None where `data` is no
        whole record of them."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            return None
        try:
            values = {name: data[name] for name in names}
            for name in ("config", "copied_sources", "env"):
                values[name] = tuple((str(a), str(b)) for a, b in values[name])
        except (TypeError, ValueError):
            return None
        if not isinstance(values["selection"], dict):
            return None
        named = values["selection"].get("build_env_vars", [])
        if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
            return None  # `on_this_node` keys the build variables it names
        named = values["selection"].get("from_image", [])
        if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
            return None  # `on_this_node` fingerprints the image's packages it names
        strings = ("pyproject", "lock", "interpreter", "uv")
        if not all(isinstance(values[name], str) for name in strings):
            return None
        if not isinstance(values["project_path"], (str, type(None))):
            return None
        return cls(**values)

    def differs_on(self, other: KeyInputs) -> list[str]:
        """The names of the fields whose values differ in `other`, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def on_this_node(self, uv_env: Mapping[str, str], resolves: bool) -> KeyInputs:
        """These inputs with this node's interpreter, uv and the uv settings of `uv_env`: what
        this node's plugin keys the same project and selection with. Whether the lock builds
        from source, the recorded settings say: a fetch setting that `resolves` does not key."""
        builds = any(
            name in SOURCE_FETCH_VARS and not (resolves and name in RESOLVE_VARS)
            for name, _ in self.env
        )
        named = self.selection.get("build_env_vars", ())
        return replace(
            self,
            selection=_with_image(self.selection, strict=False),
            interpreter=interpreter_tag(),
            uv=uv_version(),
            env=keyed_settings(uv_env, resolves, named, builds),
        )


def _with_image(selection: Mapping[str, Any], strict: bool) -> Mapping[str, Any]:
    """The selection with this node's `image.fingerprint` of its `from_image` packages (none
    asked: as it is). `strict`: a package the node lacks is a ProjectError, else a fingerprint
    of None, which keys no venv built elsewhere."""
    named = selection.get("from_image")
    if not named:
        return selection
    try:
        found: object = image.fingerprint(named)
    except (project_files.ProjectError, OSError):
        if strict:
            raise
        found = None
    return {**selection, "image": found}


@dataclass(frozen=True)
class VenvRequest:
    spec: ParsedUvProject
    files: ProjectFiles
    uv_env: Mapping[str, str] = field(repr=False)  # the environment uv runs in
    inputs: KeyInputs  # everything that shapes the venv, as hashed into `key`
    # What the build needs of the project beyond the key's digests, found while keying it.
    config_files: tuple[ConfigFile, ...] = field(repr=False)
    sources: LockedSources = field(repr=False)  # `project.local_sources`
    # The job's env_vars as given: the workers', and what tells one job's failed build from
    # another's (`failed_builds.sync_inputs`), though most of them never reach uv.
    job_env_vars: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> str:
        return self.inputs.key

    @property
    def points_into_project(self) -> bool:
        """Whether the venv refers to the project's dir (so its path is in the key)."""
        return self.inputs.project_path is not None

    @property
    def what(self) -> str:
        """`<key> (/path/to/project extras=vllm groups=-)`, for log lines and errors."""
        return f"{self.key} ({self.files.path} {self.spec.describe()})"

    def sync_command(self, venv: Path, project_dir: Path | None = None) -> SyncCommand:
        """`uv sync` of this request into `venv`, of the project's files in `project_dir`
        (default: the project's own dir; `locked: false` gives the build's scratch copy)."""
        spec, files = self.spec, self.files
        project = project_dir or files.path
        args = ["sync", "--project", str(project), *spec.sync_args(), "--python", sys.executable]
        for name in self.sources.copied_names:  # uv caches their builds by mtime
            args += ["--refresh-package", name]
        lock = tomllib.loads(files.lock.decode("utf-8")) if spec.from_image else {}
        left = tuple(image.left_out(lock.get("package", []), spec.from_image))
        args += image.no_install_args(left)
        env = {**self.uv_env, "UV_PROJECT_ENVIRONMENT": str(venv)}
        return SyncCommand(tuple(args), env, files.path, left, lock)


@dataclass(frozen=True)
class SyncCommand:
    """`uv sync` as a build runs it: its arguments (after `uv`), its environment and working
    directory (the project's dir, where uv reads `.python-version` and `uv.toml`). The build
    runs it; the failed-build memo digests it (`failed_builds.sync_inputs`)."""

    args: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    cwd: Path
    left_out: tuple[str, ...] = ()  # the lock's packages left to the image (`from_image`)
    lock: Mapping[str, Any] = field(default_factory=dict, repr=False)  # parsed, for `from_image`


def make_request(
    spec: ParsedUvProject, files: ProjectFiles, env_vars: Mapping[str, str]
) -> VenvRequest:
    """Gather and key one request; `env_vars` are the runtime_env's."""
    uv_env = sync_environment(env_vars, build_env_vars=spec.build_env_vars)
    config_file = uv_env.get("UV_CONFIG_FILE")
    if config_file and not os.path.isabs(config_file):  # uv reads it from the project dir
        uv_env["UV_CONFIG_FILE"] = str(files.path / config_file)
    sources = project_files.local_sources(files)
    configs = project_files.config_files(files)
    job_config = uv_env.get("UV_CONFIG_FILE") if "UV_CONFIG_FILE" in env_vars else None
    refused = project_cache_refusal(files, configs, job_config)
    if refused:
        raise project_files.ProjectError(refused)
    refers = spec.install_project or sources.refers_to_paths
    # Parsed only where a fetch setting is set: with none, there is nothing more to key.
    builds = any(name in uv_env for name in SOURCE_FETCH_VARS) and builds_from_source(
        files, configs, uv_env, spec.install_project
    )
    inputs = KeyInputs(
        selection=_with_image(spec.selection(), strict=True),
        pyproject=hashlib.sha256(files.pyproject).hexdigest(),
        lock=files.lock_digest,
        config=tuple((c.label, c.digest) for c in configs),
        copied_sources=project_files.copied_sources(files, sources),
        interpreter=interpreter_tag(),
        uv=uv_version(),
        env=keyed_settings(uv_env, spec.resolves, spec.build_env_vars, builds),
        project_path=str(files.path.resolve()) if refers else None,
    )
    return VenvRequest(spec, files, uv_env, inputs, configs, sources, dict(env_vars))


def withheld_from_uv(request: VenvRequest) -> tuple[str, ...]:
    """The names of the job's env_vars that do not reach uv (for the setup log)."""
    return job_variables(request.job_env_vars, request.spec.build_env_vars).withheld

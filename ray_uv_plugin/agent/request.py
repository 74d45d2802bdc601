"""One request for a venv: every input that shapes it, gathered once at the edge, keyed once.

What is in the key, and why (the README's trust table says the same):
- `uv.lock` and `pyproject.toml` bytes, and the selection (extras, groups, flags);
- the project's uv config beyond pyproject.toml (a `uv.toml` beside it or above it);
- the content of non-editable `path`/`directory` sources (uv copies them into the venv);
- the interpreter (implementation, version, build, platform, and its path, which the venv
  links to) and the uv version;
- the env vars that steer what uv installs (`uv_env.keyed_settings`);
- the project's path, only where the venv points into it (editable sources, install_project).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ray_uv_plugin.agent import project as project_files
from ray_uv_plugin.agent.project import ProjectFiles
from ray_uv_plugin.agent.spec import UvProjectSpec
from ray_uv_plugin.agent.uv import uv_version
from ray_uv_plugin.agent.uv_env import keyed_settings, sync_environment
from ray_uv_plugin.store.layout import KEY_LENGTH


def interpreter_tag() -> str:
    """The interpreter the venv is made from: version, build, platform and where it lives."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return f"{sys.implementation.name}-{sys.version}-{platform.machine()}-{sys.platform}-{base}"


@dataclass(frozen=True)
class VenvRequest:
    spec: UvProjectSpec
    files: ProjectFiles
    uv_env: Mapping[str, str] = field(repr=False)  # the environment uv runs in
    inputs: Mapping[str, object]  # everything that shapes the venv, as hashed into `key`
    key: str

    @property
    def what(self) -> str:
        """`<key> (/path/to/project extras=vllm groups=-)`, for log lines and errors."""
        return f"{self.key} ({self.files.path} {self.spec.describe()})"


def make_request(
    spec: UvProjectSpec, files: ProjectFiles, env_vars: Mapping[str, str]
) -> VenvRequest:
    """Gather and key one request; `env_vars` are the runtime_env's."""
    uv_env = sync_environment(env_vars)
    config_file = uv_env.get("UV_CONFIG_FILE")
    if config_file and not os.path.isabs(config_file):  # uv reads it from the project dir
        uv_env["UV_CONFIG_FILE"] = str(files.path / config_file)
    refers = project_files.refers_to_project_path(files, spec)
    inputs = {
        "selection": spec.selection(),
        "pyproject": hashlib.sha256(files.pyproject).hexdigest(),
        "lock": files.lock_digest,
        "config": project_files.config_files(files),
        "copied_sources": project_files.copied_sources(files),
        "interpreter": interpreter_tag(),
        "uv": uv_version(),
        "env": keyed_settings(uv_env, resolves=spec.resolves),
        "project_path": str(files.path.resolve()) if refers else None,
    }
    blob = json.dumps(inputs, sort_keys=True).encode()
    key = hashlib.sha256(blob).hexdigest()[:KEY_LENGTH]
    return VenvRequest(spec, files, uv_env, inputs, key)

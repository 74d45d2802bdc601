"""The content hash that names a venv: same inputs, same venv, on any node and in any session."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import asdict

from ray_uv_plugin.project import ProjectFiles, refers_to_project_path
from ray_uv_plugin.spec import UvProjectSpec

KEY_LENGTH = 16


def interpreter_tag() -> str:
    """The interpreter the venv is made from: version, build and platform."""
    return f"{sys.implementation.name}-{sys.version}-{platform.machine()}-{sys.platform}"


def venv_key(spec: UvProjectSpec, files: ProjectFiles) -> str:
    selection = asdict(spec)
    selection.pop("project")  # where the project lives matters only if the venv refers to it
    inputs = {
        "selection": selection,
        "interpreter": interpreter_tag(),
        "pyproject": hashlib.sha256(files.pyproject).hexdigest(),
        "lock": hashlib.sha256(files.lock).hexdigest(),
        "project_path": str(files.path.resolve()) if refers_to_project_path(files, spec) else None,
    }
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:KEY_LENGTH]

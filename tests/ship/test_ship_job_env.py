"""Which interpreter the plugin's own shipping actors and helper tasks ask for, by the job's
runtime_env (no Ray: `ship` and worker groups read it from the runtime context)."""

from __future__ import annotations

from typing import Any

import pytest

from ray_uv_plugin.ship.launch import NODE_PYTHON, node_python_env


@pytest.mark.parametrize(
    ("job_env", "expected"),
    [
        ({}, None),  # the job's default is the node's own Python already
        ({"working_dir": "gcs://_ray_pkg_1.zip"}, None),
        ({"py_executable": "uv run --no-sync python"}, NODE_PYTHON),  # Ray's `uv run` hook's
        ({"uv_project": {"extras": ["six"], "job_default": True}}, NODE_PYTHON),  # our hook's
        # A job that asked for a uv_project itself: every actor of it runs in that venv, and
        # none may leave it (`ship` refuses, helpers run in it).
        ({"uv_project": {"extras": ["six"]}}, None),
        ({"uv_project": {"job_default": "yes"}}, None),
    ],
)
def test_node_python_env_by_job_env(job_env: dict[str, Any], expected: Any) -> None:
    assert node_python_env(job_env) == expected

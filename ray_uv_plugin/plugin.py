"""The Ray glue: the `uv_project` runtime_env plugin, over `spec`, `project` and `venv_cache`."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ray._private.runtime_env.context import RuntimeEnvContext
from ray._private.runtime_env.plugin import RuntimeEnvPlugin

from ray_uv_plugin.project import load_project, resolve_project_dir
from ray_uv_plugin.spec import FIELD, parse_spec
from ray_uv_plugin.uv import format_duration
from ray_uv_plugin.venv_cache import Outcome, ensure_venv, lookup, venv_root

default_logger = logging.getLogger(__name__)

# Set by Ray's working_dir plugin around the other plugins' `create`.
WORKING_DIR_ENV = "RAY_RUNTIME_ENV_CREATE_WORKING_DIR"


class UvProjectPlugin(RuntimeEnvPlugin):
    name = FIELD
    # Larger runs later. Ray's py_executable plugin has 10: running after it, we replace the
    # `uv run ...` interpreter that Ray's `uv run` driver hook puts into the job's runtime_env.
    priority = 50

    def __init__(self) -> None:
        self._venvs: dict[int, Outcome] = {}  # id(context) -> venv, from create to modify_context

    @staticmethod
    def validate(runtime_env_dict: dict) -> None:
        parse_spec(runtime_env_dict[FIELD])

    async def create(
        self,
        uri: str | None,
        runtime_env: dict,
        context: RuntimeEnvContext,
        logger: logging.Logger = default_logger,
    ) -> float:
        start = time.perf_counter()
        spec = parse_spec(runtime_env[FIELD])
        # Read before the first await: the variable is process-wide and set per setup.
        working_dir = os.environ.get(WORKING_DIR_ENV)
        files = load_project(resolve_project_dir(spec, working_dir))
        root = venv_root()
        outcome = lookup(spec, files, root)
        if outcome is None:
            logger.info("uv_project: no ready venv for %s (%s)", files.path, spec.describe())
            env_vars = runtime_env.get("env_vars") or {}
            # uv and the file lock block: keep them off the agent's event loop.
            outcome = await asyncio.get_running_loop().run_in_executor(
                None, lambda: ensure_venv(spec, files, env_vars, root, logger)
            )
        verb = "built" if outcome.built else "reused"
        took = time.perf_counter() - start
        logger.info(
            "uv_project %s: %s in %s -> %s", outcome.key, verb, format_duration(took), outcome.path
        )
        self._venvs[id(context)] = outcome
        return 0

    def modify_context(
        self,
        uris: list[str],
        runtime_env: dict,
        context: RuntimeEnvContext,
        logger: logging.Logger = default_logger,
    ) -> None:
        venv = self._venvs.pop(id(context)).path
        context.py_executable = str(venv / "bin" / "python")
        context.env_vars["VIRTUAL_ENV"] = str(venv)
        context.env_vars["UV_PROJECT_ENVIRONMENT"] = str(venv)
        context.env_vars["PATH"] = f"{venv / 'bin'}:${{PATH}}"

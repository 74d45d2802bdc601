"""The `ray-env` way of `benchmarks.uv_run_driver`: a job runtime_env without the plugin.

Set as `RAY_RUNTIME_ENV_HOOK` (with Ray's own `uv run` hook off), it gives the job what Ray's
hook and ours both give it, minus any env of ours: the driver's own interpreter as
`py_executable` (its `.venv`, the floor's) and the project directory as `working_dir`. Every
worker then starts the way any worker of a job with a runtime_env starts (through Ray's
`setup_worker`, which imports Ray before it execs the interpreter): what that costs above the
floor is Ray's, and no plugin can take it away.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def hook(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    return {**(runtime_env or {}), "py_executable": sys.executable, "working_dir": os.getcwd()}

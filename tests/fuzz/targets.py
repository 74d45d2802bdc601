"""Every fuzz target, by name: what tests/test_fuzz.py and `python -m benchmarks.fuzz` run."""

from __future__ import annotations

from tests.fuzz import offer, project, spec, stream, uv_env, uv_run, venv_files
from tests.fuzz.harness import Target

TARGETS: dict[str, Target] = {
    module.TARGET.name: module.TARGET
    for module in (spec, project, stream, offer, venv_files, uv_run, uv_env)
}

"""The examples on real workers: the torch worker's gloo all-reduce on CPU (marked `torch`: its
venv downloads several GB from PyPI), and the nccl and vLLM paths where a GPU is (marked `gpu`).

Run them with ``uv run pytest -m torch tests/worker_groups`` / ``-m gpu``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ray_uv_plugin.env.uv import find_uv

REPO = Path(__file__).resolve().parents[2]
TORCH_ENV = {"project": str(REPO), "extras": ["torch"]}


def _has_cuda() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


needs_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU (nvidia-smi -L)")


def _warm_uv_cache(extra: str, tmp_path: Path) -> None:
    """Download the extra's wheels into uv's cache first: a multi-GB download may outlast Ray's
    runtime_env setup timeout (600 s); the plugin's own sync then links from the cache."""
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "warm-venv")}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [find_uv(), "sync", "--locked", "--extra", extra, "--no-install-project", "--quiet"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=3000,
    )


@pytest.mark.torch
@pytest.mark.timeout(3600)
def test_torch_gloo_all_reduce_across_two_nodes(two_node_cluster: Any, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))  # the driver imports only `run`, which imports no torch
    from examples.torch_worker import run

    _warm_uv_cache("torch", tmp_path)
    sums = run([1, 1], gpus=False, uv_project=TORCH_ENV, env_vars={"PYTHONPATH": str(REPO)})
    assert sums == [3.0, 3.0]  # ranks contribute 1 and 2
    assert "torch" not in sys.modules


def _run_example(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(3600)
def test_torch_nccl_all_reduce_on_gpus(tmp_path: Path) -> None:
    _warm_uv_cache("torch", tmp_path)
    gpus = (
        len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.split("\n"))
        - 1
    )
    out = _run_example("torch_worker.py", "--gpus", "--workers", str(min(gpus, 2)))
    assert "'backend': 'nccl'" in out and "all_reduce over" in out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(3600)
def test_vllm_generation_one_engine(tmp_path: Path) -> None:
    _warm_uv_cache("vllm", tmp_path)
    out = _run_example("vllm_worker.py", "--tp", "1", "--dp", "1")
    assert "engine 0: [" in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nemo_rl_style_script_runs_with_only_its_imports_changed() -> None:
    """examples/nemo_rl_api.py is written against NeMo RL's API; it starts its own Ray with
    logical GPUs, as a user would run it."""
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "nemo_rl_api.py"), "3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    losses = [ast.literal_eval(m) for m in re.findall(r"shard (\[[^\]]*\])", out)]
    assert len(losses) == 3 and losses[0] == [2.5, 17.0]  # one loss per data-parallel shard
    assert losses[2][0] < losses[1][0] < losses[0][0] and losses[2][1] < losses[0][1]
    workers = [ast.literal_eval(m) for m in re.findall(r"^worker (\{.*\})$", out, re.M)]
    assert [(w["RANK"], w["NODE_RANK"], w["LOCAL_RANK"]) for w in workers] == [
        ("0", "0", "0"),
        ("1", "0", "1"),
        ("2", "1", "0"),
        ("3", "1", "1"),
    ]
    assert {w["WORLD_SIZE"] for w in workers} == {"4"} and len(
        {w["MASTER_PORT"] for w in workers}
    ) == 1
    assert all(len(w["gpus"]) == 1 for w in workers)
    # The decorator's env var and configure_worker's env var and init kwarg all arrived.
    assert {w["env"] for w in workers} == {("info", "1")}
    assert [w["leader_of"] for w in workers] == [(0, [0]), (0, [1]), (1, [0]), (1, [1])]
    assert "weight of data-parallel shard 1 (worker 2): " in out

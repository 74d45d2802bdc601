"""What a shipped venv may carry to another node: wheels built on its node, and that node's
build target (`build_target`). Real uv builds a tiny local package into a real venv; the
machine's own parts are read from text as /proc/cpuinfo, nvidia-smi and nvcc print it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.ship.build_target import (
    build_target,
    cpu_target,
    cuda_toolkit,
    gpu_target,
    local_builds,
    target_differs,
)
from tests.support.uvproject import write_project

# A wheel for this platform without a compiler: setuptools tags it so when the distribution
# says it has extension modules.
PLATFORM_SETUP = textwrap.dedent(
    """\
    from setuptools import Distribution, setup

    class Platform(Distribution):
        def has_ext_modules(self):
            return True

    setup(distclass=Platform, packages=["hostpkg"])
    """
)


def host_package_project(path: Path, name: str, with_ray: bool = True) -> Path:
    """A locked project that depends on `hostpkg`, a local source tree that uv builds into a
    platform-specific wheel, `purepkg`, one it builds into a pure wheel, and six from PyPI."""
    files = {
        "hostpkg/pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n'
        '[project]\nname = "hostpkg"\nversion = "0.1.0"\n',
        "hostpkg/setup.py": PLATFORM_SETUP,
        "hostpkg/hostpkg/__init__.py": "BUILT = True\n",
        "purepkg/pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n'
        '[project]\nname = "purepkg"\nversion = "0.1.0"\n',
        "purepkg/purepkg/__init__.py": "",
    }
    write_project(
        path, ["hostpkg", "purepkg", "six"], name=name, with_ray=with_ray, lock=False, files=files
    )
    with (path / "pyproject.toml").open("a") as f:
        f.write(
            '\n[tool.uv.sources]\nhostpkg = { path = "hostpkg" }\npurepkg = { path = "purepkg" }\n'
        )
    subprocess.run([find_uv(), "lock", "--project", str(path), "--quiet"], check=True, timeout=300)
    return path


def test_only_wheels_uv_built_for_the_platform_count(tmp_path: Path) -> None:
    project = host_package_project(tmp_path / "proj", "hosttest", with_ray=False)
    venv = tmp_path / "venv"
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [find_uv(), "sync", "--project", str(project), "--locked", "--quiet"],
        env=env, check=True, timeout=300,
    )  # fmt: skip
    found = local_builds(venv)
    assert list(found) == ["hostpkg"], found  # not purepkg (py3-none-any), not six (PyPI's)
    assert found["hostpkg"].endswith(platform.machine()), found
    # Downloaded wheels never count, whatever their WHEEL file says: Ray's says linux_x86_64.
    assert "ray" not in local_builds(Path(sys.prefix))


def test_the_cpu_is_its_instruction_set() -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu hypervisor sse4_2 avx2 avx512f ssbd constant_tsc\n"
    assert cpu_target(x86, "x86_64") == "x86_64 avx2 avx512f sse4_2"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve2 sve\nCPU part\t: 0xd40\n"
    assert cpu_target(arm, "aarch64") == "aarch64 asimd fp sve sve2"
    assert cpu_target("", "riscv64") == "riscv64"


def test_gpus_driver_and_toolkit_are_read_from_their_tools() -> None:
    assert gpu_target("8.0, 550.54.15\n9.0, 550.54.15\n") == ("8.0, 9.0", "550")
    assert gpu_target(None) == ("none", "none")
    nvcc = (
        "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.4, V12.4.131\n"
    )
    assert cuda_toolkit(nvcc) == "release 12.4, V12.4.131"
    assert cuda_toolkit(None) == "none"


def fake_tool(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / name).chmod(0o755)


def test_the_node_target_asks_nvidia_smi_unless_the_arch_list_pins_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", 'echo "9.0, 570.86.10"')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    target = build_target(env)
    assert (target["gpus"], target["driver"]) == ("9.0", "570"), target
    assert target["cpu"].startswith(platform.machine())
    pinned = build_target({**env, "TORCH_CUDA_ARCH_LIST": "8.0;9.0"})
    assert "gpus" not in pinned and "driver" not in pinned and pinned["cpu"] == target["cpu"]
    fake_tool(bin_dir, "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    broken = build_target(env)
    assert broken["gpus"].startswith("unknown") and "exited 9" in broken["gpus"], broken
    assert build_target({"PATH": str(tmp_path / "empty")})["gpus"] == "none"


def test_a_venv_built_for_other_hardware_is_refused_saying_why() -> None:
    built = {"flash_attn": "cp311-cp311-linux_x86_64"}
    a100 = {"cpu": "x86_64 avx2 avx512f", "gpus": "8.0", "driver": "550", "cuda": "release 12.4"}
    assert target_differs(a100, dict(a100), built) is None
    h100 = {**a100, "gpus": "9.0"}
    assert target_differs(a100, h100, built) == (
        "holds flash_attn built on the source node for its GPUs (8.0); this node has 9.0"
    )
    older = {**a100, "cpu": "x86_64 avx2"}
    assert target_differs(a100, older, built) == (
        "holds flash_attn built on the source node for its CPU (x86_64); this node's CPU "
        "lacks avx512f"
    )
    toolkit = {**a100, "cuda": "release 13.0"}
    assert "CUDA toolkit (release 12.4); this node has release 13.0" in str(
        target_differs(a100, toolkit, built)
    )
    unknown = {**a100, "gpus": "unknown (nvidia-smi exited 9: ...)"}
    assert target_differs(unknown, dict(unknown), built) is not None  # unknown never matches
    pinned = {"cpu": a100["cpu"], "cuda": a100["cuda"]}  # TORCH_CUDA_ARCH_LIST on both
    assert target_differs(pinned, dict(pinned), built) is None
    many = dict.fromkeys(["a", "b", "c", "d", "e"], "tag")
    assert "holds a, b, c and 2 more built" in str(target_differs(a100, h100, many))

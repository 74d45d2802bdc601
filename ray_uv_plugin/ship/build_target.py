"""Which wheels of a venv were built on its node, and the machine they were built for.

uv marks each wheel it built itself, from an sdist or a source tree, with a `uv_build.json` in
its dist-info; wheels it downloaded have none. A wheel built on the node for a platform (a tag
other than `...-none-any`) may be compiled for that node alone: for its CPU (`-march=native`),
its GPUs (flash-attn without TORCH_CUDA_ARCH_LIST builds for the GPUs it sees), its CUDA driver
and toolkit. A venv that holds such wheels is shipped only to nodes whose build target is the
same (`ship`); other nodes build it for themselves. (The `Tag:` lines alone cannot tell: Ray's
own manylinux wheel says `linux_x86_64` inside.)
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

BUILT_BY_UV = "uv_build.json"  # in the dist-info of a wheel that uv built on this node
# x86 /proc/cpuinfo flags that compilers target (`-march=native`); the rest of the flags line
# (bugs, virtualization, power management) varies between kernels of the same CPU.
X86_ISA = re.compile(
    r"(mmx|sse|ssse3|avx|fma|f16c|bmi|aes|vaes|pclmulqdq|vpclmulqdq|sha_ni|popcnt|lzcnt|abm|"
    r"movbe|adx|gfni|amx|cx16|xsave|rdrand|rdseed)"
)
# Set in the build's environment, it names the GPUs to build for: the node's own do not matter.
ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
PROBE_TIMEOUT = 30.0  # nvidia-smi or nvcc that hangs (a wedged driver) counts as unknown
UNKNOWN = "unknown"  # a value that never matches, not even another unknown


def local_builds(venv: Path) -> dict[str, str]:
    """{distribution: its wheel tag} for each platform-specific wheel in `venv` that uv built
    on the node."""
    found: dict[str, str] = {}
    for built in sorted(venv.glob(f"lib/python*/site-packages/*.dist-info/{BUILT_BY_UV}")):
        try:
            lines = (built.parent / "WHEEL").read_text(errors="replace").splitlines()
        except OSError:
            lines = [f"Tag: {UNKNOWN} (no WHEEL file)"]  # not provably portable
        tags = [line.partition(":")[2].strip() for line in lines if line.startswith("Tag:")]
        specific = [tag for tag in tags if not tag.endswith("-any")]
        if specific:
            found[built.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0]] = specific[0]
    return found


def cpu_target(cpuinfo: str, machine: str) -> str:
    """`x86_64 avx avx2 ...`: the machine and the instruction-set extensions it has."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":  # x86
            return " ".join([machine, *sorted(f for f in value.split() if X86_ISA.match(f))])
        if name.strip() == "Features":  # arm: every feature is one of the instruction set
            return " ".join([machine, *sorted(value.split())])
    return machine


def gpu_target(nvidia_smi_csv: str | None) -> tuple[str, str]:
    """(compute capabilities, driver major version) from `nvidia-smi --query-gpu=compute_cap,
    driver_version --format=csv,noheader`; None: no nvidia-smi, so no GPUs."""
    if nvidia_smi_csv is None:
        return "none", "none"
    caps, drivers = [], set()
    for line in nvidia_smi_csv.strip().splitlines():
        cap, _, driver = (part.strip() for part in line.partition(","))
        caps.append(cap)
        drivers.add(driver.split(".")[0])
    return (", ".join(sorted(caps)) or "none"), (", ".join(sorted(drivers)) or "none")


def cuda_toolkit(nvcc_version: str | None) -> str:
    """`release 12.4, V12.4.131` from `nvcc --version`; None: no nvcc."""
    if nvcc_version is None:
        return "none"
    for line in nvcc_version.splitlines():
        if "release" in line:
            return line[line.index("release") :].strip()
    return UNKNOWN


def _run(argv: list[str]) -> str | None:
    """The command's output; None if it does not exist; UNKNOWN if it fails or hangs."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except FileNotFoundError:
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{UNKNOWN} ({e})"
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()
        return f"{UNKNOWN} ({argv[0]} exited {out.returncode}: {first[0] if first else ''})"
    return out.stdout


def _nvcc(env: Mapping[str, str]) -> str | None:
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc", path=env.get("PATH", os.defpath)) or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )


def build_target(env: Mapping[str, str]) -> dict[str, str]:
    """This node as a build in environment `env` sees it: what a locally built wheel may be
    compiled for. The GPUs are left out where `env` sets TORCH_CUDA_ARCH_LIST (keyed, so the
    same on both nodes): it, not the node, decides what is built."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    nvcc = _nvcc(env)
    target = {
        "cpu": cpu_target(cpuinfo, platform.machine()),
        "cuda": cuda_toolkit(_run([nvcc, "--version"]) if nvcc else None),
    }
    if ARCH_LIST not in env:
        smi = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
        query = ["--query-gpu=compute_cap,driver_version", "--format=csv,noheader"]
        output = _run([smi, *query]) if smi else None
        if output is not None and output.startswith(UNKNOWN):
            target["gpus"] = target["driver"] = output
        else:
            target["gpus"], target["driver"] = gpu_target(output)
    return target


def _names(packages: Mapping[str, str]) -> str:
    names = sorted(packages)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _cpu_differs(theirs: str, mine: str) -> str:
    their_machine, *their_flags = theirs.split()
    my_machine, *my_flags = mine.split()
    if their_machine != my_machine:
        return f"its CPU ({their_machine}); this node has {my_machine}"
    words = []
    if lacks := sorted(set(their_flags) - set(my_flags)):
        words.append(f"lacks {' '.join(lacks)}")
    if extra := sorted(set(my_flags) - set(their_flags)):
        words.append(f"also has {' '.join(extra)}")
    return f"its CPU ({their_machine}); this node's CPU {' and '.join(words)}"


PARTS = (("cpu", "CPU"), ("gpus", "GPUs"), ("driver", "CUDA driver"), ("cuda", "CUDA toolkit"))


def target_differs(
    theirs: Mapping[str, str], mine: Mapping[str, str], packages: Mapping[str, str]
) -> str | None:
    """Why a venv holding `packages` built for `theirs` must not run on `mine`; None if it may.
    Both must be the same, part by part: a wheel built for other GPUs or another instruction
    set fails at import or, worse, at its first kernel."""
    held = f"holds {_names(packages)} built on the source node"
    for part, what in PARTS:
        their, my = theirs.get(part), mine.get(part)
        if their == my and UNKNOWN not in str(their):
            continue
        if part == "cpu":
            return f"{held} for {_cpu_differs(str(their), str(my))}"
        return f"{held} for its {what} ({their}); this node has {my}"
    return None

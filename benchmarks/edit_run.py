"""The edit-run loop: a one-package change to a lock whose venv is ready on the node.

Lock A (a package set, `big` by default) is built and ready in a venv dir. Lock B differs from
it in one package (`uv lock --upgrade-package <spec>` of a copy): a pure-Python one, and one with
compiled extensions. For each B, in one run (ratios; the machine is noisy):

- `nocompile`: `uv sync --locked --no-compile` of B by hand into a fresh dir (the floor: the
  files, no bytecode);
- `seeded`: one actor of B through Ray with the plugin, in the venv dir that holds A (the
  plugin seeds B's bytecode from A's venv): from `.remote()` to its first call answered;
- `full`: the same actor in a fresh venv dir (nothing to seed from): the whole bytecode step;
  the seeded venv and this one are compared entry by entry (`differences`: none expected);
- `ready`: the same actor once B's venv is ready, in a new Ray session: what any way of making
  the venv adds its build to (Ray's worker start and the first call).

`lstat_walk`: B's seeded venv walked by `find` (one `lstat` per entry, in C): the floor of the
per-entry work that a build accounting for every entry pays, whatever its own code.

Target: `seeded` within 3 x `nocompile`, with complete bytecode; each build's steps (`step
<name> took <s>`: sync, listing, seeding, compile, manifest, freeze) come from its setup log.

    uv run python -m benchmarks.edit_run --out benchmarks/results/edit-run.json

`--disk ext4` or `--disk xfs` (root): the venv dirs, the hand syncs and a uv cache of their own
(`UV_CACHE_DIR`, filled by A's build, so every B finds what it needs) on a fresh loop-mounted
disk of that file system (`benchmarks.node_disks`: a journaled ext4, or an XFS with reflinks),
removed when the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

import ray_uv_plugin
from benchmarks import node_disks
from benchmarks.envs import SETS_DIR, clean_env, remove_tree
from benchmarks.sample import setup_logs
from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.settings import VENV_DIR_ENV
from ray_uv_plugin.store.layout import Venv

CHANGES = {"pure": "rich==14.3.0", "compiled": "numpy==2.4.5"}


def changed_lock(base: Path, spec: str, into: Path) -> Path:
    """A copy of the project `base` whose lock differs in the one package `spec` names."""
    into.mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copyfile(base / name, into / name)
    subprocess.run(
        [find_uv(), "lock", "--project", str(into), "--upgrade-package", spec, "--quiet"],
        check=True,
        timeout=600,
    )
    return into


def extra_of(project: Path) -> str:
    import tomllib

    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    return next(iter(extras.get("optional-dependencies", {})), "")


def sync_no_compile(project: Path, venv: Path) -> float:
    args = [find_uv(), "sync", "--project", str(project), "--locked", "--quiet"]
    args += ["--no-install-project", "--python", sys.executable]
    if extra := extra_of(project):
        args += ["--extra", extra]
    env = clean_env(
        UV_PROJECT_ENVIRONMENT=str(venv), UV_PYTHON_DOWNLOADS="never", UV_COMPILE_BYTECODE="0"
    )
    start = time.perf_counter()
    subprocess.run(args, check=True, timeout=3600, env=env, cwd=project)
    return time.perf_counter() - start


@ray.remote(num_cpus=0)
class Probe:
    def where(self) -> str:
        return sys.prefix


# The build's steps as the setup log says them: seeding, compiling, the manifest, the total.
_STEPS = ("seeded from", "compiled the", "manifest of", "built in", "step ")
_STEP = re.compile(r"^\w+: step (\w+) took ([\d.]+)s$")


def step_seconds(steps: list[str]) -> dict[str, float]:
    """Each step's seconds (`step sync took 0.91s`) of a build's lines (`build_steps`)."""
    return {m[1]: float(m[2]) for line in steps if (m := _STEP.match(line.strip()))}


def build_steps() -> list[str]:
    """The plugin's lines of this Ray session's setup logs that say where a build's time went."""
    found = []
    for text in setup_logs():
        for line in text.splitlines():
            _, _, message = line.partition("uv_project ")
            if any(step in message for step in _STEPS):
                found.append(message)
    return found


def one_actor(project: Path, venv_dir: Path) -> tuple[float, Path, list[str]]:
    """Seconds from `.remote()` to the first call of one actor of `project`'s env, in a fresh
    local Ray whose venv dir is `venv_dir`; the venv it ran in, and the build's steps."""
    os.environ[VENV_DIR_ENV] = str(venv_dir)
    os.environ["RAY_RUNTIME_ENV_PLUGINS"] = ray_uv_plugin.plugin_config()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        value: dict[str, Any] = {"project": str(project)}
        if extra := extra_of(project):
            value["extras"] = [extra]
        start = time.perf_counter()
        actor = Probe.options(
            runtime_env={"uv_project": value, "config": {"setup_timeout_seconds": 3600}}
        ).remote()
        prefix = ray.get(actor.where.remote(), timeout=3600)
        took = time.perf_counter() - start
        ray.kill(actor)
        return took, Path(prefix), build_steps()
    finally:
        ray.shutdown()


def lstat_walk(venv: Path) -> tuple[int, float]:
    """B's venv walked by `find` (C: one `lstat` of every entry, its inode, size, mtime and mode
    printed, as a build's listing takes them): (entries, seconds). What a build that accounts for
    every entry pays whatever its own code, against the no-compile sync's budget."""
    start = time.perf_counter()
    out = subprocess.run(
        ["find", str(venv), "-printf", "%i %s %T@ %m\\n"], capture_output=True, check=True
    ).stdout
    return out.count(b"\n"), time.perf_counter() - start


def _tree(venv: Path) -> dict[str, bytes | str]:
    """Every entry below `venv` but the plugin's own: a link's text, a dir, a file's bytes with
    the venv's own path written `<venv>`, a `.pyc`'s header (its body names the path it was
    compiled at, which Python puts right at import: a seed's bytecode was compiled in the seed)."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(venv):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, venv)
            if rel.startswith(".ray-uv-"):
                continue
            if os.path.islink(path):
                found[rel] = os.readlink(path)
            elif os.path.isdir(path):
                found[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    data = f.read(16) if name.endswith(".pyc") else f.read()
                found[rel] = data.replace(str(venv).encode(), b"<venv>")
    return found


def differences(seeded: Path, full: Path) -> list[str]:
    """The paths where the seeded venv differs from the full build of the same key (the first
    20): a console script's RECORD line hashes its own venv's shebang, so RECORDs compare
    without those lines' hashes."""
    a, b = _tree(seeded), _tree(full)
    for tree in (a, b):
        for rel, value in tree.items():
            if rel.endswith(".dist-info/RECORD") and isinstance(value, bytes):
                tree[rel] = b"\n".join(
                    line.rpartition(b",sha256=")[0] if line.startswith(b"../../../bin/") else line
                    for line in value.splitlines()
                )
    return sorted(rel for rel in a.keys() | b.keys() if a.get(rel) != b.get(rel))[:20]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="big", help="a committed set under benchmarks/sets")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/edit-run.json"))
    parser.add_argument("--disk", choices=["ext4", "xfs"], help="on a loop-mounted disk")
    args = parser.parse_args()
    if args.disk is None:
        run(args, Path(tempfile.mkdtemp(prefix="edit-run-")))
        return
    images = Path(tempfile.mkdtemp(prefix="edit-run-disk-"))
    try:
        with node_disks.mounted([images / "mnt"], images, size="24G", fs=args.disk):
            os.environ["UV_CACHE_DIR"] = str(images / "mnt" / "uv-cache")
            run(args, images / "mnt" / "work")
    finally:
        shutil.rmtree(images, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    """The run of `main`, in `work` (made here, removed at the end)."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ["UV_COMPILE_BYTECODE"] = "1"  # the plugin's default (the tests set 0)
    # Started with `uv run`: Ray's own uv run hook would make this a job of its own interpreter.
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    base = SETS_DIR / args.set
    results: dict[str, Any] = {
        "set": args.set,
        "disk": args.disk or "the host's",
        "machine": f"{os.cpu_count()} cores, {platform.platform()}, "
        f"Python {sys.version.split()[0]}",
        "ray": ray.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cases": {},
    }
    try:
        venvs = work / "venvs"
        a_seconds, _, _ = one_actor(base, venvs)
        results["a_full_seconds"] = round(a_seconds, 2)
        print(f"A ({args.set}) built and ready in {a_seconds:.1f}s", flush=True)
        for case, spec in CHANGES.items():
            b = changed_lock(base, spec, work / f"lock-{case}")
            nocompile = sync_no_compile(b, work / f"nocompile-{case}")
            seeded, venv, steps = one_actor(b, venvs)
            entries, walk = lstat_walk(venv)
            ready, _, _ = one_actor(b, venvs)  # the floor: B's venv ready, a new Ray session
            built = (Venv.at(venv).read_marker() or {}).get("built")
            full, full_venv, full_steps = one_actor(b, work / f"fresh-{case}")
            differ = differences(venv, full_venv)
            remove_tree(venv)  # the next case seeds from A again
            remove_tree(work / f"fresh-{case}")
            shutil.rmtree(work / f"nocompile-{case}")
            row = {
                "change": spec,
                "nocompile_seconds": round(nocompile, 2),
                "seeded_seconds": round(seeded, 2),
                "full_seconds": round(full, 2),
                "ready_seconds": round(ready, 2),
                "entries": entries,
                "lstat_walk_seconds": round(walk, 2),
                "seeded_over_nocompile": round(seeded / nocompile, 2),
                "seeded_over_full": round(seeded / full, 2),
                "built": built,
                "seeded_steps_s": step_seconds(steps),
                "full_steps_s": step_seconds(full_steps),
                "seeded_steps": steps,
                "full_steps": full_steps,
                "seeded_differs_from_full": differ,
            }
            results["cases"][case] = row
            print(json.dumps({case: row}), flush=True)
    finally:
        remove_tree(work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

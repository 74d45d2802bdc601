"""The seed's kernel work, and copying a seed instead: what a seeded build's `CacheDirs` and
`take_bytecode` cost in 1, 2 and 8 threads (`--threads`), and what a whole copy of the seed
venv costs: a hardlink copy (`cp -al`) on the venv dir's own file system, and a reflink clone
(`cp -a --reflink=always`) on a loop-mounted XFS, whose new inodes no index of the seed vouches
for, so a build from it must hash every file again (`manifest.scan` without an index).

No uv and no Ray: `--venv` is a ready venv of a venv dir (edit_run's lock A, say), and the new
venv is a hardlink copy of its tree less its bytecode and the plugin's files, the very inodes
that uv's sync links from its cache. Rounds interleave the thread counts.

    uv run python -m benchmarks.seed_work --venv <venv dir>/<key> --xfs \\
        --json benchmarks/results/seed-work.json

`--xfs` (root, `mkfs.xfs`): the XFS is made in a sparse file, mounted in a mount namespace of
its own (`unshare --mount`), so that no other process's namespace takes a copy of the mount, and
it is gone, with its file, when the run ends, whether it failed or not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ray_uv_plugin.building import seeding
from ray_uv_plugin.env.key import interpreter_tag
from ray_uv_plugin.store import freezing, manifest, tree
from ray_uv_plugin.store.layout import KEY_LENGTH, Venv, site_packages

NEW_KEY = "0" * KEY_LENGTH  # the new venv's name beside the seed, in the same venv dir


def without_bytecode(seed: Path, into: Path) -> None:
    """A hardlink copy of the venv `seed` less its `__pycache__` dirs and the plugin's files."""
    for dirpath, dirnames, filenames in os.walk(seed):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, seed)
        os.makedirs(into / rel, exist_ok=True)
        for name in filenames:
            if rel == "." and manifest.own(name):
                continue
            source = os.path.join(dirpath, name)
            if os.path.islink(source):
                os.symlink(os.readlink(source), into / rel / name)
            else:
                os.link(source, into / rel / name)


def take_rounds(seed: Path, rounds: int, counts: list[int]) -> dict[str, list[float]]:
    """`take_bytecode` seconds in each of `counts` threads, interleaved."""
    venv = seed.parent / NEW_KEY
    threads = seeding.THREADS
    took: dict[str, list[float]] = {}
    taken: dict[int, dict] = {}
    try:
        for _ in range(rounds):
            for count in counts:
                freezing.remove_tree(venv)
                without_bytecode(seed, venv)
                os.sync()
                seeding.THREADS = count
                site = site_packages(venv)
                assert site is not None
                records = seeding.record_digests(site)
                chosen = seeding.choose(Venv(seed.parent, NEW_KEY), interpreter_tag(), records)
                if chosen is None:
                    raise SystemExit(f"{seed} does not seed a copy of itself: not a ready venv?")
                listed = tree.collect(venv)
                start = time.perf_counter()
                dirs = seeding.CacheDirs(chosen, venv)
                result = seeding.take_bytecode(chosen, venv, listed, dirs)
                seconds = time.perf_counter() - start
                took.setdefault(f"threads_{count}", []).append(round(seconds, 2))
                taken.setdefault(count, result.known)
                print(f"take_bytecode, {count} thread(s): {seconds:.2f}s ({result.files} .pyc)")
    finally:
        seeding.THREADS = threads
        freezing.remove_tree(venv)
    if any(known != taken[counts[0]] for known in taken.values()):
        raise SystemExit("different thread counts took different files")
    return took


def copy_rounds(seed: Path, into: Path, how: str, rounds: int, hash_last: bool) -> dict[str, Any]:
    """Seconds of `cp -a` of `seed` to `into/copy` (`how`: `--reflink=always` or `-l`), of
    making its dirs writable as a build would, and (`hash_last`) of hashing every file of the
    last copy."""
    copy = into / "copy"
    found: dict[str, Any] = {"copy_s": [], "writable_s": []}
    try:
        for i in range(rounds):
            freezing.remove_tree(copy)
            os.sync()
            start = time.perf_counter()
            subprocess.run(["cp", "-a", how, str(seed), str(copy)], check=True)
            found["copy_s"].append(round(time.perf_counter() - start, 2))
            start = time.perf_counter()
            for dirpath, _, _ in os.walk(copy):
                os.chmod(dirpath, 0o755)
            found["writable_s"].append(round(time.perf_counter() - start, 2))
            if hash_last and i == rounds - 1:
                start = time.perf_counter()
                files = manifest.scan(copy)
                found["hash_every_file_s"] = round(time.perf_counter() - start, 2)
                found["entries"] = len(files)
                found["mb"] = round(sum(e.size for e in files.values()) / 1e6)
            print(f"cp -a {how}: {found}", flush=True)
    finally:
        freezing.remove_tree(copy)
    return found


def xfs_rounds(seed: Path, rounds: int) -> dict[str, Any]:
    """`copy_rounds` with reflinks on a loop-mounted XFS, in a child of its own mount
    namespace: the mount, and the sparse file under it, end with the child."""
    if shutil.which("mkfs.xfs") is None or shutil.which("unshare") is None:
        return {"skipped": "no mkfs.xfs or unshare on this host"}
    work = Path(tempfile.mkdtemp(prefix="seed-work-xfs-"))
    out = work / "found.json"
    script = f"""
set -e
truncate -s 10G {work}/xfs.img
mkfs.xfs -q -m reflink=1 {work}/xfs.img
mkdir {work}/mnt
mount -o loop {work}/xfs.img {work}/mnt
ionice -c3 cp -a {seed} {work}/mnt/seed
{sys.executable} -m benchmarks.seed_work --xfs-child {work}/mnt --rounds {rounds} > {out}
"""
    try:
        subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", script], check=True
        )
        return json.loads(out.read_text().splitlines()[-1])  # its last line
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, help="a ready venv of a venv dir (the seed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2,8", help="thread counts, comma-separated")
    parser.add_argument("--xfs", action="store_true", help="also clone on a loop-mounted XFS")
    parser.add_argument("--xfs-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/seed-work.json"))
    args = parser.parse_args()
    if args.xfs_child:  # in the XFS's own namespace: its seed copy is `<mount>/seed`
        seed = args.xfs_child / "seed"
        print(json.dumps(copy_rounds(seed, args.xfs_child, "--reflink=always", args.rounds, True)))
        return
    if args.venv is None:
        parser.error("--venv is required")
    seed = args.venv.resolve()
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "seed": str(seed),
    }
    counts = [int(n) for n in args.threads.split(",") if n.strip()]
    results["threads_default"] = seeding.THREADS
    results["take_bytecode_s"] = take_rounds(seed, args.rounds, counts)
    scratch = Path(tempfile.mkdtemp(prefix="seed-work-", dir=seed.parent.parent))
    try:
        results["hardlink_copy"] = copy_rounds(seed, scratch, "-l", args.rounds, False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.xfs:
        results["xfs_reflink_clone"] = xfs_rounds(seed, args.rounds)
    results["loadavg_end"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

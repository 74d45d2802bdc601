"""The CPU one ship stream costs, without Ray: pack a venv, then receive it into an `Unpacker`.

Shipping moves a venv at a node's link rate only if packing and unpacking keep up with it (a
1 Gbit/s link carries 125 MB/s). This packs a copy of a venv in one process, then feeds its
chunks to an `Unpacker` and installs nothing: the CPU seconds (user and system) and the wall
time of each side, the stream's size and members. Default venv: this checkout's `.venv`.
The copy is marked as a build marks a venv (`store.manifest`: the sender checks every file
against its build's manifest); `manifest` is what that costs a build: one pass over the venv.

    uv run python -m benchmarks.ship_stream [--venv DIR] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ray_uv_plugin.ship.archive import Chunk, Packer
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import manifest
from ray_uv_plugin.store.freezing import remove_tree
from ray_uv_plugin.store.layout import MARKER_FORMAT, Venv

ROOT = Path(__file__).resolve().parents[1]
KEY = "0123456789abcdef"  # the copy's name: the receiver takes only a venv key's shape


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _took(start: tuple[float, float, float]) -> dict[str, float]:
    user, system = _cpu()
    return {
        "user_s": round(user - start[0], 3),
        "system_s": round(system - start[1], 3),
        "wall_s": round(time.perf_counter() - start[2], 3),
    }


def mark_built(venv: Path) -> dict[str, float]:
    """Write the venv's manifest and a marker naming it, as a build does; what the manifest
    cost (hashing every file: warm in the page cache here, just copied)."""
    start = (*_cpu(), time.perf_counter())
    listed = manifest.write(venv, manifest.scan(venv))
    took = _took(start)
    venv.chmod(0o755)  # a marker makes the top dir read-only: a second one needs it writable
    Venv.at(venv).write_marker({"format": MARKER_FORMAT, "key": KEY, "manifest": listed})
    return took


def measure(venv: Path, work: Path) -> dict[str, Any]:
    """One build's manifest, one pack and one receive of `venv` (a dir named by a key), the
    receive under `work`."""
    build = mark_built(venv)
    start = (*_cpu(), time.perf_counter())
    packer = Packer(venv)
    chunks: list[Chunk] = [packer.next_chunk()]
    while not chunks[-1].last:
        chunks.append(packer.next_chunk())
    pack = _took(start)
    root = Path(tempfile.mkdtemp(dir=work))
    root.chmod(0o755)
    try:
        start = (*_cpu(), time.perf_counter())
        unpacker = Unpacker(root, KEY, "benchmark", sender_venv=str(venv))
        try:
            for c in chunks:
                unpacker.add(c.index, c.sha256, c.data)
            tree = unpacker.finish(len(chunks), packer.total, packer.whole_sha256)
        except BaseException:
            unpacker.abort()
            raise
        receive = _took(start)
        members = 0
        for folder, dirs, files in os.walk(tree):
            if folder == str(tree):  # the plugin's own (marker, manifest, its fragments): not
                dirs[:] = [name for name in dirs if not manifest.own(name)]
                files = [name for name in files if not manifest.own(name)]
            members += len(dirs) + len(files)
    finally:
        remove_tree(root)
    return {
        "stream_bytes": packer.total,
        "members": members,
        "manifest": build,
        "pack": pack,
        "receive": receive,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ship_stream", description=__doc__)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the venv to ship")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the samples here")
    args = parser.parse_args(argv)
    if not (args.venv / "bin" / "python").exists():
        print(f"{args.venv} is no venv (no bin/python): pass --venv DIR", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ruv-stream-"))
    try:
        venv = work / "src" / KEY
        shutil.copytree(args.venv, venv, symlinks=True)  # hardlinks go as content either way
        samples = []
        for _ in range(args.repeats):
            samples.append(measure(venv, work))
            print(json.dumps(samples[-1]), flush=True)
    finally:
        remove_tree(work)
    if args.json:
        args.json.write_text(json.dumps({"venv": str(args.venv), "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile the modules of a venv that have no bytecode yet, as uv's bytecode step compiles them:
a seeded build's last step (`agent.seeding`), so that a changed lock compiles what changed.

uv's step (`uv sync --compile-bytecode`) walks the whole site-packages and hands every `.py`
file to `compileall.compile_file` (errors muted, as pip does), in one worker per core. After a
seed gave the bytecode of every distribution that did not change, that walk is ~44,000 header
checks in Python workers for a few hundred new files. Here the walk lists each dir's
`__pycache__` once and only the sources without a `.pyc` of this interpreter are compiled, with
the same call and the same interpreter (the venv's base one, isolated and without `site`, so no
`.pth` file of the venv runs), and so the same bytecode: timestamp-checked, or hash-checked
where `SOURCE_DATE_EPOCH` is set, as `py_compile` decides for both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

# Reads one source path per line of the file it is given; a source that does not compile is
# left without bytecode, as uv and pip leave it (some wheels vendor Python 2 files).
_SCRIPT = """
import compileall, sys, warnings
warnings.filterwarnings("ignore")
with open(sys.argv[1], encoding="utf-8", errors="surrogateescape") as f:
    for line in f:
        compileall.compile_file(line.rstrip("\\n"), quiet=2)
"""


class CompileError(RuntimeError):
    """The compile workers failed or ran out of time: the build runs uv's own step instead."""


def missing(site: Path) -> Iterator[str]:
    """Every regular `.py` file below `site` (not in a `__pycache__`, links not followed)
    without a `.pyc` of this interpreter: what uv's step would compile."""
    tag = sys.implementation.cache_tag
    stack = [str(site)]
    while stack:
        folder = stack.pop()
        sources = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(entry.path)
                elif entry.name.endswith(".py") and entry.is_file(follow_symlinks=False):
                    sources.append(entry.name)
        if not sources:
            continue
        try:
            compiled = set(os.listdir(os.path.join(folder, "__pycache__")))
        except (FileNotFoundError, NotADirectoryError):
            compiled = set()
        for name in sources:
            if f"{name[:-3]}.{tag}.pyc" not in compiled:
                yield os.path.join(folder, name)


def compile_missing(site: Path, env: Mapping[str, str], timeout: float) -> int:
    """Compile what `missing` lists, in one worker per core; returns how many sources were
    handed to them. Raises CompileError if a worker fails or `timeout` passes (all are
    stopped)."""
    sources = [path for path in missing(site) if "\n" not in path]
    if not sources:
        return 0
    workers = min(len(os.sched_getaffinity(0)) or 1, max(1, len(sources) // 50))
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    scratch = tempfile.TemporaryDirectory(prefix="ray-uv-compile-")
    try:
        for i in range(workers):
            listed = os.path.join(scratch.name, f"sources-{i}")
            with open(listed, "w", encoding="utf-8", errors="surrogateescape") as f:
                f.writelines(f"{source}\n" for source in sources[i::workers])
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _SCRIPT, listed],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    env=dict(env),
                    cwd=site,
                )
            )
        for proc in procs:
            _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.returncode != 0:
                tail = stderr.decode(errors="replace").strip()[-500:]
                raise CompileError(f"a compile worker exited with {proc.returncode}: {tail}")
    except subprocess.TimeoutExpired:
        raise CompileError(f"compiling {len(sources)} sources ran past {timeout:.0f}s") from None
    except OSError as e:
        raise CompileError(f"the compile workers could not run: {e}") from e
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        scratch.cleanup()
    return len(sources)

"""Compile the modules of a venv that have no bytecode yet, as uv's bytecode step compiles them:
every build's last step, after `uv sync` without bytecode (and, for a seeded build, the seed's
bytecode: `building.seeding`), so that a changed lock compiles what changed, and the build knows
each `.pyc` it made (`store.accounting`).

uv's step (`uv sync --compile-bytecode`) walks the whole site-packages and hands every `.py`
file to `compileall.compile_file` (errors muted, as pip does), in one worker per core. After a
seed gave the bytecode of every distribution that did not change, that walk is ~44,000 header
checks in Python workers for a few hundred new files. Here the venv's entries, listed once by
the build (`store.tree`), give the sources without a `.pyc` of this interpreter, and only they
are compiled, with the same call and the same interpreter (the venv's base one, isolated and
without `site`, so no `.pth` file of the venv runs), and so the same bytecode: timestamp-checked,
or hash-checked where `SOURCE_DATE_EPOCH` is set, as `py_compile` decides for both.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from ray_uv_plugin.store import tree

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


def missing(listed: tree.Tree, site: Path, shipped: Collection[str] = ()) -> Iterator[str]:
    """Every regular `.py` file below `site` (not in a `__pycache__`, links not followed)
    without a `.pyc` of this interpreter, as `listed` (`store.tree`: the venv's entries) has
    them: what uv's step would compile. `shipped`: the `.pyc` files a wheel installed (absolute
    paths, as its RECORD lists them), each compiled again where uv's step would: where its
    header is not this interpreter's timestamp one of its source (`compileall.compile_file`'s
    check)."""
    tag = sys.implementation.cache_tag
    below = os.path.relpath(site, listed.root)
    prefix = "" if below == "." else f"{below}/"
    entries = listed.entries
    for rel, st in entries.items():
        if not (rel.endswith(".py") and rel.startswith(prefix) and stat.S_ISREG(st.st_mode)):
            continue
        folder, _, name = rel.rpartition("/")
        if "/__pycache__/" in f"/{folder[len(prefix) :]}/":
            continue  # uv's step does not look into a `__pycache__`
        cache = f"{folder}/__pycache__" if folder else "__pycache__"
        pyc = f"{cache}/{name[:-3]}.{tag}.pyc"
        if pyc not in entries:
            yield listed.path(rel)
        elif (
            shipped
            and listed.path(pyc) in shipped
            and not _fresh(listed.path(pyc), listed.path(rel))
        ):
            yield listed.path(rel)


def _fresh(pyc: str, source: str) -> bool:
    """Whether `compileall.compile_file` leaves `pyc` as it is: its first 12 bytes are this
    interpreter's magic, no flags and the source's mtime."""
    try:
        with open(pyc, "rb") as f:
            head = f.read(12)
        mtime = int(os.stat(source).st_mtime) & 0xFFFFFFFF
    except OSError:
        return False
    return head == importlib.util.MAGIC_NUMBER + bytes(4) + mtime.to_bytes(4, "little")


def compiled_path(source: str) -> str:
    """The `.pyc` that compiling `source` (`a/m.py`) writes: `a/__pycache__/m.<tag>.pyc`."""
    folder, _, name = source.rpartition("/")
    return f"{folder}/__pycache__/{name[:-3]}.{sys.implementation.cache_tag}.pyc"


def compile_sources(site: Path, sources: list[str], env: Mapping[str, str], timeout: float) -> None:
    """Compile `sources` (paths below `site`) in one worker per core: each one's bytecode is at
    `compiled_path`, unless it does not compile. Raises CompileError if a worker fails or
    `timeout` passes (all are stopped)."""
    sources = [path for path in sources if "\n" not in path]
    if not sources:
        return
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

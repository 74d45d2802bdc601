"""Finding and running the uv binary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray_uv_plugin.settings import UV_ENV_VAR, NodeSettings


class UvNotFoundError(FileNotFoundError):
    """No usable uv binary; the message says which setting to fix."""


def find_uv(settings: NodeSettings | None = None) -> str:
    """`RAY_UV_PLUGIN_UV`, else `uv` on PATH, else the binary of the `uv` package we depend on."""
    configured = (settings or NodeSettings.read()).uv_binary()
    if configured:
        if not os.path.isfile(configured) or not os.access(configured, os.X_OK):
            what = "is not executable" if os.path.isfile(configured) else "does not exist"
            raise UvNotFoundError(
                f"uv_project: {UV_ENV_VAR}={configured!r} {what} on this node: point it at the "
                "uv binary (`which uv`) in the environment of `ray start`, or unset it to use "
                "the uv that ray-uv-plugin installs."
            )
        return configured
    on_path = shutil.which("uv")
    if on_path:
        return on_path
    from uv import find_uv_bin

    return find_uv_bin()


_versions: dict[tuple[str, int, int], str] = {}


def uv_version(uv: str | None = None) -> str:
    """`uv 0.13.9 (...)`: part of every venv's key. Asked once per binary and process (a ready
    venv costs no subprocess after the first request a process serves)."""
    uv = uv or find_uv()
    st = os.stat(uv)
    ident = (os.path.realpath(uv), st.st_mtime_ns, st.st_size)
    if ident not in _versions:
        try:
            out = subprocess.run(
                [uv, "--version"], capture_output=True, text=True, timeout=60, check=True
            ).stdout
        except (subprocess.SubprocessError, OSError) as e:
            raise UvNotFoundError(
                f"uv_project: `{uv} --version` failed ({e}): check the uv binary on this node "
                f"({UV_ENV_VAR} or PATH)."
            ) from e
        _versions[ident] = out.strip()
    return _versions[ident]


def format_duration(seconds: float) -> str:
    """`432.0ms` or `2.41s`: timings as uv prints them, for our log lines and CLI output."""
    return f"{seconds * 1000:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


@dataclass(frozen=True)
class UvResult:
    returncode: int
    output: str
    seconds: float

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])


_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_SIGKILL = int(signal.SIGKILL)
if sys.platform == "linux":
    import ctypes

    # Resolved, and called once, here: `_die_with_parent` runs between fork() and exec() in the
    # agent, which has threads. Loading a library (or binding a symbol for the first time)
    # there would take the dynamic loader's lock, which another thread may have held at the
    # fork: the child would hang for ever.
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
    _prctl(_PR_GET_DUMPABLE)  # harmless; binds whatever ctypes' call path binds lazily
else:
    _prctl = None


def _die_with_parent() -> None:
    """In the child, before exec: a uv left running after the process that started it died
    would go on writing into a venv directory that the next request is rebuilding. Only calls
    what is resolved at import (see `_prctl`)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, _SIGKILL)


class UvTimeout(TimeoutError):
    """uv ran past its time limit and was killed, with every process it started."""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # uv and the builds it started
    except ProcessLookupError:
        pass


def run_uv(
    args: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> UvResult:
    """Run uv with stdout and stderr merged, as one would read it in a terminal; past
    `timeout` seconds, kill it and its children and raise `UvTimeout`. A uv killed by a signal
    that this function did not send (the OOM killer, an operator) is a `UvResult` with a
    negative `returncode`, as `subprocess` gives it."""
    start = time.perf_counter()
    lines: list[str] = []
    timed_out = threading.Event()  # set only by our own kill: a signal from anyone else is not

    def time_out(proc: subprocess.Popen) -> None:
        if proc.returncode is None:  # not reaped yet: its pid and group are still its own
            timed_out.set()
            _kill_group(proc)

    with subprocess.Popen(
        [find_uv(), *args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        preexec_fn=_die_with_parent,
        start_new_session=True,  # its own process group, so that a timeout ends its builds too
    ) as proc:
        timer = None if timeout is None else threading.Timer(timeout, time_out, (proc,))
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line.rstrip("\n"))
            proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if timer is not None:
                timer.cancel()
    if timed_out.is_set() and proc.returncode < 0:
        raise UvTimeout(f"ran past {timeout:.0f}s")
    return UvResult(proc.returncode, "".join(lines), time.perf_counter() - start)


class UvSyncError(RuntimeError):
    """`uv sync` did not give a usable venv; the message says why and what to do.

    `transient`: the same sync a moment later may succeed (it failed on the network, uv was
    killed by a signal that the plugin did not send, or its project dir was removed while uv
    ran); other failures are not run again at once (`failed_builds`)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class _Hint:
    needles: tuple[str, ...]  # substrings of uv's output, any of which means this
    text: str  # what the user should do
    transient: bool = False  # the same sync a moment later may succeed


# The first that matches is given.
_HINTS = [
    _Hint(
        ("needs to be updated, but `--locked`", "lockfile needs to be updated"),
        "uv.lock is out of date with pyproject.toml: run `uv lock` in the project, so that the "
        "nodes get the new lock with it (or set uv_project.frozen to use the lock as it is).",
    ),
    _Hint(
        ("incompatible with the project's Python requirement", "No interpreter found"),
        "the project's requires-python does not admit this node's Python: widen it and run "
        "`uv lock`, or run Ray on a matching interpreter.",
    ),
    _Hint(
        ("Hash mismatch for",),
        "a downloaded file does not have the hash that uv.lock records for it: the lock was "
        "edited, or the index (a mirror?) serves another file under that name. Regenerate the "
        "lock against the index the nodes use (`uv lock --refresh`) if you trust it.",
    ),
    _Hint(
        (
            "Failed to fetch",
            "Failed to download",
            "dns error",
            "Connection refused",
            "error sending request",
            "Could not connect",
            "tcp connect error",
            "Network connectivity is disabled",
            "Request failed after",
            "network timeout",
            "operation timed out",
            "Connection reset",
            "connection closed before message completed",
            "error decoding response body",
            "HTTP status server error",
        ),
        "the package index could not be reached and the uv cache on this node lacks the "
        "packages: give the node access to the index (env_vars UV_INDEX_URL / HTTPS_PROXY), or "
        "build the env while it has access (`ray-uv prepare`), or give the nodes a warm uv "
        "cache (UV_CACHE_DIR in the environment of `ray start`).",
        transient=True,
    ),
    _Hint(
        ("is not defined in the project's `optional-dependencies`",),
        "ask only for extras the project defines in [project.optional-dependencies].",
    ),
    _Hint(
        ("Group `", "is not defined in the project's `dependency-groups`"),
        "ask only for groups the project defines in [dependency-groups].",
    ),
]
_NO_HINT = _Hint((), "see uv's output below; `uv sync --locked` in the project reproduces it.")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def sync_failure(project: Path, result: UvResult) -> UvSyncError:
    """The error for a failed `uv sync`: what uv said, what to do, and whether the same sync a
    moment later may succeed (`transient`).

    A uv killed by a signal is one that `run_uv` did not send (its own timeout kill raises
    `UvTimeout`): the OOM killer or an operator, which need not strike again, so it is
    transient and the next request builds."""
    if result.returncode < 0:
        return UvSyncError(
            f"uv_project: `uv sync` for {project} did not finish: uv was killed by "
            f"{_signal_name(-result.returncode)} (not by the plugin: the OOM killer or an "
            "operator?). It is not remembered as a failure: the next try builds it again. "
            "If the node ran out of memory (`dmesg`), lower UV_CONCURRENT_BUILDS / MAX_JOBS "
            "in the job's env_vars or give the node more memory.\n"
            f"--- uv output (last lines) ---\n{result.tail()}",
            transient=True,
        )
    hint = next((h for h in _HINTS if any(n in result.output for n in h.needles)), _NO_HINT)
    return UvSyncError(
        f"uv_project: `uv sync` failed for {project} (exit {result.returncode}): {hint.text}\n"
        f"--- uv output (last lines) ---\n{result.tail()}",
        transient=hint.transient,
    )

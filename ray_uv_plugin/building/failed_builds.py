"""Builds that just failed, remembered for a minute by the process that ran them.

Ray's runtime-env agent runs a failed setup up to 3 times, 1 s apart (`RUNTIME_ENV_RETRY_TIMES`).
A `uv sync` that failed for a reason that a second does not fix (a package that does not build,
a hash mismatch, a full disk, a build past its time limit) would run three times, and the caller
would wait three builds (or fill the disk three times) for one error. Its retries get the same
error at once instead. A failure on the network, of a uv killed by a signal that the plugin did
not send, or in a project dir that was removed while uv ran, is not remembered: the next try may
get through.

Per process (the node's agent), per venv path (`<venv dir>/<key>`) and per everything else that
reached uv (`sync_inputs`: the `uv sync` command, with its whole environment, and the uv binary):
only the same sync would fail the same way. A job that changes a setting outside the key (a
timeout, a proxy, an index's credentials) gets a build of its own. After
`_remember_seconds()` the next request builds again, e.g. once the disk has been freed.

Ray's agent keeps a failed runtime_env for longer (`ray_failure_cache_seconds`, 600 s by
default): an identical runtime_env does not even reach the plugin until then, which the message
of a remembered failure says, with how to try again at once.

Ray's own retries of a request show its driver the last try's error: the plugin gives them the
first try's error as it was (`RememberedFailure.first`), since for the user it is one try. Only
another request, which uv did not run for, is told why (`RememberedFailure`'s note).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ray_uv_plugin.env.key import VenvRequest
from ray_uv_plugin.env.uv import UvSyncError, find_uv
from ray_uv_plugin.settings import NodeSettings
from ray_uv_plugin.store.layout import Venv

RAY_CACHE_ENV = "BAD_RUNTIME_ENV_CACHE_TTL_SECONDS"  # Ray's own setting, read by its agent

# (venv, sync_inputs) -> (when, the error's message)
_failed: dict[tuple[Venv, str], tuple[float, str]] = {}
_guard = threading.Lock()  # builds fail in threads of their own


class RememberedFailure(UvSyncError):
    """A sync that failed a moment ago with the same settings, not run again: `first` is that
    sync's error, and the message adds why uv did not run for this request."""

    def __init__(self, first: str, note: str) -> None:
        super().__init__(f"{first}\n{note}")
        self.first = first


def _remember_seconds(settings: NodeSettings | None = None) -> float:
    """How long a failure is remembered: `RAY_UV_PLUGIN_FAILED_BUILD_MEMO_S`, else 60 s."""
    return (settings or NodeSettings.read()).failed_build_memo_s()


def ray_failure_cache_seconds() -> int | None:
    """How long Ray's agent answers an identical runtime_env with its failure without setting
    it up again, as the agent reads it (it imports these consts at start, from its
    environment); None where this Ray keeps it elsewhere."""
    try:
        from ray._private.runtime_env.agent import runtime_env_consts
    except ImportError:
        return None
    return getattr(runtime_env_consts, RAY_CACHE_ENV, None)


def _uv_binary() -> str:
    """The uv that would run, with what tells a replaced one apart; never raises (a missing uv
    is the build's error to report)."""
    try:
        uv = find_uv()
        st = os.stat(uv)
    except OSError as e:
        return f"no uv: {e}"
    return f"{os.path.realpath(uv)} {st.st_mtime_ns} {st.st_size}"


def sync_inputs(request: VenvRequest, venv: Path) -> str:
    """A digest of everything of `request` that reaches uv, the key's inputs and the rest: its
    `uv sync` into `venv` (`VenvRequest.sync_command`: the flags, the whole environment uv runs
    in, its cwd) and the uv binary; and the job's env_vars, so that changing one asks for a new
    try (as it does of Ray's agent)."""
    command = request.sync_command(venv)
    inputs = {
        "args": list(command.args),
        "env": _as_retried(command.env),
        "cwd": str(command.cwd),
        "job_env": _as_retried(request.job_env_vars),  # `"RETRY": "1"` asks for a new try
        "uv": _uv_binary(),
    }
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


def _as_retried(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """`env`'s items as each of Ray's tries of one request gives them. Ray's working_dir plugin
    puts the working_dir first on the request's PYTHONPATH in place, before this plugin runs,
    and again on every try: `wd`, then `wd:wd`. With each path once, every try has the same
    inputs, and a request whose PYTHONPATH differs still has its own."""
    items = dict(env)
    if "PYTHONPATH" in items:
        items["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(items["PYTHONPATH"].split(os.pathsep)))
    return sorted(items.items())


def remember(venv: Venv, inputs: str, message: str, settings: NodeSettings | None = None) -> None:
    """Remember that the sync of `venv` with `inputs` (`sync_inputs`) failed with `message`
    (for as long as `settings`, else this process's, say)."""
    now = time.monotonic()
    window = _remember_seconds(settings)
    with _guard:
        for old in [k for k, (when, _) in _failed.items() if now - when >= window]:
            del _failed[old]
        _failed[(venv, inputs)] = (now, message)


def recent(
    venv: Venv, inputs: str, settings: NodeSettings | None = None
) -> RememberedFailure | None:
    """The error of the last sync of `venv` with `inputs` if it failed less than
    `_remember_seconds(settings)` ago, with what to do to try again now; else None."""
    window = _remember_seconds(settings)
    with _guard:
        when, message = _failed.get((venv, inputs), (float("-inf"), ""))  # `remember` expires
    ago = time.monotonic() - when
    if ago >= window:
        return None
    return RememberedFailure(
        message, _not_run_again(venv, ago, window, ray_failure_cache_seconds())
    )


def _not_run_again(venv: Venv, ago: float, window: float, ray_seconds: int | None) -> str:
    ray_keeps = f"{ray_seconds}s" if ray_seconds is not None else "a while"
    return (
        f"(uv was not run again for this request: a request with the same build settings "
        f"failed {ago:.0f}s ago with the error above, and a failed sync of {venv.key} is "
        f"remembered for {window:.0f}s. Ray answers an identical runtime_env with this error "
        f"for {ray_keeps} ({RAY_CACHE_ENV}): to try again at once, change the runtime_env's "
        'env_vars (e.g. add "RETRY": "1"), or lower it in the environment of `ray start`.)'
    )

"""Connecting an operator's command to a running cluster, and reading what Ray says back.

`prepare`, `watch` and the demo start a driver of their own whose job runtime_env must
be exactly theirs (no `uv run` or RAY_RUNTIME_ENV_HOOK hook may rewrite it), and that fails at
once with what to do where no cluster answers, instead of Ray's minutes of retries.
"""

from __future__ import annotations

import os
import socket
from typing import Any


class ConnectError(RuntimeError):
    """No cluster to talk to, or Ray refused the command's job: the message says what to do."""


def clean_error(exc: BaseException) -> str:
    """The useful part of a Ray error: from our plugin's message on, without Ray's preamble."""
    text = str(exc)
    start = text.find("uv_project")
    if start > 0:
        text = text[start:]
    return text.strip()


def init_unhooked(**kwargs: Any) -> None:
    """`ray.init(**kwargs)` for a driver of this package's own (`prepare`, the demo), whose
    job runtime_env is exactly `kwargs["runtime_env"]`: no driver hook may rewrite it.

    Under `uv run` (`uv run ray-uv prepare --project P` in another uv project), Ray's own hook
    would give the job that project's `uv run` as py_executable and refuse a working_dir P
    without its pyproject.toml; a RAY_RUNTIME_ENV_HOOK (ours makes the `uv run` project the
    job's uv_project) would change the job as well. Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV
    when it is imported, so setting the env var here would come too late: its constant is off
    for this call only (a caller's own later `ray.init` keeps its hook), and
    `_skip_env_hook` skips RAY_RUNTIME_ENV_HOOK (Ray 2.44.1 has only that one).
    """
    import ray
    from ray._private import ray_constants

    missing = object()
    saved = getattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", missing)
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    try:
        ray.init(_skip_env_hook=True, **kwargs)
    finally:
        if saved is missing:
            del ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV
        else:
            ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = saved


def connect(address: str | None, runtime_env: dict[str, Any] | None) -> None:
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    hint = (
        'start one with `eval "$(ray-uv plugin-config --shell)"; ray start --head`, '
        "or pass --address (the GCS address `host:6379`, or set RAY_ADDRESS)."
    )
    reachable_or_die(target, hint)
    try:
        init_unhooked(
            address=target,
            runtime_env=runtime_env,
            log_to_driver=False,
            logging_level="WARNING",
            namespace="ray-uv-prepare",
        )
    except ConnectionError as e:
        raise ConnectError(f"cannot connect to a Ray cluster at {target!r} ({e}): {hint}") from e
    except Exception as e:  # noqa: BLE001 - connected or not, Ray refused the job: say why
        raise ConnectError(f"ray.init(address={target!r}) failed: {type(e).__name__}: {e}") from e


def reachable_or_die(address: str, hint: str, timeout: float = 5.0) -> None:
    """Ray retries an unreachable GCS for minutes; a `host:port` we can check at once."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "ray://...": Ray answers those quickly itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): {hint}"
        ) from e

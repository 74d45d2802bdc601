"""Connecting an operator's command to a running cluster, and reading what Ray says back.

`prepare`, `watch` and the demo start a driver of their own whose job runtime_env must
be exactly theirs (no `uv run` or RAY_RUNTIME_ENV_HOOK hook may rewrite it), and that fails at
once with what to do where no cluster answers, or where the cluster requires a token this shell
does not send (`auth`), instead of Ray's minutes of retries.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ray_uv_plugin.cluster.auth import (
    TokenAuthError,
    check_token_auth,
    is_refused_token,
    refused_message,
)


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
    """Connect this process to the cluster at `address` (else RAY_ADDRESS, else the local one)
    for a command's own job; `ConnectError` with what to do where it cannot."""
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    hint = (
        'start one with `eval "$(ray-uv plugin-config --shell)"; ray start --head`, '
        "or pass --address (the GCS address `host:6379`, or set RAY_ADDRESS)."
    )
    answered = _reachable_or_die(target, hint)
    gcs = target if answered else local_gcs_address(target)
    if gcs:
        try:
            check_token_auth(gcs)
        except TokenAuthError as e:
            raise ConnectError(str(e)) from e
    try:
        init_unhooked(
            address=target,
            runtime_env=runtime_env,
            log_to_driver=False,
            logging_level="WARNING",
            namespace="ray-uv-prepare",
        )
    except Exception as e:  # noqa: BLE001 - connected or not, Ray refused the job: say why
        if is_refused_token(e):
            raise ConnectError(refused_message(gcs or target)) from e
        if isinstance(e, ConnectionError) and answered:
            raise ConnectError(
                f"a process answers at {target}, but Ray could not connect to a cluster there "
                f"({e}{chained(e)}): is it the GCS address (`host:6379` by default, not the "
                "dashboard's 8265)?"
            ) from e
        if isinstance(e, ConnectionError):
            raise ConnectError(
                f"cannot connect to a Ray cluster at {target!r} ({e}): {hint}"
            ) from e
        raise ConnectError(f"ray.init(address={target!r}) failed: {type(e).__name__}: {e}") from e


def chained(exc: BaseException) -> str:
    """The first line of what Ray chained under its error, if anything."""
    cause = exc.__cause__
    if cause is None or not str(cause).strip():
        return ""
    return f": {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"


def local_gcs_address(target: str) -> str | None:
    """The GCS address `ray.init(address="auto")` would connect to, in the token mode it would
    connect in (it turns token mode on where `~/.ray/auth_token` exists); None where there is
    none to find, or `target` is no `auto` (`ray://...`: Ray Client, which has its own)."""
    if target != "auto":
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        try:
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )
        except ImportError:  # a Ray before token authentication
            pass
        else:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        return canonicalize_bootstrap_address(target)
    except Exception:  # noqa: BLE001 - none to find: ray.init says so itself
        return None


def _reachable_or_die(address: str, hint: str, timeout: float = 5.0) -> bool:
    """Ray retries an unreachable GCS for minutes; a `host:port` we can check at once. True if
    `address` is one and it answered; False for one it cannot check (`auto`, `ray://...`)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return False  # "auto", "ray://...": Ray answers those quickly itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): {hint}"
        ) from e
    return True

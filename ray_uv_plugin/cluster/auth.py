"""Token authentication, from the side of a shell that connects to a cluster.

Since Ray 2.52 a cluster may require a token (`RAY_AUTH_MODE=token`): every process that talks to
it, an operator's `ray-uv prepare` included, must run in token mode and hold the cluster's token
(`RAY_AUTH_TOKEN`, or a file: `RAY_AUTH_TOKEN_PATH`, default `~/.ray/auth_token`). A shell that
lacks either gets nothing useful from `ray.init`: its GCS client retries the refused handshake 20
times, a second apart, printing Ray's `InvalidAuthToken` warning each time, and then says it
failed to connect; in token mode without a token Ray's core aborts the process. So before
`ray.init`, `check_token_auth` asks the GCS once (one handshake, milliseconds) and turns a
refusal into one message that names the cause and what to set.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"  # Ray's default (`Path.home() / ".ray/auth_token"`)
# A GCS answers a handshake in milliseconds; a port that is no GCS's never does (Ray's client
# gives up after its own 30 s or more). Past this, `ray.init` is left to say what it finds.
HANDSHAKE_WAIT_S = 10.0
WHERE_THE_TOKEN_IS = (
    "`ray get-auth-token` on the head prints the cluster's token; on KubeRay it is `auth_token` "
    "in the Secret named after the RayCluster"
)
SET_THE_TOKEN = (
    f"set {TOKEN_ENV} to the cluster's token, or {TOKEN_PATH_ENV} to a file that holds it "
    f"(default {DEFAULT_TOKEN_FILE})"
)


class TokenAuthError(RuntimeError):
    """The cluster requires a token this shell does not send: the message says what to set."""


def token_source(environ: Mapping[str, str] = os.environ) -> str:
    """Where Ray reads this shell's token from, in Ray's order, for a message."""
    if environ.get(TOKEN_ENV):
        return TOKEN_ENV
    if environ.get(TOKEN_PATH_ENV):
        return f"{environ[TOKEN_PATH_ENV]} ({TOKEN_PATH_ENV})"
    return DEFAULT_TOKEN_FILE


def in_token_mode() -> bool:
    """Whether this process talks to clusters in token mode (`RAY_AUTH_MODE=token`, or set by
    Ray for a local `ray.init`); False on a Ray without token authentication."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:
        return False
    return get_authentication_mode() == AuthenticationMode.TOKEN


def refused_message(address: str, environ: Mapping[str, str] = os.environ) -> str:
    """What to tell a shell whose handshake the cluster at `address` refused."""
    if in_token_mode():
        return (
            f"the Ray cluster at {address} refused this shell's token (from "
            f"{token_source(environ)}): it is not the cluster's. {SET_THE_TOKEN[0].upper()}"
            f"{SET_THE_TOKEN[1:]}; {WHERE_THE_TOKEN_IS}."
        )
    mode = environ.get(MODE_ENV)
    has = f"{MODE_ENV}={mode}" if mode else f"no {MODE_ENV}"
    if environ.get(TOKEN_ENV) or environ.get(TOKEN_PATH_ENV):
        has += f" (Ray sends the token of {token_source(environ)} only in token mode)"
    return (
        f"the Ray cluster at {address} answered, and it requires token authentication, but "
        f"this shell has {has}: set {MODE_ENV}=token, and {SET_THE_TOKEN}; "
        f"{WHERE_THE_TOKEN_IS}."
    )


def _missing_token_message() -> str:
    return (
        f"{MODE_ENV}=token is set in this shell, but it holds no token: {SET_THE_TOKEN}; "
        f"{WHERE_THE_TOKEN_IS}."
    )


def check_token_auth(address: str) -> None:
    """Raise `TokenAuthError` if the GCS at `address` (`host:port`) refuses this shell: no token
    mode, no token, or the wrong token. Anything else (no answer in time, a Ray without token
    auth) passes, and `ray.init` says what it finds."""
    try:
        from ray._raylet import AuthenticationTokenLoader, GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray before token authentication (2.52)
        return
    if in_token_mode():  # without a token, Ray's core would abort the process
        try:
            has_token = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
        except AuthenticationError as e:  # RAY_AUTH_TOKEN_PATH names no file, or an empty one
            raise TokenAuthError(f"{e.message}: {SET_THE_TOKEN}; {WHERE_THE_TOKEN_IS}.") from e
        if not has_token:
            raise TokenAuthError(_missing_token_message())
    outcome: list[BaseException | None] = []

    def handshake() -> None:
        try:
            GcsClient(address=address)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(e)

    with _quiet_stderr():  # Ray's core logs each refusal as a warning of its own
        thread = threading.Thread(target=handshake, name="ray-uv-auth-check", daemon=True)
        thread.start()
        thread.join(HANDSHAKE_WAIT_S)
    if outcome and isinstance(outcome[0], AuthenticationError):
        raise TokenAuthError(refused_message(address)) from outcome[0]


def is_refused_token(exc: BaseException) -> bool:
    """Whether Ray's error, or one it chains, is a refused token (`ray.init`'s retries wrap it
    in a ConnectionError over a RuntimeError that has it only in its text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null: Ray's core writes there, not to `sys.stderr`."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)

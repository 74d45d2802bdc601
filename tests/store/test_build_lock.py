"""`store.build_lock` in one process: flock is per open file, so two `BuildLock`s of one path
exclude each other here as they do across processes."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV, DEFAULT_BUILD_TIMEOUT, VenvDirError
from ray_uv_plugin.store.build_lock import (
    BuildLock,
    LockTimeout,
    build_timeout,
    hold_shared,
    is_held,
)


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    return tmp_path / "0123456789abcdef.lock"


def test_one_holder_at_a_time_and_it_says_who(lock: Path) -> None:
    first, second = BuildLock(lock), BuildLock(lock)
    assert is_held(lock) is False  # no file yet: never created by asking
    assert not lock.exists()
    assert first.try_acquire() and first.held
    assert not second.try_acquire() and not second.held
    assert is_held(lock) is True
    assert second.holder() == f"pid {os.getpid()} on {socket.gethostname()}"
    assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
    first.release()
    assert is_held(lock) is False
    assert second.try_acquire()
    second.release()
    second.release()  # twice is harmless


def test_a_lock_file_unlinked_while_held_guards_nothing(lock: Path) -> None:
    """`gc` unlinks a lock file it holds: the next builder takes a new one."""
    first = BuildLock(lock)
    assert first.try_acquire()
    lock.unlink()
    second = BuildLock(lock)
    assert second.try_acquire()
    first.release()
    second.release()


def test_an_unknown_holder_is_said_so(lock: Path) -> None:
    lock.write_text("")
    assert BuildLock(lock).holder() == "unknown pid"
    assert BuildLock(lock.with_name("missing.lock")).holder() == "unknown pid"


def test_a_shared_hold_keeps_builders_out_and_yields_to_one(lock: Path) -> None:
    with pytest.raises(FileNotFoundError):
        hold_shared(lock)  # no lock file: no venv to read
    builder = BuildLock(lock)
    assert builder.try_acquire()
    with pytest.raises(BlockingIOError):
        hold_shared(lock)
    builder.release()
    fd = hold_shared(lock)
    try:
        assert not BuildLock(lock).try_acquire()
        assert is_held(lock) is True
    finally:
        os.close(fd)
    assert is_held(lock) is False


def test_a_wait_is_bounded_and_names_the_holder(lock: Path) -> None:
    holder = BuildLock(lock)
    assert holder.try_acquire()
    try:
        with pytest.raises(LockTimeout, match=rf"another build of the key \(pid {os.getpid()}"):
            asyncio.run(BuildLock(lock).acquire_async(0.1, "the key"))
    finally:
        holder.release()
    waiter = BuildLock(lock)
    asyncio.run(waiter.acquire_async(0.1, "the key"))
    assert waiter.held
    waiter.release()


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, DEFAULT_BUILD_TIMEOUT), ("", DEFAULT_BUILD_TIMEOUT), ("90", 90.0)]
)
def test_build_timeout(monkeypatch: pytest.MonkeyPatch, value: str | None, seconds: float) -> None:
    if value is None:
        monkeypatch.delenv(BUILD_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(BUILD_TIMEOUT_ENV, value)
    assert build_timeout() == seconds


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_build_timeout_says_what_to_set(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(BUILD_TIMEOUT_ENV, value)
    with pytest.raises(VenvDirError, match=f"{BUILD_TIMEOUT_ENV}='{value}' must be a number"):
        build_timeout()

"""`env.lock_memo`: what is derived from a uv.lock is derived once per lock content. No Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_uv_plugin.env import lock_memo
from ray_uv_plugin.env.lock_memo import LockMemo
from ray_uv_plugin.env.project import ProjectFiles


def files(lock: bytes) -> ProjectFiles:
    return ProjectFiles(Path("/p"), b"", lock)


def test_a_lock_is_derived_once_per_content_and_a_failure_again() -> None:
    asked: list[bytes] = []

    def derive(f: ProjectFiles) -> int:
        asked.append(f.lock)
        if f.lock == b"bad":
            raise ValueError("no lock uv wrote")
        return len(f.lock)

    memo = LockMemo(derive)
    assert memo(files(b"abc")) == memo(files(b"abc")) == 3
    assert asked == [b"abc"]  # another ProjectFiles of the same bytes: remembered
    for _ in range(2):
        with pytest.raises(ValueError):
            memo(files(b"bad"))
    assert asked == [b"abc", b"bad", b"bad"]


def test_the_memo_keeps_a_bounded_number_of_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_memo, "KEPT", 2)
    asked: list[bytes] = []
    memo = LockMemo(lambda f: asked.append(f.lock))
    for lock in (b"a", b"b", b"c", b"a"):
        memo(files(lock))
    assert asked == [b"a", b"b", b"c", b"a"]  # full at c: started again, so a is derived anew

"""What is derived from a uv.lock, remembered by the lock's content: a warm request parses
nothing (`project.locked_sources`, `source_builds`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # `project` imports this
    from ray_uv_plugin.env.project import ProjectFiles

T = TypeVar("T")
KEPT = 64  # lock contents remembered; past that, the memo starts again


class LockMemo(Generic[T]):
    """`derive(files)`, remembered by `files.lock_digest`; a `derive` that raises is asked
    again next time."""

    def __init__(self, derive: Callable[[ProjectFiles], T]) -> None:
        self._derive = derive
        self._found: dict[str, T] = {}
        self._guard = threading.Lock()

    def __call__(self, files: ProjectFiles) -> T:
        with self._guard:
            if files.lock_digest in self._found:
                return self._found[files.lock_digest]
        found = self._derive(files)
        with self._guard:
            if len(self._found) >= KEPT:
                self._found.clear()
            self._found[files.lock_digest] = found
        return found

"""A venv's entries, listed once: every file, dir and link below it with its `lstat`.

A build reads the same tree three times over: the listing of modules without bytecode
(`building.bytecode.missing`), the manifest's pass (`store.manifest.scan`) and the freeze
(`store.freezing.freeze`). A 425-package venv holds ~134,000 entries, and each walk of them cost
1-1.5 s of `lstat`s and per-entry Python. A build lists the tree once (`collect`), after uv and
the seed made it, and once its compile step has written bytecode, lists again only the
`__pycache__` dirs that step wrote into (`Tree.relist`): those three passes then read this
value. Nothing but the build writes a venv while it is built (its dir is the plugin's,
`store.trust`); a step that may write anywhere (uv's own bytecode step, which runs the venv's
`.pth` files) is followed by a new `collect`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Tree:
    """The entries below `root` (never following a link): path relative to `root` -> its
    `lstat`, each dir before what it holds (so a reversed pass sees a dir after its contents)."""

    root: str
    entries: dict[str, os.stat_result] = field(default_factory=dict)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def relist(self, paths: Iterable[str]) -> None:
        """Each of `paths` (relative to `root`) taken again as it is now, and where it is a dir,
        everything below it: for a step that added or replaced entries only there. A path that
        is gone is dropped (what was below it is not looked for: such a step adds, never
        removes)."""
        for rel in paths:
            try:
                st = os.lstat(self.path(rel))
            except FileNotFoundError:
                self.entries.pop(rel, None)
                continue
            self.entries[rel] = st
            if stat.S_ISDIR(st.st_mode):
                self._list(rel)

    def _list(self, top: str) -> None:
        stack = [top]
        while stack:
            folder = stack.pop()
            prefix = f"{folder}/" if folder else ""
            with os.scandir(self.path(folder) if folder else self.root) as found:
                for entry in found:
                    rel = prefix + entry.name
                    st = entry.stat(follow_symlinks=False)  # the one lstat of this entry
                    self.entries[rel] = st
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(rel)


def collect(root: Path | str) -> Tree:
    """Every entry below `root`, each `lstat`ed once (`os.scandir`); an error (a dir that cannot
    be read, an entry removed while listed) is raised, as a build's walk raises it."""
    tree = Tree(str(root))
    tree._list("")
    return tree

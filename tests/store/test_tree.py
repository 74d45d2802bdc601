"""A venv's entries listed once (`store.tree`), and the build's passes that read that listing
instead of the disk: the modules without bytecode, the manifest and the freeze. Real files; no
Ray, no uv."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from ray_uv_plugin.building import bytecode
from ray_uv_plugin.store import freezing, manifest, tree

SITE = "lib/python3.11/site-packages"
TAG = sys.implementation.cache_tag


def _venv(root: Path) -> Path:
    venv = root / "venv"
    pkg = venv / SITE / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr\n")
    (venv / SITE / "top.py").write_text("x = 1\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "done.py").write_text("y = 2\n")
    (pkg / "__pycache__" / f"done.{TAG}.pyc").write_bytes(b"bytecode")
    (pkg / "__pycache__" / "stray.py").write_text("not a module of the package\n")
    os.symlink("/usr/bin/python3", venv / "bin" / "python")
    os.symlink(str(pkg), venv / SITE / "linked_pkg")  # a link to a dir: not followed
    (venv / ".ray-uv-ready").write_text("{}")  # the plugin's own: never in a manifest
    return venv


def test_every_entry_is_listed_once_with_its_lstat_and_a_dir_before_what_it_holds(
    tmp_path: Path,
) -> None:
    venv = _venv(tmp_path)
    listed = tree.collect(venv)
    every = {
        str(p.relative_to(venv))
        for p in venv.rglob("*")
        if not any(part == "linked_pkg" for part in p.relative_to(venv).parts[4:])
    }
    assert set(listed.entries) == every
    assert stat.S_ISLNK(listed.entries[f"{SITE}/linked_pkg"].st_mode)
    assert stat.S_ISLNK(listed.entries["bin/python"].st_mode)
    assert listed.entries[f"{SITE}/top.py"].st_ino == os.lstat(venv / SITE / "top.py").st_ino
    order = list(listed.entries)
    for rel in order:
        parent = rel.rpartition("/")[0]
        assert not parent or order.index(parent) < order.index(rel), rel


def test_relist_takes_what_a_step_added_or_replaced_there(tmp_path: Path) -> None:
    """The compile step writes `.pyc` files (new ones, or one replaced by a new inode) into
    `__pycache__` dirs, some of them new: listing those dirs again gives what a new walk
    gives."""
    venv = _venv(tmp_path)
    listed = tree.collect(venv)
    pkg = venv / SITE / "pkg"
    (pkg / "__pycache__" / f"__init__.{TAG}.pyc").write_bytes(b"new")
    replaced = pkg / "__pycache__" / f"done.{TAG}.pyc"
    (pkg / "tmp.pyc").write_bytes(b"again")
    os.replace(pkg / "tmp.pyc", replaced)
    (venv / SITE / "__pycache__").mkdir()
    (venv / SITE / "__pycache__" / f"top.{TAG}.pyc").write_bytes(b"top")
    listed.relist([f"{SITE}/pkg/__pycache__", f"{SITE}/__pycache__", f"{SITE}/gone"])
    again = tree.collect(venv)
    assert {rel: st.st_ino for rel, st in listed.entries.items()} == {
        rel: st.st_ino for rel, st in again.entries.items()
    }
    order = list(listed.entries)
    assert order.index(SITE) < order.index(f"{SITE}/__pycache__")


def test_the_builds_passes_read_the_listing_not_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listed once, the venv is not walked again: the modules without bytecode, the manifest
    and the freeze come from the listing, and are what a walk of the disk gives."""
    venv = _venv(tmp_path)
    site = venv / SITE
    walked = manifest.scan(venv)
    missing = sorted(bytecode.missing(tree.collect(site), site))
    assert missing == [str(site / "pkg" / "__init__.py"), str(site / "top.py")]

    listed = tree.collect(venv)

    def no_walk(*args: object, **kwargs: object) -> None:
        raise AssertionError("walked the venv again")

    try:
        with monkeypatch.context() as patched:
            for name in ("scandir", "walk", "listdir", "lstat"):
                patched.setattr(os, name, no_walk)
            assert manifest.scan(listed) == walked
            assert sorted(bytecode.missing(listed, site)) == missing
            freezing.freeze(venv, {f"{SITE}/pkg/__pycache__/done.{TAG}.pyc"}, listed)
        pyc = site / "pkg" / "__pycache__" / f"done.{TAG}.pyc"
        assert stat.S_IMODE(os.lstat(pyc).st_mode) == 0o444
        assert stat.S_IMODE(os.lstat(pyc.parent).st_mode) & 0o222 == 0
        assert manifest.scan(venv) == walked  # freezing changes no entry a manifest lists
    finally:
        freezing.thaw(venv)

"""A seeded build compiles only the modules left without bytecode (`building.bytecode`), as uv's
bytecode step would: the same interpreter, the same call. Real files and real Python workers;
no Ray, no uv. The whole seeded build: tests/building/test_seeding.py."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from ray_uv_plugin.building import bytecode
from ray_uv_plugin.store import tree


def _pyc(source: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(source)))


def _tree(site: Path) -> dict[str, Path]:
    (site / "pkg" / "sub").mkdir(parents=True)
    (site / "pkg" / "__pycache__").mkdir()
    files = {
        "top": site / "top.py",
        "init": site / "pkg" / "__init__.py",
        "done": site / "pkg" / "done.py",
        "deep": site / "pkg" / "sub" / "deep.py",
        "broken": site / "pkg" / "broken.py",
    }
    for name, path in files.items():
        path.write_text("print 'python 2'\n" if name == "broken" else f"NAME = {name!r}\n")
    _pyc(files["done"]).write_bytes(b"already here")  # a seed's: never touched
    (site / "pkg" / "data.txt").write_text("not a module")
    os.symlink(files["top"], site / "pkg" / "linked.py")  # uv's walk does not follow links
    return files


def test_only_the_modules_without_bytecode_are_compiled(tmp_path, monkeypatch) -> None:
    site = tmp_path / "site-packages"
    files = _tree(site)
    listed = sorted(bytecode.missing(tree.collect(site), site))
    expected = sorted(str(files[n]) for n in ("top", "init", "deep", "broken"))
    assert listed == expected
    bytecode.compile_sources(site, listed, dict(os.environ), timeout=120)
    assert {bytecode.compiled_path(source) for source in listed} == {
        str(_pyc(files[n])) for n in ("top", "init", "deep", "broken")
    }
    for name in ("top", "init", "deep"):
        data = _pyc(files[name]).read_bytes()
        assert data[:4] == importlib.util.MAGIC_NUMBER, name
        assert int.from_bytes(data[8:12], "little") == int(files[name].stat().st_mtime)
    assert _pyc(files["done"]).read_bytes() == b"already here"
    assert not _pyc(files["broken"]).exists()  # left as uv leaves it
    assert list(bytecode.missing(tree.collect(site), site)) == [str(files["broken"])]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert list(bytecode.missing(tree.collect(empty), empty)) == []
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    bytecode.compile_sources(empty, [], {}, 10)  # no worker started


def test_no_pth_file_of_the_venv_runs_while_it_compiles(tmp_path) -> None:
    """The workers run without `site`: a `.pth` line in the venv is never executed."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "m.py").write_text("x = 1\n")
    flag = tmp_path / "ran"
    (site / "evil.pth").write_text(f"import os; open({str(flag)!r}, 'w')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    sources = list(bytecode.missing(tree.collect(site), site))
    bytecode.compile_sources(site, sources, env, timeout=120)
    assert _pyc(site / "m.py").exists() and not flag.exists()


def test_workers_that_cannot_run_raise_compile_error(tmp_path, monkeypatch) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(bytecode.CompileError, match="could not run"):
        bytecode.compile_sources(site, [str(site / "m.py")], {}, timeout=30)
    assert not _pyc(site / "m.py").exists()

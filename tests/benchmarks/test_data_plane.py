"""`benchmarks.data_plane`: the tar pipe carries a tree's bytes whole and counts both sides' CPU
(over loopback, no Ray), and the floor's measuring code imports nothing of the plugin."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_pipe_carries_the_tree_whole_and_counts_each_sides_cpu(tmp_path: Path) -> None:
    """A tree of 12 MB (a link, an empty dir, a read-only script) arrives as it was; the bytes
    counted are a tar of it; both sides used CPU (sha256 and tar below them)."""
    from benchmarks.data_plane import pipe

    venv = tmp_path / "venv"
    (venv / "lib" / "empty").mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "lib" / "big.bin").write_bytes(os.urandom(12 * 10**6))
    (venv / "bin" / "tool").write_text("#!/bin/sh\necho hi\n")
    (venv / "bin" / "tool").chmod(0o555)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    dest = tmp_path / "received"

    measured = pipe(venv, dest)
    files = sorted(str(p.relative_to(venv)) for p in venv.rglob("*"))
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == files
    assert (dest / "lib" / "big.bin").read_bytes() == (venv / "lib" / "big.bin").read_bytes()
    assert os.readlink(dest / "bin" / "python") == "/usr/bin/python3"
    assert (dest / "bin" / "tool").stat().st_mode & 0o777 == 0o555
    tar = subprocess.run(["tar", "-C", str(venv), "-cf", "-", "."], capture_output=True)
    assert measured.bytes == len(tar.stdout) > 12 * 10**6
    assert measured.send_cpu_seconds > 0 and measured.receive_cpu_seconds > 0
    assert measured.seconds > 0


def test_a_pipe_from_a_missing_venv_says_which_side_failed(tmp_path: Path) -> None:
    from benchmarks.data_plane import DataPlaneError, pipe

    with pytest.raises(DataPlaneError, match="the sender failed"):
        pipe(tmp_path / "none", tmp_path / "received")
    assert not (tmp_path / "received").exists()


def test_the_floor_is_measured_without_the_plugins_code() -> None:
    """`benchmarks.data_plane` and `benchmarks.bounds` import nothing of `ray_uv_plugin`, in
    their source and when imported in a fresh interpreter; the pipe's and the actor's scripts
    name none of it either."""
    from benchmarks import data_plane

    for module in ("data_plane", "bounds"):
        tree = ast.parse((ROOT / "benchmarks" / f"{module}.py").read_text())
        imported = [
            alias.name if isinstance(node, ast.Import) else node.module or ""
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        ]
        assert not [n for n in imported if n.startswith("ray_uv_plugin")], (module, imported)
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, benchmarks.data_plane, benchmarks.bounds; "
         "print(sorted(m for m in sys.modules if m.startswith('ray_uv_plugin')))"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]", loaded.stdout
    for script in (data_plane.SEND, data_plane.RECEIVE, data_plane.WORKER_START):
        assert "ray_uv_plugin" not in script and "runtime_env" not in script

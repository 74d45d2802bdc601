"""A hash is taken again without reading the file only while its inode is provably unchanged
(`store.hashed`): the same inode, size and mtime, that mtime older than the filesystem's clock
when hashing began. Real files; no Ray, no uv."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from ray_uv_plugin.store import hashed, manifest, tree


def _old(path: Path, data: bytes) -> Path:
    """A file written a while ago, as uv's cache's are."""
    path.write_bytes(data)
    then = time.time() - 60
    os.utime(path, (then, then))
    return path


def _index_of(venv: Path) -> tuple[manifest.Files, hashed.Hashed]:
    index = hashed.Hashed(hashed.fs_clock(venv))
    return manifest.scan(venv, record=index), index


def test_an_unchanged_inode_is_known_and_any_write_since_is_not(tmp_path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    module = _old(venv / "m.py", b"x = 1\n")
    files, index = _index_of(venv)
    assert index.sha256(os.lstat(module)) == files["m.py"].content
    assert index.reused == module.stat().st_size
    # The same bytes written again, same size, within the same second: the mtime moves on.
    module.write_bytes(b"x = 2\n")
    assert index.sha256(os.lstat(module)) is None


def test_a_file_written_after_hashing_began_is_not_recorded(tmp_path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    index = hashed.Hashed(hashed.fs_clock(venv))
    fresh = venv / "fresh.py"
    fresh.write_bytes(b"x = 1\n")
    manifest.scan(venv, record=index)
    assert index.inodes == {}
    assert index.sha256(os.lstat(fresh)) is None


def test_another_inode_with_the_same_size_and_mtime_is_not_known(tmp_path) -> None:
    """A file replaced (renamed over) by one of the same size, its mtime set back: another
    inode, read again."""
    venv = tmp_path / "venv"
    venv.mkdir()
    module = _old(venv / "m.py", b"x = 1\n")
    _, index = _index_of(venv)
    st = module.stat()
    other = tmp_path / "other.py"
    other.write_bytes(b"y = 2\n")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, module)
    assert os.lstat(module).st_mtime_ns == st.st_mtime_ns
    assert index.sha256(os.lstat(module)) is None


def test_a_scan_takes_known_hashes_and_reads_the_rest(tmp_path) -> None:
    """A hardlink to a hashed inode is not read: the index's hash is what the manifest lists
    (shown here with a hash planted in the index); a changed one is read."""
    seed, venv = tmp_path / "seed", tmp_path / "venv"
    seed.mkdir()
    venv.mkdir()
    same = _old(seed / "same.py", b"a = 1\n")
    changed = _old(seed / "changed.py", b"b = 1\n")
    _, index = _index_of(seed)
    planted = "0" * 64
    size, mtime, _ = index.inodes[same.stat().st_ino]
    index.inodes[same.stat().st_ino] = (size, mtime, planted)
    os.link(same, venv / "same.py")
    os.link(changed, venv / "changed.py")
    changed.write_bytes(b"b = 2\n")
    files = manifest.scan(venv, reuse=index)
    assert files["same.py"].content == planted
    assert files["changed.py"].content == hashlib.sha256(b"b = 2\n").hexdigest()


def _written(tmp_path: Path) -> tuple[Path, hashed.Index, hashed.Hashed, str]:
    """A venv of one old file, its index written: (venv, index, the part's rows, the sha256 a
    marker names)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    _old(venv / "m.py", b"x = 1\n")
    _, rows = _index_of(venv)
    fragments = manifest.Fragments(venv)
    part = hashed.Part(fragments.put(rows.fragment()), "l" * 64, "s" * 64, ("m-1.dist-info",), ())
    fragments.sync()
    index = hashed.Index(rows.dev, {"m.py": part}, {"m-1.dist-info": "r" * 64})
    return venv, index, rows, hashed.write(venv, index)


def test_an_index_is_used_only_if_it_is_the_one_the_marker_names(tmp_path) -> None:
    venv, index, rows, sha = _written(tmp_path)
    loaded = hashed.load(venv, sha)
    assert loaded == index
    part_rows = hashed.rows(venv, loaded.parts["m.py"].rows)
    assert part_rows is not None and part_rows.inodes == rows.inodes
    assert part_rows.clock_ns == rows.clock_ns and part_rows.dev == rows.dev
    assert hashed.load(venv, None) is None  # a venv of an earlier version
    assert hashed.load(venv, "f" * 64) is None  # not the one named
    fragment = venv / manifest.PARTS / loaded.parts["m.py"].rows
    doc = json.loads(fragment.read_bytes())
    doc["clock_ns"] += 10**12  # a later clock would pass files written since
    fragment.chmod(0o644)
    fragment.write_bytes(json.dumps(doc).encode())
    assert hashed.rows(venv, loaded.parts["m.py"].rows) is None
    path = venv / hashed.HASHED
    doc = json.loads(path.read_bytes())
    doc["records"]["m-1.dist-info"] = "0" * 64  # another RECORD would keep another's parts
    path.write_bytes(json.dumps(doc).encode())
    assert hashed.load(venv, sha) is None
    path.unlink()
    assert hashed.load(venv, sha) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_an_index_of_another_user_is_not_used(tmp_path) -> None:
    venv, index, _, sha = _written(tmp_path)
    assert hashed.load(venv, sha) is not None
    assert hashed.rows(venv, index.parts["m.py"].rows) is not None
    os.chown(venv / manifest.PARTS / index.parts["m.py"].rows, 65534, 65534)
    assert hashed.rows(venv, index.parts["m.py"].rows) is None
    os.chown(venv / hashed.HASHED, 65534, 65534)
    assert hashed.load(venv, sha) is None


def _part(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*"))]


def test_a_listing_is_the_seeds_only_for_the_same_inodes_unchanged(tmp_path) -> None:
    """The same entries, linked: the same listing. A write, a mode, an entry more, another
    inode of the same bytes: another. A file written after the clock: none (never kept)."""
    seed, venv = tmp_path / "seed", tmp_path / "venv"
    (seed / "pkg" / "__pycache__").mkdir(parents=True)
    _old(seed / "pkg" / "a.py", b"a = 1\n")
    _old(seed / "pkg" / "__pycache__" / "a.pyc", b"bytecode")
    for rel in _part(seed):
        if (seed / rel).is_dir():
            (venv / rel).mkdir(parents=True)
        else:
            os.link(seed / rel, venv / rel)
    clock = hashed.fs_clock(tmp_path)

    def listing(root: Path) -> str:
        return hashed.listing(tree.collect(root), _part(root), clock)

    before = listing(seed)
    assert listing(venv) == before != ""
    copy = venv / "pkg" / "a.py"
    os.unlink(copy)
    copy.write_bytes(b"a = 1\n")
    st = os.lstat(seed / "pkg" / "a.py")
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same bytes, size and mtime
    assert listing(venv) not in (listing(seed), "")
    os.unlink(copy)
    os.link(seed / "pkg" / "a.py", copy)
    assert listing(venv) == listing(seed)
    os.chmod(copy, 0o755)  # the inode's: the seed's too
    assert listing(venv) != before
    os.chmod(copy, st.st_mode)
    assert listing(venv) == before
    (venv / "pkg" / "b.txt").write_bytes(b"")
    assert listing(venv) == ""  # written after the clock
    os.utime(venv / "pkg" / "b.txt", (st.st_atime, st.st_mtime))
    assert listing(venv) not in (before, "")


def test_sources_are_the_modules_by_size_and_mtime(tmp_path) -> None:
    """What a `.pyc` header checks: a module's size and mtime (seconds), not its inode; not
    the bytecode, nor files that are no module."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "pkg" / "__pycache__").mkdir(parents=True)
        _old(root / "pkg" / "m.py", b"x = 1\n")
        os.utime(root / "pkg" / "m.py", (1_700_000_000, 1_700_000_000))
    (b / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"anything")
    (b / "pkg" / "data.txt").write_bytes(b"not a module")

    def sources(root: Path) -> str:
        return hashed.sources(tree.collect(root), _part(root))

    assert sources(a) == sources(b)
    os.utime(b / "pkg" / "m.py", (1_700_000_001, 1_700_000_001))
    assert sources(a) != sources(b)
    os.utime(b / "pkg" / "m.py", (1_700_000_000, 1_700_000_000))
    (b / "pkg" / "n.py").write_bytes(b"")
    assert sources(a) != sources(b)

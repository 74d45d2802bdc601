"""A changed lock costs what changed: a new venv takes the bytecode of the
distributions that did not change from the nearest ready venv of the node, and is what a fresh
`uv sync --locked` with bytecode gives. Real uv, real packages; no Ray."""

from __future__ import annotations

import importlib.util
import logging
import marshal
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ray_uv_plugin.building import bytecode, seeding
from ray_uv_plugin.building import record as build_record
from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.store import accounting, freezing, gc, hashed, manifest
from ray_uv_plugin.store import tree as store_tree
from ray_uv_plugin.store.layout import MARKER, Venv, site_packages
from tests.support.uvproject import write_project, write_wheel

pytestmark = pytest.mark.timeout(600)

COMPILED = {"UV_COMPILE_BYTECODE": "1"}
SHARED = ["six==1.16.0", "idna==3.7", "tomli==2.0.1"]


@pytest.fixture(scope="module")
def locks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two locks that differ in one pure-Python package."""
    tmp = tmp_path_factory.mktemp("seeding")
    a = write_project(tmp / "a", [*SHARED, "tomli-w==1.0.0"])
    b = write_project(tmp / "b", [*SHARED, "tomli-w==1.1.0"])
    return a, b


def build(project: Path, root: Path):
    logger = logging.getLogger("test_seeding")
    return ensure_venv(parse_spec({}), load_project(project), COMPILED, root=root, logger=logger)


def tree(venv: Path) -> dict[str, bytes | str]:
    """Every path below `venv` (less the plugin's own files): a link's target, a file's bytes,
    a `.pyc`'s module instead (see `accepted`), with the venv's own path written as `<venv>`."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(venv):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(venv))
            if rel.startswith(manifest.OWN_PREFIX):
                continue
            if path.is_symlink():
                found[rel] = os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            elif name.endswith(".pyc"):
                found[rel] = "pyc"
            elif name == "RECORD":  # a console script's hash is of its venv's own shebang
                lines = path.read_bytes().splitlines()
                found[rel] = b"\n".join(
                    line.rpartition(b",sha256=")[0] if line.startswith(b"../../../bin/") else line
                    for line in lines
                )
            else:
                found[rel] = path.read_bytes().replace(str(venv).encode(), b"<venv>")
    return found


def accepted(venv: Path) -> list[str]:
    """The modules whose bytecode Python would not use as it is: no `.pyc`, a header that does
    not match its source, or a body that is not code."""
    site = site_packages(venv)
    assert site is not None
    bad = []
    for source in site.rglob("*.py"):
        pyc = Path(importlib.util.cache_from_source(str(source)))
        try:
            data = pyc.read_bytes()
        except FileNotFoundError:
            bad.append(f"{source.relative_to(site)}: no .pyc")
            continue
        st = source.stat()
        flags = int.from_bytes(data[4:8], "little")
        header_ok = (
            data[:4] == importlib.util.MAGIC_NUMBER
            and flags == 0
            and int.from_bytes(data[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(data[12:16], "little") == st.st_size & 0xFFFFFFFF
        )
        if not header_ok or type(marshal.loads(data[16:])).__name__ != "code":
            bad.append(f"{source.relative_to(site)}: not accepted")
    return bad


def test_a_seeded_venv_is_what_a_fresh_sync_with_bytecode_gives(locks, tmp_path, caplog) -> None:
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    before = manifest.scan(seed.path)
    caplog.set_level(logging.INFO, logger="test_seeding")
    seeded = build(b, root)
    marker = Venv.at(seeded.path).read_marker()
    assert marker is not None
    how = marker["built"]
    assert how["how"] == "seeded" and how["distributions"] >= len(SHARED) and how["files"] > 0
    # One `uv sync` (without bytecode), then only the changed distribution compiled; the
    # unchanged files' hashes taken from the seed's index, not read again.
    assert caplog.text.count("uv: Resolved") == 1, caplog.text
    compiled = re.search(r"compiled the (\d+) modules the seed did not give", caplog.text)
    assert compiled and 0 < int(compiled[1]) < 20, caplog.text
    kept = re.search(r"manifest of \d+ entries in (\d+) parts, (\d+) of them kept", caplog.text)
    assert kept and 0 < int(kept[2]) < int(kept[1]), caplog.text  # the changed one's not kept
    # Where its time went: one line per step, with its seconds.
    for step in ("sync", "listing", "seeding", "compile", "manifest", "freeze"):
        line = rf"uv_project {seeded.key}: step {step} took \d+\.\d\ds"
        assert len(re.findall(line, caplog.text)) == 1, (step, caplog.text)
    assert hashed.load(seeded.path, marker["hashed"]) is not None
    fresh = build(b, tmp_path / "fresh")  # a venv dir with nothing to seed from
    assert Venv.at(fresh.path).read_marker()["built"] == {"how": "full"}
    assert seeded.key == fresh.key
    # The same files, byte for byte (but each venv's own path), the same RECORDs, and bytecode
    # that Python accepts for every module, the changed distribution's included.
    seeded_tree, fresh_tree = tree(seeded.path), tree(fresh.path)
    assert seeded_tree.keys() == fresh_tree.keys()
    assert {k for k in seeded_tree if seeded_tree[k] != fresh_tree[k]} == set()
    assert accepted(seeded.path) == [] and accepted(fresh.path) == []
    assert any("tomli_w" in p and p.endswith(".pyc") for p in seeded_tree)
    # Frozen and marked the same way.
    assert marker["immutable"] == Venv.at(fresh.path).read_marker()["immutable"]
    assert not os.access(seeded.path / "lib", os.W_OK) or os.geteuid() == 0
    # Its manifest, the parts kept from the seed's included, is what the venv holds.
    assert manifest.load(seeded.path, marker["manifest"]) == manifest.scan(seeded.path)
    # The seed was only read.
    assert manifest.scan(seed.path) == before
    assert manifest.load(seed.path, Venv.at(seed.path).read_marker()["manifest"]) == before


def test_a_damaged_seed_never_leaks_and_the_build_says_so(locks, tmp_path, caplog) -> None:
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    site = site_packages(seed.path)
    assert site is not None
    pyc = Path(importlib.util.cache_from_source(str(site / "six.py")))
    freezing.thaw(seed.path)
    data = bytearray(pyc.read_bytes())
    data[-1] ^= 0xFF  # the header still matches: Python would load it
    os.chmod(pyc, 0o644)
    pyc.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, logger="test_seeding")
    built = build(b, root)
    assert "full build" in caplog.text and seed.key in caplog.text
    assert Venv.at(built.path).read_marker()["built"] == {"how": "full"}
    new = Path(importlib.util.cache_from_source(str(site_packages(built.path) / "six.py")))
    assert new.read_bytes() != bytes(data)
    assert accepted(built.path) == []


@pytest.mark.parametrize("damage", ["changed", "removed"])
def test_a_seed_fragment_that_is_not_its_name_s_is_not_kept(
    locks, tmp_path, caplog, damage: str
) -> None:
    """A part is kept from the seed only with its fragments read and checked as this venv
    holds them: one changed or removed in the seed is listed and hashed here instead, and the
    manifest is still what the venv holds."""
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    meta = Venv.at(seed.path).read_marker()
    found = manifest.parts(seed.path, meta["manifest"])
    assert found is not None
    fragment = seed.path / manifest.PARTS / found[1]["idna"]
    freezing.thaw(seed.path)
    if damage == "changed":
        os.chmod(fragment, 0o644)
        fragment.write_bytes(fragment.read_bytes().replace(b'"file"', b'"file" ', 1))
    else:
        fragment.unlink()
    caplog.set_level(logging.INFO, logger="test_seeding")
    seeded = build(b, root)
    marker = Venv.at(seeded.path).read_marker()
    assert marker["built"]["how"] == "seeded"
    kept = re.search(r"in (\d+) parts, (\d+) of them kept", caplog.text)
    assert kept and int(kept[2]) > 0, caplog.text  # the others were
    assert manifest.load(seeded.path, marker["manifest"]) == manifest.scan(seeded.path)
    parts = manifest.parts(seeded.path, marker["manifest"])
    assert parts is not None and "idna" in parts[1]
    assert (seeded.path / manifest.PARTS / parts[1]["idna"]).stat().st_nlink == 1  # its own


def test_a_seed_is_not_marked_used_so_gc_and_the_budget_may_still_remove_it(
    locks, tmp_path
) -> None:
    """A burst of new keys seeding from an old venv must not keep it from `gc` and the venv
    dir's budget, which remove the venvs used least recently: the seed's last use (its
    marker's mtime) is what it was before it was seeded from."""
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    hour_ago = time.time() - 3600
    os.utime(seed.path / MARKER, (hour_ago, hour_ago))
    seeded = build(b, root)
    assert Venv.at(seeded.path).read_marker()["built"]["seed"] == seed.key
    assert abs((seed.path / MARKER).stat().st_mtime - hour_ago) < 1
    report = gc.collect(root, older_than_days=1 / 48)  # idle 30 min: the seed only
    assert [d.entry.key for d in report.removed] == [seed.key]


def test_a_seed_whose_index_cannot_be_used_gives_a_full_build(locks, tmp_path, caplog) -> None:
    """A seed built by an earlier version (or whose index is lost) is not read: what its
    parts hold is known only from its index. The build is a full one, and the log says why."""
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    freezing.thaw(seed.path)
    (seed.path / hashed.HASHED).unlink()
    caplog.set_level(logging.INFO, logger="test_seeding")
    built = build(b, root)
    assert Venv.at(built.path).read_marker()["built"] == {"how": "full"}
    assert f"the nearest venv {seed.key} has no index" in caplog.text
    assert "a full build instead" in caplog.text
    assert caplog.text.count("uv: Resolved") == 1, caplog.text  # nothing linked: no second sync
    assert accepted(built.path) == []


def test_when_the_compile_workers_fail_uv_compiles(locks, tmp_path, monkeypatch, caplog) -> None:
    a, b = locks
    root = tmp_path / "venvs"
    build(a, root)

    def fail(*args, **kwargs):
        raise bytecode.CompileError("a compile worker exited with 1: planted")

    monkeypatch.setattr(bytecode, "compile_sources", fail)
    caplog.set_level(logging.INFO, logger="test_seeding")
    seeded = build(b, root)
    assert "planted; uv compiles instead" in caplog.text
    assert Venv.at(seeded.path).read_marker()["built"]["how"] == "seeded"
    assert accepted(seeded.path) == []


@pytest.mark.parametrize("where", ["absolute", "beside"])
def test_a_seed_whose_marker_names_a_site_packages_outside_it_is_passed_over(
    locks, tmp_path, caplog, where: str
) -> None:
    """A marker's `site_packages` (a receiver may have copied the sender's) must name a
    dir inside the venv. An absolute one failed every later seeded build with a ValueError; a
    `../<other key>/...` one read another venv's files as the seed's. Either: not a seed."""
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    meta = Venv.at(seed.path).read_marker()
    own = seed.path / meta["site_packages"]
    elsewhere = tmp_path / "elsewhere" / "venv"
    shutil.copytree(own, elsewhere / meta["site_packages"], symlinks=True)
    named = (  # the same files as the seed's, outside it
        str(elsewhere / meta["site_packages"])
        if where == "absolute"
        else f"../../elsewhere/venv/{meta['site_packages']}"
    )
    assert seeding.seed_site(seed.path, {**meta, "site_packages": named}) is None
    os.chmod(seed.path, 0o755)  # the marker's dir, read-only once marked
    (seed.path / MARKER).unlink()
    Venv.at(seed.path).write_marker({**meta, "site_packages": named})
    caplog.set_level(logging.INFO, logger="test_seeding")
    built = build(b, root)
    assert Venv.at(built.path).read_marker()["built"] == {"how": "full"}
    assert "seeded from" not in caplog.text
    assert accepted(built.path) == []


def test_a_seed_site_must_resolve_inside_its_venv(tmp_path) -> None:
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (tmp_path / "other" / "site-packages").mkdir(parents=True)
    (venv / "lib" / "python3.12").symlink_to(tmp_path / "other")
    inside = seeding.seed_site(venv, {"site_packages": "lib/python3.11/site-packages"})
    assert inside == venv / "lib" / "python3.11" / "site-packages"
    for bad in ("lib/python3.12/site-packages", "lib/../../other/site-packages", "", None, 3):
        assert seeding.seed_site(venv, {"site_packages": bad}) is None, bad


# --- ready means accounted for -----------------------------------------------------------------

TAG = sys.implementation.cache_tag


def _unchecked_pyc(code: str) -> bytes:
    """An unchecked hash-based `.pyc`: Python runs it without looking at its source."""
    body = marshal.dumps(compile(code, "planted", "exec"))
    return importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + bytes(8) + body


def _planted(venv: Path, *flags: str) -> str:
    """What `typing_extensions.PLANTED` is in `venv`'s Python run with `flags` ('-' if unset)."""
    code = "import typing_extensions as t; print(getattr(t, 'PLANTED', '-'))"
    return subprocess.run(
        [str(venv / "bin" / "python"), *flags, "-c", code],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip


def test_a_seed_never_gives_bytecode_that_a_distribution_of_its_own_lock_installed(
    tmp_path,
) -> None:
    """Lock A holds a wheel that installs `typing_extensions`' bytecode (both levels) with code
    of its own; lock B has `typing_extensions` and not that wheel. A's venv is what a fresh
    build of A gives, seeded or not: uv's bytecode step compiles the plain level again (its
    header is no timestamp one) and leaves `-O`'s, which A's lock installs. B's venv, seeded
    from A's, runs none of it: it is what a fresh build of B gives."""
    planted = _unchecked_pyc("PLANTED = 'by A'")
    wheel = write_wheel(
        tmp_path / "wheels", "planter", "1.0",
        {
            "planter.py": b"",
            f"__pycache__/typing_extensions.{TAG}.pyc": planted,
            f"__pycache__/typing_extensions.{TAG}.opt-1.pyc": planted,
        },
    )  # fmt: skip
    shared = [*SHARED, "typing_extensions==4.12.2"]
    z = write_project(tmp_path / "z", [*shared, "tomli-w==1.0.0"])
    a = write_project(tmp_path / "a", [*shared, f"planter @ {wheel.as_uri()}"])
    b = write_project(tmp_path / "b", shared)
    root = tmp_path / "venvs"
    build(z, root)
    seed = build(a, root)  # seeded from z's
    assert Venv.at(seed.path).read_marker()["built"]["how"] == "seeded"
    fresh_a = build(a, tmp_path / "fresh-a")
    for venv in (seed.path, fresh_a.path):
        assert (_planted(venv), _planted(venv, "-O")) == ("-", "by A"), venv
    seeded = build(b, root)
    marker = Venv.at(seeded.path).read_marker()
    assert marker["built"]["how"] == "seeded" and marker["built"]["seed"] == seed.key
    assert _planted(seeded.path) == _planted(seeded.path, "-O") == "-"
    site = site_packages(seeded.path)
    assert not (site / "__pycache__" / f"typing_extensions.{TAG}.opt-1.pyc").exists()
    fresh = build(b, tmp_path / "fresh")
    assert tree(seeded.path) == tree(fresh.path)
    assert accepted(seeded.path) == []


def test_a_file_that_no_distribution_installed_nor_a_compile_step_made_fails_the_build(
    tmp_path, monkeypatch
) -> None:
    """A `.pth` file of the lock runs in every Python of the venv that loads `site`: the
    plugin's compile step loads none, so it writes nothing; uv's bytecode step (where the
    plugin's cannot run) does, and what it writes fails the build, named, with nothing kept."""
    line = b"import os, sys; open(os.path.join(sys.prefix, 'STRAY'), 'w').close()\n"
    wheel = write_wheel(tmp_path / "wheels", "strayer", "1.0", {"strayer.pth": line})
    project = write_project(tmp_path / "p", ["six==1.16.0", f"strayer @ {wheel.as_uri()}"])
    built = build(project, tmp_path / "venvs")
    assert not (built.path / "STRAY").exists()
    assert Venv.at(built.path).read_marker()["accounted"] == {"bytecode": "plugin"}

    def fail(*args, **kwargs):
        raise bytecode.CompileError("a compile worker exited with 1: planted")

    monkeypatch.setattr(bytecode, "compile_sources", fail)
    root = tmp_path / "other"
    with pytest.raises(UvSyncError) as e:
        build(project, root)
    message = str(e.value)
    assert "holds 1 files that no distribution of the lock installed" in message, message
    assert "STRAY" in message and "uv lock" in message
    assert not [p for p in root.iterdir() if p.is_dir()]  # nothing half-built


def test_a_seeded_venv_s_bytecode_is_read_only_and_uv_s_files_keep_their_mode(
    locks, tmp_path
) -> None:
    """A seed's `.pyc` is hardlinked into the venvs seeded from it: with a write bit, a write
    in place in one venv changed another key's. The build's own bytecode loses its
    write bits; uv's files, its cache's inodes, keep the mode uv gave them."""
    a, b = locks
    root = tmp_path / "venvs"
    seed = build(a, root)
    seeded = build(b, root)
    assert Venv.at(seeded.path).read_marker()["built"]["how"] == "seeded"
    site = site_packages(seeded.path)
    assert site is not None
    pyc = Path(importlib.util.cache_from_source(str(site / "six.py")))
    theirs = Path(importlib.util.cache_from_source(str(site_packages(seed.path) / "six.py")))
    assert os.path.samestat(pyc.stat(), theirs.stat())  # linked from the seed
    for venv in (seed.path, seeded.path):
        for found in site_packages(venv).rglob("*.pyc"):
            assert found.stat().st_mode & 0o222 == 0, found
    assert (site / "six.py").stat().st_mode & 0o200  # uv's: its cache's inode, as uv made it


# --- the seed's kernel work in threads ---------------------------------------------------------

SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def _synthetic_seed(tmp_path: Path, packages: int = 40, modules: int = 10) -> seeding.Seed:
    """A ready seed of `packages` distributions, without uv: its bytecode compiled by
    `py_compile` (as its build's compile step does), its manifest and index written as a
    build writes them."""
    import py_compile

    seed = tmp_path / "seed"
    for p in range(packages):
        (seed / SITE / f"pkg{p}").mkdir(parents=True)
        rows = []
        for m in range(modules):
            rel = f"pkg{p}/m{m}.py"
            (seed / SITE / rel).write_text(f"VALUE = {p * 1000 + m}\n")
            py_compile.compile(str(seed / SITE / rel), doraise=True)
            rows.append(f"{rel},,\n")
        (seed / SITE / f"pkg{p}-1.0.dist-info").mkdir()
        (seed / SITE / f"pkg{p}-1.0.dist-info" / "RECORD").write_text("".join(rows))
    listed = store_tree.collect(seed)
    fresh = build_record.Fresh(seed, listed, hashed.fs_clock(seed))
    for name, paths in manifest.split(listed.entries, SITE).items():
        fresh.add(name, paths, None)
    recorded = accounting.read_records(seed)
    owners = build_record.owners_of(recorded, SITE).owners
    compiled = {path for path in listed.entries if path.endswith(".pyc")}
    records = seeding.record_digests(seed / SITE)
    made, index_sha, _ = build_record.write_records(
        fresh, SITE, {}, None, owners, compiled, recorded, records
    )
    index = hashed.load(seed, index_sha)
    found = manifest.parts(seed, made)
    assert index is not None and found is not None
    return seeding.Seed("seedkey", seed, SITE, tuple(sorted(records)), found[1], index)


def _new_venv(seed: seeding.Seed, new: Path) -> Path:
    """A new venv of the seed's distributions, without bytecode: each source and RECORD
    hardlinked from the seed's (as uv links its cache's file into both)."""
    site = seed.path / seed.site
    for dirpath, _, filenames in os.walk(site):
        if os.path.basename(dirpath) == "__pycache__":
            continue
        into = new / SITE / os.path.relpath(dirpath, site)
        into.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            os.link(os.path.join(dirpath, name), into / name)
    return new


def test_the_seed_s_links_and_dirs_are_made_in_threads_with_the_same_outcome(
    tmp_path, monkeypatch
) -> None:
    """`mkdir` and `link` release the GIL: several threads make the `__pycache__` dirs and the
    links, and every `.pyc` is taken, the seed's own inode."""
    seed = _synthetic_seed(tmp_path)
    new = _new_venv(seed, tmp_path / "new")
    monkeypatch.setattr(seeding, "CHUNK", 16, raising=False)
    monkeypatch.setattr(seeding, "THREADS", 4, raising=False)  # whatever the host's CPUs
    threads: dict[str, set[int]] = {"mkdir": set(), "link": set()}
    # the first thread to make a dir (or a link) waits, up to 20 s, for a second one to make one
    # too: one thread that takes every chunk before the pool's others start cannot pass, and a
    # pool that runs them at once always does, however the host schedules it
    second = {"mkdir": threading.Event(), "link": threading.Event()}
    real_mkdir, real_link = os.mkdir, os.link

    def seen(call: str) -> None:
        threads[call].add(threading.get_ident())
        if len(threads[call]) > 1:
            second[call].set()
        else:
            second[call].wait(20)

    def mkdir(path, *args, **kwargs):
        seen("mkdir")
        return real_mkdir(path, *args, **kwargs)

    def link(src, dst, *args, **kwargs):
        seen("link")
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "link", link)
    listed = store_tree.collect(new)
    taken = seeding.take_bytecode(seed, new, listed, seeding.CacheDirs(seed, new))
    monkeypatch.undo()
    assert len(threads["mkdir"]) > 1 and len(threads["link"]) > 1, threads
    assert threading.get_ident() not in threads["link"]
    assert taken.files == 400 == len(taken.known)
    for rel in taken.known:
        assert os.lstat(new / rel).st_ino == os.lstat(seed.path / rel).st_ino
        assert listed.entries[rel].st_ino == os.lstat(new / rel).st_ino  # listed as linked
    assert accepted(new) == []


def test_a_changed_seed_file_in_any_thread_s_share_fails_the_take(tmp_path, monkeypatch) -> None:
    """One seed `.pyc` of 400 that is not what its manifest says (its header still its
    source's, so Python would load it) is a SeedError, whichever thread links it, and it is
    not left linked. A module changed since the seed was built (its mtime moved) takes no
    bytecode from the seed in its part: it is left to the compile step."""
    seed = _synthetic_seed(tmp_path)
    monkeypatch.setattr(seeding, "CHUNK", 16, raising=False)
    source = seed.path / SITE / "pkg3" / "m1.py"
    os.utime(source, (time.time() - 7200, time.time() - 7200))
    new = _new_venv(seed, tmp_path / "new")
    listed = store_tree.collect(new)
    taken = seeding.take_bytecode(seed, new, listed, seeding.CacheDirs(seed, new))
    assert taken.files == 390 and (new / SITE / "pkg3" / "__pycache__").is_dir()
    seeding.remove_empty(listed, taken)  # after the compile step: as a fresh build has it
    assert not (new / SITE / "pkg3" / "__pycache__").exists()
    assert f"{SITE}/pkg3/__pycache__" not in listed.entries
    changed = seed.path / SITE / "pkg27" / "__pycache__" / f"m5.{TAG}.pyc"
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0xFF
    changed.write_bytes(bytes(data))
    new = _new_venv(seed, tmp_path / "again")
    with pytest.raises(seeding.SeedError, match=r"pkg27/__pycache__/m5\..*other content"):
        seeding.take_bytecode(seed, new, store_tree.collect(new), seeding.CacheDirs(seed, new))
    assert not (new / SITE / "pkg27" / "__pycache__" / changed.name).exists()


def test_a_part_is_kept_only_as_the_seed_had_it_owned_and_listed(tmp_path) -> None:
    """A new venv's part keeps the seed's records only where its listing is the seed's, the
    same distributions list its files, each with the seed's RECORD and of the lock."""
    seed = _synthetic_seed(tmp_path, packages=6, modules=2)
    new = _new_venv(seed, tmp_path / "new")
    for pyc in (seed.path / SITE).rglob("*.pyc"):  # the seed's bytecode, linked
        (new / pyc.relative_to(seed.path)).parent.mkdir(exist_ok=True)
        os.link(pyc, new / pyc.relative_to(seed.path))
    changed = new / SITE / "pkg4" / "m0.py"
    data = changed.read_bytes()
    changed.unlink()
    changed.write_bytes(data)  # the same bytes, another inode
    st = os.lstat(seed.path / SITE / "pkg4" / "m0.py")
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns))
    listed = store_tree.collect(new)
    groups = manifest.split(listed.entries, SITE)
    recorded = accounting.read_records(new)
    owners = build_record.owners_of(recorded, SITE).owners
    records = seeding.record_digests(new / SITE)
    records["pkg1-1.0.dist-info"] = "0" * 64  # another RECORD
    owners["pkg2"] = owners["pkg2"] | {"pkg0-1.0.dist-info"}  # another distribution's file
    foreign = {"pkg3-1.0.dist-info"}  # of no package of the lock
    clock, dev = hashed.fs_clock(new), os.lstat(new / SITE).st_dev
    kept = build_record._kept(seed, groups, listed, owners, records, foreign, clock, dev, {})
    assert sorted(kept) == ["pkg0", "pkg5"]
    assert all(kept[name] == seed.index.parts[name] for name in kept)
    # A listing the seeding found is taken for the same paths only.
    listing = seed.index.parts["pkg4"].listing
    found = {"pkg4": (frozenset(groups["pkg4"]), listing)}
    records = seeding.record_digests(new / SITE)
    kept = build_record._kept(seed, groups, listed, owners, records, set(), clock, dev, found)
    assert "pkg4" in kept  # as the seeding said it found it
    found = {"pkg4": (frozenset(groups["pkg4"][1:]), listing)}
    kept = build_record._kept(seed, groups, listed, owners, records, set(), clock, dev, found)
    assert "pkg4" not in kept

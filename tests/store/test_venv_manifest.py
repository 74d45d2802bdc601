"""What is shipped is what was built (`store.manifest`), without Ray: a real
build writes the manifest of every file and its marker names it; the sender refuses a venv
that changed since (and the ways it may change); a receiver installs only what the build made
and writes a manifest of its own. Through Ray, with two raylets: tests/ship/test_ship.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from ray_uv_plugin.building import bytecode
from ray_uv_plugin.building.ensure import ensure_venv, lookup
from ray_uv_plugin.building.record import Bytecode, write_manifest
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.ship import archive
from ray_uv_plugin.ship.archive import ArchiveError, DriftError, Packer
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import accounting, hashed, manifest
from ray_uv_plugin.store.layout import MARKER, NOT_AS_RECORDED, Venv, VenvDir
from tests.support.uvproject import write_project

KEY = "0123456789abcdef"


def test_a_venv_names_its_files_where_they_have_always_been(tmp_path: Path) -> None:
    """`<root>/<key>`, its marker inside, its build lock beside it: each path made in one place."""
    venv = VenvDir(tmp_path).venv(KEY)
    assert venv == Venv.at(tmp_path / KEY) and VenvDir(tmp_path).lock(KEY) == venv.lock
    assert venv.path == tmp_path / KEY and venv.python == tmp_path / KEY / "bin" / "python"
    assert venv.marker == tmp_path / KEY / ".ray-uv-ready" == venv.path / MARKER
    assert venv.lock == tmp_path / f"{KEY}.lock"
    assert venv.site_packages() is None  # none yet
    (venv.path / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    assert venv.site_packages() == venv.path / "lib" / "python3.11" / "site-packages"


MiB = 1024 * 1024


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("manifest") / "proj", ["six"])


@pytest.fixture(scope="module")
def built(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ready venv (ray and six, a console script) under a venv dir of its own."""
    root = tmp_path_factory.mktemp("venvs-a")
    return ensure_venv(parse_spec({"project": str(project)}), load_project(project), root=root).path


def walk(venv: Path) -> dict[str, tuple]:
    """Every entry below `venv` but the marker and the manifest, read here without the module."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(venv):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, venv)
            if rel.startswith(".ray-uv-"):
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", 0, os.readlink(path), 0)
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", 0, "", 0)
            else:
                sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                mode = (st.st_mode & 0o755) | 0o600
                found[rel] = ("file", st.st_size, sha, mode)
    return found


def test_a_build_writes_the_manifest_of_every_file_and_its_marker_names_it(built: Path) -> None:
    data = (built / manifest.MANIFEST).read_bytes()
    marker = Venv.at(built).read_marker()
    assert marker["manifest"] == hashlib.sha256(data).hexdigest()
    files = manifest.load(built, marker["manifest"])
    assert {path: tuple(entry) for path, entry in files.items()} == walk(built)
    assert files["bin/python"].kind == "symlink" and files["bin/ray"].kind == "file"
    assert not [p for p in files if p.startswith(MARKER)]
    # uv's RECORDs agree with what it installed, the console scripts it wrote included, and
    # every other file is bytecode of a listed source or uv's scaffolding.
    checked = accounting.account(built, files, accounting.read_records(built), compiled=None)
    assert checked == accounting.Accounting([], [])
    compiles = os.environ.get("UV_COMPILE_BYTECODE") != "0"  # tests/conftest.py: off
    assert marker["accounted"] == {"bytecode": "plugin" if compiles else "none"}
    assert "not_as_recorded" not in marker


def test_a_compiled_build_lists_every_entry_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build lists its venv once (`store.tree`) and, after its compile step, lists again only
    the `__pycache__` dirs that step wrote into: its manifest is still entry for entry what a
    walk finds, for a full build, a seeded one, and one whose bytecode uv's own step made
    (which runs the venv's `.pth` files, so the venv is listed anew)."""
    root = tmp_path / "venvs"

    def built(name: str, idna: str) -> dict:
        project = write_project(tmp_path / name, ["six==1.16.0", f"idna=={idna}"])
        env = {"UV_COMPILE_BYTECODE": "1"}
        venv = ensure_venv(parse_spec({}), load_project(project), env, root=root).path
        marker = Venv.at(venv).read_marker()
        files = manifest.load(venv, marker["manifest"])
        assert {path: tuple(entry) for path, entry in files.items()} == walk(venv), name
        assert any(path.endswith(".pyc") for path in files), name
        return marker

    assert built("full", "3.7")["built"] == {"how": "full"}
    assert built("seeded", "3.6")["built"]["how"] == "seeded"

    def fail(*args: object, **kwargs: object) -> None:
        raise bytecode.CompileError("a compile worker exited with 1: planted")

    monkeypatch.setattr(bytecode, "compile_sources", fail)
    marker = built("by-uv", "3.5")
    assert marker["built"]["how"] == "seeded" and marker["accounted"]["bytecode"] == "uv"


def test_reusing_a_ready_venv_reads_no_manifest(
    built: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm path stays a few stats: nothing in it hashes or reads the manifest."""

    def refuse(*args: object) -> None:
        raise AssertionError("the warm path read the venv's files")

    for name in ("scan", "load", "hash_file", "digest"):
        monkeypatch.setattr(manifest, name, refuse)
    request = make_request(parse_spec({"project": str(project)}), load_project(project), {})
    assert lookup(request, built.parent) is not None


def test_a_build_with_files_not_as_their_record_says_fails_naming_them(
    built: Path, project: Path, tmp_path: Path
) -> None:
    """A file changed in uv's cache reaches every venv hardlinked from it: the build's RECORD
    check names it (here: a copy of a real venv whose six.py was edited), and the build fails
    with what to do (through Ray, leaving nothing: tests/agent/test_errors.py)."""
    venv = tmp_path / KEY
    shutil.copytree(built, venv, symlinks=True)  # copies: uv's cache keeps its six.py
    six = next(venv.glob("lib/python*/site-packages/six.py"))
    six.write_text(six.read_text() + "\n# changed\n")
    recorded = accounting.read_records(venv)
    compiled = Bytecode("plugin", frozenset(p for p in manifest.scan(venv) if p.endswith(".pyc")))
    locked = accounting.locked_distributions((project / "uv.lock").read_bytes())
    rel = str(six.relative_to(venv))
    with pytest.raises(UvSyncError) as e:
        write_manifest(
            Venv.at(venv),
            logging.getLogger("test"),
            recorded,
            compiled,
            locked,
            None,
            lambda: tmp_path,
        )
    said = str(e.value)
    assert re.search(
        rf"holds 1 files that differ from their distribution's RECORD: {re.escape(rel)} "
        rf"\(six-[\d.]+\.dist-info\)\. Most likely they changed in this node's uv cache "
        rf"\({re.escape(str(tmp_path))}\), through a hardlink",
        said,
    ), said
    assert f"run `UV_CACHE_DIR={tmp_path} uv cache clean six` on this node, then retry" in said
    assert "the wheel's own RECORD is wrong: report it to the package" in said


def test_a_marker_of_an_earlier_version_with_files_not_as_recorded_is_not_ready(
    tmp_path: Path,
) -> None:
    """Earlier versions made such a venv ready, with a warning: it is rebuilt now (and its
    build fails while the cache holds the changed file), and a sender still refuses it."""
    marker = (
        f'{{"format": 1, "key": "{KEY}", "site_packages": "lib/python3.11/site-packages", '
        f'"manifest": "{{sha}}", "{NOT_AS_RECORDED}": '
        '{"count": 1, "first": ["lib/python3.11/site-packages/six.py (six-1.17.0.dist-info)"]}}'
    )
    venv = fake_ready_venv(tmp_path, marker.encode(), b'{"files": {}, "format": 1}')
    without = {k: v for k, v in Venv.at(venv).read_marker().items() if k != NOT_AS_RECORDED}
    (tmp_path / "other").mkdir()
    other = fake_ready_venv(tmp_path / "other", json.dumps(without).encode())
    assert Venv(other.parent, KEY).check_ready(use=False)  # ready but for `not_as_recorded`
    why = Venv(tmp_path, KEY).check_ready(use=False).why_not
    assert (
        why
        == "its files differ from their distribution's RECORD (an earlier version made it ready)"
    )
    with pytest.raises(ArchiveError, match=r"1 files that differ .*\(six-1\.17\.0\.dist-info\)"):
        Packer(venv)


# --- the sender refuses a venv that drifted ---------------------------------------------------


def small_venv(path: Path) -> Path:
    """A venv-shaped tree, marked as a build marks it: manifest, then the marker naming it."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").symlink_to("tool")
    (path / "bin" / "tool").write_text("#!/bin/sh\n")
    (path / "bin" / "tool").chmod(0o755)
    site = path / "lib" / "python3.11" / "site-packages"
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("x = 1\n")
    (site / "pkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"pyc")
    (site / "big.bin").write_bytes(os.urandom(MiB))
    (path / "lib64").symlink_to("lib")
    Venv.at(path).write_marker(
        {"key": path.name, "manifest": manifest.write(path, manifest.scan(path))}
    )
    return path


def pack(venv: Path, chunk_bytes: int = 64 * 1024) -> tuple[list[archive.Chunk], Packer]:
    packer = Packer(venv, chunk_bytes)
    chunks = [packer.next_chunk()]
    while not chunks[-1].last:
        chunks.append(packer.next_chunk())
    return chunks, packer


SITE = "lib/python3.11/site-packages"


def _same_size_other_bytes(venv: Path) -> None:
    path = venv / SITE / "pkg" / "__init__.py"
    path.write_text("y = 1\n")


CHANGES = {
    "content": (_same_size_other_bytes, f"{SITE}/pkg/__init__.py has other content now"),
    "size": (
        lambda v: (v / SITE / "big.bin").open("ab").write(b"!"),
        f"{SITE}/big.bin has {MiB + 1} bytes now, {MiB} when built",
    ),
    "added": (
        lambda v: (v / SITE / "evil.pth").write_text("import os\n"),
        f"{SITE}/evil.pth was added after the build",
    ),
    "added-in-pycache": (
        lambda v: (v / SITE / "pkg" / "__pycache__" / "x.py").write_text(""),
        f"{SITE}/pkg/__pycache__/x.py was added after the build",
    ),
    "removed": (
        lambda v: (v / SITE / "pkg" / "__init__.py").unlink(),
        f"{SITE}/pkg/__init__.py was removed after the build",
    ),
    "mode": (
        lambda v: (v / SITE / "pkg" / "__init__.py").chmod(0o755),
        f"{SITE}/pkg/__init__.py has mode 0o755 now, 0o644 when built",
    ),
    "link": (
        lambda v: ((v / "lib64").unlink(), (v / "lib64").symlink_to("/lib")),
        "lib64 links to '/lib' now, to 'lib' when built",
    ),
    "kind": (
        lambda v: ((v / SITE / "big.bin").unlink(), (v / SITE / "big.bin").mkdir()),
        f"{SITE}/big.bin is a dir now, a file when built",
    ),
    "manifest-edited": (
        lambda v: (v / manifest.MANIFEST).write_bytes(b"{}"),
        "has a manifest .* that is not its build's",
    ),
    "manifest-removed": (
        lambda v: (v / manifest.MANIFEST).unlink(),
        "has lost its manifest",
    ),
    "built-by-an-earlier-version": (
        lambda v: Venv.at(v).write_marker({"key": v.name}),
        "has no manifest of its files \\(it was built by an earlier version",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_venv_changed_since_its_build_is_not_sent(tmp_path: Path, change: str) -> None:
    venv = small_venv(tmp_path / KEY)
    alter, message = CHANGES[change]
    alter(venv)
    with pytest.raises(DriftError, match=message):
        pack(venv)


def test_bytecode_python_wrote_after_the_build_is_left_out(tmp_path: Path) -> None:
    """A root worker writes `.pyc` files where the build compiled none: they are not sent,
    and the venv is not refused for them (any other new file in `__pycache__` is)."""
    venv = small_venv(tmp_path / KEY)
    (venv / SITE / "pkg" / "__pycache__" / "new.cpython-311.pyc").write_bytes(b"new")
    (venv / SITE / "__pycache__").mkdir()
    (venv / SITE / "__pycache__" / "top.cpython-311.pyc").write_bytes(b"top")
    chunks, packer = pack(venv)
    assert packer.left_out == 3  # two files and the new dir
    tree = receive(tmp_path / "dst", chunks, packer)
    assert not (tree / SITE / "__pycache__").exists()
    assert not (tree / SITE / "pkg" / "__pycache__" / "new.cpython-311.pyc").exists()
    assert (tree / SITE / "pkg" / "__pycache__" / "__init__.cpython-311.pyc").read_bytes() == b"pyc"


def test_a_venv_marked_not_whole_is_rebuilt_at_its_next_use(tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    venv = small_venv(root / KEY)
    Venv.at(venv).write_marker({**Venv.at(venv).read_marker(), "format": 1, "site_packages": SITE})
    ready = Venv(root, KEY).check_ready()
    # A value for a ready venv: the marker it read, so that callers read it once.
    assert ready and ready.why_not is None and ready.marker == Venv.at(venv).read_marker()
    Venv.at(venv).mark_not_whole("lib/x.py has other content now")
    not_ready = Venv(root, KEY).check_ready()
    assert not not_ready and not_ready.marker is None
    assert not_ready.why_not == "it is not what its build made: lib/x.py has other content now"
    assert Venv.at(venv).read_marker()[
        "manifest"
    ]  # the rest of the marker is kept, for `ray-uv list`
    assert stat.S_IMODE(os.lstat(venv).st_mode) & 0o222 == 0  # read-only again


# --- a receiver installs only what the build made ---------------------------------------------


def receive(root: Path, chunks: list[archive.Chunk], packer: Packer, key: str = KEY) -> Path:
    root.mkdir(mode=0o700, exist_ok=True)
    unpacker = Unpacker(root, key, "test", sender_venv=str(packer.venv))
    try:
        for c in chunks:
            unpacker.add(c.index, c.sha256, c.data)
        return unpacker.finish(len(chunks), packer.total, packer.whole_sha256)
    except BaseException:
        unpacker.abort()
        raise


def test_a_receiver_installs_only_what_the_build_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender that does not check (an older or broken one) sends a venv changed since its
    build, with the build's marker: the receiver's own list of what it unpacked is not the
    manifest that marker names, so nothing is installed."""
    venv = small_venv(tmp_path / "src" / KEY)
    offered = {**Venv.at(venv).read_marker(), "venv": str(venv)}  # what the sender's offer carries
    _same_size_other_bytes(venv)
    monkeypatch.setattr(manifest, "difference", lambda *args: None)  # a sender that does not check
    chunks, packer = pack(venv)
    monkeypatch.undo()
    root = tmp_path / "dst"
    tree = receive(root, chunks, packer)
    with pytest.raises(ArchiveError, match="what arrived is not what the venv's build made"):
        install_received(root, KEY, tree, offered)
    assert not os.path.lexists(root / KEY)


def test_a_received_venv_has_a_manifest_of_its_own_and_ships_on(
    built: Path, tmp_path: Path
) -> None:
    """Relocation rewrites the scripts in bin/ for the receiver's path: its manifest lists what
    it installed, its marker names that, and it can be sent on as it is."""
    chunks, packer = pack(built, 8 * MiB)
    root_b = tmp_path / "venvs-b"
    install_received(
        root_b, built.name, receive(root_b, chunks, packer, built.name),
        {**Venv.at(built).read_marker(), "venv": str(built)},
    )  # fmt: skip
    on_b = root_b / built.name
    assert Venv(root_b, built.name).check_ready()
    marker = Venv.at(on_b).read_marker()
    files = manifest.load(on_b, marker["manifest"])
    assert {path: tuple(entry) for path, entry in files.items()} == walk(on_b)
    theirs = manifest.load(built, Venv.at(built).read_marker()["manifest"])
    changed = sorted(p for p in files if files[p] != theirs[p])
    assert "bin/ray" in changed and all(p.startswith("bin/") for p in changed), changed
    # An index of its own, as a build's: this node's inodes, each part's rows the manifest's
    # hashes, so a build here can seed from it.
    index = hashed.load(on_b, marker["hashed"])
    found = manifest.parts(on_b, marker["manifest"])
    assert index is not None and found is not None and index.parts.keys() == found[1].keys()
    for name, part in index.parts.items():
        rows = hashed.rows(on_b, part.rows)
        assert rows is not None
        for path, entry in manifest.load_part(on_b, name, found[1][name]).items():
            if entry.kind == "file":
                assert rows.sha256(os.lstat(on_b / path)) == entry.content, path
    chunks, packer = pack(on_b, 8 * MiB)  # B sends it on to C
    root_c = tmp_path / "venv-c"
    install_received(
        root_c, built.name, receive(root_c, chunks, packer, built.name),
        {**marker, "venv": str(on_b)},
    )  # fmt: skip
    assert Venv(root_c, built.name).check_ready()
    assert (root_c / built.name / "bin" / "ray").read_text().startswith(f"#!{root_c}")


# --- found by the venv_files fuzzer (tests/fuzz/venv_files.py) ---------------------------------


def fake_ready_venv(root: Path, marker: bytes, manifest_bytes: bytes = b"") -> Path:
    """A venv dir entry with a marker and a manifest of the given bytes ("{sha}" in the marker
    is the manifest's sha256), as a hand or another version could leave them."""
    venv = root / KEY
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#")
    (venv / "lib/python3.11/site-packages").mkdir(parents=True)
    (venv / manifest.MANIFEST).write_bytes(manifest_bytes)
    sha = hashlib.sha256(manifest_bytes).hexdigest().encode()
    (venv / MARKER).write_bytes(marker.replace(b"{sha}", sha))
    return venv


DEEP = b"[" * 50_000 + b"]" * 50_000


def test_a_marker_nested_too_deep_is_unreadable_not_a_crash(tmp_path: Path) -> None:
    """read_marker promised never to raise, and raised RecursionError."""
    venv = fake_ready_venv(tmp_path, DEEP)
    assert Venv.at(venv).read_marker() is None
    assert "its marker is unreadable (nested too deep" in str(
        Venv(tmp_path, KEY).check_ready().why_not
    )


@pytest.mark.parametrize(
    "data",
    [DEEP, b'{"format": 1, "files": {"a": ["file", Infinity, "", 0]}}'],
    ids=["nested-too-deep", "infinite-size"],
)
def test_a_manifest_json_reads_but_no_manifest_holds_is_a_manifest_error(
    tmp_path: Path, data: bytes
) -> None:
    """Once a RecursionError and an OverflowError (int(Infinity)) out of manifest.load."""
    marker = f'{{"format": 1, "key": "{KEY}", "manifest": "{{sha}}"}}'
    venv = fake_ready_venv(tmp_path, marker.encode(), data)
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(manifest.ManifestError, match="has an unreadable manifest"):
        manifest.load(venv, sha)


@pytest.mark.parametrize("recorded", ["[1, 2]", '{"count": 2, "first": [1, null]}', '"yes"'])
def test_a_sender_refuses_a_marker_with_odd_record_mismatches_in_words(
    tmp_path: Path, recorded: str
) -> None:
    """`not_as_recorded` that is no dict (or lists no names) once raised AttributeError or
    TypeError out of Packer."""
    marker = (
        f'{{"format": 1, "key": "{KEY}", "site_packages": "lib/python3.11/site-packages", '
        f'"manifest": "{{sha}}", "{NOT_AS_RECORDED}": {recorded}}}'
    )
    files = b'{"files": {}, "format": 1}'
    venv = fake_ready_venv(tmp_path, marker.encode(), files)
    with pytest.raises(ArchiveError, match="differ from their distribution's RECORD"):
        Packer(venv)


@pytest.mark.parametrize("recorded", ["null", "5", '"vllm"', '{"a": 1}'])
def test_ray_uv_list_shows_a_marker_whose_extras_are_no_list(tmp_path: Path, recorded: str) -> None:
    """`list(meta.get("extras", []))` once failed the whole listing on one such marker
    (TypeError), or showed a string's letters."""
    from ray_uv_plugin.store import inventory

    marker = f'{{"format": 1, "key": "{KEY}", "extras": {recorded}, "groups": {recorded}}}'
    fake_ready_venv(tmp_path, marker.encode())
    (entry,) = inventory.scan_one(tmp_path, KEY).venvs
    assert (entry.extras, entry.groups) == ([], [])


def test_a_receiver_refuses_a_file_that_is_not_accounted_for(built: Path, tmp_path: Path) -> None:
    """A venv whose manifest lists a file no RECORD of its lock lists and no compile step of
    its build made (a sender whose build did not account for its files): refused, named."""
    venv = tmp_path / "src" / built.name
    shutil.copytree(built, venv, symlinks=True)
    stray = next(venv.glob("lib/python*/site-packages")) / "stray.py"
    stray.write_text("PLANTED = 1\n")
    Venv.at(venv).write_marker(
        {**Venv.at(venv).read_marker(), "manifest": manifest.write(venv, manifest.scan(venv))}
    )
    chunks, packer = pack(venv, 8 * MiB)
    root = tmp_path / "dst"
    tree = receive(root, chunks, packer, built.name)
    with pytest.raises(ArchiveError, match="no distribution of the lock installed") as e:
        install_received(root, built.name, tree, {**Venv.at(venv).read_marker(), "venv": str(venv)})
    assert str(stray.relative_to(venv)) in str(e.value)
    assert not os.path.lexists(root / built.name)


def test_a_manifest_is_kept_by_part_and_its_sha256_is_its_entries_alone(tmp_path: Path) -> None:
    """A part is a top-level package or module of site-packages (a top-level module's bytecode
    with it), every dist-info dir together, and the venv's own entries; the plugin's own names
    are none. What the marker names is a function of the entries (`digest`), whoever writes it,
    and a fragment that is not its name's is refused."""
    site = "lib/python3.11/site-packages"
    prefix = f"{site}/"
    assert manifest.part_of(f"{site}/numpy/core/__init__.py", prefix) == "numpy"
    assert manifest.part_of(f"{site}/__pycache__/six.cpython-311.pyc", prefix) == "six.py"
    assert manifest.part_of(f"{site}/six.py", prefix) == "six.py"
    assert manifest.part_of(f"{site}/__pycache__", prefix) == manifest.VENV
    assert manifest.part_of(f"{site}/six-1.0.dist-info/RECORD", prefix) == manifest.DIST_INFOS
    assert manifest.part_of(site, prefix) == manifest.part_of("bin/python", prefix) == manifest.VENV
    paths = [".ray-uv-ready", f"{manifest.PARTS}/abc", "bin", f"{site}/six.py"]
    assert manifest.split(paths, site) == {manifest.VENV: ["bin"], "six.py": [f"{site}/six.py"]}
    venv = tmp_path / KEY
    (venv / site / "pkg").mkdir(parents=True)
    (venv / site / "pkg" / "m.py").write_bytes(b"x = 1\n")
    (venv / site / "six.py").write_bytes(b"y = 2\n")
    (venv / "bin").mkdir()
    files = manifest.scan(venv)
    sha = manifest.write(venv, files)
    assert sha == manifest.digest(files)
    found = manifest.parts(venv, sha)
    assert found is not None and found[0] == site
    assert sorted(found[1]) == [manifest.VENV, "pkg", "six.py"]
    assert manifest.load(venv, sha) == files
    fragment = venv / manifest.PARTS / found[1]["pkg"]
    fragment.chmod(0o644)
    fragment.write_bytes(fragment.read_bytes().replace(b"m.py", b"n.py"))
    with pytest.raises(manifest.ManifestError, match="not its build's"):
        manifest.load(venv, sha)
    fragment.unlink()
    with pytest.raises(manifest.ManifestError, match="has lost a fragment"):
        manifest.load(venv, sha)

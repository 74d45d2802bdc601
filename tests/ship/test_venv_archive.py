"""The ship stream without Ray (`ship.archive`, `ship.unpack`, `ship.relocation`): hostile
streams, built by hand with `tarfile` and correctly hashed, fed to a real `Unpacker`; the packer
on trees that change under it; and relocation of real uv venvs (real uv, a real console script)
between paths of each of uv's shebang forms. Ray's side of shipping is in tests/ship/test_ship.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.ship import archive, relocation
from ray_uv_plugin.ship.archive import ArchiveError, Packer
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import hashed, manifest
from ray_uv_plugin.store.layout import MARKER_FORMAT, Venv

KEY = "0123456789abcdef"
OTHER_KEY = "fedcba9876543210"
MiB = 1024 * 1024

Member = tuple[tarfile.TarInfo, bytes | None]


def d(name: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info, None


def f(name: str, data: bytes = b"", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def link(name: str, target: str, hard: bool = False) -> Member:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info, None


SKELETON = [d("bin"), f("bin/python", b"#"), d("lib")]


def tar_bytes(members: list[Member], manifest: bool = True, end: bool = True) -> bytes:
    """A tar stream as the packer writes it (a manifest of `members`, end-of-archive blocks),
    or without either."""
    buf = io.BytesIO()
    tar = tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT)
    for info, data in members:
        tar.addfile(info, io.BytesIO(data) if data is not None else None)
    if manifest:
        archive.write_manifest(tar, [info for info, _ in members])
    if end:
        tar.close()
    return buf.getvalue()


def feed(root: Path, payload: bytes, chunk: int = 4096, key: str = KEY, **limits) -> Path:
    """Send `payload` in chunks to an Unpacker under `root`, as `ship` does; abort on error."""
    root.mkdir(mode=0o700, exist_ok=True)
    unpacker = Unpacker(root, key, "test", **limits)
    pieces = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
    try:
        for n, piece in enumerate(pieces):
            unpacker.add(n, hashlib.sha256(piece).hexdigest(), piece)
        whole = archive.stream_sha256(hashlib.sha256(piece).hexdigest() for piece in pieces)
        return unpacker.finish(len(pieces), len(payload), whole)
    except BaseException:
        unpacker.abort()
        raise


def tree(path: Path) -> dict[str, str]:
    """Every entry under `path`, never following a link: name -> kind (and link text)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                found[rel] = f"link {os.readlink(full)}"
            else:
                found[rel] = "dir" if os.path.isdir(full) else "file"
    return found


def returns_within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run `call` in a thread: what it raised, or a failure if it is still running."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds}s"
    return outcome[0]


# --- nothing reaches outside <venv dir>/<key> ------------------------------------------------

CHAIN = [d("a"), link("a/up", ".."), link("esc", "a/up/..")]


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (CHAIN + [link(f"esc/{OTHER_KEY}.lock", "hijacked")], "'esc' is no directory"),
        (CHAIN + [f(f"esc/{OTHER_KEY}.lock", b"x")], "'esc' is no directory"),
        (CHAIN, "'esc' leads to .*, outside the venv"),
        ([d("a"), link("a/up", ".."), link("up2", "a/up/../..")], "'up2' leads to"),
        ([link("lib/py", "../bin"), link("lib/py/x", "y")], "'lib/py' is no directory"),
    ],
    ids=["link-through-chain", "file-through-chain", "stray-chain", "two-up", "through-link"],
)
def test_links_that_lead_out_through_other_links_change_nothing_outside(
    tmp_path: Path, members: list[Member], message: str
) -> None:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    (root / f"{OTHER_KEY}.lock").write_text("another build's lock")
    before = tree(tmp_path)
    with pytest.raises(ArchiveError, match=message):
        feed(root, tar_bytes(SKELETON + members))
    assert tree(tmp_path) == before  # no link or file left, in the venv dir or above it


@pytest.mark.parametrize("top", ["bin", "lib"])
def test_a_top_level_bin_or_lib_that_is_a_link_is_refused(tmp_path: Path, top: str) -> None:
    members = [d("real"), link(top, "real")]
    members += [d("lib")] if top == "bin" else [d("bin"), f("bin/python", b"#")]
    with pytest.raises(ArchiveError, match=f"'{top}' is a symlink, not a directory"):
        feed(tmp_path / "v", tar_bytes(members))
    assert os.listdir(tmp_path / "v") == []


@pytest.mark.parametrize(
    "second",
    [link("lib/x.py", "y.py"), f("lib/x.py", b"other"), link("lib", "bin"), f("lib")],
    ids=["file-by-link", "file-by-file", "dir-by-link", "dir-by-file"],
)
def test_a_member_that_replaces_an_earlier_one_is_refused(tmp_path: Path, second: Member) -> None:
    members = SKELETON + [f("lib/x.py", b"print()"), second]
    with pytest.raises(ArchiveError, match="is in the stream twice"):
        feed(tmp_path / "v", tar_bytes(members))
    assert os.listdir(tmp_path / "v") == []


def test_a_member_tarfile_would_skip_is_an_error(tmp_path: Path) -> None:
    """tarfile's default errorlevel drops a hard link it cannot make without a word."""
    members = SKELETON + [link("lib/h", "lib/missing", hard=True)]
    with pytest.raises(ArchiveError, match="a hard link to 'lib/missing': no file earlier"):
        feed(tmp_path / "v", tar_bytes(members))


def test_a_fifo_or_device_is_refused(tmp_path: Path) -> None:
    fifo, _ = f("lib/pipe")
    fifo.type = tarfile.FIFOTYPE
    with pytest.raises(ArchiveError, match="lib/pipe.*not in a venv"):
        feed(tmp_path / "v", tar_bytes(SKELETON + [(fifo, None)]))


def test_the_sender_marker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="the sender's marker"):
        feed(tmp_path / "v", tar_bytes(SKELETON + [f(archive.MARKER, b"{}")]))


@pytest.mark.parametrize("key", ["../../evil", "k" * 16, KEY + "/..", KEY.upper(), ""])
def test_a_bad_key_is_refused_before_anything_is_written(tmp_path: Path, key: str) -> None:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    with pytest.raises(ArchiveError, match="is no venv key"):
        Unpacker(root, key, "test")
    assert tree(tmp_path) == {"venvs": "dir"}


@pytest.mark.parametrize(
    "venv",
    [f"relative/{KEY}", f"/a/../b/{KEY}", f"/a//b/{KEY}", "/a/b/other", f"/a/it's/{KEY}", "/"],
)
def test_a_bad_sender_venv_path_is_refused(tmp_path: Path, venv: str) -> None:
    root = tmp_path / "venvs"
    root.mkdir(mode=0o700)
    with pytest.raises(ArchiveError, match="the sender's venv path"):
        Unpacker(root, KEY, "test", sender_venv=venv)
    assert os.listdir(root) == []
    # ... and where it is used, in `install_received`, whoever unpacked the tree.
    received = feed(root, tar_bytes(SKELETON))
    with pytest.raises(ArchiveError, match="the sender's venv path"):
        install_received(root, KEY, received, {"venv": venv})
    assert not os.path.lexists(root / KEY)


SITE = "lib/python3.11/site-packages"


@pytest.mark.parametrize("theirs", ["/usr/lib/python3/dist-packages", f"../{OTHER_KEY}/{SITE}"])
def test_a_receiver_writes_its_own_site_packages_whatever_the_sender_s_marker_says(
    tmp_path: Path, theirs: str
) -> None:
    """A receiver's marker is its own: what seeding on its node reads (`site_packages`) is the
    dir it received, never a path of the sender's choosing (before: copied as sent)."""
    root = tmp_path / "venvs"
    members = [*SKELETON, d("lib/python3.11"), d(SITE), f(f"{SITE}/six.py", b"x = 1\n")]
    record = b"six.py,,6\nsix-1.0.dist-info/RECORD,,\n"  # accounted for (`store.accounting`)
    members += [d(f"{SITE}/six-1.0.dist-info"), f(f"{SITE}/six-1.0.dist-info/RECORD", record)]
    received = feed(root, tar_bytes(members))
    sent = {
        "format": "theirs",
        "key": OTHER_KEY,
        "venv": f"/old/venvs/{KEY}",
        "manifest": hashlib.sha256((received / manifest.MANIFEST).read_bytes()).hexdigest(),
        "site_packages": theirs,
        "hashed": "0" * 64,
        "not_whole": "the sender's say",
        "name": "proj",
    }
    install_received(root, KEY, received, sent)
    marker = Venv.at(root / KEY).read_marker()
    assert marker["site_packages"] == SITE and marker["key"] == KEY and marker["name"] == "proj"
    assert "not_whole" not in marker and "venv" not in marker
    assert marker["hashed"] != sent["hashed"]  # its own index, of this node's inodes
    assert hashed.load(root / KEY, marker["hashed"]) is not None
    assert marker["format"] == MARKER_FORMAT


def test_a_received_venv_s_files_are_the_receiver_s_own_and_read_only(tmp_path: Path) -> None:
    """The receiver wrote every file (unpacked, copied from a seed, relocated): none keeps a
    write bit, so a venv seeded from it here shares no file that a write in place changes."""
    root = tmp_path / "venvs"
    members = [*SKELETON, d("lib/python3.11"), d(SITE), f(f"{SITE}/six.py", b"x = 1\n", 0o664)]
    record = b"six.py,,6\nsix-1.0.dist-info/RECORD,,\n"
    members += [d(f"{SITE}/six-1.0.dist-info"), f(f"{SITE}/six-1.0.dist-info/RECORD", record)]
    received = feed(root, tar_bytes(members))
    sha256 = hashlib.sha256((received / manifest.MANIFEST).read_bytes()).hexdigest()
    install_received(root, KEY, received, {"venv": f"/old/venvs/{KEY}", "manifest": sha256})
    for name in ("bin/python", f"{SITE}/six.py"):
        assert os.lstat(root / KEY / name).st_mode & 0o222 == 0, name


def test_a_venv_dir_whose_path_uv_would_quote_receives_nothing(tmp_path: Path) -> None:
    root = tmp_path / "it's venvs"
    root.mkdir(mode=0o700)
    with pytest.raises(ArchiveError, match="this node's venv path .* holds \"'\""):
        Unpacker(root, KEY, "test")
    assert os.listdir(root) == []
    with pytest.raises(ArchiveError, match="the venv's new path"):
        relocation.relocate(tmp_path, f"/old/{KEY}", str(root / KEY))


def test_relocate_never_follows_a_link_out_of_the_venv(tmp_path: Path) -> None:
    old, new = f"/old/venvs/{KEY}", str(tmp_path / "venvs" / KEY)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "script").write_text(f"#!{old}/bin/python\n")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "bin").symlink_to(outside)
    with pytest.raises(ArchiveError, match="bin is not a directory"):
        relocation.relocate(venv, old, new)
    (venv / "bin").unlink()
    (venv / "bin").mkdir()
    (venv / "bin" / "script").symlink_to(outside / "script")
    assert relocation.relocate(venv, old, new) == 0
    assert (outside / "script").read_text() == f"#!{old}/bin/python\n"


@pytest.mark.parametrize(
    ("members", "limits", "message"),
    [
        ([f(f"lib/{n}") for n in range(60)], {"max_members": 50}, "more than 50 members"),
        ([f("lib/big", b"x" * 5000)], {"max_bytes": 4000}, "more than 4000 bytes of files"),
    ],
    ids=["members", "bytes"],
)
def test_a_stream_bigger_than_the_limits_is_refused(
    tmp_path: Path, members: list[Member], limits: dict, message: str
) -> None:
    with pytest.raises(ArchiveError, match=message):
        feed(tmp_path / "v", tar_bytes(SKELETON + members), **limits)
    assert os.listdir(tmp_path / "v") == []
    feed(tmp_path / "w", tar_bytes(SKELETON + members))  # the module's limits are far above


def test_the_limits_are_those_the_docs_give() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    text = " ".join(docs.split())
    gib = archive.MAX_BYTES // 1024**3
    assert f"{archive.MAX_MEMBERS:,} members or {gib} GiB" in text
    assert f"after {archive.STALL_SECONDS / 60:.0f} minutes without progress" in text


def test_a_huge_tar_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    info, data = f("lib/x.py")
    info.pax_headers = {"comment": "x" * (2 * MiB)}
    with pytest.raises(ArchiveError, match="a tar header of .* bytes"):
        feed(tmp_path / "v", tar_bytes(SKELETON + [(info, data)]), chunk=MiB)


def test_a_stream_longer_than_the_limits_allow_is_refused_as_it_arrives(tmp_path: Path) -> None:
    payload = tar_bytes(SKELETON + [f("lib/x", b"x" * 100_000)])
    with pytest.raises(ArchiveError, match="chunk 0: the stream is longer than a venv's"):
        feed(tmp_path / "v", payload, chunk=len(payload), max_bytes=1000, max_members=5)


# --- a receive is bounded ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [([b"z" * 4096] * 2, "data after the end"), ([b"z" * 4096] * 3, "data after the end")]
    + [([b"\0" * 4096] * 12, "data after the end")],
    ids=["2-chunks", "3-chunks", "many-zeros"],
)
def test_chunks_after_the_end_of_the_archive_fail_the_receive(
    tmp_path: Path, extra: list[bytes], message: str
) -> None:
    payload = tar_bytes(SKELETON) + b"".join(extra)
    raised = returns_within(30, lambda: feed(tmp_path / "v", payload, chunk=4096, stall_s=5))
    assert isinstance(raised, ArchiveError) and message in str(raised), raised
    assert os.listdir(tmp_path / "v") == []


def test_a_receive_whose_chunks_stop_coming_ends_and_aborts_in_bounded_time(
    tmp_path: Path,
) -> None:
    root = tmp_path / "v"
    root.mkdir(mode=0o700)
    payload = tar_bytes(SKELETON + [f("lib/x", os.urandom(20_000))])
    unpacker = Unpacker(root, KEY, "test", stall_s=1)
    unpacker.add(0, hashlib.sha256(payload[:8192]).hexdigest(), payload[:8192])
    time.sleep(2)  # no second chunk: the sender stalled
    raised = returns_within(10, lambda: unpacker.add(1, "0" * 64, b""))
    assert isinstance(raised, ArchiveError) and "no chunk arrived for 1s" in str(raised)
    assert returns_within(10, unpacker.abort) is None
    assert os.listdir(root) == []


def test_abort_returns_while_the_unpacker_waits_for_a_chunk(tmp_path: Path) -> None:
    root = tmp_path / "v"
    root.mkdir(mode=0o700)
    unpacker = Unpacker(root, KEY, "test")  # the default stall time: minutes
    start = time.monotonic()
    assert returns_within(10, unpacker.abort) is None
    assert time.monotonic() - start < 5
    assert os.listdir(root) == []


# --- a truncated or changed venv is never marked ready -----------------------------------------


def cut_at_a_member_boundary(members: list[Member]) -> bytes:
    """The stream a packer that stopped early would send: whole members, no end."""
    return tar_bytes(members, manifest=False, end=False)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (cut_at_a_member_boundary(SKELETON + [f("lib/a", b"a")]), "without the sender"),
        (tar_bytes(SKELETON + [f("lib/a", b"a")], manifest=False), "without the sender's manifest"),
        (tar_bytes(SKELETON + [f("lib/a", b"a")], end=False), "without the tar's end-of-archive"),
    ],
    ids=["cut-at-a-member", "no-manifest", "no-end-blocks"],
)
def test_a_stream_cut_short_is_refused(tmp_path: Path, payload: bytes, message: str) -> None:
    with pytest.raises(ArchiveError, match=message):
        feed(tmp_path / "v", payload)
    assert os.listdir(tmp_path / "v") == []


def test_a_stream_that_differs_from_its_manifest_is_refused(tmp_path: Path) -> None:
    listed = SKELETON + [f("lib/a", b"a"), f("lib/b", b"b")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in listed[:-1]:  # lib/b is missing
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        archive.write_manifest(tar, [info for info, _ in listed])
    with pytest.raises(ArchiveError, match="holds 4 members; the sender's manifest lists 5"):
        feed(tmp_path / "v", buf.getvalue())


def mark_built(venv: Path) -> Path:
    """Mark `venv` as a build does: its manifest, then the marker naming it."""
    Venv.at(venv).write_marker(
        {"key": venv.name, "manifest": manifest.write(venv, manifest.scan(venv))}
    )
    return venv


def fake_venv(path: Path) -> Path:
    """A venv-shaped tree as a build leaves it (`mark_built`): a big file first, so that a
    packer is mid-way while we change it."""
    (path / "a").mkdir(parents=True)
    (path / "a" / "big").write_bytes(os.urandom(2 * MiB))
    (path / "b").mkdir()
    (path / "b" / "pkg.py").write_text("x = 1\n")
    (path / "bin").mkdir()
    (path / "bin" / "python").write_text("#")
    os.link(path / "b" / "pkg.py", path / "b" / "same.py")
    (path / "lib").mkdir()
    (path / "lib64").symlink_to("lib")
    return mark_built(path)


def pack_all(packer: Packer) -> list[archive.Chunk]:
    chunks = [packer.next_chunk()]
    while not chunks[-1].last:
        chunks.append(packer.next_chunk())
    return chunks


def test_a_packed_tree_arrives_whole_with_its_links_and_times(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "src" / KEY)
    os.utime(venv / "b" / "pkg.py", (1_000_000_000, 1_000_000_000))
    packer = Packer(venv, 64 * 1024)
    chunks = pack_all(packer)
    root = tmp_path / "dst"
    root.mkdir(mode=0o700)
    unpacker = Unpacker(root, KEY, "test")
    for c in chunks:
        unpacker.add(c.index, c.sha256, c.data)
    got = unpacker.finish(len(chunks), packer.total, packer.whole_sha256)
    expected = tree(venv)
    del expected[archive.MARKER]
    assert tree(got) == expected  # no marker, the same links; the manifest of what arrived
    assert (got / "a" / "big").read_bytes() == (venv / "a" / "big").read_bytes()
    assert os.stat(got / "b" / "pkg.py").st_ino == os.stat(got / "b" / "same.py").st_ino
    assert os.stat(got / "b" / "pkg.py").st_mtime == 1_000_000_000


def test_the_stream_has_no_header_per_member_beyond_tars_own(tmp_path: Path) -> None:
    """A pax header per member (a fractional mtime, an owner's name) would double what the
    receiver parses: members carry whole-second mtimes and no owner; a name over tar's 100
    characters still gets its pax header."""
    venv = fake_venv(tmp_path / "src" / KEY)
    os.utime(venv / "b" / "pkg.py", (1_000_000_000.75, 1_000_000_000.75))
    long_name = "n" * 120
    (venv / "b" / long_name).write_text("")
    stream = b"".join(c.data for c in pack_all(Packer(mark_built(venv), 64 * 1024)))
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r|") as tar:
        members = {m.name: m for m in tar}
    with_pax = sorted(name for name, m in members.items() if m.pax_headers)
    assert with_pax == [f"b/{long_name}"], with_pax
    assert members["b/pkg.py"].mtime == 1_000_000_000
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members.values()} == {(0, 0, "", "")}
    assert members["b/same.py"].islnk() and members["b/same.py"].linkname == "b/pkg.py"


def test_chunks_each_right_but_not_the_senders_whole_are_refused(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "src" / KEY)
    packer = Packer(venv, 4096)
    chunks = pack_all(packer)
    assert len(chunks) > 2
    assert packer.whole_sha256 == archive.stream_sha256(c.sha256 for c in chunks)
    root = tmp_path / "dst"
    root.mkdir(mode=0o700)
    unpacker = Unpacker(root, KEY, "test")
    try:
        for c in chunks:
            unpacker.add(c.index, c.sha256, c.data)
        reordered = archive.stream_sha256(
            [chunks[1].sha256, chunks[0].sha256] + [c.sha256 for c in chunks[2:]]
        )
        with pytest.raises(ArchiveError, match="the whole stream's sha256 differs"):
            unpacker.finish(len(chunks), packer.total, reordered)
    finally:
        unpacker.abort()
    assert list(root.iterdir()) == []


def changed_mid_pack(venv: Path, change: Callable[[], None]) -> ArchiveError:
    """Pack `venv` in small chunks, `change` it while the packer is inside a/big."""
    packer = Packer(venv, 64 * 1024)
    packer.next_chunk()
    change()
    with pytest.raises(ArchiveError) as raised:
        pack_all(packer)
    return raised.value


def test_a_dir_the_packer_cannot_read_fails_the_pack(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / KEY)
    error = changed_mid_pack(venv, lambda: shutil.rmtree(venv / "b"))
    assert f"cannot read {venv / 'b'}" in str(error)


def test_a_venv_replaced_while_it_is_packed_fails_the_pack(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / KEY)

    def replace() -> None:  # `gc` renames it away, a build makes it again
        os.rename(venv, tmp_path / "gone")
        shutil.copytree(tmp_path / "gone", venv, symlinks=True)

    assert "was renamed, replaced or rebuilt" in str(changed_mid_pack(venv, replace))


def test_a_venv_re_marked_while_it_is_packed_fails_the_pack(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / KEY)
    remark = lambda: (venv / archive.MARKER).write_text('{"key": "y"}')  # noqa: E731
    assert "was renamed, replaced or rebuilt" in str(changed_mid_pack(venv, remark))


# --- relocation keeps uv's shebang form ---------------------------------------------------------


def venv_dir(base: Path, kind: str) -> Path:
    """A venv dir whose `<key>/bin/python` takes each of uv's shebang forms."""
    if kind == "short":
        return base / "s"
    if kind == "space":
        return base / "with space" / "venvs"
    return base / ("l" * 100) / "venvs"  # `#!` + the interpreter's path: over 127 bytes


def uv_venv(venv: Path) -> None:
    """A venv made by uv at `venv`, from this interpreter, with a console script (tqdm's)."""
    uv = find_uv()
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([uv, "venv", "--quiet", "--python", python, str(venv)], check=True, timeout=300)
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    subprocess.run([uv, "pip", "install", "--quiet", "tqdm"], check=True, env=env, timeout=300)


def bin_scripts(venv: Path) -> dict[str, bytes]:
    bin_dir = venv / "bin"
    return {
        p.name: p.read_bytes()
        for p in sorted(bin_dir.iterdir())
        if p.is_file() and not p.is_symlink() and (p.name == "tqdm" or "activate" in p.name)
    }


@pytest.mark.parametrize(
    ("src", "dst"),
    [("short", "long"), ("long", "short"), ("short", "space"), ("space", "long")],
)
def test_a_relocated_venv_has_the_scripts_uv_writes_for_its_new_path(
    tmp_path: Path, src: str, dst: str
) -> None:
    source = venv_dir(tmp_path / "src", src) / KEY
    uv_venv(source)
    target_root = venv_dir(tmp_path / "dst", dst)
    uv_venv(target_root / KEY)  # what uv itself writes at the new path
    expected = bin_scripts(target_root / KEY)
    shutil.rmtree(target_root / KEY)
    assert expected["tqdm"].startswith(b"#!/bin/sh\n") == (dst != "short")

    packer = Packer(mark_built(source), MiB)
    chunks = pack_all(packer)
    target_root.chmod(0o700)
    unpacker = Unpacker(target_root, KEY, "test", sender_venv=str(source))
    for c in chunks:
        unpacker.add(c.index, c.sha256, c.data)
    received = unpacker.finish(len(chunks), packer.total, packer.whole_sha256)
    install_received(
        target_root, KEY, received, {**Venv.at(source).read_marker(), "venv": str(source)}
    )

    assert bin_scripts(target_root / KEY) == expected
    out = subprocess.run(
        [str(target_root / KEY / "bin" / "tqdm"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_shebang_takes_uv_s_form_at_its_limit() -> None:
    exe = b"/" + b"x" * 123
    assert relocation.shebang(exe) == b"#!" + exe  # 2 + 124 + 1 = 127 bytes: still plain
    assert relocation.shebang(exe + b"y").startswith(b"#!/bin/sh\n'''exec' '/xxx")
    assert relocation.shebang(b"/a b/python").startswith(b"#!/bin/sh\n")


# --- found by the stream fuzzer (tests/fuzz/stream.py): each refusal is the receiver's own ----


def deep_manifest() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in SKELETON:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        data = b"[" * 100_000 + b"]" * 100_000
        info = tarfile.TarInfo(archive.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    ("payload", "message", "cause"),
    [
        (tar_bytes(SKELETON + [link("lib/x", "")]), "'lib/x': a symlink to nowhere", None),
        (tar_bytes(SKELETON + [link("lib/x", "", hard=True)]), "a hardlink to nowhere", None),
        (tar_bytes(SKELETON + [f("lib/" + "y" * 300)]), "cannot be made here: File name", OSError),
        (deep_manifest(), "the sender's manifest is unreadable", RecursionError),
        (b"\x01" * 1024, "the stream is not a tar the packer writes", tarfile.TarError),
        (b"", "the stream is not a tar the packer writes", tarfile.TarError),
        # (a non-ASCII name goes into a pax header, which keeps the NUL)
        (tar_bytes(SKELETON + [d("lib/\u00e9\x00b")]), "a NUL byte in its name or link", None),
        (tar_bytes(SKELETON + [link("lib/x", "\u00e9\x00b")]), "NUL byte in its name", None),
    ],
    ids=[
        "empty-symlink",
        "empty-hardlink",
        "name-too-long",
        "deep-manifest",
        "garbage",
        "empty",
        "nul-in-name",
        "nul-in-link",
    ],
)
def test_a_stream_that_breaks_the_unpacking_is_refused_in_the_receivers_words(
    tmp_path: Path, payload: bytes, message: str, cause: type[BaseException] | None
) -> None:
    """Each once reached the caller as an OSError, a RecursionError, a ValueError (`embedded
    null byte`: a pax name with a NUL) or tarfile's own error wrapped as `unpacking: <that
    error>` (`[Errno 2] No such file or directory: '' -> ...`)."""
    with pytest.raises(ArchiveError, match=message) as raised:
        feed(tmp_path / "v", payload)
    extracted = raised.value.__cause__
    assert isinstance(extracted, ArchiveError), extracted  # the unpacking thread's refusal
    if cause is not None:
        assert isinstance(extracted.__cause__, cause)
    assert os.listdir(tmp_path / "v") == []

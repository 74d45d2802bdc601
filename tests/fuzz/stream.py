"""The ship stream as a receiver takes it: chunks, the end, the stream's manifest, the sender's
marker; run through the real `Unpacker` and `install_received` in a venv dir of its own, then
the file system is checked.

A case is a venv as a model (members: dirs, files, links, and what no venv holds), a stream
made of it (its manifest honest or not, its end blocks or not, bytes after them), byte changes
to the stream, chunking and lies in the chunk protocol, and the marker the sender sends (which
names the manifest of files it built: the model's). Link texts and names may hold `{outside}`,
`{root}`, `{other}` and `{python}`, replaced per run by a dir beside the venv dir, the venv dir,
another venv's key and this node's interpreter.
"""

from __future__ import annotations

import atexit
import csv
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ray_uv_plugin.ship import archive, unpack
from ray_uv_plugin.ship.archive import ArchiveError
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import freezing, manifest
from ray_uv_plugin.store.layout import MARKER_FORMAT, Venv
from tests.fuzz.harness import Case, Target, Violation, b64, bounded, refused_clearly, seeded, unb64

KEY = "0123456789abcdef"
OTHER_KEY = "fedcba9876543210"
SITE = "lib/python3.11/site-packages"
SENDER_VENV = f"/senders/venvs/{KEY}"
STALL_S = 2.0  # the receiver's bound on every wait, shortened for the fuzzer
BOUND_S = 30.0  # a receive still running then is a hang
# The unpacker polls for an abort this often; the fuzzer's aborts need not wait 0.2 s each.
unpack._POLL_SECONDS = 0.01

SKELETON: list[dict[str, Any]] = [
    {"name": "bin", "type": "dir"},
    {"name": "bin/python", "type": "symlink", "link": "{python}"},
    {"name": "lib", "type": "dir"},
    {"name": "lib/python3.11", "type": "dir"},
    {"name": SITE, "type": "dir"},
]

# --- cases ----------------------------------------------------------------------------------

segment = st.one_of(
    st.sampled_from(["a", "pkg", "__init__.py", "x.py", "__pycache__", "bin", "lib", "é", "a b"]),
    st.sampled_from(["..", ".", "", ".ray-uv-ready", ".ray-uv-manifest", ".ray-uv-ready.manifest"]),
    st.sampled_from(["{other}", "..{other}", "{outside}", "python", "a\nb", "x" * 120, "y" * 300]),
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=10),
)
link_text = st.one_of(
    st.sampled_from(["..", "../..", "a", "./a", "../bin", "/", "{python}", "{outside}"]),
    st.sampled_from(["{outside}/f", "{root}", f"{{root}}/{OTHER_KEY}", f"../../{OTHER_KEY}"]),
    st.sampled_from(["python3", "/usr/bin/python3", "../../../../../../etc", "a/../.."]),
    st.lists(segment, min_size=1, max_size=4).map("/".join),
)
member_type = st.sampled_from(
    ["dir", "file", "file", "file", "symlink", "hardlink", "fifo", "chr", "blk", "cont"]
)


@st.composite
def members(draw: Any) -> list[dict[str, Any]]:
    """A venv's tree below site-packages, parents first, and now and then a member from
    anywhere, of any type."""
    out: list[dict[str, Any]] = []
    dirs = [SITE]
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(member_type)
        if draw(st.integers(0, 4)) == 0:
            name = "/".join(draw(st.lists(segment, min_size=1, max_size=4)))
        else:
            name = f"{draw(st.sampled_from(dirs))}/{draw(segment)}"
        member: dict[str, Any] = {"name": name, "type": kind}
        if kind == "dir":
            dirs.append(name)
        elif kind == "file":
            member["data"] = b64(draw(st.binary(max_size=300)))
            member["mode"] = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o2777, 0o7777, 0]))
        elif kind == "symlink":
            member["link"] = draw(link_text)
        elif kind == "hardlink":
            files = [m["name"] for m in out if m["type"] == "file"]
            member["link"] = draw(st.sampled_from(files) if files else link_text)
        if draw(st.integers(0, 30)) == 0:
            member["pax"] = draw(st.sampled_from([2 * 1024 * 1024, 64, 1024 * 1024 - 600]))
        out.append(member)
    return out


protocol = st.fixed_dictionaries(
    {},
    optional={
        "skip": st.integers(0, 8),  # chunk n is never sent
        "repeat": st.integers(0, 8),  # chunk n is sent twice
        "bad_sha": st.integers(0, 8),  # chunk n's sha256 is not its data's
        "chunks_off": st.integers(-2, 2),  # `finish` names another count of chunks...
        "total_off": st.integers(-2, 2),  # ... of bytes
        "whole_wrong": st.booleans(),  # ... or another whole sha256
        "stop_after": st.integers(0, 8),  # the sender stops: no more chunks, no finish
    },
)
mutation = st.one_of(
    st.fixed_dictionaries(
        {"op": st.just("flip"), "at": st.floats(0, 1), "xor": st.integers(1, 255)}
    ),
    st.fixed_dictionaries({"op": st.just("cut"), "at": st.floats(0, 1)}),
    st.fixed_dictionaries(
        {
            "op": st.just("insert"),
            "at": st.floats(0, 1),
            "data": st.binary(min_size=1, max_size=600).map(b64),
        }
    ),
    st.fixed_dictionaries(
        {"op": st.just("zero"), "at": st.floats(0, 1), "n": st.integers(1, 1024)}
    ),
)
stream_manifest = st.one_of(
    st.just("honest"),
    st.sampled_from(["none", "drop-last", "extra", "deep", "not-json", "dir"]),
    st.recursive(
        st.one_of(st.none(), st.integers(), st.text(max_size=5)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    ).map(lambda doc: {"json": doc}),
)


def _case(
    model: list,
    manifest_kind: Any,
    end: str,
    trailer: bytes,
    mutations: list,
    chunk: int,
    proto: dict,
    marker: str,
    limits: dict,
) -> Case:
    return {
        "members": model,
        "manifest": manifest_kind,
        "end": end,
        "trailer": b64(trailer),
        "mutations": mutations,
        "chunk": chunk,
        "protocol": proto,
        "marker": marker,
        "limits": limits,
    }


plain_segment = st.one_of(
    st.sampled_from(["pkg", "__init__.py", "x.py", "__pycache__", "a b", "é", "data.json"]),
    st.text(
        st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=12
    ).filter(lambda s: s not in (".", "..")),
)


@st.composite
def honest_members(draw: Any) -> list[dict[str, Any]]:
    """A venv a build could make: dirs, files of any mode, hard links, each file listed by a
    distribution's RECORD (`_infos` adds it): no link but uv's scaffolding's."""
    out: list[dict[str, Any]] = []
    dirs, names = [SITE], {m["name"] for m in SKELETON}
    for _ in range(draw(st.integers(0, 10))):
        name = f"{draw(st.sampled_from(dirs))}/{draw(plain_segment)}"
        if name in names:
            continue
        names.add(name)
        kind = draw(st.sampled_from(["dir", "file", "file", "hardlink"]))
        member: dict[str, Any] = {"name": name, "type": kind}
        files = [m["name"] for m in out if m["type"] == "file"]
        if kind == "dir":
            dirs.append(name)
        elif kind == "hardlink" and files:
            member["link"] = draw(st.sampled_from(files))
        else:
            member["type"] = "file"
            member["data"] = b64(draw(st.binary(max_size=2000)))
            member["mode"] = draw(st.sampled_from([0o644, 0o755, 0o600, 0o4755, 0o777]))
        out.append(member)
    return out


honest = st.builds(
    lambda model, chunk: {
        **_case(model, "honest", "close", b"", [], chunk, {}, "model", {}),
        "honest": True,
    },
    st.builds(lambda m: SKELETON + m, honest_members()),
    st.sampled_from([512, 1000, 4096, 10240, 1 << 20]),
)
attack = st.builds(
    _case,
    st.builds(lambda m: SKELETON + m, members()),
    st.one_of(st.just("honest"), st.just("honest"), stream_manifest),
    st.sampled_from(["close", "close", "close", "none"]),
    st.one_of(st.just(b""), st.just(b""), st.binary(max_size=64), st.just(b"\0" * 30000)),
    st.one_of(st.just([]), st.just([]), st.lists(mutation, min_size=1, max_size=3)),
    st.sampled_from([512, 1000, 4096, 10240, 65536, 1 << 20]),
    st.one_of(st.just({}), st.just({}), protocol),
    st.sampled_from(["model", "model", "model", "none", "other", "not-str"]),
    st.one_of(
        st.just({}),
        st.fixed_dictionaries(
            {"max_members": st.integers(1, 12), "max_bytes": st.integers(0, 2000)}
        ),
    ),
)
# Attacks built on honest venvs too: one change to a stream that would be taken.
fresh = st.one_of(honest, attack, honest.flatmap(lambda case: _mutate(case)))


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    return st.builds(
        lambda mutations, chunk, proto, extra: {
            **seed,
            "honest": False,
            "members": seed["members"] + extra,
            "mutations": seed.get("mutations", []) + mutations,
            "chunk": chunk or seed["chunk"],
            "protocol": {**seed.get("protocol", {}), **proto},
        },
        st.lists(mutation, min_size=1, max_size=2),
        st.sampled_from([0, 0, 512, 4096]),
        st.one_of(st.just({}), protocol),
        st.one_of(st.just([]), members()),
    )


# --- the stream ----------------------------------------------------------------------------


def _fill(text: str, where: dict[str, str]) -> str:
    for token, value in where.items():
        text = text.replace(token, value)
    return text


_TYPES = {
    "dir": tarfile.DIRTYPE,
    "file": tarfile.REGTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "cont": tarfile.CONTTYPE,
}


def _record(case: Case) -> list[dict[str, Any]]:
    """The dist-info of an honest venv's one distribution, whose RECORD lists every file: what
    a receiver accounts for (`store.accounting`)."""
    if not case.get("honest"):
        return []
    rows = io.StringIO()
    # Every field quoted, as uv's writer quotes a name with a "\r" (Python's, with "\n" lines,
    # would not, and a reader splits the row there).
    writer = csv.writer(rows, lineterminator="\n", quoting=csv.QUOTE_ALL)
    for m in case["members"]:
        if m["type"] in ("file", "hardlink"):
            writer.writerow([os.path.relpath(m["name"], SITE), "", ""])
    info = f"{SITE}/fuzzed-0.dist-info"
    writer.writerow([os.path.relpath(f"{info}/RECORD", SITE), "", ""])
    data = b64(rows.getvalue().encode())
    return [{"name": info, "type": "dir"}, {"name": f"{info}/RECORD", "type": "file", "data": data}]


def _infos(case: Case, where: dict[str, str]) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    out = []
    for m in case["members"] + _record(case):
        info = tarfile.TarInfo(_fill(m["name"], where))
        info.type, info.mtime = _TYPES[m["type"]], 1_700_000_000
        info.mode = m.get("mode", 0o755 if m["type"] == "dir" else 0o644)
        data = unb64(m["data"]) if m["type"] == "file" else None
        if data is not None:
            info.size = len(data)
        if "link" in m:
            info.linkname = _fill(m["link"], where)
        if "pax" in m:
            info.pax_headers = {"comment": "x" * m["pax"]}
        out.append((info, data))
    return out


def _stream(case: Case, infos: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    tar = tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT)
    for info, data in infos:
        tar.addfile(info, io.BytesIO(data) if data is not None else None)
    listed = [info for info, _ in infos]
    kind = case["manifest"]
    if kind == "honest":
        archive.write_manifest(tar, listed)
    elif kind in ("drop-last", "extra"):
        extra = [tarfile.TarInfo("lib/extra")] if kind == "extra" else []
        archive.write_manifest(tar, (listed[:-1] if kind == "drop-last" else listed) + extra)
    elif kind != "none":
        if kind == "deep":
            data = b"[" * 100_000 + b"]" * 100_000
        elif kind == "not-json":
            data = b"\xff{"
        elif kind == "dir":
            data = None
        else:
            data = json.dumps(kind["json"]).encode()
        info = tarfile.TarInfo(archive.MANIFEST)
        if data is None:
            info.type = tarfile.DIRTYPE
        else:
            info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data is not None else None)
    if case["end"] == "close":
        tar.close()
    payload = buf.getvalue() + unb64(case["trailer"])
    for change in case["mutations"]:
        at = int(change["at"] * len(payload))
        if change["op"] == "flip" and payload:
            at = min(at, len(payload) - 1)
            payload = payload[:at] + bytes([payload[at] ^ change["xor"]]) + payload[at + 1 :]
        elif change["op"] == "cut":
            payload = payload[:at]
        elif change["op"] == "insert":
            payload = payload[:at] + unb64(change["data"]) + payload[at:]
        elif change["op"] == "zero":
            payload = payload[:at] + b"\0" * change["n"] + payload[at + change["n"] :]
    return payload


def _built_files(infos: list[tuple[tarfile.TarInfo, bytes | None]]) -> manifest.Files:
    """The manifest of files the sender's build made, if the model were its venv: what the
    marker names (so the sender lies as a whole, and only the receiver's own checks stand)."""
    files: manifest.Files = {}
    for info, data in infos:
        if info.isdir():
            files[info.name] = manifest.DIR
        elif info.isreg() and data is not None:
            files[info.name] = manifest.file_entry(
                info.mode, len(data), hashlib.sha256(data).hexdigest()
            )
        elif info.issym():
            files[info.name] = manifest.link_entry(info.linkname)
        elif info.islnk() and info.linkname in files:
            files[info.name] = files[info.linkname]
    return files


# --- the file system around the venv dir ---------------------------------------------------


def _snapshot(base: Path, skip: Path) -> dict[str, tuple]:
    """Every entry under `base` but `skip`: kind, mode and content (never following a link)."""
    seen: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        if Path(dirpath) == skip.parent:
            dirnames[:] = [d for d in dirnames if d != skip.name]
            filenames = [f for f in filenames if f != skip.name]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st_ = os.lstat(path)
            if stat.S_ISLNK(st_.st_mode):
                what: tuple = ("link", os.readlink(path))
            elif stat.S_ISREG(st_.st_mode):
                what = ("file", st_.st_mode, Path(path).read_bytes(), st_.st_mtime_ns)
            elif path == str(skip.parent):  # the venv dir: where receives come and go
                what = ("dir", st_.st_mode)
            else:
                what = ("dir", st_.st_mode, st_.st_mtime_ns)
            seen[os.path.relpath(path, base)] = what
    return seen


class _Place:
    """A venv dir with another venv and its lock in it, and a dir beside it: what a receive
    must leave as it was. Made once per process, checked and reset after each case."""

    def __init__(self) -> None:
        parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.base = Path(tempfile.mkdtemp(prefix="fuzz-stream-", dir=parent))
        self.root = self.base / "venvs"
        self.outside = self.base / "outside"
        atexit.register(freezing.remove_tree, self.base)
        self.reset()

    def reset(self) -> None:
        for entry in list(self.base.iterdir()):
            freezing.remove_tree(entry)
        self.root.mkdir(mode=0o700)
        self.outside.mkdir()
        (self.outside / "f").write_text("outside the venv dir")
        other = self.root / OTHER_KEY
        other.mkdir()
        (other / "f").write_text("another venv")
        (self.root / f"{OTHER_KEY}.lock").write_text("")
        self.before = _snapshot(self.base, self.root / KEY)

    def where(self) -> dict[str, str]:
        python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        return {
            "{outside}": str(self.outside),
            "{root}": str(self.root),
            "{other}": OTHER_KEY,
            "{python}": python,
        }


_place: _Place | None = None
OUTCOMES: Counter[str] = Counter()  # installed, or the refusal's first words: the long run's
EXAMPLES: dict[str, str] = {}  # an outcome's first message


def _receive(root: Path, payload: bytes, case: Case, meta: dict[str, Any]) -> BaseException | None:
    """What a `VenvReceiver` does with the stream: `Unpacker`, chunks, `finish`, install;
    `abort` on any error. Returns the error, None if the venv was installed."""
    proto, size = case["protocol"], case["chunk"]
    pieces = [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]
    sha = [hashlib.sha256(p).hexdigest() for p in pieces]
    unpacker = Unpacker(
        root, KEY, "fuzz", sender_venv=SENDER_VENV, stall_s=STALL_S, **case["limits"]
    )
    try:
        order = list(range(len(pieces)))
        if "skip" in proto and proto["skip"] < len(order):
            order.remove(proto["skip"])
        if "repeat" in proto and proto["repeat"] < len(pieces):
            order.insert(proto["repeat"], proto["repeat"])
        for n, index in enumerate(order):
            if n == proto.get("stop_after"):
                raise ArchiveError("the fuzzer's sender stopped")  # as a driver's abort
            digest = "0" * 64 if index == proto.get("bad_sha") else sha[index]
            unpacker.add(index, digest, pieces[index])
        whole = archive.stream_sha256(sha)
        if proto.get("whole_wrong"):
            whole = archive.stream_sha256(reversed(sha)) if len(sha) > 1 else "0" * 64
        total = len(payload) + proto.get("total_off", 0)
        tree = unpacker.finish(len(pieces) + proto.get("chunks_off", 0), total, whole)
        install_received(root, KEY, tree, meta)
        return None
    except Exception as e:  # noqa: BLE001 - judged by the caller
        unpacker.abort()
        return e


def check(case: Case) -> None:
    global _place
    if _place is None:
        _place = _Place()
    place = _place
    root, where = place.root, place.where()
    infos = _infos(case, where)
    try:
        payload = _stream(case, infos)
    except (ValueError, UnicodeError, OverflowError):
        return  # tarfile cannot write this model: no stream to test
    built = _built_files(infos)
    meta: dict[str, Any] = {
        "format": MARKER_FORMAT,
        "key": KEY,
        "venv": SENDER_VENV,
        "site_packages": SITE,
        "manifest": {
            "model": manifest.digest(built),
            "none": None,
            "other": manifest.digest({"bin": manifest.DIR}),
            "not-str": 3,
        }[case["marker"]],
    }
    try:
        error = bounded(lambda: _receive(root, payload, case, meta), BOUND_S, "the receive")
        if error is not None:
            refused_clearly(error, (ArchiveError,), "the receive")
            _check_cause(error)
        OUTCOMES[_outcome(error)] += 1
        EXAMPLES.setdefault(_outcome(error), str(error)[:300])
        if error is not None and case.get("honest"):
            raise Violation(f"an honest stream of a venv a build could make was refused: {error}")
        _check_place(place, error, built, {i.name: d for i, d in infos})
    except BaseException:
        place.reset()
        raise
    freezing.remove_tree(root / KEY)


def _check_cause(error: BaseException) -> None:
    """A refusal wraps what the unpacking thread raised: that too must be a refusal (an
    `ArchiveError`, or a manifest that is not the build's), never a bug or an OS error that
    the checks should have prevented."""
    cause = error.__cause__
    if str(error).startswith("unpacking: ") and not isinstance(cause, ArchiveError):
        raise Violation(
            f"the refusal {str(error)[:200]!r} is an unexpected {type(cause).__name__} inside"
        ) from error


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "installed"
    words = str(error).removeprefix("unpacking: ").split()
    return " ".join(w for w in words[:4] if not any(c.isdigit() or c in "'/" for c in w))


def _check_place(
    place: _Place, error: BaseException | None, built: manifest.Files, data: dict[str, Any]
) -> None:
    root = place.root
    after = _snapshot(place.base, root / KEY)
    if after != place.before:
        changed = sorted(set(after.items()) ^ set(place.before.items()))[:3]
        raise Violation(f"the receive changed what is outside {root}/{KEY}: {changed}")
    ready = Venv(root, KEY).check_ready()
    if error is not None:
        if os.path.lexists(root / KEY):
            raise Violation(f"a refused receive ({error}) left {root / KEY}")
        return
    if not ready:
        raise Violation(f"an installed receive is not ready: {ready.why_not}")
    now = manifest.scan(root / KEY)
    for name, entry in built.items():  # scripts naming the sender's path were relocated
        if name.startswith("bin/") and entry.kind == "file" and name in now:
            if SENDER_VENV.encode() in (data.get(name) or b""):
                now[name] = entry
    why = manifest.first_difference(built, now)
    if why:
        raise Violation(f"a venv marked ready is not what the sender's manifest says: {why}")


TARGET = Target(
    name="stream",
    cases=seeded("stream", fresh, _mutate),
    check=check,
    modules=(
        "ray_uv_plugin.ship.unpack",
        "ray_uv_plugin.ship.install",
        "ray_uv_plugin.ship.relocation",
        "ray_uv_plugin.store.manifest",
    ),
    properties=(
        "nothing outside <venv dir>/<key> changes: another venv, its lock, a dir beside the "
        "venv dir (names, kinds, modes, contents, link texts, mtimes)",
        "a venv is marked ready only if its files on disk are, entry for entry, the manifest "
        "the sender's marker names (scripts relocated to this node's path aside)",
        "a refused receive leaves no <key> and no <key>.ship-* behind",
        "every receive returns within 30 s (the receiver's stall bound set to 2 s)",
        "every refusal is an ArchiveError with a message",
    ),
)

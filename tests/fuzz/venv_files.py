"""The files a venv dir holds beside a venv's own: its marker (`.ray-uv-ready`) and its
build's manifest (`.ray-uv-ready.manifest`), as each reader takes them: the plugin's ready
check (`layout.Venv.check_ready`), `Venv.read_marker`, `ray-uv list` (`inventory`), a sender
(`manifest.load`, `archive.Packer`) and the rebuild mark (`mark_not_whole`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ray_uv_plugin.ship import archive
from ray_uv_plugin.store import freezing, inventory, manifest
from ray_uv_plugin.store.layout import MARKER, NOT_AS_RECORDED, NOT_WHOLE, Venv
from ray_uv_plugin.store.trust import UntrustedPathError
from tests.fuzz.harness import Case, Target, Violation, b64, refused_clearly, seeded, unb64

KEY = "0123456789abcdef"
SITE = "lib/python3.11/site-packages"

json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from([KEY, SITE, "lib", "", "../..", "/etc"]),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
marker_fields = st.fixed_dictionaries(
    {},
    optional={
        "format": st.one_of(st.just(1), json_value),
        "key": st.one_of(st.just(KEY), json_value),
        "site_packages": st.one_of(st.just(SITE), json_value),
        "manifest": st.one_of(st.just("{manifest}"), json_value),
        NOT_WHOLE: json_value,
        NOT_AS_RECORDED: st.one_of(
            json_value, st.fixed_dictionaries({"count": json_value, "first": json_value})
        ),
        "inputs": json_value,
        "extras": json_value,
        "groups": json_value,
        "project": json_value,
        "name": json_value,
        "ray": json_value,
    },
)
entry = st.one_of(
    st.tuples(
        st.sampled_from(["file", "dir", "symlink", "fifo"]),
        st.one_of(st.integers(-1, 10**6), json_value),
        st.one_of(st.text(max_size=64), json_value),
        st.one_of(st.integers(0, 0o7777), json_value),
    ).map(list),
    json_value,
)
manifest_doc = st.one_of(
    st.fixed_dictionaries(
        {
            "format": st.one_of(st.just(1), json_value),
            "files": st.one_of(
                st.dictionaries(st.text(max_size=20), entry, max_size=5), json_value
            ),
        }
    ),
    json_value,
)


def _raw(doc: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    """A file's bytes: the JSON of a document, or JSON Python writes and other parsers
    refuse (NaN, Infinity), nesting deeper than the parser goes, or not JSON at all."""
    return st.one_of(
        doc.map(lambda d: json.dumps(d).encode()),
        st.sampled_from(
            [
                b"[" * 50_000 + b"]" * 50_000,
                b'{"format": 1, "files": {"a": ["file", Infinity, "", 0]}}',
                b'{"format": 1, "files": {"a": ["file", 1e400, "", 0]}}',
                b"\xff\xfe",
                b"",
                b"null",
                b"NaN",
            ]
        ),
        st.binary(max_size=64),
    ).map(b64)


file_kind = st.sampled_from(["file", "file", "file", "absent", "dir", "symlink", "fifo"])
fresh = st.fixed_dictionaries(
    {
        "marker": st.fixed_dictionaries({"kind": file_kind, "data": _raw(marker_fields)}),
        "manifest": st.fixed_dictionaries({"kind": file_kind, "data": _raw(manifest_doc)}),
        "python": st.sampled_from(["file", "absent", "dangling"]),
        "site": st.booleans(),
    }
)


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    return st.builds(
        lambda which, data: {**seed, which: {**seed[which], "data": data}},
        st.sampled_from(["marker", "manifest"]),
        st.one_of(_raw(marker_fields), _raw(manifest_doc)),
    )


def _place(base: Path, what: dict[str, str], path: Path, fill: dict[str, str]) -> None:
    data = unb64(what["data"])
    for token, value in fill.items():
        data = data.replace(token.encode(), value.encode())
    if what["kind"] == "file":
        path.write_bytes(data)
    elif what["kind"] == "dir":
        path.mkdir()
    elif what["kind"] == "symlink":
        target = base / "elsewhere"
        target.write_bytes(data)
        path.symlink_to(target)
    elif what["kind"] == "fifo":
        os.mkfifo(path)


def _venv(base: Path, case: Case) -> Path:
    root = base / "venvs"
    venv = root / KEY
    (venv / "bin").mkdir(parents=True)
    if case["python"] == "file":
        (venv / "bin" / "python").write_text("#")
    elif case["python"] == "dangling":
        (venv / "bin" / "python").symlink_to(base / "gone")
    if case["site"]:
        (venv / SITE).mkdir(parents=True)
    (venv / SITE / "x.py" if case["site"] else venv / "bin" / "x").write_text("x = 1\n")
    _place(base, case["manifest"], venv / manifest.MANIFEST, {})
    sha = ""
    if case["manifest"]["kind"] == "file":
        sha = hashlib.sha256((venv / manifest.MANIFEST).read_bytes()).hexdigest()
    _place(base, case["marker"], venv / MARKER, {"{manifest}": sha})
    return venv


def check(case: Case) -> None:
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fuzz-venv-files-", dir=shm) as tmp:
        base = Path(tmp)
        try:
            _check(_venv(base, case))
        finally:
            freezing.remove_tree(base / "venvs")


def _check(venv: Path) -> None:
    root = venv.parent
    try:
        meta = Venv.at(venv).read_marker()
    except Exception as e:  # noqa: BLE001 - judged
        raise Violation(f"read_marker raised {type(e).__name__}: {e}") from e
    if meta is not None and not isinstance(meta, dict):
        raise Violation(f"read_marker gave {type(meta).__name__}")
    try:
        why = Venv(root, KEY).check_ready().why_not
    except UntrustedPathError:
        why = "untrusted"  # a symlink or FIFO in the marker's place: refused, as it should
    except Exception as e:  # noqa: BLE001 - judged
        raise Violation(f"check_ready raised {type(e).__name__}: {e}") from e
    if why is None:
        meta = Venv.at(venv).read_marker() or {}
        if (
            meta.get("key") != KEY
            or meta.get("format") != 1
            or meta.get(NOT_WHOLE)
            or meta.get(NOT_AS_RECORDED)
        ):
            raise Violation(f"check_ready took a venv whose marker is {meta!r}")
    elif not isinstance(why, str) or not why:
        raise Violation(f"check_ready gave {why!r}")
    _check_list(root)
    _check_load(venv, meta)
    if why is None:  # a sender streams only a venv that is ready
        _check_packer(venv)
    try:
        Venv.at(venv).mark_not_whole("fuzz")
    except OSError:
        return  # what its callers expect where the marker is no file (they say so)
    except Exception as e:  # noqa: BLE001 - judged
        raise Violation(f"mark_not_whole raised {type(e).__name__}: {e}") from e
    if Venv(root, KEY).check_ready():
        raise Violation("a venv marked not whole is still ready")


def _check_list(root: Path) -> None:
    """What `ray-uv list` shows of each venv."""
    try:
        inv = inventory.scan_one(root, KEY)
        for entry in inv.venvs:
            shown = (entry.project, entry.name, entry.extras, entry.groups, entry.state)
            json.dumps([str(s) for s in shown])
            inventory.age(entry)
    except Exception as e:  # noqa: BLE001 - judged
        raise Violation(f"ray-uv list's scan raised {type(e).__name__}: {e}") from e


def _check_load(venv: Path, meta: dict[str, Any] | None) -> None:
    sha = (meta or {}).get("manifest")
    try:
        files = manifest.load(venv, sha)
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (manifest.ManifestError,), "manifest.load")
        return
    for path, found in files.items():
        if not isinstance(path, str) or not isinstance(found, manifest.Entry):
            raise Violation(f"manifest.load gave {path!r}: {found!r}")
        if not (isinstance(found.size, int) and isinstance(found.mode, int)):
            raise Violation(f"manifest.load gave {path!r}: {found!r}")
        manifest.difference(path, found, None)


def _check_packer(venv: Path) -> None:
    """A sender reads the marker and the manifest it names, then streams the venv."""
    try:
        packer = archive.Packer(venv, chunk_bytes=4096, stall_s=10)
        while not packer.next_chunk().last:
            pass
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (archive.ArchiveError,), "Packer")


TARGET = Target(
    name="venv_files",
    cases=seeded("venv_files", fresh, _mutate),
    check=check,
    modules=(
        "ray_uv_plugin.store.layout",
        "ray_uv_plugin.store.manifest",
        "ray_uv_plugin.store.inventory",
        "ray_uv_plugin.ship.archive",
    ),
    properties=(
        "read_marker gives a dict or None and never raises",
        "check_ready gives None or why (a str), refuses a link or FIFO as untrusted, and "
        "takes only a marker naming its key, format 1 and no not_whole",
        "ray-uv list's scan of the venv and each column it shows never raise",
        "manifest.load gives entries of the declared types, or a ManifestError",
        "a sender (Packer) streams the venv or refuses with an ArchiveError",
        "mark_not_whole always marks, and the venv is not ready after",
    ),
)

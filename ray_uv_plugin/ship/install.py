"""Install a venv received from another node: the receive side's last step, under the key's lock."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.building import record as build_record
from ray_uv_plugin.building import seeding
from ray_uv_plugin.ship import relocation
from ray_uv_plugin.ship.archive import ArchiveError
from ray_uv_plugin.store import accounting, freezing, hashed, manifest
from ray_uv_plugin.store import tree as store_tree
from ray_uv_plugin.store.layout import MARKER_FORMAT, Venv, site_packages

# What a receiver keeps of the sender's marker (`meta`): what it checked before it took the venv
# (`ray`, and `inputs`, which make the key here), what says how the venv was built, for
# `ray-uv list`, and how its bytecode was made (`accounted`: it accounted for every file itself,
# `store.accounting`); with what `ship.actors` says of the receive. Everything else it computes
# from what it received: a sender's `site_packages` or index of hashed inodes names the
# sender's disk, not this one, and what seeding here reads must be this node's say.
KEPT = (
    "name", "project", "extras", "groups", "ray", "python", "inputs", "built_at",
    "build_seconds", "shipped_from", "received_at", "built", "accounted",
)  # fmt: skip


def _records(tree: Path, files: manifest.Files, recorded: accounting.Recorded) -> tuple[str, str]:
    """The manifest of what was installed, and this node's index of it (`store.hashed`), as a
    build writes them: the receiver hashed every file as it wrote it (or relocated it), so a
    build seeded from this venv reads it as it reads a built one's. Returns their sha256."""
    listed = store_tree.collect(tree)
    site = manifest.site_of(tree)
    fresh = build_record.Fresh(tree, listed, hashed.fs_clock(tree))
    for name, paths in manifest.split(listed.entries, site).items():
        try:
            fresh.take(name, {path: files[path] for path in paths})
        except KeyError as e:
            raise ArchiveError(f"{e.args[0]} is in the venv but not in its manifest") from None
    if len(fresh.files) != len(files):
        missing = sorted(files.keys() - fresh.files.keys())[: accounting.SHOWN]
        raise ArchiveError(f"the venv lacks {', '.join(missing)}, which its manifest lists")
    owners = build_record.owners_of(recorded, site).owners
    records = seeding.record_digests(tree / site) if site else {}
    made, index, _ = build_record.write_records(
        fresh, site, {}, None, owners, None, recorded, records
    )
    return made, index


def install_received(
    root: Path,
    key: str,
    tree: Path,
    meta: Mapping[str, Any],
    heads: Mapping[str, bytes] | None = None,
) -> None:
    """Make a venv unpacked from another node (`ship`, checked whole) the ready `<key>`: the
    caller holds the key's build lock. Only what its build made is installed: the manifest of
    what was unpacked (`unpack` leaves it in `tree`) must be the one the sender's marker (`meta`)
    names. Relocated, renamed into place, frozen, then marked, as builds are, with a manifest of
    its own (relocation changed its scripts) and a marker of its own (`KEPT`), once every file
    is accounted for (`store.accounting`; `heads`: the headers of the `.pyc` files `unpack`
    wrote, read again where absent)."""
    old = relocation.check_sender_venv(str(meta["venv"]), key)  # the sender's say: checked
    try:
        files = manifest.load(tree, meta.get("manifest"))
    except manifest.ManifestError as e:
        raise ArchiveError(f"what arrived is not what the venv's build made: it {e}") from e
    site = site_packages(tree)
    if site is None:
        raise ArchiveError("what arrived has no site-packages dir (lib/python*/site-packages)")
    recorded = accounting.read_records(tree)
    checked = accounting.account(tree, files, recorded, compiled=None, heads=heads)
    if checked.unaccounted:  # RECORD hashes: the build's manifest, which its build checked
        raise ArchiveError(f"what arrived holds {accounting.unaccounted_note(checked)}")
    received = Venv(root, key)
    venv = received.path
    if os.path.lexists(venv):  # not ready, or the caller would not have unpacked it
        freezing.remove_tree(venv)
    if relocation.relocate(tree, old, str(venv)):  # rewrote scripts in bin/: hashed again
        for name, entry in files.items():
            if entry.kind == "file" and name.startswith("bin/") and name.count("/") == 1:
                st, sha256 = manifest.hash_file(str(tree / name))
                files[name] = manifest.file_entry(st.st_mode, st.st_size, sha256)
    own, index = _records(tree, files, recorded)
    os.rename(tree, venv)
    try:
        # Every file is the receiver's own (unpacked, copied from a seed, relocated): read-only.
        immutable = freezing.freeze(venv, {name for name, e in files.items() if e.kind == "file"})
        received.write_marker(
            {
                **{name: meta[name] for name in KEPT if name in meta},
                "format": MARKER_FORMAT,
                "key": key,
                "site_packages": str(site.relative_to(tree)),
                "immutable": immutable,
                "manifest": own,
                "hashed": index,
            }
        )
    except BaseException:
        freezing.remove_tree(venv)
        raise

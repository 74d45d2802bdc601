"""Install a venv received from another node: the receive side's last step, under the key's lock."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.ship import relocation
from ray_uv_plugin.ship.archive import ArchiveError
from ray_uv_plugin.store import freezing, manifest
from ray_uv_plugin.store.layout import write_marker


def install_received(root: Path, key: str, tree: Path, meta: Mapping[str, Any]) -> None:
    """Make a venv unpacked from another node (`ship`, checked whole) the ready `<key>`: the
    caller holds the key's build lock. Only what its build made is installed: the manifest of
    what was unpacked (`unpack` leaves it in `tree`) must be the one the sender's marker (`meta`)
    names. Relocated, renamed into place, frozen, then marked, as builds are, with a manifest of
    its own: relocation changed its scripts."""
    old = relocation.check_sender_venv(str(meta["venv"]), key)  # the sender's say: checked
    try:
        files = manifest.load(tree, meta.get("manifest"))
    except manifest.ManifestError as e:
        raise ArchiveError(f"what arrived is not what the venv's build made: it {e}") from e
    venv = root / key
    if os.path.lexists(venv):  # not ready, or the caller would not have unpacked it
        freezing.remove_tree(venv)
    if relocation.relocate(tree, old, str(venv)):  # rewrote scripts in bin/: hashed again
        for name, entry in files.items():
            if entry.kind == "file" and name.startswith("bin/") and name.count("/") == 1:
                st, sha256 = manifest.hash_file(str(tree / name))
                files[name] = manifest.file_entry(st.st_mode, st.st_size, sha256)
    own = manifest.write(tree, files)
    os.rename(tree, venv)
    try:
        immutable = freezing.freeze(venv)
        # The sender's index of hashed inodes names its own disk's: none here.
        marker = {k: v for k, v in meta.items() if k not in ("venv", "hashed")}
        write_marker(venv, {**marker, "key": key, "immutable": immutable, "manifest": own})
    except BaseException:
        freezing.remove_tree(venv)
        raise

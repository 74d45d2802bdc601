"""Install a venv received from another node: the receive side's last step, under the key's lock."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.ship import relocation
from ray_uv_plugin.store import freezing
from ray_uv_plugin.store.layout import write_marker


def install_received(root: Path, key: str, tree: Path, meta: Mapping[str, Any]) -> None:
    """Make a venv unpacked from another node (`ship`, checked whole) the ready `<key>`: the
    caller holds the key's build lock. Renamed into place, frozen, then marked, as builds are."""
    old = relocation.check_sender_venv(str(meta["venv"]), key)  # the sender's say: checked
    venv = root / key
    if os.path.lexists(venv):  # not ready, or the caller would not have unpacked it
        freezing.remove_tree(venv)
    relocation.relocate(tree, old, str(venv))
    os.rename(tree, venv)
    try:
        immutable = freezing.freeze(venv)
        marker = {k: v for k, v in meta.items() if k != "venv"}
        write_marker(venv, {**marker, "key": key, "immutable": immutable})
    except BaseException:
        freezing.remove_tree(venv)
        raise

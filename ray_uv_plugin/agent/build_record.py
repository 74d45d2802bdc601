"""What a built venv records of itself before it is frozen: its manifest (`store.manifest`) and
its marker (`store.layout`), the last file written, which makes it ready."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_uv_plugin.agent import seeding
from ray_uv_plugin.agent.project import project_name
from ray_uv_plugin.agent.request import VenvRequest
from ray_uv_plugin.agent.uv import UvSyncError
from ray_uv_plugin.store import hashed, manifest
from ray_uv_plugin.store.layout import MARKER_FORMAT, site_packages, write_marker


def _site_packages(venv: Path) -> str:
    site = site_packages(venv)
    if site is None:
        raise UvSyncError(f"uv_project: uv made {venv} without a site-packages dir.")
    return str(site.relative_to(venv))


def write_manifest(
    venv: Path, logger: logging.Logger, taken: seeding.Taken | None = None
) -> dict[str, Any]:
    """The venv's manifest (`store.manifest`), before it is frozen; returns what the marker
    records of it: its sha256, and the files that differ from their distribution's RECORD.
    Such a file was changed in uv's cache (through another venv's hardlink to it), or its
    wheel's RECORD is wrong (some are): the venv is used here, with a warning, and never sent
    to another node (`ship.archive.Packer`), which builds its own."""
    start = time.perf_counter()
    index = hashed.Hashed(hashed.fs_clock(venv))
    unread = 0  # bytes known without reading them
    if taken is None:
        files = manifest.scan(venv, record=index)
    else:  # the seed's bytecode was checked as it was linked; uv linked its other files too
        before = taken.hashed.reused if taken.hashed else 0
        files = manifest.scan(venv, taken.known, taken.hashed, index)
        from_index = taken.hashed.reused - before if taken.hashed else 0
        unread = sum(entry.size for _, entry in taken.known.values()) + from_index
    listed: dict[str, Any] = {}
    mismatches = manifest.records(venv, files)
    if mismatches:
        files_named = ", ".join(mismatches[:5]) + (", ..." if len(mismatches) > 5 else "")
        logger.warning(
            f"uv_project {venv.name}: {len(mismatches)} installed files differ from their "
            f"distribution's RECORD: {files_named}. A file changed in uv's cache (through a "
            "hardlink to it) reaches every venv made from it: `uv cache clean <package>` and "
            "rebuild; a wheel whose RECORD is wrong is the wheel's fault. The venv is used "
            "here, and never sent to other nodes."
        )
        listed[manifest.NOT_AS_RECORDED] = {"count": len(mismatches), "first": mismatches[:5]}
    listed["manifest"] = manifest.write(venv, files)
    listed["hashed"] = hashed.write(venv, index)
    size = sum(entry.size for entry in files.values())
    logger.info(
        "uv_project %s: manifest of %d entries (%.0f MB, %.0f MB of them read, the rest "
        "known unchanged since the seed hashed them) in %.2fs",
        venv.name,
        len(files),
        size / 1e6,
        (size - unread) / 1e6,
        time.perf_counter() - start,
    )
    return listed


def write_marker_of(
    venv: Path, request: VenvRequest, seconds: float, immutable: bool, listed: Mapping[str, Any]
) -> None:
    """The marker: what the venv was built from and how (the key's inputs, the build's
    seconds, whether it is immutable), with what `write_manifest` listed."""
    import ray

    spec = request.spec
    write_marker(
        venv,
        {
            "format": MARKER_FORMAT,
            "key": venv.name,
            "name": project_name(request.files),
            "project": str(request.files.path),
            "extras": ["*"] if spec.all_extras else list(spec.extras),
            "groups": list(spec.groups),
            "ray": ray.__version__,
            "python": sys.version.split()[0],
            "site_packages": _site_packages(venv),
            "built_at": time.time(),
            "build_seconds": round(seconds, 3),
            "immutable": immutable,  # chattr +i below the top dir (root only), else modes alone
            "inputs": request.inputs.as_json(),
            **listed,  # the manifest's sha256, files not as their RECORD says: `write_manifest`
        },
    )

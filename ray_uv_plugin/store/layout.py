"""The venv dir: where each venv, its lock and its marker live, and when a venv is ready.

Every role reads it: the plugin (in Ray's runtime-env agent) builds and reuses venvs here, a
ship receiver installs venvs here, and `list`/`gc` read and prune it. So this module imports
only the settings, `trust`, `freezing` and the standard library.

Layout under the venv dir (`RAY_UV_PLUGIN_VENV_DIR`, absolute, private to this user: `trust`):
    <key>/                 the venv, made by `uv sync` with UV_PROJECT_ENVIRONMENT=<key>,
                           read-only once built
    <key>/.ray-uv-ready    JSON metadata naming <key>, written last: only a venv with it is used
    <key>/.ray-uv-ready.manifest  every file the build made, with its sha256 (`manifest`), by
                           part of site-packages; the marker names its sha256. Read only
                           when the venv is shipped or seeds another
    <key>/.ray-uv-ready.hashed  each file's inode, size and mtime when it was hashed, by part
                           (`hashed`): a seeded build keeps a part, or takes an unchanged
                           inode's hash, from it
    <key>/.ray-uv-ready.parts/<sha256>  the fragments both name, one per part each; a part a
                           seeded build kept is the seed's fragment, linked
    <key>.lock             the build lock (`build_lock`), held while uv runs; it holds the pid
                           of its last holder and is the record that the plugin made <key>
    <key>.ship-XXXX        a venv being received from another node (`ship`), never used as it
                           is; removed by the next receive or build of <key>
    .build-<time>-<pid>-<random>  a build's ticket for one of the venv dir's build slots
                           (`build_slots`): held while the build waits and runs, then removed
    .budget.lock           held while a build makes room within the venv dir's budget (`budget`)
    .held-<key>-<pid>-<random>  a record that Ray's agent <pid> holds <key> for a live job
                           (`holds`): flocked while it does, then removed; `gc` keeps <key>
    .phase-<key>           what the build or receive of <key> that holds its lock is doing now,
                           or why the last one failed (`phases`), for the readiness view
    .outcomes              a line per setup that ended (reused, built, seeded, shipped, failed),
                           appended; the node's setup metrics count and rotate it (`outcomes`)

A ready venv is checked on every use (a few `stat`s): trusted, marker whole and naming its key,
interpreter and site-packages present; if not, it is rebuilt.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_uv_plugin.settings import NodeSettings
from ray_uv_plugin.store import freezing, trust

KEY_LENGTH = 16  # hex digits of a venv's key: its dir's name
MARKER = ".ray-uv-ready"
MARKER_FORMAT = 1
NOT_WHOLE = "not_whole"  # in a marker: why the venv is not what its build made (rebuilt)
# In a marker of an earlier version (a build now fails instead: `building.record`): files
# that differ from their distribution's RECORD (`store.accounting`). Not ready: rebuilt.
NOT_AS_RECORDED = "not_as_recorded"
SHIP_INFIX = ".ship-"  # `<key>.ship-XXXX`: a venv being received, never used as it is
BUILD_TICKET_PREFIX = ".build-"  # `.build-<time>-<pid>-<random>`: a build's ticket
BUDGET_LOCK = ".budget.lock"  # held while a build makes room within the budget
HELD_PREFIX = ".held-"  # `.held-<key>-<pid>-<random>`: Ray's agent holds <key> for a job
PHASE_PREFIX = ".phase-"  # `.phase-<key>`: what a build or receive of <key> does now (`phases`)
DIST_INFO = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info$")


def venv_root(settings: NodeSettings | None = None) -> Path:
    """The venv dir (`settings`', else this process's), with the symlinks on its way that we
    trust resolved (`trust.resolve_root`), so that a link changed later cannot move the venvs
    that workers were handed."""
    root = (settings or NodeSettings.read()).venv_dir_path()
    try:
        return trust.resolve_root(root, must_exist=False)
    except OSError:
        return root  # as given: `trust.check_root`, which every use of it passes, says why


def _read_marker(venv: Venv, touch: bool = False) -> dict[str, Any] | None:
    try:
        fd = trust.open_no_follow(venv.marker)
    except FileNotFoundError:
        return None
    try:
        trust.check_fd(venv.marker, fd, "the venv's marker")
        data = os.read(fd, 1 << 20)
        if touch:
            try:
                os.utime(fd)  # its mtime is the venv's last use, for `gc`
            except PermissionError:
                # Another member's venv in a trusted-group venv dir: its lock file, which the
                # group may write, records the use instead (`gc` reads the later of the two).
                try:
                    os.utime(venv.lock, follow_symlinks=False)
                except OSError:
                    pass  # a read-only shared venv dir: usable, its last use goes unrecorded
    finally:
        os.close(fd)
    try:
        meta = json.loads(data.decode("utf-8"))
    except RecursionError as e:  # nested deeper than json reads: no marker of ours
        raise ValueError("nested too deep to be a marker") from e
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    return meta


@dataclass(frozen=True)
class Readiness:
    """What `Venv.check_ready` found: true for a ready venv, with the marker it read (a caller
    needs no second read); else false, with why not."""

    marker: Mapping[str, Any] | None = None  # a ready venv's marker, as read
    why_not: str | None = None  # `absent`, or what is wrong with the venv

    def __bool__(self) -> bool:
        return self.why_not is None


def _not_ready(why: str) -> Readiness:
    return Readiness(why_not=why)


@dataclass(frozen=True)
class Venv:
    """One venv of a venv dir, `<root>/<key>`, and the paths it has there: its marker, its
    build lock beside it, its site-packages. Functions take this, not a bare path from which
    each works out the venv dir, the key and the marker again."""

    root: Path  # the venv dir
    key: str  # the venv's key: its dir's name

    @classmethod
    def at(cls, path: Path) -> Venv:
        """The venv whose dir is `path` (`<root>/<key>`)."""
        path = Path(path)
        return cls(path.parent, path.name)

    @property
    def path(self) -> Path:
        return self.root / self.key

    @property
    def marker(self) -> Path:
        return self.path / MARKER

    @property
    def lock(self) -> Path:
        """The key's build lock (`build_lock`), beside the venv."""
        return self.root / f"{self.key}.lock"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def site_packages(self) -> Path | None:
        """The venv's site-packages dir, if it has one (`site_packages`)."""
        return site_packages(self.path)

    def read_marker(self) -> dict[str, Any] | None:
        """The marker's metadata if it is a trusted regular file holding a JSON object; else
        None. Never raises: `list` and `gc` read markers of every state."""
        try:
            return _read_marker(self)
        except (OSError, ValueError):
            return None

    def check_ready(self, use: bool = True) -> Readiness:
        """Whether the venv is ready and we may use it (then marked used, for `gc`, unless
        `use` is False: a venv only read, as a seed is), with its marker; else why not:
        `absent`, or what is wrong with it. Raises `UntrustedPathError` for what we must not
        touch."""
        venv = self.path
        try:
            trust.check_dir(venv, "the venv")
        except FileNotFoundError:
            return _not_ready("absent")
        try:
            meta = _read_marker(self, touch=use)
        except trust.WrongTypeError:
            return _not_ready("its marker is not a regular file")
        except trust.UntrustedPathError:
            raise
        except (OSError, ValueError) as e:
            return _not_ready(f"its marker is unreadable ({e})")
        if meta is None:
            return _not_ready("no marker (an unfinished build)")
        if meta.get("key") != self.key or meta.get("format") != MARKER_FORMAT:
            return _not_ready(
                f"its marker names key {meta.get('key')!r}, format {meta.get('format')!r}"
            )
        if meta.get(NOT_WHOLE):
            return _not_ready(f"it is not what its build made: {meta[NOT_WHOLE]}")
        if meta.get(NOT_AS_RECORDED):
            return _not_ready(
                "its files differ from their distribution's RECORD (an earlier version made it "
                "ready)"
            )
        if not os.path.exists(self.python):
            return _not_ready("bin/python is missing or its interpreter is gone")
        site = meta.get("site_packages")
        if not isinstance(site, str) or not os.path.isdir(venv / site):
            return _not_ready(f"{site or 'site-packages'} is missing")
        return Readiness(marker=meta)

    def write_marker(self, meta: Mapping[str, Any]) -> None:
        """Written last, then the venv's top dir is made read-only too."""
        venv = self.path
        tmp = venv / f"{MARKER}.tmp"
        fd = trust.open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.marker)
        os.chmod(venv, os.lstat(venv).st_mode & 0o7555)

    def mark_not_whole(self, why: str) -> None:
        """Record in the marker that the venv is not what its build made (a sender found it
        changed since: `manifest`), so that its next use rebuilds it (`check_ready`), and says
        why. Its top dir is read-only once marked (`write_marker`): opened for the marker's
        rename."""
        venv = self.path
        meta = self.read_marker() or {"format": MARKER_FORMAT, "key": self.key}
        os.chmod(venv, stat.S_IMODE(os.lstat(venv).st_mode) | stat.S_IWUSR)
        try:
            os.unlink(venv / f"{MARKER}.tmp")
        except FileNotFoundError:
            pass
        self.write_marker({**meta, NOT_WHOLE: why})

    def remove_leftovers(self) -> int:
        """Remove what a receive of this key that died left behind (under its build lock)."""
        removed = 0
        for entry in os.scandir(self.root):
            if entry.name.startswith(f"{self.key}{SHIP_INFIX}"):
                freezing.remove_tree(Path(entry.path))
                removed += 1
        return removed


@dataclass(frozen=True)
class VenvDir:
    """The venv dir, `root`: each key's venv and lock in it."""

    root: Path

    def venv(self, key: str) -> Venv:
        return Venv(self.root, key)

    def lock(self, key: str) -> Path:
        return self.venv(key).lock

    def check_ready(self, key: str, use: bool = True) -> Readiness:
        return self.venv(key).check_ready(use)


def site_packages(venv: Path) -> Path | None:
    """The venv's site-packages dir (`lib/pythonX.Y/site-packages`), if it has one."""
    found = sorted(Path(venv).glob("lib/python*/site-packages"))
    return found[0] if found else None


def ray_dist_info(venv: Path) -> Path | None:
    """The `ray-<version>.dist-info` dir of the Ray installed in the venv, if any."""
    site = site_packages(venv)
    if site is None:
        return None
    for path in sorted(site.glob("ray-*.dist-info")):
        if DIST_INFO.match(path.name):
            return path
    return None


def installed_ray_version(venv: Path) -> str | None:
    """The version of the Ray installed in the venv, from its dist-info dir's name."""
    dist_info = ray_dist_info(venv)
    return None if dist_info is None else DIST_INFO.match(dist_info.name)["version"]  # type: ignore[index]

"""Who may have written a path we are about to run or trust: the venv dir's trust model.

A venv is code that Ray workers execute. So the plugin (and `list`, `gc`, `prepare`) use a path
under the venv dir only if it was made by the user running them, and nobody else can change it:

- the venv dir and each of its ancestors: owned by this user (ancestors: or root), not
  writable by group or others (an ancestor may be if it is sticky, as `/tmp` is);
- each symlink on the way to it, in the path as configured and in the links' targets: owned by
  this user or root, in a directory checked as an ancestor (so nobody else made it or can
  replace it). Every use of the venv dir gets the path with these links resolved, so a link
  changed after the check changes nothing;
- each `<key>` dir, its marker and `<key>.lock`: owned by this user, not writable by group or
  others, and never a symlink (opened with `O_NOFOLLOW`).

The directory that `ray-uv plugin-config --shell` puts on PYTHONPATH for the driver hook is
code every Python of that shell imports ahead of the standard library: the same rules apply
to it, its contents and the dirs above it (`untrusted_import_dir`).

`RAY_UV_PLUGIN_TRUSTED_GROUP` (a group name or gid) opts in to a venv dir shared by several
users, e.g. the Ray users of several hosts on NFS: then paths whose group is that group may be
owned by any user and be group-writable. Others-writable is never trusted.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shlex
import stat
from pathlib import Path

from ray_uv_plugin.settings import TRUSTED_GROUP_ENV, NodeSettings


class UntrustedPathError(PermissionError):
    """A path under the venv dir that someone else could have written; says what to do."""


class WrongTypeError(UntrustedPathError):
    """A trusted path of the wrong kind: a file where a directory belongs, or the reverse."""


def trusted_gid(settings: NodeSettings | None = None) -> int | None:
    value = (settings or NodeSettings.read()).trusted_group_name()
    if value is None:
        return None
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise UntrustedPathError(
            f"{TRUSTED_GROUP_ENV}={value!r} names no group on this host: set it to an existing "
            "group name or gid, or unset it to keep the venv dir private to this user."
        ) from None


def user_name(uid: int, unknown: str | None = None) -> str:
    """The uid's login name; `unknown` (else `uid 1001`) for a uid without one."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return unknown or f"uid {uid}"


def who(uid: int) -> str:
    """`alice (uid 1001)`, or `uid 1001` for a uid without a name."""
    name = user_name(uid)
    return name if name == f"uid {uid}" else f"{name} (uid {uid})"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def describe(st: os.stat_result) -> str:
    """`owner alice (uid 1001), group ray (gid 50), mode 0o777`."""
    return (
        f"owner {who(st.st_uid)}, group {_group(st.st_gid)}, mode {oct(stat.S_IMODE(st.st_mode))}"
    )


OTHER_OWNER = "it is owned by another user"
OTHERS_WRITE = "others can write it"
GROUP_WRITE = "its group can write it"
# The `what` of `check_stat` for the venv dir itself and for a venv's marker.
VENV_DIR = "the venv dir"
MARKER_WHAT = "the venv's marker"

# What each refusal says to do. Only an entry of the venv dir (a `<key>` venv or its lock) is
# to be removed: the plugin makes it again. The venv dir and the directories above it may be
# anything (a shared mount, `/tmp`): their modes are to be fixed, never the directory removed.


def _own_dir() -> str:
    me = who(os.geteuid())
    return (
        f"or set RAY_UV_PLUGIN_VENV_DIR to a directory only {me} can write; a venv dir shared "
        f"by a trusted group needs {TRUSTED_GROUP_ENV}=<group> on every node (mode 2770)"
    )


def _venv_dir_fix(path: Path, why: str) -> str:
    if why == OTHER_OWNER:
        return f"run Ray as the user that owns it, {_own_dir()}"
    return f"make it private: `chmod 700 {shlex.quote(str(path))}`, {_own_dir()}"


def _ancestor_fix(path: Path, why: str) -> str:
    if why == OTHER_OWNER:
        return "set RAY_UV_PLUGIN_VENV_DIR to a path whose directories only you or root own"
    quoted = shlex.quote(str(path))
    bits = "o-w" if why == OTHERS_WRITE else "g-w"
    return (
        f"`chmod {bits} {quoted}`, or, where others must keep adding entries there, "
        f"`chmod +t {quoted}` (sticky, as /tmp: nobody may rename or remove another's entry), "
        "or set RAY_UV_PLUGIN_VENV_DIR to a path whose directories only you or root can write"
    )


def _entry_fix(path: Path, what: str) -> str:
    unit = path.parent if what == MARKER_WHAT else path  # the marker's venv, not the marker
    return (
        f"remove {unit} (one venv or build lock: the plugin makes it again); if you did not "
        "make it, check who else can write the venv dir (RAY_UV_PLUGIN_VENV_DIR)"
    )


def why_untrusted(
    st: os.stat_result, gid: int | None, ancestor: bool = False, sticky_ok: bool | None = None
) -> str | None:
    """Why a path with this `lstat` must not be trusted, or None if it may be. An `ancestor`
    may be root's, and writable where sticky (unless `sticky_ok` is False: a dir whose every
    entry is used, as one on PYTHONPATH, where a new entry is enough to change what runs)."""
    group_ok = gid is not None and st.st_gid == gid
    owners = {os.geteuid(), 0} if ancestor else {os.geteuid()}
    if st.st_uid not in owners and not group_ok:
        return OTHER_OWNER
    sticky = (ancestor if sticky_ok is None else sticky_ok) and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky:
        return OTHERS_WRITE
    if st.st_mode & stat.S_IWGRP and not (sticky or group_ok):
        return GROUP_WRITE
    return None


def _raise(path: Path, st: os.stat_result, why: str, what: str, fix: str) -> None:
    raise UntrustedPathError(f"uv_project: refusing {what} {path}: {why} ({describe(st)}); {fix}.")


def _check_stat(path: Path, st: os.stat_result, what: str, kind: int = stat.S_IFDIR) -> None:
    """Raise unless `st` (an `lstat`/`fstat` of `path`) is of `kind` and trusted. `what` is
    `VENV_DIR` for the venv dir itself, else names an entry of it (`MARKER_WHAT`: a venv's)."""
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symlink, which is never followed"
        _raise(path, st, why, what, _entry_fix(path, what))
    why = why_untrusted(st, trusted_gid())
    if why:
        fix = _venv_dir_fix(path, why) if what == VENV_DIR else _entry_fix(path, what)
        _raise(path, st, why, what, fix)
    if stat.S_IFMT(st.st_mode) != kind:
        wanted = "a directory" if kind == stat.S_IFDIR else "a regular file"
        fix = (
            "set RAY_UV_PLUGIN_VENV_DIR to a directory"
            if what == VENV_DIR
            else _entry_fix(path, what)
        )
        raise WrongTypeError(f"uv_project: {what} {path} is not {wanted} ({describe(st)}): {fix}.")


def check_dir(path: Path, what: str) -> os.stat_result:
    """`lstat` of `path`, checked: a trusted directory, not a symlink. FileNotFoundError if gone."""
    st = os.lstat(path)
    _check_stat(path, st, what)
    return st


MAX_SYMLINKS = 40  # as the kernel's own limit on the links one path lookup follows


def _relative(root: Path) -> UntrustedPathError:
    return UntrustedPathError(
        f"uv_project: RAY_UV_PLUGIN_VENV_DIR={str(root)!r} is relative, so every worker "
        "would resolve it against its own directory: set an absolute path on every node."
    )


def _lstat(root: Path, path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except PermissionError as e:
        raise UntrustedPathError(
            f"uv_project: cannot check {path} on the way to the venv dir {root} ({e.strerror}): "
            "the venv dir must be reachable by the user that runs Ray."
        ) from e


def _check_above(root: Path, path: Path, st: os.stat_result, gid: int | None) -> None:
    """`path` (`st`: its `lstat`) is a directory on the way to the venv dir `root`: trusted as
    an ancestor."""
    why = why_untrusted(st, gid, ancestor=True)
    if why:
        _raise(path, st, why, f"a directory above the venv dir {root}:", _ancestor_fix(path, why))
    if not stat.S_ISDIR(st.st_mode):
        raise WrongTypeError(
            f"uv_project: {path}, on the way to the venv dir {root}, is not a directory "
            f"({describe(st)}): set RAY_UV_PLUGIN_VENV_DIR to a directory."
        )


def _check_link(root: Path, link: Path, st: os.stat_result, followed: int) -> Path:
    """A symlink on the way to the venv dir: its target, if nobody else could have made or
    changed it. Its directory was checked as an ancestor already: nobody else may replace an
    entry in it (sticky: not ours), so a link of ours or root's there stays as it is."""
    target = Path(os.readlink(link))
    if st.st_uid not in (os.geteuid(), 0):
        raise UntrustedPathError(
            f"uv_project: refusing the symlink {link} -> {target} on the way to the venv dir "
            f"{root}: it is owned by another user, who could point it elsewhere at any time "
            f"({describe(st)}): remove it if it should not be there, or set "
            "RAY_UV_PLUGIN_VENV_DIR to a path that no other user's symlink leads through."
        )
    if followed > MAX_SYMLINKS:
        raise UntrustedPathError(
            f"uv_project: the venv dir {root} leads through more than {MAX_SYMLINKS} symlinks "
            "(a loop?): set RAY_UV_PLUGIN_VENV_DIR to the directory itself."
        )
    return target


def resolve_root(root: Path, must_exist: bool = True) -> Path:
    """The venv dir `root` with every symlink on its way resolved, each checked as it is met.

    Walks the path as given, one component at a time with `lstat`, never `realpath`: a symlink
    in it is followed only if `_check_link` trusts it, then its target is walked the same way.
    Each directory passed through is checked as an ancestor, the last one as the venv dir.
    A missing component raises FileNotFoundError, or with `must_exist=False` ends the walk:
    the rest is returned as given (the caller creates it, then checks it with `check_root`).
    """
    if not root.is_absolute():
        raise _relative(root)
    gid = trusted_gid()
    here = Path("/")  # walked so far: no symlinks, every component checked
    _check_above(root, here, _lstat(root, here), gid)
    todo = list(root.parts[1:])
    followed = 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = here.parent  # `here` has no symlinks: its parent is the real one
            continue
        path = here / name
        try:
            st = _lstat(root, path)
        except FileNotFoundError:
            if must_exist:
                raise
            return Path(os.path.normpath(path.joinpath(*todo)))
        if stat.S_ISLNK(st.st_mode):
            followed += 1
            target = _check_link(root, path, st, followed)
            if target.is_absolute():
                here = Path("/")
            todo[:0] = target.parts[1:] if target.is_absolute() else target.parts
            continue
        if todo:
            _check_above(root, path, st, gid)
        here = path
    check_dir(here, VENV_DIR)
    return here


def check_root(root: Path) -> Path:
    """The venv dir, the directories above it and the symlinks on its way: trusted (see the
    module docstring). Returns the resolved path: use it, not `root`."""
    return resolve_root(root)


def untrusted_import_dir(path: Path) -> tuple[Path, os.stat_result, str] | None:
    """The first path through which someone but this user, root (or the trusted group) could
    change what Python imports from the directory `path` (absolute, without symlinks), as
    (path, its `lstat`, why); None if there is none. The venv dir's rules: each dir above it
    owned by us or root and writable by nobody else unless sticky; `path` and everything in it
    likewise but never excused by a sticky bit (a new module there is imported), and no
    symlink anywhere (where it leads would need checking too)."""
    gid = trusted_gid()
    here = Path("/")
    for name in (*path.parts[1:], None):
        st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            return here, st, "it is not a directory (a symlink, or replaced since)"
        why = why_untrusted(st, gid, ancestor=True, sticky_ok=name is not None)
        if why:
            return here, st, why
        if name is not None:
            here = here / name
    for dirpath, dirnames, filenames in os.walk(path):
        for entry in dirnames + filenames:
            full = Path(dirpath, entry)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                return full, st, "it is a symlink, which Python would follow"
            why = why_untrusted(st, gid, ancestor=True, sticky_ok=False)
            if why:
                return full, st, why
    return None


def open_no_follow(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """Open `path` without following a symlink at it (ELOOP is reported as untrusted), and
    without blocking on a FIFO planted in its place (`check_fd` then refuses it)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a symlink
            why = "it is a symlink, which is never followed"
            _raise(path, os.lstat(path), why, "the file", _entry_fix(path, "the file"))
        raise


def check_fd(path: Path, fd: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    _check_stat(path, st, what, stat.S_IFREG)
    return st


def read_own_file(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of a file of ours (not a link, ours and not writable by others: `check_fd`),
    at most `max_bytes` + 1 of them, so that a caller can tell one that is too large."""
    fd = open_no_follow(path)
    try:
        check_fd(path, fd, what)
        with open(os.dup(fd), "rb") as f:
            return f.read(max_bytes + 1)
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it (one a write that died
    left is removed first), synced, then renamed over it."""
    tmp = path.with_name(f"{path.name}.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _new_dir_mode() -> int:
    return 0o2750 if trusted_gid() is not None else 0o700


def make_root(root: Path) -> Path:
    """Create the venv dir private to this user (or to the trusted group), and any missing
    directory above it (0755: only we may write it, anyone may pass), then check it all.
    Modes are set explicitly, not left to the umask: under the usual 002 `os.makedirs` would
    make group-writable parents that the check then refuses. Returns the resolved venv dir.

    Each directory is made in one already checked (or just made by us), so nobody else can
    put a symlink in its place before its chmod. One that another process made first is
    walked and checked again before anything is made in it."""
    for _attempt in range(len(root.parts) + MAX_SYMLINKS):
        real = resolve_root(root, must_exist=False)
        missing = []
        for path in (real, *real.parents):
            if os.path.lexists(path):
                break
            missing.append(path)
        if all(_make_dir(path, venv_dir=path == real) for path in reversed(missing)):
            return check_root(root)
    raise UntrustedPathError(
        f"uv_project: could not create the venv dir {root}: its directories kept changing "
        "while it was made; create it yourself (mode 0700) and retry."
    )


def _make_dir(path: Path, venv_dir: bool) -> bool:
    """mkdir with the mode we require whatever the umask; False if it exists already."""
    try:
        os.mkdir(path, 0o700)  # never more open than meant, even before the chmod
    except FileExistsError:
        return False
    gid = trusted_gid()
    if not venv_dir:
        os.chmod(path, 0o755)
    elif gid is not None:
        os.chown(path, -1, gid)
        os.chmod(path, 0o2770)
    else:
        os.chmod(path, _new_dir_mode())
    return True

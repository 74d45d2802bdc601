"""Moving a venv to another path: what a venv unpacked under another venv dir needs.

uv writes the venv's absolute path only into `bin/` (console scripts' shebangs, activate
scripts); `pyvenv.cfg` names the interpreter, and Python fixes `.pyc` file names when it loads
them. Shebangs are rewritten in the form uv picks for the new path (`#!<path>`, or a `/bin/sh`
wrapper for a path with a space or too long for the kernel).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

from ray_uv_plugin.ship.archive import ArchiveError, check_key

_SHEBANG_LIMIT = 127  # the kernel's, as uv counts it: `#!`, the interpreter's path, `\n`
# uv quotes or escapes these in scripts, each shell's activate script its own way.
_QUOTED_CHARS = re.compile(r"['\"\\$`\x00-\x1f\x7f]")


def check_sender_venv(path: str, key: str) -> str:
    """The path the venv had on the sending node, which `relocate` replaces in its scripts:
    absolute, normalised, `<venv dir>/<key>`, and free of characters uv quotes in scripts."""
    check_key(key)
    if not (os.path.isabs(path) and os.path.normpath(path) == path):
        raise ArchiveError(
            f"the sender's venv path {path!r} is not absolute and normalised: set "
            "RAY_UV_PLUGIN_VENV_DIR to such a path on the sending node"
        )
    if os.path.basename(path) != key:
        raise ArchiveError(f"the sender's venv path {path!r} does not end in /{key}")
    check_script_path(path, "the sender's venv path")
    return path


def check_script_path(path: str, what: str) -> None:
    bad = _QUOTED_CHARS.search(path)
    if bad:
        raise ArchiveError(
            f"{what} {path!r} holds {bad.group()!r}, which uv quotes in each script its own "
            "way, so the venv's scripts cannot be relocated: use a venv dir path without "
            "quotes, backslashes, `$`, backticks or control characters (a node that cannot "
            "take a shipped venv builds it for itself)"
        )


# The two shebangs uv writes (`format_shebang` in uv's wheel installer), naming `<venv>/bin/...`.
_SH_SHEBANG = re.compile(rb"#!/bin/sh\n'''exec' '(?P<exe>[^'\n]*)' \"\$0\" \"\$@\"\n' '''")
_PLAIN_SHEBANG = re.compile(rb"#!(?P<exe>[^\s]+)(?=\n)")


def shebang(executable: bytes) -> bytes:
    """The shebang uv writes for `executable`: a `/bin/sh` wrapper where a plain `#!` line
    would not work (a space splits it, the kernel cuts one over 127 bytes), else plain."""
    if len(executable) + 3 > _SHEBANG_LIMIT or b" " in executable:
        return b"#!/bin/sh\n'''exec' '" + executable + b"' \"$0\" \"$@\"\n' '''"
    return b"#!" + executable


def _relocated(data: bytes, old: bytes, new: bytes) -> bytes:
    """A bin/ script naming the venv at `old`, naming it at `new` instead."""
    match = _SH_SHEBANG.match(data) or _PLAIN_SHEBANG.match(data)
    if match and match["exe"].startswith(old + b"/"):
        header = shebang(new + match["exe"][len(old) :])
        return header + data[match.end() :].replace(old, new)
    return data.replace(old, new)


def relocate(venv: Path, old: str, new: str) -> int:
    """Point the scripts in `venv/bin` that name the venv's old path at its new one; returns
    how many it changed. A no-op when the venv is unpacked where it was built. Only regular
    files directly in a real `bin/` dir are read and replaced, never through a link."""
    if old == new:
        return 0
    check_script_path(old, "the venv's old path")
    check_script_path(new, "the venv's new path")
    bin_dir = venv / "bin"
    if not stat.S_ISDIR(os.lstat(bin_dir).st_mode):
        raise ArchiveError(f"{bin_dir} is not a directory")
    changed = 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for entry in list(os.scandir(bin_dir)):  # listed first: replacing adds and removes names
        if not entry.is_file(follow_symlinks=False):
            continue
        with open(os.open(entry.path, flags), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                continue
            data = f.read()
        if b"\0" in data or old.encode() not in data:
            continue
        fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=".relocating-")
        try:
            with open(fd, "wb") as out:
                out.write(_relocated(data, old.encode(), new.encode()))
                os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode))
            os.replace(tmp, entry.path)
        except BaseException:
            os.unlink(tmp)
            raise
        changed += 1
    return changed

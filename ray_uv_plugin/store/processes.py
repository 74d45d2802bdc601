"""Which venvs the live processes of this host run in, read from `/proc`, and which processes
this user cannot look into (`Processes.blind_spot`): `gc` keeps what may be in use instead of
guessing, `list` shows each venv's users. A venv that Ray's agent holds for a live job (`holds`)
counts as used by the agent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ray_uv_plugin.settings import VENV_ENV
from ray_uv_plugin.store import holds, trust

VENV_SETTING = f"{VENV_ENV}=".encode()  # in a worker's /proc/<pid>/environ
OLD_VENV_SETTING = b"VIRTUAL_ENV="  # what versions before it set


def _proc_entries(proc: Path) -> Iterator[tuple[int, Path]]:
    for name in os.listdir(proc):
        if name.isdigit():
            yield int(name), proc / name


@dataclass
class Processes:
    """The live processes of this host as this user sees them (`processes`)."""

    users: dict[str, set[int]] = field(default_factory=dict)  # real venv path -> pids
    # pid -> (file-system uid, gids) of each process whose environment this user may not read
    unreadable: dict[int, tuple[int, frozenset[int]]] = field(default_factory=dict)
    proc: Path | None = Path("/proc")  # None: it could not be listed
    # (st_dev, st_ino) of each venv a process names, as its own mount namespace resolves the
    # name -> pids: a container that mounts the venv dir elsewhere names it by another path.
    inodes: dict[tuple[int, int], set[int]] = field(default_factory=dict)

    def users_under(self, root: Path) -> dict[str, set[int]]:
        """`users`, plus the processes that name an entry of `root` by another path (from a
        container that mounts the venv dir elsewhere), plus the agents that hold one for a live
        job (`holds`: its workers may all be gone, and Ray starts the next in it), keyed by the
        entry's real path."""
        users = {venv: set(pids) for venv, pids in self.users.items()}
        for venv, pids in holds.holders(root).items():
            users.setdefault(venv, set()).update(pids)
        try:
            names = os.listdir(root) if self.inodes else []
        except OSError:
            names = []
        for name in names:
            try:
                st = os.lstat(root / name)
            except OSError:
                continue
            pids = self.inodes.get((st.st_dev, st.st_ino))
            if pids:
                users.setdefault(os.path.realpath(root / name), set()).update(pids)
        return users

    def blind_spot(self, root: Path) -> str | None:
        """Why this user may not see every process that can run in a venv of `root`, or None.

        Who can: in a private venv dir only its owner (the plugin of any other user, root's
        included, refuses a dir it does not own); in a trusted-group one also root and every
        process in the group. Other users' environments are readable by root alone, and
        `/proc` mounted with `hidepid` hides their processes altogether. Root sees what can be
        seen: what even root may not read (a sandbox's init with more capabilities) is no
        worker of the plugin.
        """
        if self.proc is None:
            return "/proc cannot be listed"
        if os.geteuid() == 0:
            return None
        try:
            owner = os.lstat(root).st_uid
        except OSError:
            return None
        gid = trust.trusted_gid()
        if gid is not None and not (self.proc / "1").exists():
            return "other users' processes are hidden: /proc is mounted with hidepid"
        hidden = [
            uid
            for uid, gids in self.unreadable.values()
            if uid == owner or (gid is not None and (uid == 0 or gid in gids))
        ]
        if not hidden:
            return None
        names = ", ".join(sorted({trust.user_name(uid) for uid in hidden}))
        return f"{len(hidden)} process{'' if len(hidden) == 1 else 'es'} of {names}"


def _credentials(pdir: Path) -> tuple[int, frozenset[int]] | None:
    """(file-system uid, every gid) from `/proc/<pid>/status`, which any user may read."""
    try:
        fields = dict(
            line.split(":", 1) for line in (pdir / "status").read_text().splitlines() if ":" in line
        )
        uid = int(fields["Uid"].split()[3])
        gids = {int(fields["Gid"].split()[3]), *map(int, fields.get("Groups", "").split())}
    except (OSError, KeyError, IndexError, ValueError):
        return None
    return uid, frozenset(gids)


def processes(proc: Path = Path("/proc")) -> Processes:
    """Which venvs live processes run in, and which processes this user cannot look into.

    A process runs in a venv if its environment says `RAY_UV_PLUGIN_VENV=<venv>` (the plugin
    sets it for every worker; Ray workers' argv[0] is `ray::Name`, so this is what counts),
    `VIRTUAL_ENV=<venv>` (older versions set that), or its argv[0] is `<venv>/bin/python...`
    (argv is readable for other users' processes too; the environment is not).
    """
    found = Processes(proc=proc)
    try:
        entries = list(_proc_entries(proc))
    except OSError:
        return Processes(proc=None)
    for pid, pdir in entries:
        venvs: set[str] = set()
        try:
            for item in (pdir / "environ").read_bytes().split(b"\0"):
                for prefix in (VENV_SETTING, OLD_VENV_SETTING):
                    if item.startswith(prefix):
                        venvs.add(os.fsdecode(item[len(prefix) :]))
        except PermissionError:
            creds = _credentials(pdir)
            if creds is not None:
                found.unreadable[pid] = creds
        except OSError:
            continue  # gone
        try:
            argv0 = os.fsdecode((pdir / "cmdline").read_bytes().split(b"\0")[0])
        except OSError:
            argv0 = ""
        exe = Path(argv0)
        if exe.name.startswith("python") and exe.parent.name == "bin":
            venvs.add(str(exe.parent.parent))  # not resolved: bin/python links out of the venv
        for venv in venvs:
            if venv:
                found.users.setdefault(os.path.realpath(venv), set()).add(pid)
            if inode := _inode_seen_by(pdir, venv):
                found.inodes.setdefault(inode, set()).add(pid)
    return found


def _inode_seen_by(pdir: Path, venv: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the directory that the process `pdir` means by `venv`: looked up
    through `/proc/<pid>/root`, i.e. in its mount namespace (a container's view)."""
    if not venv.startswith("/"):
        return None
    try:
        st = os.stat(f"{pdir}/root{venv}")
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def venv_users(proc: Path = Path("/proc")) -> dict[str, set[int]]:
    """Real path of a venv -> pids of the live processes that run in it (`processes`)."""
    return processes(proc).users

"""The chaos run's invariants, checked after every round, each a function that returns the
violations it found (in words; empty when it held).

- `whole`: every ready venv of every node, every round, is what its build made (its files,
  entry for entry, the manifest its marker names: `store.manifest`) and what its lock selects
  (each package that `uv sync` installs here for the marker's selection, at the locked version);
- `ran_in_ready`: every worker ran in the venv of the key its job asked for: its `sys.prefix` a
  venv of a node's venv dir named by that key, `RAY_UV_PLUGIN_VENV` the same path, the marker
  (as the worker read it at its start) ready and naming it, and the venv's site-packages
  holding every package the lock selects; and every worker a job started reported;
- `locks`: no build lock or build slot ticket is held past the bound (the nodes' build timeout
  and a margin, from the holder's record: it writes the file when it takes it), nor by a
  stopped process; after the last round, the run waits until every lock still held is past
  the bound or let go, and checks again;
- `leftovers`: what each venv dir holds, before any gc, that no live process owns: a venv no
  build finishes, a receive's or a gc's temp dir, a ticket or a hold's record nobody holds.
  Then `ray-uv gc` (no age or size: no venv in use or idle goes) removes what it can;
- `no_hang` and `next_round` are the jobs' own (chaos.py): each ended within its bound, and
  the requests made once the faults were gone all succeeded.

Reading a marker here never touches it (`check_ready` would: a use, for gc).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, Marker
from packaging.utils import canonicalize_name

from ray_uv_plugin.store import build_slots, holds, manifest
from ray_uv_plugin.store.build_lock import is_held
from ray_uv_plugin.store.hashed import Hashed, fs_clock
from ray_uv_plugin.store.layout import (
    BUDGET_LOCK,
    DIST_INFO,
    MARKER_FORMAT,
    NOT_WHOLE,
    Venv,
    site_packages,
)

KEY = re.compile(r"^[0-9a-f]{16}$")
LOCK = re.compile(r"^[0-9a-f]{16}\.lock$")
TEMP = re.compile(r"^(?P<key>[0-9a-f]{16})\.(?:ship-[A-Za-z0-9_]+|gc-\d+)$")
# A build past the nodes' timeout is killed and lets its lock go; a minute more for a busy host.
LOCK_MARGIN_S = 60.0
_ROOT_SOURCES = ("editable", "virtual")  # a project's own package in uv.lock
DEFAULT_GROUPS = ("dev",)  # what `uv sync` adds with no group named


def ready(venv: Path) -> dict[str, Any] | None:
    """The marker of a ready venv (as `check_ready` takes it, without touching it); None if not
    ready."""
    meta = Venv.at(venv).read_marker()
    if meta is None or meta.get("key") != venv.name or meta.get("format") != MARKER_FORMAT:
        return None
    return None if meta.get(NOT_WHOLE) else meta


# --- what a lock selects -------------------------------------------------------------------


def _holds_here(marker: object) -> bool:
    """Whether a lock entry's marker holds on this interpreter (one unreadable: yes)."""
    if not isinstance(marker, str) or not marker:
        return True
    try:
        return Marker(marker).evaluate({"extra": ""})
    except InvalidMarker:
        return True


def selected_packages(
    lock: bytes, extras: Iterable[str] = (), groups: Iterable[str] = ()
) -> dict[str, str | None]:
    """{name: version} of the packages that `uv sync` installs here from `lock` for a
    selection (`extras`, "*" for all; `groups` beside the default `dev`): the projects' own
    dependencies, their extras' and groups', and what those reach, markers evaluated for this
    interpreter. The projects themselves are left out (most selections do not install them)."""
    doc = tomllib.loads(lock.decode("utf-8"))
    packages = {canonicalize_name(str(p.get("name", ""))): p for p in doc.get("package", [])}
    wanted_extras, wanted_groups = set(extras), {*DEFAULT_GROUPS, *groups}
    todo: list[tuple[str, tuple[str, ...]]] = []
    roots = []
    for name, package in packages.items():
        source = package.get("source")
        if not (isinstance(source, dict) and any(k in source for k in _ROOT_SOURCES)):
            continue
        roots.append(name)
        lists = [package.get("dependencies", [])]
        for extra, entries in package.get("optional-dependencies", {}).items():
            if "*" in wanted_extras or extra in wanted_extras:
                lists.append(entries)
        for group, entries in package.get("dev-dependencies", {}).items():
            if group in wanted_groups:
                lists.append(entries)
        todo += [(e["name"], tuple(e.get("extra", ()))) for es in lists for e in es
                 if _holds_here(e.get("marker"))]  # fmt: skip
    found: dict[str, str | None] = {}
    seen: set[tuple[str, str]] = set()
    while todo:
        raw, its_extras = todo.pop()
        name = canonicalize_name(raw)
        package = packages.get(name, {})
        for part in ("", *its_extras):
            if (name, part) in seen:
                continue
            seen.add((name, part))
            version = package.get("version")
            found[name] = None if version is None else str(version)
            entries = (
                package.get("dependencies", [])
                if part == ""
                else package.get("optional-dependencies", {}).get(part, [])
            )
            todo += [(e["name"], tuple(e.get("extra", ()))) for e in entries
                     if _holds_here(e.get("marker"))]  # fmt: skip
    for name in roots:
        found.pop(name, None)
    return found


def installed(dist_infos: Iterable[str]) -> dict[str, str]:
    """{name: version} of a site-packages' `<name>-<version>.dist-info` dir names."""
    found = {}
    for entry in dist_infos:
        match = DIST_INFO.match(entry)
        if match:
            found[canonicalize_name(match["name"])] = match["version"]
    return found


def missing_locked(have: Mapping[str, str], wanted: Mapping[str, str | None]) -> list[str]:
    """The selected packages (`selected_packages`) that `have` lacks or has at another
    version, in words."""
    missing = []
    for name, version in sorted(wanted.items()):
        if name not in have:
            missing.append(f"{name} {version or ''} missing".replace("  ", " "))
        elif version is not None and canonicalize_name(have[name]) != canonicalize_name(version):
            missing.append(f"{name} {have[name]}, locked {version}")
    return missing


def _dist_infos(venv: Path) -> list[str]:
    site = site_packages(venv)
    return os.listdir(site) if site is not None else []


# --- the checks that keep state across rounds ----------------------------------------------


@dataclass
class Checks:
    """What the checks keep from round to round: each device's hashes (a file is read again
    only when its inode changed since: `store.hashed`), each project's lock as first read, and
    the leftovers already reported."""

    hashed: dict[int, Hashed] = field(default_factory=dict)
    locks: dict[str, bytes] = field(default_factory=dict)
    reported: set[tuple[str, int]] = field(default_factory=set)

    def lock_of(self, project: str) -> bytes:
        if project not in self.locks:
            self.locks[project] = (Path(project) / "uv.lock").read_bytes()
        return self.locks[project]

    def selected(self, meta: Mapping[str, Any]) -> dict[str, str | None]:
        """What the lock of a marker's project selects for the marker's extras and groups."""
        return selected_packages(
            self.lock_of(str(meta.get("project"))),
            meta.get("extras") or (),
            meta.get("groups") or (),
        )

    def selected_for(self, value: Mapping[str, Any], project: str) -> dict[str, str | None] | None:
        """`selected` for a `uv_project` value whose project is `project`; None if its lock
        cannot be read (then the venv's own check, `whole`, says why)."""
        extras = ["*"] if value.get("all_extras") else value.get("extras") or ()
        meta = {"project": project, "extras": extras, "groups": value.get("groups") or ()}
        try:
            return self.selected(meta)
        except (OSError, ValueError):
            return None

    def index(self, root: Path) -> Hashed:
        """This round's hash index for `root`'s device, holding what earlier rounds hashed."""
        dev = root.stat().st_dev
        old = self.hashed.get(dev)
        now = Hashed(clock_ns=fs_clock(root), dev=dev, inodes=dict(old.inodes) if old else {})
        self.hashed[dev] = now
        return now

    def whole(self, venv_dirs: Iterable[Path]) -> list[str]:
        """Every ready venv under `venv_dirs`, every round: its files as its manifest lists
        them, and every package its lock selects installed at the locked version."""
        found = []
        for root in venv_dirs:
            if not root.is_dir():
                continue
            index = self.index(root)
            for entry in sorted(root.iterdir()):
                if not KEY.match(entry.name) or not entry.is_dir() or entry.is_symlink():
                    continue
                meta = ready(entry)
                if meta is None:
                    continue
                why = check_whole(entry, meta, index) or self.check_lock(entry, meta)
                if why and ready(entry) is not None:  # not one removed or marked while read
                    found.append(f"ready venv not whole: {why}")
        return found

    def check_lock(self, venv: Path, meta: Mapping[str, Any]) -> str | None:
        """Why the ready venv lacks what its lock selects; None if it holds all of it."""
        try:
            missing = missing_locked(installed(_dist_infos(venv)), self.selected(meta))
        except (OSError, ValueError) as e:
            return f"{venv}: its project's lock ({meta.get('project')}) cannot be read: {e}"
        return f"{venv}: not as its lock selects: {', '.join(missing)}" if missing else None

    def leftovers(self, root: Path) -> list[str]:
        """`unowned` entries of `root` not reported before."""
        found = []
        for path, why in unowned(root):
            try:
                seen = (str(path), path.lstat().st_ino)
            except FileNotFoundError:
                continue
            if seen not in self.reported:
                self.reported.add(seen)
                found.append(f"left in {root}: {path.name} ({why})")
        return found


def check_whole(venv: Path, meta: Mapping[str, Any], index: Hashed | None = None) -> str | None:
    """Why the ready venv `venv` is not what its build made; None if it is. `index`: hashes of
    unchanged inodes, taken instead of reading the file again, and filled."""
    try:
        built = manifest.load(venv, meta.get("manifest"))
        now = manifest.scan(venv, reuse=index, record=index)
    except (OSError, manifest.ManifestError) as e:
        return f"{venv}: {e}"
    diff = manifest.first_difference(built, now)
    return f"{venv}: {diff}" if diff else None


def whole(venv_dirs: Iterable[Path]) -> list[str]:
    """`Checks.whole` with no state kept: every file read."""
    return Checks().whole(venv_dirs)


# --- what the workers said ------------------------------------------------------------------


def ran_in_ready(
    reports: Iterable[Mapping[str, Any]],
    venv_dirs: Iterable[Path],
    selected: Mapping[str, Mapping[str, str | None]] | None = None,
) -> list[str]:
    """Each worker's own report (`chaos_jobs.WORKER`, with `asked_key` added by the harness:
    the key of its job's request, or why it is not known): its venv is the key's, ready when it
    started, and holds what the lock selects (`selected`: by key)."""
    roots = [str(d) for d in venv_dirs]
    selected = selected or {}
    found = []
    for r in reports:
        prefix, marker, asked = r.get("prefix", ""), r.get("marker"), r.get("asked_key")
        where = f"worker pid {r.get('pid')} (job {r.get('job_id')}) in {prefix}"
        if not any(prefix.startswith(root + os.sep) for root in roots):
            found.append(f"{where}: outside every venv of the nodes' venv dirs")
            continue
        if os.path.dirname(prefix) not in roots:
            found.append(f"{where}: not a venv of a node's venv dir")
            continue
        key = os.path.basename(prefix)
        if r.get("venv_env") != prefix:
            found.append(f"{where}: RAY_UV_PLUGIN_VENV is {r.get('venv_env')!r}, not its prefix")
        if not isinstance(asked, str) or not KEY.match(asked):
            found.append(f"{where}: the key its job asked for is not known: {asked}")
        elif asked != key:
            found.append(f"{where}: its job asked for {asked}, it ran in {key}")
        if not isinstance(marker, dict):
            found.append(f"{where}: no marker when it started ({marker!r})")
        elif marker.get("key") != key or marker.get(NOT_WHOLE):
            found.append(f"{where}: its marker was not a ready one: {marker}")
        wanted = selected.get(asked) if isinstance(asked, str) else None
        if wanted is not None:
            missing = missing_locked(installed(r.get("dist_infos") or []), wanted)
            if missing:
                found.append(f"{where}: its site-packages lack what the lock selects: "
                             f"{', '.join(missing)}")  # fmt: skip
    return found


def missing_workers(
    jobs: Iterable[Mapping[str, Any]], reports: Iterable[Mapping[str, Any]], excused: set[str]
) -> list[str]:
    """Each job's workers that never reported: the job said how many it started
    (`workers_started`, its Ray job id). A job whose failure a fault explains (`excused`, by
    log name) may miss some; no other may."""
    got: dict[str, int] = {}
    for r in reports:
        got[str(r.get("job_id"))] = got.get(str(r.get("job_id")), 0) + 1
    found = []
    for job in jobs:
        started = job.get("workers_started")
        if not started or job.get("name") in excused:
            continue
        seen = got.get(str(job.get("job_id")), 0)
        if seen < started:
            found.append(f"{job.get('name')}: {started} workers started, {seen} reported")
    return found


def key_of(value: Mapping[str, Any], project: str, env_vars: Mapping[str, str]) -> str:
    """The key this node's plugin gives a `uv_project` value whose project is `project` (as
    `plugin._create` makes it); in the node's environment."""
    from ray_uv_plugin.env.key import make_request
    from ray_uv_plugin.env.project import load_project
    from ray_uv_plugin.env.spec import parse_spec

    spec = parse_spec(dict(value))
    where = Path(spec.project) if spec.project else Path(project)
    return make_request(spec, load_project(where), dict(env_vars)).key


def asked_keys(requests: list[tuple[Mapping, str, Mapping]], env: Mapping[str, str]) -> list[str]:
    """`key_of` of each (value, project, env_vars), in a process with the nodes' environment
    `env` (the key reads uv's settings from it); "unknown: why" for one that cannot be keyed."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos_invariants"], input=json.dumps(requests),
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if out.returncode != 0:
        return [f"unknown: keying failed: {out.stderr[-300:]}"] * len(requests)
    return json.loads(out.stdout)


# --- locks and leftovers ------------------------------------------------------------------


def flock_holders() -> dict[int, list[int]]:
    """{inode: [pid, ...]} of the host's flocks (`/proc/locks`)."""
    holders: dict[int, list[int]] = {}
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            holders.setdefault(int(parts[5].rsplit(":", 1)[1]), []).append(int(parts[4]))
        except (ValueError, IndexError):
            continue
    return holders


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def held_locks(venv_dirs: Iterable[Path]) -> list[tuple[Path, os.stat_result]]:
    """Every lock file and build slot ticket under `venv_dirs` that a process holds now."""
    found = []
    for root in venv_dirs:
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if not (LOCK.match(entry.name) or build_slots.is_queue_entry(entry.name)):
                continue
            if is_held(entry) is not True:
                continue
            try:
                found.append((entry, entry.stat()))
            except FileNotFoundError:
                continue
    return found


def locks(
    venv_dirs: Iterable[Path],
    bound_s: float,
    now: float | None = None,
    margin_s: float = LOCK_MARGIN_S,
) -> list[str]:
    """No lock or ticket held past `bound_s` (+ `margin_s`) since its holder took it, nor by
    a stopped process."""
    now = time.time() if now is None else now
    holders = flock_holders()
    found = []
    for entry, st in held_locks(venv_dirs):
        states = {pid: _state(pid) for pid in holders.get(st.st_ino, [])}
        age = now - st.st_mtime
        if age > bound_s + margin_s:
            found.append(f"{entry} held {age:.0f}s (bound {bound_s:.0f}s) by {states}")
        elif any(s == "T" for s in states.values()):
            found.append(f"{entry} held by a stopped process: {states}")
    return found


def locks_at_end(
    venv_dirs: list[Path], bound_s: float, margin_s: float = LOCK_MARGIN_S, poll_s: float = 2.0
) -> list[str]:
    """`locks` once every lock still held is past the bound or let go: after the last round,
    whose locks the rounds' checks came too early to judge."""
    while True:
        now = time.time()
        young = [st.st_mtime for _, st in held_locks(venv_dirs)
                 if now - st.st_mtime <= bound_s + margin_s]  # fmt: skip
        if not young:
            return locks(venv_dirs, bound_s, margin_s=margin_s)
        time.sleep(min(poll_s, max(0.0, min(young) + bound_s + margin_s - now) + 0.1))


def unowned(root: Path) -> list[tuple[Path, str]]:
    """What `root` holds that no live process owns and no ready venv is: a venv no build
    finishes (no ready marker, its lock free), a receive's or a gc's temp dir whose key's
    lock is free, a ticket or a hold's record no process holds. Read before any gc."""
    found = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        name = entry.name
        if KEY.match(name) and entry.is_dir() and not entry.is_symlink():
            meta = Venv.at(entry).read_marker()
            if ready(entry) is not None or (isinstance(meta, dict) and meta.get(NOT_WHOLE)):
                continue  # ready, or marked to be rebuilt on its next use
            if is_held(root / f"{name}.lock") is False:
                what = "no marker" if meta is None else "a marker not ready"
                found.append((entry, f"a venv no build finishes: {what}, its lock free"))
        elif match := TEMP.match(name):
            if is_held(root / f"{match['key']}.lock") is False:
                found.append((entry, "a temp dir whose key's lock is free"))
        elif (
            name != BUDGET_LOCK
            and (build_slots.is_queue_entry(name) or holds.is_record(name))
            and is_held(entry) is False
        ):
            found.append((entry, "a ticket or hold nobody holds"))
    return found


def collect_garbage(root: Path, gc_env: Mapping[str, str], ray_uv: str) -> list[str]:
    """`ray-uv gc` on the venv dir, with no age or size: what it removes is what no process
    owns, never a venv (an idle one stays for the next round's warm jobs)."""
    out = subprocess.run(
        [ray_uv, "gc"], env=dict(gc_env), capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        return [f"ray-uv gc on {root} failed ({out.returncode}): {out.stderr[-400:]}"]
    return []


if __name__ == "__main__":  # `asked_keys`' process: in the nodes' environment
    answers = []
    for value, project, env_vars in json.load(sys.stdin):
        try:
            answers.append(key_of(value or {}, project, env_vars or {}))
        except Exception as e:  # noqa: BLE001 - said, and judged as a violation
            answers.append(f"unknown: {type(e).__name__}: {e}"[:300])
    print(json.dumps(answers))

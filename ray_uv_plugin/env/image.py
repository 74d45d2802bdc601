"""Packages the image provides (`uv_project.from_image`, such as an NGC image's own torch): the
venv sees the node interpreter's site-packages, installs everything else its lock selects, and
the build checks that the image's packages are what the venv runs with (docs/image_packages.md).

- What is left out (`left_out`): the named packages and the packages of `uv.lock` that only they
  reach, over every dependency, extra and group the lock records (markers are not read: a
  package that anything else might need is kept, so nothing a selection needs goes missing).
- What the venv sees (`write_pth`): a `.pth` file of the plugin's own in its site-packages naming
  the node interpreter's site-packages after the venv's own, so the venv's packages shadow the
  image's. Ray's Python may itself be a venv: its site-packages are what "the image" means, and
  `include-system-site-packages` would show the base CPython's instead.
- What the key records (`fingerprint`): each named package as the node's interpreter has it.
- What the build checks (`check_venv`): no copy of a left-out package in the venv, each named
  package found at the image's location by the venv's Python, and every requirement on one by a
  distribution of the venv (or the lock's override of it) met by the image's version.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ray_uv_plugin.env.project import ProjectError
from ray_uv_plugin.env.uv import UvSyncError
from ray_uv_plugin.store.accounting import IMAGE_PTH
from ray_uv_plugin.store.layout import DIST_INFO, site_packages

_ROOT_SOURCES = ("editable", "virtual")  # a workspace member's source in uv.lock


def _edges(package: Mapping) -> Iterable[str]:
    """The names a lock package depends on: its dependencies, extras' and groups'."""
    lists = [package.get("dependencies", [])]
    for key in ("optional-dependencies", "dev-dependencies"):
        table = package.get(key, {})
        if isinstance(table, dict):
            lists += list(table.values())
    for entries in lists:
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                yield canonicalize_name(entry["name"])


def _reach(graph: Mapping[str, set[str]], start: Iterable[str], stop: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = [name for name in start if name not in stop]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [n for n in graph.get(name, ()) if n not in stop and n not in seen]
    return seen


def left_out(packages: Sequence[Mapping], named: Iterable[str]) -> list[str]:
    """The lock's packages (`project.lock_packages`) that the venv leaves to the image: the
    `named` ones in the lock, and those reached only through them. A name the lock lacks (one
    `exclude-dependencies` took out) has nothing to leave out."""
    graph: dict[str, set[str]] = {}
    roots = []
    for package in packages:
        name = canonicalize_name(str(package.get("name", "")))
        graph.setdefault(name, set()).update(_edges(package))
        source = package.get("source")
        if isinstance(source, dict) and any(kind in source for kind in _ROOT_SOURCES):
            roots.append(name)
    stop = {canonicalize_name(n) for n in named} & graph.keys()
    kept = _reach(graph, roots, stop)
    return sorted(_reach(graph, stop, set()) - kept)


def no_install_args(names: Iterable[str]) -> list[str]:
    """The `uv sync` flags that leave `names` out."""
    return [arg for name in names for arg in ("--no-install-package", name)]


def site_dirs() -> list[str]:
    """The node interpreter's site-packages dirs: what the venv sees of the image."""
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


_memo: dict[tuple[str, tuple[str, ...]], tuple[tuple[int, int, int], dict[str, str]]] = {}
_memo_guard = threading.Lock()


def _one(name: str, dirs: list[str]) -> dict[str, str]:
    key = (canonicalize_name(name), tuple(dirs))
    with _memo_guard:
        known = _memo.get(key)
    if known is not None:  # the warm path: one stat of the RECORD the fingerprint read
        stamp, found = known
        try:
            st = os.stat(found["record_path"])
            if (st.st_ino, st.st_mtime_ns, st.st_size) == stamp:
                return found
        except OSError:
            pass
    dist = next(iter(metadata.distributions(name=name, path=dirs)), None)
    if dist is None:
        raise ProjectError(
            f"uv_project.from_image names {name!r}, which this node's Python ({sys.executable}) "
            f"does not have in {', '.join(dirs) or 'any site-packages'}: install it in the "
            "image, or drop it from from_image so that the venv installs it from uv.lock."
        )
    listed = [f for f in dist.files or () if f.name == "RECORD" and f.parent.suffix == ".dist-info"]
    if not listed:
        raise ProjectError(
            f"uv_project.from_image names {name!r}, whose installed copy in this node's Python "
            f"({dist.locate_file('')}) has no RECORD to fingerprint it by: reinstall it with pip "
            "or uv in the image."
        )
    record = Path(str(dist.locate_file(listed[0])))
    data = record.read_bytes()
    st = os.stat(record)
    found = {
        "name": key[0],
        "version": dist.version,
        "location": str(dist.locate_file("")),
        "record": hashlib.sha256(data).hexdigest(),
        "record_path": str(record),
    }
    with _memo_guard:
        _memo[key] = ((st.st_ino, st.st_mtime_ns, st.st_size), found)
    return found


def fingerprint(named: Iterable[str], dirs: list[str] | None = None) -> list[list[str]]:
    """Each named package as the node's interpreter has it in `dirs` (its site-packages):
    `[name, version, location, sha256 of its installed RECORD]`, for the key. A ProjectError
    where one is missing. Remembered per process by the RECORD's inode, mtime and size."""
    dirs = site_dirs() if dirs is None else dirs
    found = [_one(name, dirs) for name in sorted(named)]
    return [[f["name"], f["version"], f["location"], f["record"]] for f in found]


def write_pth(venv: Path, dirs: list[str]) -> None:
    """The venv's `.pth` naming the image's site-packages (after the venv's own, as `site`
    appends a `.pth` file's lines to `sys.path`)."""
    site_dir = site_packages(venv)
    if site_dir is None:
        raise UvSyncError(f"uv_project: uv made {venv} without a site-packages dir.")
    (site_dir / IMAGE_PTH).write_text("".join(f"{d}\n" for d in dirs))


_WHERE = (
    "import importlib.metadata as m, json, sys\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    d = next(iter(m.distributions(name=name)), None)\n"
    "    out[name] = None if d is None else [d.version, str(d.locate_file(''))]\n"
    "print(json.dumps(out))\n"
)


def check_venv(
    venv: Path,
    image: Sequence[Sequence[str]],
    left: Iterable[str],
    lock: Mapping,
    extras: Collection[str] | None = (),
) -> None:
    """Fail the build (UvSyncError) unless the venv runs with the image's packages: `image` is
    their `fingerprint`, `left` what `left_out` gave, `lock` the parsed `uv.lock`, `extras`
    those asked for (None: all), whose requirements of the project's own are checked too."""
    site_dir = site_packages(venv)
    if site_dir is None:
        raise UvSyncError(f"uv_project: uv made {venv} without a site-packages dir.")
    names = {name for name, *_ in image} | {canonicalize_name(n) for n in left}
    copies = sorted(
        entry
        for entry in os.listdir(site_dir)
        if (match := DIST_INFO.match(entry)) and canonicalize_name(match["name"]) in names
    )
    if copies:
        raise UvSyncError(
            f"uv_project: the venv {venv.name} holds {', '.join(copies)}, which from_image "
            "leaves to the image: they would shadow the image's. Nothing was kept; a build hook "
            "or a package outside uv.lock installed them: find it (`uv tree`) and drop it."
        )
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-B", "-c", _WHERE, *(n for n, *_ in image)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if where.returncode != 0:
        raise UvSyncError(f"uv_project: the venv {venv.name}'s Python failed: {where.stderr}")
    seen = json.loads(where.stdout)
    for name, version, location, _ in image:
        if seen.get(name) != [version, location]:
            raise UvSyncError(
                f"uv_project: in the venv {venv.name}, {name} is {seen.get(name)}, not the "
                f"image's {version} at {location}: the venv's Python does not see the image's "
                "site-packages. Nothing was kept; report it with the node's Python."
            )
    _check_requirements(site_dir, {n: v for n, v, *_ in image}, lock, extras)


def _overrides(lock: Mapping) -> dict[str, list[str]]:
    """The lock's `override-dependencies`, by name: they replace every requirement on it."""
    found: dict[str, list[str]] = {}
    for entry in lock.get("manifest", {}).get("overrides", []):
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            name = canonicalize_name(entry["name"])
            found.setdefault(name, []).append(str(entry.get("specifier", "")))
    return found


def _holds(marker: str, extras: Collection[str]) -> bool:
    """Whether a marker holds here with no extra or one of `extras` (one unreadable: yes)."""
    try:
        return any(Marker(marker).evaluate({"extra": e}) for e in ["", *extras])
    except InvalidMarker:
        return True


def _project_requirements(
    lock: Mapping, extras: Collection[str] | None
) -> Iterable[tuple[str, str, str]]:
    """(who, name, specifier) of the workspace members' own requirements in the lock (the
    project is rarely installed, so its distribution cannot say), with no extra or one of
    `extras` (None: any)."""
    for package in lock.get("package", []):
        source = package.get("source")
        if not (isinstance(source, dict) and any(kind in source for kind in _ROOT_SOURCES)):
            continue
        who = f"{package.get('name')} (the project, in uv.lock)"
        for entry in package.get("metadata", {}).get("requires-dist", []):
            if not isinstance(entry, dict) or "name" not in entry:
                continue
            marker = entry.get("marker")
            if marker and extras is not None and not _holds(str(marker), extras):
                continue
            yield who, canonicalize_name(entry["name"]), str(entry.get("specifier", ""))


def _check_requirements(
    site_dir: Path,
    versions: Mapping[str, str],
    lock: Mapping,
    extras: Collection[str] | None = (),
) -> None:
    overrides = _overrides(lock)
    wanted: list[tuple[str, str, str]] = []  # (who, name, specifier)
    for name, specs in overrides.items():
        wanted += [("uv.lock's override-dependencies", name, s) for s in specs if name in versions]
    for who, name, spec in _project_requirements(lock, extras):
        if name in versions and name not in overrides:
            wanted.append((who, name, spec))
    for dist in metadata.distributions(path=[str(site_dir)]):
        who = f"{dist.metadata['Name']} {dist.version}"
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = canonicalize_name(req.name)
            if name not in versions or name in overrides:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                wanted.append((who, name, str(req.specifier)))
    for who, name, spec in wanted:
        try:
            version = Version(versions[name])
        except InvalidVersion:
            continue  # no version to compare: the image's own business
        req = Requirement(f"{name}{spec}")
        if not req.specifier.contains(version, prereleases=True):
            public = version.public
            raise UvSyncError(
                f"uv_project: {who} requires {name}{spec or ''}, and the image's {name} is "
                f"{versions[name]}: the venv would run it with a {name} it does not accept. "
                "Nothing was kept. Either declare that it runs with the image's: in "
                f'pyproject.toml, `[tool.uv] override-dependencies = ["{name}>={public}"]` '
                "(it replaces every requirement on it; add a marker to scope it), then `uv "
                f"lock`; or pin a release of the dependent that accepts {name} {versions[name]}, "
                f"or use an image whose {name} meets {spec}."
            )


def recorded(meta: Mapping | None) -> list[str]:
    """The image's packages a venv's marker records (its key's `fingerprint`), as `ray-uv
    check` and `list` show them: `torch 2.8.0a0+nv (/usr/lib/python3/dist-packages)`; none
    for a venv without `from_image`, or a marker that is not what a build writes."""
    inputs = (meta or {}).get("inputs")
    selection = inputs.get("selection") if isinstance(inputs, dict) else None
    found = selection.get("image") if isinstance(selection, dict) else None
    if not isinstance(found, list):
        return []
    return [
        f"{entry[0]} {entry[1]} ({entry[2]})"
        for entry in found
        if isinstance(entry, list) and len(entry) == 4 and all(isinstance(e, str) for e in entry)
    ]

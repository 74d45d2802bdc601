"""The uv project on disk: its files, the extras and groups it offers, the Ray it pins."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from ray_uv_plugin.env.lock_memo import LockMemo
from ray_uv_plugin.env.spec import ParsedUvProject


class ProjectError(ValueError):
    """The project cannot give the environment asked for; the message says how to fix it."""


@dataclass(frozen=True)
class ProjectFiles:
    """The bytes that decide what a venv holds, read once per request."""

    path: Path
    pyproject: bytes
    lock: bytes
    uploaded: bool = False  # `path` is a working_dir that Ray uploaded (see `load_project`)

    @cached_property
    def lock_digest(self) -> str:
        """sha256 of uv.lock: in the key, and what its parse is remembered by."""
        return hashlib.sha256(self.lock).hexdigest()

    @cached_property
    def pyproject_table(self) -> dict:
        """pyproject.toml, parsed once: a build's checks and its marker read it, a reuse never."""
        try:
            return tomllib.loads(self.pyproject.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ProjectError(
                f"uv_project: {self.path}/pyproject.toml is not valid TOML: {e}"
            ) from e


@dataclass(frozen=True)
class LockedSources:
    """What the plugin needs from uv.lock, parsed once per content by a TOML parser."""

    ray_versions: tuple[str, ...]  # of each `ray` package in it (one, in a usable lock)
    # Path, directory and editable sources other than the project itself: the venv points into
    # the project's dir (or copies from beside it), so its path belongs in the key. Not a wheel
    # file: uv unpacks it, its content is keyed (`copied_sources`), and a project that depends
    # on this plugin's wheel in a driver group (README "Install") keeps one venv per key
    # across Ray sessions.
    refers_to_paths: bool
    copied: tuple[str, ...]  # non-editable path and directory sources, as uv.lock names them
    copied_names: tuple[str, ...]  # the names of the packages installed from those
    # Each package's versions (`accounting.locked_distributions`): a build's check of the
    # dist-info dirs it made (`locked_sources` only; `local_sources` parses nothing).
    distributions: Mapping[str, frozenset[str] | None] = field(default_factory=dict)


NO_LOCAL_SOURCES = LockedSources((), False, (), ())
# Whether uv.lock may name a local source at all: any `path` or `directory` key, or an
# `editable` one other than the project itself. Most locks have none, and a request for them
# (in a new agent too: a new Ray session) parses nothing; the others are parsed. Three
# searches for a literal each: about 1 ms for a 0.5 MB lock.
# A key may be quoted (`"path" = ...`, TOML's same key; uv writes it bare).
_MAY_BE_LOCAL = (
    re.compile(rb"path[\"']?\s*="),
    re.compile(rb"directory[\"']?\s*="),
    re.compile(rb"editable[\"']?\s*=\s*+(?![\"']\.[\"'])"),  # not the project's
)


def lock_packages(files: ProjectFiles) -> list[dict]:
    """uv.lock's `[[package]]` tables; ProjectError where it is no lock uv wrote."""
    try:
        packages = tomllib.loads(files.lock.decode("utf-8")).get("package", [])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ProjectError(
            f"uv_project: {files.path}/uv.lock is not valid TOML ({e}): run `uv lock` again "
            "and give the nodes the new lock with the project."
        ) from e
    if not isinstance(packages, list):
        raise ProjectError(
            f"uv_project: {files.path}/uv.lock holds no list of packages (`package` is a "
            f"{type(packages).__name__}): it is not a lock uv wrote; run `uv lock` again."
        )
    return [p for p in packages if isinstance(p, dict)]


def _locked_sources(files: ProjectFiles) -> LockedSources:
    # Here, not at the top: the `uv run` driver hook, imported by every Ray driver, reads
    # pyproject.toml files with this module and needs nothing of the venv dir's accounting.
    from ray_uv_plugin.store.accounting import distributions_of

    packages = lock_packages(files)
    refers, copied, names = False, set(), []
    for package in packages:
        source = package.get("source")
        if not isinstance(source, dict):
            continue
        where = {kind: source.get(kind) for kind in ("editable", "path", "directory")}
        wheel_file = str(where["path"]).endswith(".whl")
        refers = refers or any(
            value not in (None, ".") and not (kind == "path" and wheel_file)
            for kind, value in where.items()
        )
        copy = where["path"] if where["path"] is not None else where["directory"]
        if copy is not None:
            copied.add(str(copy))
            names.append(str(package.get("name")))
    return LockedSources(
        ray_versions=tuple(
            sorted(
                {str(p["version"]) for p in packages if p.get("name") == "ray" and "version" in p}
            )
        ),
        refers_to_paths=refers,
        copied=tuple(sorted(copied)),
        copied_names=tuple(sorted(names)),
        distributions=distributions_of(packages),
    )


# uv.lock's `LockedSources`, parsed on the first request of each lock content.
locked_sources = LockMemo(_locked_sources)


def local_sources(files: ProjectFiles) -> LockedSources:
    """`locked_sources` where uv.lock may name a local source, else `NO_LOCAL_SOURCES` (its
    `ray_versions` unread): what every request asks, answered without a parse for most locks."""
    if not any(key.search(files.lock) for key in _MAY_BE_LOCAL):
        return NO_LOCAL_SOURCES
    return locked_sources(files)


def resolve_project_dir(spec: ParsedUvProject, working_dir: str | None) -> Path:
    """`project` if given (relative to the working_dir), else the working_dir itself."""
    if spec.project is not None:
        project = Path(spec.project).expanduser()
        if not project.is_absolute():
            if working_dir is None:
                raise ProjectError(
                    f"uv_project.project {spec.project!r} is relative but the runtime_env has "
                    "no working_dir to resolve it against: give an absolute path as seen on "
                    "the node, or set working_dir."
                )
            project = Path(working_dir) / project
        return project
    if working_dir is None:
        raise ProjectError(
            "uv_project needs a project: set runtime_env 'working_dir' to the directory that "
            "holds pyproject.toml and uv.lock (e.g. {'working_dir': '.', 'uv_project': {}}), "
            "or set uv_project.project to that directory as seen on the node."
        )
    return Path(working_dir)


def load_project(path: Path, uploaded: bool = False) -> ProjectFiles:
    """The project's files; `uploaded`: `path` is a working_dir that Ray uploaded and unpacked
    here (what is missing was then left out by the upload, not by the user's project)."""
    if path.exists() and not path.is_dir():
        raise ProjectError(
            f"uv_project: the project {path} is a file, not a directory; point "
            "uv_project.project (or working_dir) at the directory that holds pyproject.toml "
            "and uv.lock."
        )
    if not path.is_dir():
        raise ProjectError(
            f"uv_project: project directory {path} does not exist on this node: point "
            "uv_project.project (or working_dir) at the directory that holds pyproject.toml "
            "and uv.lock, a path that every node sees or one relative to the working_dir."
        )
    pyproject, lock = path / "pyproject.toml", path / "uv.lock"
    if not pyproject.is_file():
        raise ProjectError(
            f"uv_project: {path} has no pyproject.toml; it must be a uv project "
            "(`uv init`, then `uv lock`)."
        )
    if not lock.is_file() and uploaded:
        raise ProjectError(
            f"uv_project: the working_dir Ray uploaded to this node ({path}) has no uv.lock: "
            f"its upload left the lock out. {_upload_skips('uv.lock')}, or set "
            "RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 for the driver; and run `uv lock` if the "
            "project has none."
        )
    if not lock.is_file():
        raise ProjectError(
            f"uv_project: {path} has no uv.lock; run `uv lock` in {path} and give the nodes "
            "the lock with the project (the environment is built from it)."
        )
    return ProjectFiles(path, pyproject.read_bytes(), lock.read_bytes(), uploaded)


def _upload_skips(name: str) -> str:
    """Why an uploaded working_dir lacks `name` (a path relative to it), and what to do."""
    return (
        "Ray's upload skips files matched by .gitignore, .rayignore and runtime_env 'excludes': "
        f"take {name} out of them (`git check-ignore -v {name}` says which rule)"
    )


def read_pyproject(pyproject: Path) -> dict | None:
    """A pyproject.toml, parsed; None where it cannot be read or is not TOML in UTF-8 (uv
    would not take it for a project either). For files beside the request's: the `uv run`
    hook's project discovery, and what a build copies."""
    try:
        return tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None


def declared_name(pyproject: object) -> str | None:
    """`[project] name` of a parsed pyproject.toml, where it is a string."""
    table = pyproject.get("project") if isinstance(pyproject, dict) else None
    name = table.get("name") if isinstance(table, dict) else None
    return name if isinstance(name, str) else None


def project_name(files: ProjectFiles) -> str:
    """`[project] name`, which `ray-uv list` shows beside the (often temporary) path."""
    return declared_name(files.pyproject_table) or "?"


def _table(files: ProjectFiles, data: dict, key: str, where: str) -> dict:
    """`data[key]`, a TOML table (empty if absent); ProjectError naming `where` if it is
    another kind of value, which no uv project has."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ProjectError(
            f"uv_project: {where} in {files.path}/pyproject.toml is a {type(value).__name__}, "
            "not a table: fix pyproject.toml (uv refuses it too)."
        )
    return value


def _check_names(
    files: ProjectFiles, kind: str, asked: tuple[str, ...], table: dict, where: str
) -> None:
    offered = {canonicalize_name(name) for name in table}
    unknown = [name for name in asked if canonicalize_name(name) not in offered]
    if unknown:
        raise ProjectError(
            f"uv_project: unknown {kind}(s) {', '.join(unknown)} for {files.path}; the project "
            f"has {', '.join(sorted(offered)) or f'no {kind}s'} ({where} in pyproject.toml)."
        )


def check_request(files: ProjectFiles, spec: ParsedUvProject) -> None:
    """Fail fast, before uv runs, on what pyproject.toml alone shows is wrong."""
    data = files.pyproject_table
    project = _table(files, data, "project", "[project]")
    extras = _table(files, project, "optional-dependencies", "[project.optional-dependencies]")
    _check_names(files, "extra", spec.extras, extras, "[project.optional-dependencies]")
    groups = _table(files, data, "dependency-groups", "[dependency-groups]")
    _check_names(files, "group", spec.groups, groups, "[dependency-groups]")
    requires = project.get("requires-python")
    if requires and not isinstance(requires, str):
        raise ProjectError(
            f"uv_project: requires-python in {files.path}/pyproject.toml is a "
            f"{type(requires).__name__}, not a version specifier such as '>=3.11'."
        )
    if requires:
        try:
            allowed = SpecifierSet(requires)
        except InvalidSpecifier:
            return  # uv will say what is wrong with it
        here = ".".join(map(str, sys.version_info[:3]))
        if not allowed.contains(here, prereleases=True):
            raise ProjectError(
                f"uv_project: {files.path} requires-python {requires!r}, but this node's Ray "
                f"runs Python {here} ({sys.executable}); workers must use the node's "
                "interpreter, so widen requires-python (and `uv lock`) or run Ray on a "
                "matching Python."
            )


def check_ray_pin(files: ProjectFiles, node_ray: str) -> None:
    """Workers import Ray from the venv: the lock must hold exactly the node's version."""
    versions = list(locked_sources(files).ray_versions)
    if not versions:
        raise ProjectError(
            f"uv_project: {files.path}/uv.lock holds no ray, but Ray workers need it in their "
            f"venv: add `ray=={node_ray}` to the project's dependencies and run `uv lock`."
        )
    if versions != [node_ray]:
        raise ProjectError(
            f"uv_project: {files.path}/uv.lock pins ray {', '.join(versions)} but this node "
            f"runs ray {node_ray}; pin `ray=={node_ray}` in pyproject.toml and run `uv lock`."
        )


# Not part of what a build of a directory source reads.
_SKIPPED = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "build"}


def refers_to_project_path(files: ProjectFiles, spec: ParsedUvProject) -> bool:
    """Whether the venv will point into the project directory (so its path belongs in the key)."""
    return spec.install_project or local_sources(files).refers_to_paths


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    if path.is_file():
        h.update(path.read_bytes())
        return h.hexdigest()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED)
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            if os.path.islink(full):
                h.update(b"link:" + os.readlink(full).encode())
            else:
                h.update(_file_digest(full))
    return h.hexdigest()


def _file_digest(path: str) -> bytes:
    """A regular file's sha256; for a FIFO or a device, its kind alone: reading one would block
    the node's agent (a FIFO without a writer) or never end (/dev/zero)."""
    if stat.S_ISSOCK(os.lstat(path).st_mode):  # no open(2) at all
        return b"special:" + oct(stat.S_IFSOCK).encode()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return b"special:" + oct(stat.S_IFMT(mode)).encode()
        return hashlib.file_digest(f, "sha256").digest()


def copied_sources(
    files: ProjectFiles, sources: LockedSources | None = None
) -> tuple[tuple[str, str], ...]:
    """(source as in uv.lock, content digest) of each non-editable path or directory source
    (`sources`: `local_sources(files)`, where the caller has it)."""
    digests = []
    for source in (local_sources(files) if sources is None else sources).copied:
        try:
            target = (files.path / source).resolve()
            exists = target.exists()
        except (OSError, ValueError) as e:  # a NUL byte, a loop of links
            raise ProjectError(
                f"uv_project: uv.lock of {files.path} installs {source!r}, which is no path "
                f"on this node ({e})."
            ) from e
        if not exists:
            message = (
                f"uv_project: uv.lock of {files.path} installs {source!r}, which does not "
                f"exist on this node ({target})"
            )
            if files.uploaded and target.is_relative_to(files.path.resolve()):
                inside = os.path.relpath(target, files.path.resolve())
                raise ProjectError(
                    f"{message}: the working_dir's upload left it out. "
                    f"{_upload_skips(inside)}, or keep the file in a folder that none of them "
                    "match (the .gitignore of `uv init` ignores wheels/, dist/ and build/; "
                    "vendor/ is kept)."
                )
            raise ProjectError(
                f"{message}: put it inside the working_dir or on a path every node sees."
            )
        digests.append((source, _tree_digest(target)))
    return tuple(digests)


def _has_tool_uv(pyproject: Path) -> bool:
    return "uv" in (read_pyproject(pyproject) or {}).get("tool", {})


@dataclass(frozen=True)
class ConfigFile:
    """A uv config file that uv applies to the project beyond its pyproject.toml."""

    path: Path  # the file uv reads
    label: str  # how the key names it: `uv.toml` for the project's own, else `path`
    digest: str  # sha256 of its bytes


def config_files(files: ProjectFiles) -> tuple[ConfigFile, ...]:
    """The uv config uv applies to this project beyond pyproject.toml: a `uv.toml` beside it,
    or, if it has no `[tool.uv]`, the nearest one above, as uv finds it."""
    found = []
    for directory in (files.path, *files.path.resolve().parents):
        uv_toml = directory / "uv.toml"
        if uv_toml.is_file():
            # The project's own by content alone: the same project in another session's
            # working_dir is the same venv.
            label = "uv.toml" if directory == files.path else str(uv_toml)
            digest = hashlib.sha256(uv_toml.read_bytes()).hexdigest()
            found.append(ConfigFile(uv_toml, label, digest))
            break
        pyproject = directory / "pyproject.toml"
        if directory == files.path:
            if b"[tool.uv" in files.pyproject and _has_tool_uv(pyproject):
                break  # uv stops here; its bytes are keyed already
        elif pyproject.is_file() and _has_tool_uv(pyproject):
            digest = hashlib.sha256(pyproject.read_bytes()).hexdigest()
            found.append(ConfigFile(pyproject, str(pyproject), digest))
            break
    return tuple(found)

"""Which of Ray's libraries a venv's Ray can run, found from its files alone (no subprocess).

Ray's libraries need more than `ray`: Ray Data needs `ray[data]` (pandas, pyarrow, fsspec),
Serve `ray[serve]` (starlette, fastapi, uvicorn...), Tune and Train `ray[tune]`/`ray[train]`,
a Ray Client server `ray[client]` (grpcio). A worker whose venv lacks them dies at start with
`No module named 'starlette'`, in a log the user rarely reads. This module lists, for a built venv,
which libraries its Ray would miss and the requirement to add, by comparing the distributions the
Ray extra requires (from the venv's own `ray-*.dist-info/METADATA`) with the `*.dist-info` dirs
in its site-packages, and says whether the node's own Ray environment has the extra.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ray_uv_plugin.store.layout import DIST_INFO, ray_dist_info, site_packages

# The agent names the per-request logger `runtime_env_<job_id>`, and Ray's client proxier asks
# for a SpecificServer's env with job_id `ray_client_server_<port>` (Ray 2.60,
# ray/util/client/server/proxier.py and runtime_env_agent.py): the one request whose worker is
# known to be a Ray Client server.
CLIENT_SERVER_LOGGER_PREFIX = "runtime_env_ray_client_server_"


@dataclass(frozen=True)
class Library:
    name: str  # as `ray-uv check --library NAME` takes it
    extra: str  # Ray's extra: ray[<extra>]
    title: str
    needs: str  # which processes import it: they run in the env
    first: tuple[str, ...] = ()  # distributions named first when missing (the telling ones)


LIBRARIES: tuple[Library, ...] = (
    Library(
        "data",
        "data",
        "Ray Data",
        "map_batches/map tasks and actor pools, and, with a job-level uv_project, every "
        "Data task of the job",
        ("pandas", "pyarrow", "fsspec"),
    ),
    Library(
        "serve",
        "serve",
        "Ray Serve",
        "replicas (ray_actor_options runtime_env), and, with a job-level uv_project, the Serve "
        "controller and proxies",
        ("starlette", "fastapi", "uvicorn"),
    ),
    Library(
        "tune",
        "tune",
        "Ray Tune",
        "trainables, and with a job-level env the Tune driver",
        ("pandas", "pyarrow", "fsspec", "tensorboardx"),
    ),
    Library(
        "train",
        "train",
        "Ray Train",
        "the worker group, and with a job-level env the Train controller",
        ("pandas", "pyarrow", "fsspec", "tensorboardx"),
    ),
    Library(
        "client",
        "client",
        "Ray Client",
        "the job's Ray Client server, when `ray.init('ray://...')` sets a job-level uv_project",
        ("grpcio",),
    ),
)
BY_NAME = {lib.name: lib for lib in LIBRARIES}


class MissingLibraryError(RuntimeError):
    """A request whose worker provably runs a Ray library that its venv's Ray lacks."""


@dataclass(frozen=True)
class Missing:
    """One Ray library that a venv's Ray cannot run."""

    library: Library
    ray_version: str
    distributions: tuple[str, ...]  # the extra's distributions that the venv lacks
    node_has: bool | None  # the node's own Ray environment has the extra (None: unknown)

    @property
    def requirement(self) -> str:
        return f"ray[{self.library.extra}]=={self.ray_version}"

    def describe(self) -> str:
        shown = ", ".join(self.distributions[:5])
        more = len(self.distributions) - 5
        if more > 0:
            shown += f" and {more} more"
        return f"{self.library.title} needs `{self.requirement}` ({shown} not installed)"

    def advice(self) -> str:
        return (
            f"add {self.requirement!r} to your project's dependencies (`uv add "
            f"'{self.requirement}'`, or in pyproject.toml) and run `uv lock`"
        )


def _installed_distributions(site: Path) -> dict[str, str]:
    """Canonical distribution name -> version, from the `*.dist-info` dir names (one listdir)."""
    found: dict[str, str] = {}
    try:
        names = os.listdir(site)
    except OSError:
        return found
    for name in names:
        m = DIST_INFO.match(name)
        if m:
            found[canonicalize_name(m["name"])] = m["version"]
    return found


def _extra_distributions(requires: Iterable[str], extra: str) -> tuple[str, ...]:
    """The canonical names of the distributions that `extra` adds to the base requirements,
    with markers evaluated for this interpreter (the venvs use the node's interpreter)."""
    out: list[str] = []
    mentions = re.compile(r"extra\s*==\s*['\"]" + re.escape(extra) + r"['\"]")
    for line in requires:
        if not mentions.search(line):
            continue  # parsing every requirement costs ~0.1 ms; Ray lists hundreds
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None:
            continue  # a base requirement
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            name = canonicalize_name(req.name)
            if name not in out:
                out.append(name)
    return tuple(out)


def _requires_from_metadata(text: str) -> list[str]:
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


@lru_cache(maxsize=1)
def _node_state() -> tuple[str, tuple[str, ...], frozenset[str]] | None:
    """The node's own Ray: (version, its Requires-Dist lines, installed distributions)."""
    import importlib.metadata as md

    try:
        ray_dist = md.distribution("ray")
    except md.PackageNotFoundError:
        return None
    installed: set[str] = set()
    for path in sys.path:
        if path and os.path.isdir(path):
            installed.update(_installed_distributions(Path(path)))
    return ray_dist.version, tuple(ray_dist.requires or ()), frozenset(installed)


def node_has(extra: str) -> bool | None:
    """Whether the Python running this code (the node's Ray) has every distribution of
    `ray[extra]`; None if it has no Ray."""
    state = _node_state()
    if state is None:
        return None
    _, requires, installed = state
    return all(d in installed for d in _extra_distributions(requires, extra))


@dataclass(frozen=True)
class Status:
    """One library in one venv: what it lacks (empty: the venv's Ray can run it)."""

    library: Library
    ray_version: str
    missing: tuple[str, ...]
    node_has: bool | None

    @property
    def ok(self) -> bool:
        return not self.missing

    def as_missing(self) -> Missing:
        return Missing(self.library, self.ray_version, self.missing, self.node_has)


_cache: dict[tuple[str, int, int, tuple[str, ...]], list[Status]] = {}


def library_status(venv: Path, libraries: Sequence[Library] = LIBRARIES) -> list[Status]:
    """Every library's status in the venv at `venv`. Raises ValueError if it holds no Ray.

    Remembered per site-packages dir and its mtime (a venv is read-only once built): a warm
    request pays two `stat`s and a glob."""
    site = site_packages(venv)
    st = os.stat(site) if site else None
    if site is None or st is None:
        raise ValueError(_no_ray(venv))
    cache_key = (str(site), st.st_mtime_ns, st.st_ino, tuple(lib.name for lib in libraries))
    cached = _cache.get(cache_key)
    if cached is None:
        cached = _cache[cache_key] = _library_status(venv, site, libraries)
    return list(cached)


def _no_ray(venv: Path) -> str:
    return (
        f"uv_project: {venv} has no Ray installed (no ray-*.dist-info in its site-packages): "
        "make ray a dependency of the project and run `uv lock`."
    )


def _library_status(venv: Path, site: Path, libraries: Sequence[Library]) -> list[Status]:
    dist_info = ray_dist_info(venv)
    if dist_info is None:
        raise ValueError(_no_ray(venv))
    installed = _installed_distributions(site)
    version = DIST_INFO.match(dist_info.name)["version"]  # type: ignore[index]
    try:
        requires = _requires_from_metadata((dist_info / "METADATA").read_text("utf-8"))
    except OSError as e:
        raise ValueError(f"uv_project: cannot read Ray's metadata in {dist_info}: {e}") from e
    out = []
    for lib in libraries:
        wanted = _extra_distributions(requires, lib.extra)
        missing = [d for d in wanted if d not in installed]
        missing.sort(
            key=lambda d: (d not in lib.first, lib.first.index(d) if d in lib.first else 0)
        )
        out.append(Status(lib, version, tuple(missing), node_has(lib.extra)))
    return out


def missing_libraries(venv: Path, only_node_has: bool = True) -> list[Missing]:
    """The Ray libraries the venv's Ray would miss, each with the requirement to add.

    With `only_node_has` (the plugin's use) only those the node's own Ray has: a library the
    node itself cannot run is not this env's fault. Cost: one listdir and one small file read.
    """
    return [
        s.as_missing()
        for s in library_status(venv)
        if s.missing and (s.node_has or not only_node_has)
    ]


def _warning_lines(key: str, missing: Sequence[Missing]) -> list[str]:
    """The setup log's warnings for a venv (`key`) whose Ray lacks libraries."""
    return [
        f"uv_project {key}: this env's Ray cannot run {m.library.title}: {m.describe()}; the "
        f"node's Ray has it. {m.library.title} processes ({m.library.needs}) started in this env "
        f"die at start with `ModuleNotFoundError`. If the job uses "
        f"{m.library.title}, {m.advice()}; `ray-uv check --library {m.library.name}` checks "
        "a project ahead of time."
        for m in missing
    ]


def _is_client_server_request(logger: logging.Logger | None) -> bool:
    """Whether this setup is for a Ray Client SpecificServer (the job-level env of a
    `ray.init("ray://...", runtime_env=...)`), from the agent's per-request logger name."""
    return bool(logger is not None and logger.name.startswith(CLIENT_SERVER_LOGGER_PREFIX))


def _client_server_error(key: str, missing: Missing) -> str:
    return (
        f"uv_project {key}: Ray Client runs the job's client server in the job-level "
        f"uv_project env, and this env's Ray lacks `{missing.requirement}` "
        f"({', '.join(missing.distributions)} not installed), so the server could not start "
        f"(the client would wait 60 s for `Initialization failure from server`). Either "
        f"{missing.advice()}, or leave uv_project out of the job-level runtime_env of "
        "`ray.init('ray://...')` and set it per task or actor "
        "(`.options(runtime_env={'uv_project': {...}})`)."
    )


def check_libraries(key: str, venv: Path, logger: logging.Logger | None = None) -> list[Missing]:
    """The plugin's hook, after a venv is found or built: log a warning per Ray library the
    node's Ray has and this env's Ray lacks; raise `MissingLibraryError` where the request
    provably needs one (a Ray Client server without `ray[client]`). Never raises otherwise:
    a venv it cannot read is left to the venv checks."""
    logger = logger or logging.getLogger(__name__)
    try:
        statuses = library_status(venv)
    except ValueError:
        return []
    if _is_client_server_request(logger):
        client = next(s for s in statuses if s.library.name == "client")
        if client.missing:
            raise MissingLibraryError(_client_server_error(key, client.as_missing()))
    missing = [s.as_missing() for s in statuses if s.missing and s.node_has]
    for line in _warning_lines(key, missing):
        logger.warning(line)
    return missing

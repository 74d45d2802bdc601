"""A project's `pyproject.toml` and `uv.lock` as the plugin reads them on a node (`project`):
loaded from disk, parsed, checked against the request, its local sources found and hashed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ray_uv_plugin.env import project
from ray_uv_plugin.env.project import ProjectError, ProjectFiles
from ray_uv_plugin.env.spec import ParsedUvProject, parse_spec
from tests.fuzz.harness import (
    Case,
    Target,
    Violation,
    b64,
    bounded,
    refused_clearly,
    seeded,
    toml_text,
    unb64,
)

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=10),
    st.sampled_from(["ray", "2.60.0", ">=3.11", "<3", "==3.11.*", "~=", ".", "..", "/", "libs/a"]),
)
anything = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.sampled_from(["vllm", "dev", "Fig", "a-b", "a_b", "x"])
name_table = st.one_of(st.dictionaries(names, st.lists(st.text(max_size=8), max_size=2)), anything)
pyproject_doc = st.fixed_dictionaries(
    {},
    optional={
        "project": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": st.one_of(names, anything),
                    "requires-python": st.one_of(scalar, anything),
                    "optional-dependencies": name_table,
                    "dependencies": anything,
                },
            ),
            anything,
        ),
        "dependency-groups": name_table,
        "tool": st.one_of(
            st.fixed_dictionaries(
                {"uv": st.one_of(st.dictionaries(st.text(max_size=6), anything), anything)}
            ),
            anything,
        ),
        "build-system": anything,
    },
)
source = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "registry": st.just("https://pypi.org/simple"),
            "path": st.one_of(st.sampled_from(["libs/a", "libs/a.whl", ".", "missing"]), scalar),
            "directory": st.one_of(st.sampled_from(["libs/a", "libs", "missing"]), scalar),
            "editable": st.one_of(st.sampled_from([".", "libs/a"]), scalar),
            "virtual": st.just("."),
        },
    ),
    anything,
)
package = st.one_of(
    st.fixed_dictionaries(
        {"name": st.one_of(st.just("ray"), names, anything)},
        optional={"version": st.one_of(st.just("2.60.0"), scalar), "source": source},
    ),
    anything,
)
lock_doc = st.fixed_dictionaries(
    {"version": st.one_of(st.just(1), scalar)},
    optional={"package": st.one_of(st.lists(package, max_size=4), anything)},
)
text_file = st.one_of(
    pyproject_doc.map(lambda d: toml_text(d).encode()),
    st.binary(max_size=40),
    st.sampled_from([b"\xff\xfe", b"[project", b"a = 1\na = 2\n", b"[[package]]\n" * 3]),
)
lock_file = st.one_of(lock_doc.map(lambda d: toml_text(d).encode()), st.binary(max_size=40))
spec_value = st.one_of(
    st.just({}),
    st.fixed_dictionaries(
        {},
        optional={
            "extras": st.lists(names, max_size=2),
            "groups": st.lists(names, max_size=2),
            "install_project": st.booleans(),
        },
    ),
)
layout = st.sampled_from(["file", "file", "file", "absent", "dir", "symlink"])
fresh = st.fixed_dictionaries(
    {
        "pyproject": text_file.map(b64),
        "lock": lock_file.map(b64),
        "spec": spec_value,
        "node_ray": st.sampled_from(["2.60.0", "2.44.1"]),
        "layout": st.fixed_dictionaries({"pyproject.toml": layout, "uv.lock": layout}),
        # a libs/a dir beside the project files; "fifo": with a FIFO in it (a build's pipe)
        "local": st.sampled_from([False, True, "fifo"]),
    }
)


BOUND_S = 10.0  # hashing a project's local sources takes no longer


def _flip(data: bytes, at: float, xor: int) -> bytes:
    if not data:
        return data
    i = min(int(at * len(data)), len(data) - 1)
    return data[:i] + bytes([data[i] ^ xor]) + data[i + 1 :]


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    """A seed's file with a byte changed, cut, or a line added."""

    def change(which: str, at: float, xor: int, cut: bool, line: bytes) -> Case:
        data = unb64(seed[which])
        data = data[: int(at * len(data))] if cut else _flip(data, at, xor)
        return {**seed, which: b64(data + line)}

    return st.builds(
        change,
        st.sampled_from(["pyproject", "lock"]),
        st.floats(0, 1),
        st.integers(1, 255),
        st.booleans(),
        st.one_of(st.just(b""), lock_doc.map(lambda d: b"\n" + toml_text(d).encode())),
    )


def _write(base: Path, case: Case) -> None:
    for name, key in (("pyproject.toml", "pyproject"), ("uv.lock", "lock")):
        kind, path = case["layout"][name], base / name
        if kind == "file":
            path.write_bytes(unb64(case[key]))
        elif kind == "dir":
            path.mkdir()
        elif kind == "symlink":
            (base.parent / f"real-{name}").write_bytes(unb64(case[key]))
            path.symlink_to(base.parent / f"real-{name}")
    if case["local"]:
        (base / "libs" / "a").mkdir(parents=True)
        (base / "libs" / "a" / "x.py").write_text("x = 1\n")
        (base / "libs" / "a.whl").write_bytes(b"PK")
    if case["local"] == "fifo":
        os.mkfifo(base / "libs" / "a" / "pipe")


def _judged(what: str, call: Any) -> Any:
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (ProjectError,), what)
        return None


def check(case: Case) -> None:
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fuzz-project-", dir=shm) as tmp:
        base = Path(tmp) / "proj"
        base.mkdir()
        _write(base, case)
        _check(base, case)


def _inside(base: Path, source: str) -> bool:
    try:
        return source not in (".", "") and (base / source).resolve().is_relative_to(base)
    except (OSError, ValueError):
        return True  # no path at all: copied_sources must say so


def _check(base: Path, case: Case) -> None:
    files = _judged("load_project", lambda: project.load_project(base))
    if files is None:  # what the parsers would read all the same
        files = ProjectFiles(base, unb64(case["pyproject"]), unb64(case["lock"]))
    try:
        spec = parse_spec(case["spec"])
    except ValueError:
        spec = ParsedUvProject()
    table = _judged("pyproject_table", lambda: files.pyproject_table)
    if table is not None and not isinstance(table, dict):
        raise Violation(f"pyproject_table gave {type(table).__name__}")
    name = _judged("project_name", lambda: project.project_name(files))
    if name is not None and not isinstance(name, str):
        raise Violation(f"project_name gave {name!r}")
    _judged("check_request", lambda: project.check_request(files, spec))
    _judged("check_ray_pin", lambda: project.check_ray_pin(files, case["node_ray"]))
    for what in ("locked_sources", "local_sources"):
        found = _judged(what, lambda what=what: getattr(project, what)(files))
        if found is None:
            continue
        if not all(
            isinstance(s, str) for s in found.ray_versions + found.copied + found.copied_names
        ):
            raise Violation(f"{what} gave {found!r}")
        if not isinstance(found.refers_to_paths, bool):
            raise Violation(f"{what} gave refers_to_paths={found.refers_to_paths!r}")
        inside = all(_inside(base, s) for s in found.copied)
        if what == "local_sources" and inside:  # hashing what is outside the project: skipped
            digests = bounded(
                lambda f=found: _judged("copied_sources", lambda: project.copied_sources(files, f)),
                BOUND_S,
                "copied_sources",
            )
            if digests is not None and not all(
                isinstance(a, str) and isinstance(b, str) for a, b in digests
            ):
                raise Violation(f"copied_sources gave {digests!r}")
    _check_shortcut(files)
    refers = _judged("refers_to_project_path", lambda: project.refers_to_project_path(files, spec))
    if refers is not None and not isinstance(refers, bool):
        raise Violation(f"refers_to_project_path gave {refers!r}")
    configs = _judged("config_files", lambda: project.config_files(files))
    if configs is not None and not all(isinstance(c, project.ConfigFile) for c in configs):
        raise Violation(f"config_files gave {configs!r}")


def _check_shortcut(files: ProjectFiles) -> None:
    """`local_sources` skips the parse of a lock that cannot name a local source: the parse
    must then find none (else the key would miss a source's content)."""
    try:
        parsed = project.locked_sources(files)
    except ProjectError:
        return
    quick = project.local_sources(files)
    if quick is project.NO_LOCAL_SOURCES and (parsed.copied or parsed.refers_to_paths):
        raise Violation(
            f"local_sources skipped a lock whose parse names local sources {parsed.copied} "
            f"(refers to paths: {parsed.refers_to_paths})"
        )


TARGET = Target(
    name="project",
    cases=seeded("project", fresh, _mutate),
    check=check,
    modules=("ray_uv_plugin.env.project",),
    properties=(
        "load_project, pyproject_table, project_name, check_request, check_ray_pin, "
        "locked_sources, local_sources, copied_sources, refers_to_project_path and "
        "config_files each give a value of their declared type or raise ProjectError (a "
        "ValueError) with a message, for any bytes in pyproject.toml and uv.lock and either "
        "being a file, a dir, a symlink or absent",
        "copied_sources returns within 10 s, a FIFO in a source dir included",
        "local_sources skips the parse only of a lock whose parse names no local source",
    ),
)

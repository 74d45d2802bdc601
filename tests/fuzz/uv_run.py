"""A driver's `uv run` command line, its uv env vars and the project it runs in, as the
driver hook reads them (`uv_run.read_uv_run`, `project_discovery`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ray_uv_plugin.driver import uv_run_options
from ray_uv_plugin.driver.uv_run import read_uv_run
from ray_uv_plugin.driver.uv_run_options import UvRunParseError, split_options
from ray_uv_plugin.env.spec import parse_spec
from tests.fuzz.harness import (
    Case,
    Target,
    Violation,
    b64,
    refused_clearly,
    seeded,
    toml_text,
    unb64,
)

DRIVER_PYTHON = "3.11.7"
options = sorted(uv_run_options.TAKES_VALUE) + sorted(uv_run_options.SHORT)
values = st.one_of(
    st.sampled_from(["vllm", "dev", "", " ", "3.11", "3.12", "cpython@3.11.7", "member", "app"]),
    st.sampled_from(["sub", "..", "/", "-x", "--", "=", "a=b", "pkg", "Member", " app "]),
    st.text(st.characters(exclude_characters="\x00"), max_size=6),  # argv holds no NUL
)
word = st.one_of(
    st.sampled_from(options),
    st.builds(lambda o, v: f"{o}={v}", st.sampled_from(options), values),
    st.builds(lambda o, v: f"{o}{v}", st.sampled_from(sorted(uv_run_options.SHORT)), values),
    st.sampled_from(["--", "-", "python", "x.py", "-qqp3.11", "-p=3.11", "--bogus", "-Z"]),
    values,
)
environ = st.dictionaries(
    st.sampled_from(
        sorted(uv_run_options.ENV_FLAGS) + sorted(uv_run_options.ENV_VALUES) + ["UV_OTHER"]
    ),
    st.one_of(st.sampled_from(["1", "true", "0", "", "yes", "3.11", "sub"]), values),
    max_size=3,
)
anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
pyproject = st.fixed_dictionaries(
    {},
    optional={
        "project": st.one_of(
            st.fixed_dictionaries(
                {"name": st.one_of(st.sampled_from(["app", "member"]), anything)}
            ),
            anything,
        ),
        "build-system": anything,
        "tool": st.one_of(
            st.fixed_dictionaries(
                {
                    "uv": st.one_of(
                        st.fixed_dictionaries(
                            {},
                            optional={
                                "package": st.one_of(st.booleans(), anything),
                                "workspace": st.one_of(
                                    st.fixed_dictionaries(
                                        {},
                                        optional={
                                            "members": st.one_of(
                                                st.lists(
                                                    st.sampled_from(
                                                        ["packages/*", "/abs", "", "**", "../x"]
                                                    ),
                                                    max_size=2,
                                                ),
                                                anything,
                                            ),
                                            "exclude": anything,
                                        },
                                    ),
                                    anything,
                                ),
                            },
                        ),
                        anything,
                    )
                }
            ),
            anything,
        ),
    },
).map(lambda doc: b64(toml_text(doc).encode()))
fresh = st.fixed_dictionaries(
    {
        "argv": st.builds(lambda rest: ["uv", "run", *rest], st.lists(word, max_size=8)),
        "environ": environ,
        "root": st.one_of(pyproject, st.binary(max_size=20).map(b64)),
        "member": pyproject,
        "cwd": st.sampled_from(["root", "member", "sub", "outside"]),
    }
)


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    return st.builds(
        lambda at, new: {**seed, "argv": seed["argv"][:at] + new + seed["argv"][at:]},
        st.integers(2, 10),
        st.lists(word, min_size=1, max_size=3),
    )


def _layout(base: Path, case: Case) -> Path:
    """A project (maybe a workspace) with a member in packages/member, and the driver's cwd."""
    root = base / "proj"
    member = root / "packages" / "member"
    (root / "sub").mkdir(parents=True)
    member.mkdir(parents=True)
    (root / "pyproject.toml").write_bytes(unb64(case["root"]))
    (member / "pyproject.toml").write_bytes(unb64(case["member"]))
    (base / "outside").mkdir()
    return {"root": root, "member": member, "sub": root / "sub", "outside": base / "outside"}[
        case["cwd"]
    ]


def check(case: Case) -> None:
    argv = case["argv"]
    try:
        split_options(argv)
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (UvRunParseError,), f"split_options({argv!r})")
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fuzz-uv-run-", dir=shm) as tmp:
        cwd = _layout(Path(tmp), case)
        _check(argv, cwd, case["environ"])


def _check(argv: list[str], cwd: Path, environ: dict[str, Any]) -> None:
    what = f"read_uv_run({argv!r}, environ={environ!r})"
    try:
        driver = read_uv_run(argv, cwd, environ, DRIVER_PYTHON)
    except Exception as e:  # noqa: BLE001 - judged
        raise Violation(f"{what} raised {type(e).__name__}: {e}") from e
    if (driver.value is None) == (driver.unmappable is None):
        raise Violation(f"{what} gave {driver}: a value and a reason, or neither")
    if driver.value is None:
        if not isinstance(driver.warning, str) or not driver.warning:
            raise Violation(f"{what} gave no warning")
        return
    project = driver.value.get("project")
    if not isinstance(project, str) or not os.path.isabs(project):
        raise Violation(f"{what} gave project {project!r}")
    value = {k: v for k, v in driver.value.items() if k != "project"}
    try:
        parse_spec({**value, "job_default": True})
    except ValueError as e:
        raise Violation(
            f"{what} mapped to {driver.value!r}, which every worker's setup refuses: {e}"
        ) from e


TARGET = Target(
    name="uv_run",
    cases=seeded("uv_run", fresh, _mutate),
    check=check,
    modules=(
        "ray_uv_plugin.driver.uv_run",
        "ray_uv_plugin.driver.uv_run_options",
        "ray_uv_plugin.driver.project_discovery",
    ),
    properties=(
        "split_options gives (options, command) or raises UvRunParseError with a message",
        "read_uv_run never raises, whatever the command line, the driver's uv env vars and "
        "the pyproject.toml files of the project and its workspace",
        "it gives a value or the option (with why) that keeps Ray's own uv run, never both",
        "a value it gives names an absolute project and is a uv_project value parse_spec "
        "takes (with job_default, as the hook sends it)",
    ),
)

"""A job's `env_vars` and `build_env_vars` as the build takes them (`uv_env`): which reach uv,
the environment uv runs in, and the settings keyed (`UV_CONFIG_FILE` read by content)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ray_uv_plugin.env import uv_env
from ray_uv_plugin.env.uv_env import (
    CONTROLLED,
    DROPPED,
    INTERPRETER_VARS,
    LINK_MODES,
    LOADER_VARS,
    UvEnvError,
    job_variables,
    keyed_settings,
    sync_environment,
)
from ray_uv_plugin.env.uv_variables import UV_VARIABLES
from tests.fuzz.harness import Case, Target, Violation, bounded, refused_clearly, seeded

BOUND_S = 10.0  # reading one config file takes no longer

known = sorted(
    set(list(UV_VARIABLES)[:40])
    | uv_env.BUILD_VARS
    | INTERPRETER_VARS
    | LOADER_VARS
    | uv_env.NETWORK_VARS
    | set(DROPPED)
    | set(CONTROLLED)
    | {"UV_CONFIG_FILE", "UV_LINK_MODE", "UV_INDEX_X_PASSWORD", "UV_TYPO", "PATH", "HOME"}
    | {"CMAKE_ARGS", "NVCC_THREADS", "XDG_CONFIG_HOME", "MYLIB_FLAVOR", "SECRET"}
)
names = st.one_of(
    st.sampled_from(known),
    st.sampled_from(["", "A=B", "A\x00B", "uv_cache_dir", "1X", "É", "UV_", "UV_INDEX_"]),
    st.text(max_size=8),
)
values = st.one_of(
    st.sampled_from(["1", "", "symlink", "copy", "hardlink", "clone", "$PATH", "${HOME}/x"]),
    st.sampled_from(["$SECRET", "${SECRET}", "a\x00b", "$", "${", "{config}", "{fifo}", "{dir}"]),
    st.sampled_from(["/dev/null", "/nonexistent/uv.toml", "{config}\x00", "~/uv.toml"]),
    st.text(max_size=12),
    st.integers(),
)
env_names = st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True)
fresh = st.fixed_dictionaries(
    {
        "env_vars": st.dictionaries(names, values, max_size=6),
        "build_env_vars": st.lists(st.one_of(st.sampled_from(known), env_names), max_size=3),
        "node_env": st.dictionaries(
            st.one_of(st.sampled_from(known), env_names),
            st.one_of(values.filter(lambda v: isinstance(v, str) and "\x00" not in v)),
            max_size=6,
        ),
        "resolves": st.booleans(),
    }
)


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    return st.builds(
        lambda name, value: {**seed, "env_vars": {**seed["env_vars"], name: value}}, names, values
    )


def _fill(value: Any, where: dict[str, str]) -> Any:
    if not isinstance(value, str):
        return value
    for token, real in where.items():
        value = value.replace(token, real)
    return value


def _bounded(call: Any, what: str) -> Any:
    """("ok", what `call` gave) or ("raised", what it raised); a `Violation` if it hangs."""

    def run() -> Any:
        try:
            return ("ok", call())
        except Exception as e:  # noqa: BLE001 - judged
            return ("raised", e)

    return bounded(run, BOUND_S, what)


def _usable(env: dict[str, str], what: str) -> None:
    """What `subprocess` can start uv with: str names without `=` or NUL, str values without
    NUL."""
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\x00" in name:
            raise Violation(f"{what} holds the name {name!r}, which no process environment can")
        if not isinstance(value, str) or "\x00" in value:
            raise Violation(f"{what} gives {name} the value {value!r}")


def check(case: Case) -> None:
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fuzz-uv-env-", dir=shm) as tmp:
        config, fifo = Path(tmp) / "uv.toml", Path(tmp) / "fifo"
        config.write_text("[pip]\n")
        os.mkfifo(fifo)
        where = {"{config}": str(config), "{fifo}": str(fifo), "{dir}": tmp}
        _check(case, where)


def _check(case: Case, where: dict[str, str]) -> None:
    env_vars = {k: _fill(v, where) for k, v in case["env_vars"].items()}
    node_env = {k: _fill(v, where) for k, v in case["node_env"].items()}
    named = case["build_env_vars"]
    kind, job = _bounded(lambda: job_variables(env_vars, named, node_env), "job_variables")
    if kind == "raised":
        refused_clearly(job, (UvEnvError,), "job_variables")
    else:
        if set(job.passed) & set(job.withheld):
            raise Violation(f"{sorted(set(job.passed) & set(job.withheld))} passed and withheld")
        if not set(job.passed) | set(job.withheld) <= set(env_vars):
            raise Violation("job_variables named a variable the job did not set")
        hooks = set(job.passed) & (INTERPRETER_VARS | LOADER_VARS | set(DROPPED))
        if hooks:
            raise Violation(f"{sorted(hooks)} of the job reach uv")
    kind, env = _bounded(
        lambda: sync_environment(env_vars, node_env, build_env_vars=named), "sync_environment"
    )
    if kind == "raised":
        refused_clearly(env, (UvEnvError,), "sync_environment")
        return
    _usable(env, "sync_environment")
    for name, value in CONTROLLED.items():
        if env.get(name) != value:
            raise Violation(f"sync_environment gives {name}={env.get(name)!r}, not {value!r}")
    if set(env) & (INTERPRETER_VARS | set(DROPPED)):
        raise Violation(f"sync_environment passes {sorted(set(env) & INTERPRETER_VARS)}")
    if env.get("UV_LINK_MODE") not in LINK_MODES:
        raise Violation(f"UV_LINK_MODE={env.get('UV_LINK_MODE')!r}")
    kind, keyed = _bounded(lambda: keyed_settings(env, case["resolves"], named), "keyed_settings")
    if kind == "raised":
        refused_clearly(keyed, (UvEnvError,), "keyed_settings")
        return
    if not all(isinstance(a, str) and isinstance(b, str) for a, b in keyed):
        raise Violation(f"keyed_settings gave {keyed!r}")


TARGET = Target(
    name="uv_env",
    cases=seeded("uv_env", fresh, _mutate),
    check=check,
    modules=("ray_uv_plugin.env.uv_env",),
    properties=(
        "job_variables, sync_environment and keyed_settings each give their value or raise "
        "UvEnvError with a message, within 10 s",
        "no job variable is both passed and withheld, and none of the interpreter's hooks, "
        "loader hooks or the plugin's own reach uv",
        "sync_environment's result can start a process (names without = or NUL, str values "
        "without NUL), holds the plugin's controlled settings and an allowed UV_LINK_MODE",
    ),
)

"""The environment `uv sync` runs in, and what of it shapes the venv.

uv runs in the node's environment (the `ray start` shell's: the operator's, the same for every
job on the node) with a job's `env_vars` over it, but only those of a job's variables that an
allow-list names. A venv is reused by every later job with the same key, so a job's variable
reaches the build only where the key records it or where it cannot change what is installed:

- controlled: the plugin sets it itself, whatever the node or the job says (`CONTROLLED`,
  `DROPPED`, the config dirs); the interpreter's own hooks (`PYTHONPATH`, `PYTHONHOME`...) never
  reach uv, whose bytecode step starts the new venv's Python (`INTERPRETER_VARS`);
- refused: a value that would make a venv that breaks later (`UV_LINK_MODE=symlink`), a `UV_*`
  name uv does not have (a likely typo that would key a venv per value), an interpreter hook
  named in `build_env_vars`, and a job's choice of uv cache (`NODE_CACHE_VARS`: the cache is
  the node's, since uv checks a file's hash when it downloads it, not when it installs it from
  its cache);
- not keyed: it can change where and how packages are fetched, never which files a locked
  install of wheels puts into the venv (`NOT_KEYED`: indexes, network, cache, credentials,
  output; the proxy and TLS variables of `NETWORK_VARS`). Where the lock builds anything from
  source, what decides what that build fetches (`SOURCE_FETCH_VARS`: indexes, proxies, CAs) is
  keyed (`env.source_builds`);
- keyed: every other `UV_*` variable uv has, the build variables of packages built from source
  (`BUILD_VARS`, `BUILD_VAR_PREFIXES`), and whatever the job names in `uv_project.build_env_vars`
  (e.g. `PATH` to pick another compiler, `MYLIB_FLAVOR` for a build hook): name and value are
  part of the venv's key, so a job that sets `CMAKE_ARGS` gets a venv of its own instead of
  changing the one every other job uses. A named variable's value is keyed by its sha256 unless
  it is known to be no secret (`_plain`).

Every other variable of a job (`PYTHONPATH`, `LD_PRELOAD`, `PATH`, a secret...) is for its
workers: Ray sets it for them, and uv never sees it (`JobEnv.withheld` names them for the setup
log). A `$NAME` in a job's value that reaches uv is expanded only for the node's
`EXPANDED_NODE_VARS` (paths, never a credential); any other reference is left as written, so no
secret of the node's environment can be carried into an index URL, a key or a log.

The user's and the system's uv config files (`~/.config/uv/uv.toml`, `/etc/uv/uv.toml`) are
controlled too: uv is pointed at config dirs that hold none. The project's own config
(`[tool.uv]`, a `uv.toml` beside or above it) is keyed by content (`project.config_files`).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ray_uv_plugin.env.uv_cache import NODE_CACHE_DIRS, NODE_CACHE_VARS, cache_refusal
from ray_uv_plugin.env.uv_variables import UV_VARIABLES

# Set by the plugin for every build (UV_PROJECT_ENVIRONMENT is added per venv).
CONTROLLED = {
    "UV_PYTHON_DOWNLOADS": "never",  # the venv uses the node's interpreter, named by --python
    "UV_NO_PROGRESS": "1",
}
# Defaults the node or the job may change (both keyed): the venv is read-only after the build,
# so workers of another user than root could not write `.pyc` files; compile them once, here.
DEFAULTS = {"UV_COMPILE_BYTECODE": "1"}
# Dropped from the node's environment and the job's: the spec and the plugin decide these.
DROPPED = (
    "VIRTUAL_ENV",
    "UV_PROJECT_ENVIRONMENT",
    "UV_PYTHON",
    "UV_LOCKED",
    "UV_FROZEN",
    "UV_NO_SYNC",
)
# What decides which code a Python runs before its first line: uv's bytecode step and every
# build backend start a Python, and what it runs there may write into the new venv. Never
# passed to uv, from the node or the job, and refused in `build_env_vars`.
INTERPRETER_VARS = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONUSERBASE",
        "PYTHONEXECUTABLE",
        "PYTHONSAFEPATH",
        "PYTHONPLATLIBDIR",
    }
)
# Loader hooks: the node's are the operator's (e.g. a jemalloc preload) and reach uv; a job's
# would run its code in uv and in every build, so they are refused in `build_env_vars`.
LOADER_VARS = frozenset({"LD_PRELOAD", "LD_AUDIT"})
LINK_MODES = ("hardlink", "copy", "clone")  # all give the same files; `symlink` is refused
DEFAULT_LINK_MODE = "hardlink"
EMPTY_CONFIG_DIR = Path(__file__).parent / "uv_config"  # holds an empty uv/uv.toml

# Where uv resolves from: no locked install depends on them (every file comes from the URL and
# hash in uv.lock), but `locked: false` resolves with them, and then they are keyed.
RESOLVE_VARS = frozenset(
    {
        "UV_INDEX_URL",
        "UV_EXTRA_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_INDEX",
        "UV_FIND_LINKS",
        "UV_INDEX_STRATEGY",
        "UV_OFFLINE",
    }
)
# Credentials uv reads: passed to uv where set, never keyed (a key is recorded in the marker,
# which `ray-uv list --json` shows), like `UV_INDEX_<NAME>_USERNAME`/`_PASSWORD`.
CREDENTIALS = frozenset(
    {
        "UV_API_KEY",
        "UV_AUTH_TOKEN",
        "UV_GITHUB_TOKEN",
        "UV_PUBLISH_PASSWORD",
        "UV_PUBLISH_TOKEN",
        "UV_PUBLISH_USERNAME",
        "UV_KEYRING_PROVIDER",
        "UV_CREDENTIALS_DIR",
    }
)
NOT_KEYED = (
    RESOLVE_VARS
    | CREDENTIALS
    | frozenset(
        {
            "UV_CACHE_DIR",
            "UV_NO_CACHE",
            "UV_NATIVE_TLS",
            "UV_SYSTEM_CERTS",
            "UV_INSECURE_HOST",
            "UV_HTTP_TIMEOUT",
            "UV_HTTP_CONNECT_TIMEOUT",
            "UV_HTTP_RETRIES",
            "UV_REQUEST_TIMEOUT",
            "UV_CONCURRENT_DOWNLOADS",
            "UV_CONCURRENT_BUILDS",
            "UV_CONCURRENT_INSTALLS",
            "UV_CONCURRENT_CACHE_READS",
            "UV_LINK_MODE",
            "UV_NO_PROGRESS",
            "UV_NO_WRAP",
            "UV_LOG_CONTEXT",
            "UV_HIDE_BUILD_OUTPUT",
            "UV_LOCK_TIMEOUT",
            "UV_PYTHON_INSTALL_DIR",
            "UV_TOOL_DIR",
            "UV_PYTHON_PREFERENCE",
            "UV_PYTHON_DOWNLOADS",
            "UV_RUN_RECURSION_DEPTH",  # set by `uv run` in whatever started Ray
            "UV_INTERNAL__PARENT_INTERPRETER",
        }
    )
)
# Credentials of a named index (`UV_INDEX_<NAME>_USERNAME`/`_PASSWORD`): never in a key.
NOT_KEYED_PREFIXES = ("UV_INDEX_",)
# Where a job's uv finds the network: passed from the job, never keyed (as `NOT_KEYED`).
NETWORK_VARS = frozenset(
    name
    for base in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
    for name in (base, base.lower())
) | frozenset({"SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"})
# What decides what a build from source fetches beyond uv.lock's URLs and hashes (its build
# requirements' indexes, the proxy and CAs of its downloads and a build hook's): keyed where the
# lock builds anything from source (`env.source_builds`), a URL's credentials left out.
SOURCE_FETCH_VARS = (
    RESOLVE_VARS
    | NETWORK_VARS
    | frozenset({"UV_INSECURE_HOST", "UV_NATIVE_TLS", "UV_SYSTEM_CERTS"})
)
# Variables that build backends of packages built from source read (compilers, flags, CUDA,
# versions): keyed where set, by the node or the job. Any other one a build reads is named in
# `uv_project.build_env_vars`.
BUILD_VARS = frozenset(
    {
        "CC",
        "CXX",
        "CPP",
        "LD",
        "AR",
        "CFLAGS",
        "CXXFLAGS",
        "CPPFLAGS",
        "LDFLAGS",
        "MAX_JOBS",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDACXX",
        "TORCH_CUDA_ARCH_LIST",
        "SETUPTOOLS_SCM_PRETEND_VERSION",
    }
)
BUILD_VAR_PREFIXES = (
    "CMAKE_",  # CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_GENERATOR...
    "NVCC_",  # NVCC_APPEND_FLAGS, NVCC_PREPEND_FLAGS, NVCC_THREADS
    "FLASH_ATTENTION_",  # FLASH_ATTENTION_FORCE_BUILD, FLASH_ATTENTION_SKIP_CUDA_BUILD...
    "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_",
)
# The node's variables a job's value may refer to as `$NAME` / `${NAME}`: paths, no secrets.
EXPANDED_NODE_VARS = frozenset(
    {"PATH", "HOME", "USER", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "TMPDIR"}
)
_REFERENCE = re.compile(r"\$(\w+|\{(\w+)\})")
_CREDENTIALS = re.compile(r"://[^/@\s]*@")  # `user:password@` of a URL


class UvEnvError(ValueError):
    """An env var the plugin cannot build with; the message says what to set instead."""


def is_build_var(name: str) -> bool:
    """Whether `name` is a build variable that is keyed wherever it is set."""
    return name in BUILD_VARS or name.startswith(BUILD_VAR_PREFIXES)


def _reaches_uv(name: str) -> bool:
    """Whether a job's variable `name` reaches uv without being named in `build_env_vars`
    (uv's own, a build variable, a network setting); every other one stays the workers'."""
    if name in DROPPED:
        return False
    return name.startswith("UV_") or is_build_var(name) or name in NETWORK_VARS


def check_build_env_vars(names: Iterable[str]) -> None:
    """Refuse names that no build may take from a job, whatever the key says."""
    for name in names:
        if name in NODE_CACHE_VARS or name in NODE_CACHE_DIRS:
            raise UvEnvError(
                cache_refusal(name, "uv_project.build_env_vars names", "build_env_vars")
            )
        if name in INTERPRETER_VARS or name in LOADER_VARS:
            raise UvEnvError(
                f"uv_project.build_env_vars names {name}, which decides what code every Python "
                "of the build runs (uv's bytecode step starts the new venv's Python), so it "
                f"cannot shape a venv that other jobs run. Drop {name!r} from build_env_vars: "
                "the job's workers still get it from env_vars."
            )
        if name in DROPPED or name in CONTROLLED or name.startswith("XDG_CONFIG_"):
            raise UvEnvError(
                f"uv_project.build_env_vars names {name}, which the plugin sets itself for every "
                f"build (the uv_project fields decide it). Drop {name!r} from build_env_vars."
            )


def _expand(value: str, node_env: Mapping[str, str]) -> str:
    """`value` with `$NAME`/`${NAME}` replaced for the node's `EXPANDED_NODE_VARS` alone;
    other references stay as written (a secret of the node never reaches uv through a job)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(2) or match.group(1)
        if name in EXPANDED_NODE_VARS and name in node_env:
            return node_env[name]
        return match.group(0)

    return _REFERENCE.sub(one, value)


@dataclass(frozen=True)
class JobEnv:
    """A job's `env_vars` as the build takes them: `passed` reach uv (expanded), `withheld`
    are the names that stay with the workers alone."""

    passed: dict[str, str]
    withheld: tuple[str, ...]


def job_variables(
    env_vars: Mapping[str, str],
    build_env_vars: Iterable[str] = (),
    node_env: Mapping[str, str] | None = None,
) -> JobEnv:
    """Split a job's `env_vars` into what reaches uv and what stays the workers'; refuses a
    `UV_*` name that uv does not have (a likely typo)."""
    node_env = os.environ if node_env is None else node_env
    named = frozenset(build_env_vars)
    check_build_env_vars(named)
    passed, withheld = {}, []
    for name, value in env_vars.items():
        if name in DROPPED:
            continue
        if name not in named and not _reaches_uv(name):
            withheld.append(name)
            continue
        if name in NODE_CACHE_VARS:
            raise UvEnvError(cache_refusal(name, "uv_project: env_vars sets", "env_vars"))
        if (
            name.startswith("UV_")
            and name not in named
            and name not in UV_VARIABLES
            and not name.startswith(NOT_KEYED_PREFIXES)
        ):
            raise UvEnvError(
                f"uv_project: env_vars sets {name}, which uv does not read (a typo?); each "
                f"value of it would key a venv of its own. Fix or drop {name!r}; if it is a "
                f'setting of a newer uv, add "build_env_vars": ["{name}"] to uv_project, '
                "which passes it to uv and keys it."
            )
        passed[name] = _expand(str(value), node_env)
        if "=" in name or "\x00" in name + passed[name]:
            raise UvEnvError(
                f"uv_project: env_vars sets {name!r} to {str(value)!r}: a name with '=' or a NUL "
                "byte, or a value with a NUL byte, is no environment variable uv can be started "
                f"with. Fix or drop {name!r}."
            )
    return JobEnv(passed, tuple(sorted(withheld)))


def sync_environment(
    extra_env: Mapping[str, str],
    node_env: Mapping[str, str] | None = None,
    build_env_vars: Iterable[str] = (),
) -> dict[str, str]:
    """The node's environment with the job's variables that reach uv over it, as uv will see
    it (less UV_PROJECT_ENVIRONMENT, which names the venv and so comes after the key)."""
    node_env = os.environ if node_env is None else node_env
    job = job_variables(extra_env, build_env_vars, node_env)
    env = {k: v for k, v in node_env.items() if k not in DROPPED and k not in INTERPRETER_VARS}
    env.update(job.passed)
    env.update(CONTROLLED)
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    link_mode = env.setdefault("UV_LINK_MODE", DEFAULT_LINK_MODE)
    if link_mode not in LINK_MODES:
        raise UvEnvError(
            f"uv_project: UV_LINK_MODE={link_mode!r} is not allowed: a venv of symlinks into "
            "the uv cache breaks when the cache is cleaned or belongs to another job. Use one "
            f"of {', '.join(LINK_MODES)} (the default is {DEFAULT_LINK_MODE}), or unset it."
        )
    # No user or system uv.toml: both dirs hold an empty `uv/uv.toml`; without one, uv falls
    # back to /etc/uv/uv.toml.
    env["XDG_CONFIG_HOME"] = env["XDG_CONFIG_DIRS"] = str(EMPTY_CONFIG_DIR)
    return env


def _keyed(name: str, named: frozenset[str], resolves: bool, builds: bool) -> bool:
    if name in named or is_build_var(name):
        return True
    if (resolves and name in RESOLVE_VARS) or (builds and name in SOURCE_FETCH_VARS):
        return True
    if not name.startswith("UV_") or name in NOT_KEYED or name in CONTROLLED:
        return False
    return not name.startswith(NOT_KEYED_PREFIXES)


def keyed_settings(
    env: Mapping[str, str],
    resolves: bool = False,
    build_env_vars: Iterable[str] = (),
    builds_from_source: bool = False,
) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that shape the venv, with their values (a config file named by
    `UV_CONFIG_FILE` by its content); `build_env_vars` are the names a job asked to key.
    `resolves` (`locked: false`) keys the index settings, `builds_from_source` (the lock builds
    something from source) those of `SOURCE_FETCH_VARS`, a URL's credentials left out. A named
    variable that is not `_plain` is keyed by its value's sha256 (`sha256:<hex>`)."""
    named = frozenset(build_env_vars)
    items = []
    for name in sorted(n for n in env if _keyed(n, named, resolves, builds_from_source)):
        value = env[name]
        if name == "UV_CONFIG_FILE":
            value = f"{value} sha256:{_config_digest(value)}"
        elif name in SOURCE_FETCH_VARS and name not in named:
            value = _CREDENTIALS.sub("://***@", value)
        elif name in named and not _plain(name):
            value = f"sha256:{hashlib.sha256(value.encode()).hexdigest()}"
        items.append((name, value))
    return tuple(items)


def _plain(name: str) -> bool:
    """Whether a variable named in `build_env_vars` is keyed by its value as it is: one that is
    keyed without being named (a build variable, a `UV_*` setting) or one of the node's path
    variables (`EXPANDED_NODE_VARS`). Any other is keyed by its value's sha256: it may be a
    secret (a job that names a node's variable without setting it keys the node's value), and
    the key's inputs are in every marker, `ray-uv list --json` and shipped venv."""
    return name in EXPANDED_NODE_VARS or _keyed(name, frozenset(), False, False)


def _config_digest(path: str) -> str:
    """The sha256 of the uv config file `UV_CONFIG_FILE` names. Only a regular file is read: a
    FIFO would block the node's agent until someone writes to it, a device may never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise UvEnvError(
            f"uv_project: UV_CONFIG_FILE={path!r} cannot be read ({why}): point it at a "
            "uv.toml that every node has, or unset it."
        ) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UvEnvError(
            f"uv_project: UV_CONFIG_FILE={path!r} is no regular file: point it at a uv.toml "
            "that every node has, or unset it."
        )
    with open(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

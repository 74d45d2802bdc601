"""`uv run`'s options, as a driver's command line and environment give them: the table of every
option (which select the environment, which change nothing it installs, which it cannot take),
and reading a command line by it (`split_options`, `env_options`). No Ray.

uv's options and whether each takes a value are our own table (checked against `uv run --help`
of uv 0.13.9, hidden negations included); uv stops reading options at the first word that is
not one, which starts the command, as it does at `--`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ray_uv_plugin.env.fields import FIELDS, uv_options
from ray_uv_plugin.settings import boolish

# The options that decide the selection, read by `uv_run._Selection.apply`; value: takes a value.
# The table's fields' (`--extra`, `--no-locked`...; `--no-install-project` is no option of uv
# 0.13.9's `uv run`: mapped if one has it), and `uv run`'s own.
SELECTING = {
    **{option: value is None for option, (_, value) in uv_options().items()},
    "--dev": False,
    "--no-dev": False,
    "--only-dev": False,
    "--no-sync": False,
    "--python": True,
}

# Options that change output, the driver's own start or where uv fetches files, never what a
# sync of the lock installs (the lock names every file's URL and hash). `--directory`: the
# driver already runs there. `--exact`: our venvs hold exactly the selection anyway.
# `--compile-bytecode`: our venvs are compiled at build time anyway.
IGNORED = {
    "--quiet": False,
    "--verbose": False,
    "--color": True,
    "--no-progress": False,
    "--native-tls": False,
    "--no-native-tls": False,
    "--system-certs": False,
    "--no-system-certs": False,
    "--offline": False,
    "--no-offline": False,
    "--cache-dir": True,
    "--no-cache": False,
    "--refresh": False,
    "--no-refresh": False,
    "--refresh-package": True,
    "--allow-insecure-host": True,
    "--keyring-provider": True,
    "--index": True,
    "--default-index": True,
    "--index-url": True,
    "--extra-index-url": True,
    "--find-links": True,
    "--no-index": False,
    "--index-strategy": True,
    "--require-build-hashes": False,
    "--no-require-build-hashes": False,
    "--module": False,
    "--managed-python": False,
    "--no-managed-python": False,
    "--no-python-downloads": False,
    "--allow-python-downloads": False,
    "--python-preference": True,
    "--preview": False,
    "--no-preview": False,
    "--preview-features": True,
    "--show-settings": False,
    "--max-recursion-depth": True,
    "--directory": True,
    "--exact": False,
    "--inexact": False,
    "--no-exact": False,
    "--editable": False,
    "--no-env-file": False,
    "--no-active": False,
    "--compile-bytecode": False,
    "--no-compile-bytecode": False,
    "--no-upgrade": False,
    "--no-reinstall": False,
    "--build": False,
    "--binary": False,
    "--build-isolation": False,
    "--help": False,
}

_NOT_IN_A_LOCK = "adds packages that uv.lock does not hold"
_BUILDS = "changes how uv builds or installs packages, which a sync of uv.lock does not repeat"
_RESOLVES = "changes how uv resolves, which a sync of uv.lock does not repeat"
# Options that may shape the environment in a way a `uv_project` value cannot express.
UNMAPPABLE: dict[str, tuple[bool, str]] = {
    "--with": (True, _NOT_IN_A_LOCK),
    "--with-editable": (True, _NOT_IN_A_LOCK),
    "--with-requirements": (True, _NOT_IN_A_LOCK),
    "--isolated": (False, "runs in a throwaway environment, not the project's"),
    "--no-project": (False, "runs without the project, so there is no uv.lock to sync"),
    "--script": (False, "runs a PEP 723 script, whose dependencies no uv.lock holds"),
    "--gui-script": (False, "runs a PEP 723 script, whose dependencies no uv.lock holds"),
    "--active": (False, "runs in the active virtualenv, not the project's"),
    "--env-file": (True, "loads env vars that may steer uv and the driver"),
    "--all-packages": (False, "installs every workspace member, which uv_project cannot ask"),
    "--no-editable": (False, "installs editables as copies, which uv_project cannot"),
    "--no-editable-package": (True, "installs editables as copies, which uv_project cannot"),
    "--python-platform": (True, "installs for another platform than the node's"),
    "--no-binary": (False, _BUILDS),
    "--no-binary-package": (True, _BUILDS),
    "--no-build": (False, _BUILDS),
    "--no-build-package": (True, _BUILDS),
    "--config-setting": (True, _BUILDS),
    "--config-settings-package": (True, _BUILDS),
    "--no-build-isolation": (False, _BUILDS),
    "--no-build-isolation-package": (True, _BUILDS),
    "--link-mode": (True, _BUILDS),
    "--reinstall": (False, _BUILDS),
    "--reinstall-package": (True, _BUILDS),
    "--upgrade": (False, _RESOLVES),
    "--upgrade-package": (True, _RESOLVES),
    "--upgrade-group": (True, _RESOLVES),
    "--resolution": (True, _RESOLVES),
    "--prerelease": (True, _RESOLVES),
    "--prerelease-package": (True, _RESOLVES),
    "--fork-strategy": (True, _RESOLVES),
    "--exclude-newer": (True, _RESOLVES),
    "--exclude-newer-package": (True, _RESOLVES),
    "--no-sources": (False, _RESOLVES),
    "--no-sources-package": (True, _RESOLVES),
    "--config-file": (True, "reads a uv config the workers' nodes would not read"),
    "--no-config": (False, "skips the uv config the workers' nodes would read"),
}

SHORT = {
    "-q": "--quiet",
    "-v": "--verbose",
    "-n": "--no-cache",
    "-m": "--module",
    "-h": "--help",
    "-p": "--python",
    "-w": "--with",
    "-s": "--script",
    "-i": "--index-url",
    "-f": "--find-links",
    "-U": "--upgrade",
    "-P": "--upgrade-package",
    "-C": "--config-setting",
}

TAKES_VALUE = {
    **SELECTING,
    **IGNORED,
    **{name: takes for name, (takes, _) in UNMAPPABLE.items()},
}

# The driver's env vars that uv reads as these options (a command-line option wins over them).
ENV_FLAGS = {
    "UV_LOCKED": "--locked",
    "UV_FROZEN": "--frozen",
    "UV_NO_SYNC": "--no-sync",
    "UV_NO_DEV": "--no-dev",
    "UV_NO_DEFAULT_GROUPS": "--no-default-groups",
    "UV_ISOLATED": "--isolated",
    "UV_NO_PROJECT": "--no-project",
    "UV_NO_EDITABLE": "--no-editable",
    "UV_NO_SOURCES": "--no-sources",
    "UV_NO_BUILD": "--no-build",
    "UV_NO_BINARY": "--no-binary",
    "UV_NO_BUILD_ISOLATION": "--no-build-isolation",
    "UV_NO_CONFIG": "--no-config",
}
ENV_VALUES = {
    "UV_PROJECT": "--project",
    "UV_PYTHON": "--python",
    "UV_ENV_FILE": "--env-file",
    "UV_CONFIG_FILE": "--config-file",
    "UV_RESOLUTION": "--resolution",
    "UV_PRERELEASE": "--prerelease",
    "UV_EXCLUDE_NEWER": "--exclude-newer",
    "UV_FORK_STRATEGY": "--fork-strategy",
    "UV_LINK_MODE": "--link-mode",
}
# The options whose value names an extra, a group or a package: a blank one names none.
NAMING = tuple(f.uv.split()[0] for f in FIELDS if f.kind in ("names", "name") and f.uv)


class UvRunParseError(ValueError):
    """A `uv run` command line we cannot read: `option` is the word that stopped us."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def split_options(argv: Sequence[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """`uv run [options] command...` -> ([(long option, value)], command). Raises
    UvRunParseError naming an option not in our table."""
    if len(argv) < 2 or os.path.basename(argv[0]) != "uv" or argv[1] != "run":
        raise UvRunParseError(" ".join(argv[:2]), f"not a `uv run` command line: {list(argv)!r}")
    options: list[tuple[str, str | None]] = []
    words = list(argv[2:])
    while words:
        word = words.pop(0)
        if word == "--":
            return options, words
        if not word.startswith("-") or word == "-":
            return options, [word, *words]
        if word.startswith("--"):
            name, eq, inline = word.partition("=")
            if name not in TAKES_VALUE:
                raise UvRunParseError(name, f"`{name}` is not an option of `uv run` that we know")
            if TAKES_VALUE[name]:
                options.append((name, inline if eq else _value(name, words)))
            elif eq:
                raise UvRunParseError(word, f"`{name}` takes no value")
            else:
                options.append((name, None))
            continue
        # Short options, clustered as clap reads them: `-qq`, `-p3.11`, `-p=3.11`, `-qp 3.11`.
        cluster = word[1:]
        while cluster:
            short, cluster = "-" + cluster[0], cluster[1:]
            if short not in SHORT:
                raise UvRunParseError(short, f"`{short}` is not an option of `uv run` that we know")
            name = SHORT[short]
            if TAKES_VALUE[name]:
                value = cluster.removeprefix("=") if cluster else _value(short, words)
                options.append((name, value))
                break
            options.append((name, None))
    return options, []


def _value(name: str, words: list[str]) -> str:
    if not words:
        raise UvRunParseError(name, f"`{name}` needs a value")
    return words.pop(0)


def env_options(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The options the driver's env vars stand for, to be read before the command line's."""
    options: list[tuple[str, str | None]] = []
    for var, name in ENV_FLAGS.items():
        if boolish(environ.get(var)):  # as uv reads a boolean env var
            options.append((name, None))
    for var, name in ENV_VALUES.items():
        if environ.get(var):
            options.append((name, environ[var]))
    return options

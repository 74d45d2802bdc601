"""The `uv_project` fields, declared once: name, type, default, uv flag, `ray-uv` flag, whether
and how the venv's key records it, and one line of doc. Standard library only (the schema is made
from it where importing Ray or `packaging` would cost).

What comes from this table: `ParsedUvProject` (its fields, `sync_args`, `selection`) and
`parse_spec`'s type checks (`spec.py`), `UvProject` (`registration.py`), the JSON schema Ray
checks drivers' values with (`schema.py`), the `ray-uv prepare` / `check` selection flags, the
`uv run` hook's reading of uv's options (`uv_options`), and the README's field table.

    uv run python -m ray_uv_plugin.env.fields README.md   # rewrite the README's table
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["path", "name", "names", "env_names", "bool"]


@dataclass(frozen=True)
class Field:
    """One `uv_project` field."""

    name: str
    kind: Kind  # path, name: a str; names: extras/groups; env_names: env var names; bool
    default: Any
    doc: str  # one line, markdown: the README's meaning and the schema's description
    uv: str | None = None  # the `uv sync` / `uv run` option, with its metavar: `--extra X`
    cli: str | None = None  # the `ray-uv prepare` / `check` option; None: not one of theirs
    keyed: bool = True  # whether the venv's key records it (`ParsedUvProject.selection`)
    # Whether every key records it, default or not: the fields of the first keys. The others
    # appear only when set, so that the venvs of values without them keep their keys.
    key_always: bool = False
    default_label: str | None = None  # the README's default, where not the value's own
    uv_when: bool = True  # a bool field: the value with which uv gets `uv` (True: when set)
    uv_unless: str | None = None  # a bool field whose `uv` flag another field's own replaces
    uv_no: bool = False  # a bool field: uv also takes `--no-<flag>`, which sets the other value

    @property
    def is_list(self) -> bool:
        return self.kind in ("names", "env_names")

    @property
    def type_label(self) -> str:
        return {"path": "str", "name": "str", "bool": "bool"}.get(self.kind, "list[str]")

    @property
    def uv_flag(self) -> str | None:
        """The uv option alone, without its metavar: `--extra`."""
        return self.uv.split()[0] if self.uv else None

    @property
    def flag(self) -> str | None:
        """The `ray-uv` option alone, without its metavar: `--extra`."""
        return self.cli.split()[0] if self.cli else None

    @property
    def metavar(self) -> str | None:
        parts = (self.cli or "").split()
        return parts[1] if len(parts) > 1 else None


FIELDS: tuple[Field, ...] = (
    Field(
        "project",
        "path",
        None,
        "Directory holding `pyproject.toml` and `uv.lock`, as seen on the node; a relative "
        "path is relative to the `working_dir`.",
        uv="--project DIR",
        keyed=False,  # its files are keyed, by content; its path only where the venv points in
        default_label="the job's or actor's `working_dir`",
    ),
    Field(
        "extras",
        "names",
        (),
        "Extras to install, from `[project.optional-dependencies]`.",
        uv="--extra X",
        cli="--extra X",
        key_always=True,
    ),
    Field(
        "all_extras",
        "bool",
        False,
        "Install every extra; not with a non-empty `extras`.",
        uv="--all-extras",
        cli="--all-extras",
        key_always=True,
        uv_no=True,
    ),
    Field(
        "no_extras",
        "names",
        (),
        "Extras to leave out, over `extras` and `all_extras`.",
        uv="--no-extra X",
        cli="--no-extra X",
    ),
    Field(
        "groups",
        "names",
        (),
        "Dependency groups to install, from `[dependency-groups]`.",
        uv="--group G",
        cli="--group G",
        key_always=True,
    ),
    Field(
        "no_default_groups",
        "bool",
        False,
        "Skip uv's default groups (uv installs the `dev` group by default).",
        uv="--no-default-groups",
        cli="--no-default-groups",
        key_always=True,
    ),
    Field(
        "all_groups",
        "bool",
        False,
        "Install every dependency group; `no_groups` still leaves some out.",
        uv="--all-groups",
        cli="--all-groups",
    ),
    Field(
        "only_groups",
        "names",
        (),
        "Install only these groups, without the project's dependencies (implies "
        "`no_default_groups`); not with `groups` or `all_groups`.",
        uv="--only-group G",
        cli="--only-group G",
    ),
    Field(
        "no_groups",
        "names",
        (),
        'Groups to leave out, over default groups, `groups` and `all_groups` (`["dev"]` is '
        "`uv run --no-dev`).",
        uv="--no-group G",
        cli="--no-group G",
    ),
    Field(
        "package",
        "name",
        None,
        "The workspace member to install; `project` is then the workspace root, which holds "
        "`uv.lock`.",
        uv="--package P",
        cli="--package P",
        default_label="none",
    ),
    Field(
        "locked",
        "bool",
        True,
        "Fail if `uv.lock` is out of date with `pyproject.toml`; `false`: uv may re-lock, in a "
        "private copy of `pyproject.toml` and `uv.lock` (never in your project), refused for "
        "locks with path sources. Exclusive with `frozen`.",
        uv="--locked",
        cli="--no-locked",
        key_always=True,
        uv_unless="frozen",  # `--frozen` uses the lock as it is: no `--locked` beside it
        uv_no=True,
    ),
    Field(
        "frozen",
        "bool",
        False,
        "Use `uv.lock` as it is, without checking it against `pyproject.toml`; exclusive with "
        "`locked: true`.",
        uv="--frozen",
        cli="--frozen",
        key_always=True,
        uv_no=True,
    ),
    Field(
        "install_project",
        "bool",
        False,
        "Install the project itself (editable).",
        uv="--no-install-project",
        uv_when=False,
        cli="--install-project",
        key_always=True,
    ),
    Field(
        "build_env_vars",
        "env_names",
        (),
        "Names of the job's `env_vars` that the build takes and the key records (a build "
        "hook's `MYLIB_FLAVOR`, `FLASH_ATTENTION_FORCE_BUILD`, `PATH` to pick another "
        "compiler); the job's other variables are its workers' alone. `PYTHONPATH`, "
        "`PYTHONHOME` and `LD_PRELOAD` are refused, and so is what moves uv's cache "
        "(`UV_CACHE_DIR`, `HOME`...: the node's).",
    ),
    Field(
        "from_image",
        "names",
        (),
        "Packages the node's Python (the image) provides, such as `torch`: the venv sees its "
        "site-packages and installs neither them nor what only they need in `uv.lock`; the "
        "key records their installed versions, and the build checks them "
        "([docs/image_packages.md](docs/image_packages.md)). Not with `locked: false`.",
        cli="--from-image P",
    ),
    Field(
        "job_default",
        "bool",
        False,
        "Set by the `uv run` driver hook on the job's value: it steps aside for an actor or "
        'task that sets its own `py_executable` (even `""`), `pip`, `uv` or `conda`. Not '
        "part of the key.",
        keyed=False,
    ),
)

BY_NAME = {f.name: f for f in FIELDS}
NAMES = tuple(f.name for f in FIELDS)
# The fields that `ray-uv prepare` and `check` take as flags: every one that selects packages.
SELECTION = tuple(f for f in FIELDS if f.cli)


def uv_options(table: tuple[Field, ...] = FIELDS) -> dict[str, tuple[Field, bool | None]]:
    """uv's options that set a field, as `uv sync` and `uv run` take them: option -> (the
    field, the value a flag sets, or None for an option that takes one). A bool field's flag
    has its negation too (`--no-locked`, `--no-all-extras`), where uv has one (`uv_no`)."""
    options: dict[str, tuple[Field, bool | None]] = {}
    for f in table:
        if f.uv_flag is None:
            continue
        if f.kind != "bool":
            options[f.uv_flag] = (f, None)
            continue
        options[f.uv_flag] = (f, f.uv_when)
        if f.uv_no:
            options["--no-" + f.uv_flag[2:]] = (f, not f.uv_when)
    return options


def _default_label(f: Field) -> str:
    if f.default_label is not None:
        return f.default_label
    if f.is_list:
        return "`[]`"
    return "true" if f.default else "false"


def readme_table() -> list[str]:
    """The README's field table, as markdown lines."""
    lines = [
        "| field | type | default | uv option | `ray-uv prepare`/`check` | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in FIELDS:
        uv = f"`{f.uv}`{'' if f.uv_when else ' if false'}" if f.uv else "-"
        cli = f"`{f.cli}`" if f.cli else "-"
        lines.append(
            f"| `{f.name}` | {f.type_label} | {_default_label(f)} | {uv} | {cli} | {f.doc} |"
        )
    return lines


TABLE_BEGIN = "<!-- uv_project fields: made by `uv run python -m ray_uv_plugin.env.fields "
TABLE_END = "<!-- end of the uv_project fields -->"


def table_in(text: str) -> list[str]:
    """The lines between the README's table markers (what `readme_table` must equal)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_BEGIN))
    end = lines.index(TABLE_END)
    return lines[start + 1 : end]


def _rewrite_table(text: str) -> str:
    """`text` (a README) with the lines between the markers made from `FIELDS`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_BEGIN))
    end = lines.index(TABLE_END)
    return "\n".join([*lines[: start + 1], *readme_table(), *lines[end:]]) + "\n"


if __name__ == "__main__":  # a developer's command, in the checkout: the README is no package file
    readme = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    readme.write_text(_rewrite_table(readme.read_text()))

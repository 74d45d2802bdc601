"""The `uv_project` runtime_env value: parsed once, at the edge, into a frozen `ParsedUvProject`."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from packaging.utils import canonicalize_name

from ray_uv_plugin.env.fields import BY_NAME, FIELDS, Field
from ray_uv_plugin.env.uv_env import check_build_env_vars
from ray_uv_plugin.settings import OWN_CHOICE_FIELDS

FIELD = "uv_project"


class UvProjectSpecError(ValueError):
    """A `uv_project` value that cannot be used; the message says which part and how to fix it."""


class UvProjectTypeError(UvProjectSpecError, TypeError):
    """A `uv_project` field of the wrong type."""


class ParsedValue:
    """What a worker asks for: which project, and which of its extras and groups; the
    `uv_project` value as `parse_spec` checked it (a user writes it as a dict or `UvProject`).

    Its fields are the table's (`fields.FIELDS`, each dataclass field's metadata["field"]), and
    so are its uv flags and its part of the key: `ParsedUvProject` is this made from the table.
    """

    TABLE: ClassVar[tuple[Field, ...]]

    @property
    def resolves(self) -> bool:
        """Whether uv resolves anew (neither `--locked` nor `--frozen`): the index settings then
        shape the venv (they are keyed), and the build re-locks in a scratch copy."""
        return not (self.locked or self.frozen)

    def sync_args(self) -> list[str]:
        """The `uv sync` flags that select exactly this environment (`project` is where uv
        runs: the build's `--project`)."""
        args: list[str] = []
        for f in self.TABLE:
            value = getattr(self, f.name)
            if f.uv_flag is None or f.kind == "path":
                continue
            if f.kind == "bool":
                if value == f.uv_when and not (f.uv_unless and getattr(self, f.uv_unless)):
                    args.append(f.uv_flag)
            elif f.kind == "name":
                if value is not None:
                    args += [f.uv_flag, value]
            else:
                for name in value:
                    args += [f.uv_flag, name]
        return args

    def selection(self) -> dict[str, Any]:
        """What selects the packages, normalised (`Fig` and `fig` are one extra): for the key.

        The fields keyed from the start appear always, the others only when set, so the venvs
        of values without them keep their keys.
        """
        keyed = [f for f in self.TABLE if f.keyed]
        selection = {f.name: _keyed(f, getattr(self, f.name)) for f in keyed if f.key_always}
        added = {f.name: _keyed(f, getattr(self, f.name)) for f in keyed if not f.key_always}
        selection.update({name: value for name, value in added.items() if value})
        return selection

    def as_value(self) -> dict[str, Any]:
        """The `uv_project` value that parses to this one, as a runtime_env holds it (JSON):
        the fields that differ from their defaults, lists as lists."""
        value: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            given = getattr(self, f.name)
            if given != f.default:
                value[f.name] = list(given) if isinstance(given, tuple) else given
        return value

    def describe(self) -> str:
        """A short human label: `extras=vllm groups=-` for logs and `ray-uv list`."""
        extras, groups = self.extras, self.groups
        only, package = self.only_groups, self.package
        extras = "all" if self.all_extras else (",".join(extras) or "-")
        groups = ",".join(only or groups) or ("all" if self.all_groups else "-")
        label = f"extras={extras} groups={'only:' if only else ''}{groups}"
        return label + (f" package={package}" if package else "")


def _keyed(f: Field, value: Any) -> Any:
    """A field's value as the key records it: names normalised and sorted."""
    if f.kind == "names":
        return _canonical(value)
    if f.kind == "env_names":
        return list(value)
    if f.kind == "name":
        return canonicalize_name(value) if value else None
    return value


def _canonical(names: tuple[str, ...]) -> list[str]:
    return sorted(canonicalize_name(name) for name in names)


_TYPES = {"path": "str | None", "name": "str | None", "bool": "bool"}


def value_class(table: tuple[Field, ...], name: str = "ParsedUvProject") -> type[ParsedValue]:
    """The frozen dataclass of a table's fields, each with its default and, as metadata, its
    `Field`; `ParsedUvProject` is the one of `FIELDS`."""
    return dataclasses.make_dataclass(
        name,
        [
            (
                f.name,
                _TYPES.get(f.kind, "tuple[str, ...]"),
                dataclasses.field(
                    default=tuple(f.default) if f.is_list else f.default,
                    metadata={"field": f},
                ),
            )
            for f in table
        ],
        bases=(ParsedValue,),
        namespace={"TABLE": table, "__doc__": ParsedValue.__doc__, "__module__": __name__},
        frozen=True,
    )


ParsedUvProject = value_class(FIELDS)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ParsedUvProject))


def _names(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UvProjectTypeError(
            f"uv_project.{field} must be a list of strings, got {type(value).__name__} "
            f"{value!r}; e.g. {{'{field}': ['name']}}."
        )
    names: dict[str, str] = {}  # normalised -> as given, which error messages show
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise UvProjectTypeError(
                f"uv_project.{field} must hold non-empty strings, got {item!r}."
            )
        names.setdefault(canonicalize_name(item), item.strip())
    return tuple(names[name] for name in sorted(names))


def _env_names(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UvProjectTypeError(
            f"uv_project.{field} must be a list of env var names, got "
            f"{type(value).__name__} {value!r}; e.g. {{'{field}': ['CMAKE_ARGS']}}."
        )
    for item in value:
        if not isinstance(item, str) or not _ENV_NAME.fullmatch(item):
            raise UvProjectTypeError(
                f"uv_project.{field} must hold env var names (letters, digits, _), got {item!r}."
            )
    check_build_env_vars(value)
    return tuple(sorted(set(value)))


def _path(field: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise UvProjectTypeError(
            f"uv_project.{field} must be a directory path (str), got {value!r}."
        )
    return value


def _name(field: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise UvProjectTypeError(
            f"uv_project.{field} must be the name of a workspace member (str), got {value!r}."
        )
    return None if value is None else value.strip()


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UvProjectTypeError(f"uv_project.{field} must be true or false, got {value!r}.")
    return value


# How `parse_spec` checks a field of each kind, and the value it keeps (None: the default).
_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "path": _path,
    "name": _name,
    "names": _names,
    "env_names": _env_names,
    "bool": _bool,
}


def _with_guess(name: Any) -> str:
    """An unknown field as the user wrote it, with the field it is closest to: a typo
    (`extra`, `group`, `lock`) is the usual cause."""
    close = difflib.get_close_matches(str(name), FIELD_NAMES, n=1, cutoff=0.6)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def _check_field_names(names: Iterable[Any]) -> None:
    """Refuse names that are no `uv_project` field, each with the field it is closest to."""
    unknown = sorted(set(names) - set(FIELD_NAMES), key=str)
    if unknown:
        raise UvProjectTypeError(
            f"uv_project has unknown field(s) {', '.join(map(_with_guess, unknown))}; "
            f"the fields are {', '.join(FIELD_NAMES)}."
        )


def parse_spec(value: Any) -> ParsedUvProject:
    """Check a user's `uv_project` value and turn it into a `ParsedUvProject`."""
    if isinstance(value, ParsedUvProject):
        return value
    if not isinstance(value, dict):
        raise UvProjectTypeError(
            f"uv_project must be a dict such as {{'extras': ['vllm']}} (or {{}} for the "
            f"project's default environment), got {type(value).__name__} {value!r}."
        )
    _check_field_names(value)
    kwargs = {f.name: _PARSERS[f.kind](f.name, value[f.name]) for f in FIELDS if f.name in value}
    kwargs = {name: given for name, given in kwargs.items() if given is not None}
    if kwargs.get("frozen"):
        if kwargs.get("locked"):
            raise UvProjectSpecError(
                "uv_project: 'locked' and 'frozen' are exclusive: 'locked' fails when uv.lock "
                "is out of date, 'frozen' uses it as it is. Set only one of them."
            )
        kwargs["locked"] = False
    if kwargs.get("all_extras") and kwargs.get("extras"):
        raise UvProjectSpecError(
            "uv_project: 'all_extras' already installs every extra; drop 'extras' or set "
            "'all_extras' to false."
        )
    if kwargs.get("only_groups") and (kwargs.get("groups") or kwargs.get("all_groups")):
        raise UvProjectSpecError(
            "uv_project: 'only_groups' installs just those groups (not the project's "
            "dependencies); it cannot go with 'groups' or 'all_groups'. Put every group you "
            "want into 'only_groups', or drop it."
        )
    if kwargs.get("from_image") and not (kwargs.get("frozen") or kwargs.get("locked", True)):
        raise UvProjectSpecError(
            "uv_project: 'from_image' leaves packages out by what uv.lock says only they need, "
            "so it needs the lock as it is: drop 'locked: false' (run `uv lock` instead), or "
            "drop 'from_image'."
        )
    return ParsedUvProject(**kwargs)


def keyword_value(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The `uv_project` value of keywords as `UvProject` takes them (one per field): those
    given other than as "not given", as given (lists as lists), checked by `parse_spec`."""
    _check_field_names(fields)  # a typo is told its field, not just "unexpected keyword"
    value = {name: given for name, given in fields.items() if not _left_out(name, given)}
    parse_spec(value)
    return {k: list(v) if BY_NAME[k].is_list else v for k, v in value.items()}


def _left_out(name: str, given: Any) -> bool:
    """Whether a keyword is the field's "not given": an empty list, False for a flag that is
    off by default, None otherwise (`locked=None`: the table's default then holds). What is
    left in is checked as the dict's own value: a str is no list of names (`extras="table"`
    must not become ['t', 'a', 'b', 'l', 'e']), and `all_extras=[]` is no `False`."""
    f = BY_NAME[name]
    if f.is_list:
        return isinstance(given, (list, tuple)) and not given
    return given is (False if f.default is False else None)


def keyword_default(f: Field) -> Any:
    """A field's keyword's default in `UvProject` (and `prepare_env`): "not given"."""
    return () if f.is_list else (False if f.default is False else None)


# Other runtime_env fields that also decide the worker's Python or packages, and what to do.
_CONFLICTS = {
    "pip": "add the packages to the project instead (`uv add ...`, then `uv lock`)",
    "uv": "add the packages to the project instead (`uv add ...`, then `uv lock`)",
    "conda": "put the conda packages' PyPI equivalents into the project, or drop uv_project",
}


def is_uv_run_interpreter(py_executable: str) -> bool:
    """Whether a `py_executable` is `uv run ...`, as Ray's `uv run` driver hook sets it; a
    `uv_project` env replaces that interpreter with its venv's. Read as a shell would, so a
    quoted path holding spaces is one word."""
    try:
        words = shlex.split(py_executable)
    except ValueError:  # an unbalanced quote: not a command line Ray could run either
        return False
    return len(words) >= 2 and os.path.basename(words[0]) == "uv" and words[1] == "run"


def yields_to(spec: ParsedUvProject, runtime_env: Mapping[str, Any]) -> str | None:
    """The field for which a job-default `uv_project` (the `uv run` driver hook's) steps aside,
    or None. A `py_executable` counts even when empty: `{"py_executable": ""}` is how the
    plugin's own shipping actors and helper tasks ask for the node's Ray Python."""
    if not spec.job_default:
        return None
    for field in OWN_CHOICE_FIELDS:
        value = runtime_env.get(field)
        if field != "py_executable":
            if value:
                return field
        elif value is not None and not is_uv_run_interpreter(value):
            return field  # Ray's own `uv run` hook's interpreter is the one the default replaces
    return None


def check_siblings(runtime_env: Mapping[str, Any]) -> None:
    """Refuse the runtime_env fields that would fight `uv_project` over the worker's Python."""
    for field, instead in _CONFLICTS.items():
        if runtime_env.get(field):
            raise UvProjectSpecError(
                f"uv_project cannot be combined with runtime_env '{field}': both decide which "
                f"packages the worker runs with. Keep uv_project and {instead}; or keep "
                f"'{field}' and drop uv_project."
            )
    py_executable = runtime_env.get("py_executable")
    if py_executable and not is_uv_run_interpreter(py_executable):
        raise UvProjectSpecError(
            f"uv_project cannot be combined with runtime_env 'py_executable' "
            f"({py_executable!r}): uv_project runs the worker with its venv's python. Drop "
            "py_executable (a `uv run ...` one, as Ray's uv run driver hook sets, is replaced "
            "by uv_project), or drop uv_project."
        )

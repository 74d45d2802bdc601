"""The `uv_project` runtime_env value: parsed once, at the edge, into a frozen `ParsedUvProject`."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from packaging.utils import canonicalize_name

from ray_uv_plugin.agent.fields import FIELDS
from ray_uv_plugin.agent.uv_env import check_build_env_vars

FIELD = "uv_project"


class UvProjectSpecError(ValueError):
    """A `uv_project` value that cannot be used; the message says which part and how to fix it."""


class UvProjectTypeError(UvProjectSpecError, TypeError):
    """A `uv_project` field of the wrong type."""


@dataclass(frozen=True)
class ParsedUvProject:
    """What a worker asks for: which project, and which of its extras and groups; the
    `uv_project` value as `parse_spec` checked it (a user writes it as a dict or `UvProject`)."""

    project: str | None = None
    extras: tuple[str, ...] = ()
    all_extras: bool = False
    no_extras: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    no_default_groups: bool = False
    all_groups: bool = False
    only_groups: tuple[str, ...] = ()
    no_groups: tuple[str, ...] = ()
    package: str | None = None
    locked: bool = True
    frozen: bool = False
    install_project: bool = False
    # Packages the node's Python provides (`agent.image`): not installed, checked, keyed.
    from_image: tuple[str, ...] = ()
    # Names of the job's env_vars that the build takes, and so the key (`uv_env`): a build
    # variable no list knows (`MYLIB_FLAVOR`), or `PATH` to pick another compiler.
    build_env_vars: tuple[str, ...] = ()
    # Set by the `uv run` driver hook on the job's value; it yields to an actor's own choice of
    # interpreter (see `yields_to`). Not part of the key: it changes no package.
    job_default: bool = False

    @property
    def resolves(self) -> bool:
        """Whether uv resolves anew (neither `--locked` nor `--frozen`): the index settings then
        shape the venv (they are keyed), and the build re-locks in a scratch copy."""
        return not (self.locked or self.frozen)

    def sync_args(self) -> list[str]:
        """The `uv sync` flags that select exactly this environment."""
        args = ["--frozen"] if self.frozen else (["--locked"] if self.locked else [])
        if self.package is not None:
            args += ["--package", self.package]
        for flag, names in (
            ("--extra", self.extras),
            ("--no-extra", self.no_extras),
            ("--group", self.groups),
            ("--only-group", self.only_groups),
            ("--no-group", self.no_groups),
        ):
            for name in names:
                args += [flag, name]
        for flag, on in (
            ("--all-extras", self.all_extras),
            ("--all-groups", self.all_groups),
            ("--no-default-groups", self.no_default_groups),
            ("--no-install-project", not self.install_project),
        ):
            if on:
                args.append(flag)
        return args

    def selection(self) -> dict[str, Any]:
        """What selects the packages, normalised (`Fig` and `fig` are one extra): for the key.

        The fields added for `uv run` drivers appear only when set, so the venvs of
        values without them keep their keys.
        """
        selection: dict[str, Any] = {
            "extras": _canonical(self.extras),
            "all_extras": self.all_extras,
            "groups": _canonical(self.groups),
            "no_default_groups": self.no_default_groups,
            "locked": self.locked,
            "frozen": self.frozen,
            "install_project": self.install_project,
        }
        added = {
            "no_extras": _canonical(self.no_extras),
            "all_groups": self.all_groups,
            "only_groups": _canonical(self.only_groups),
            "no_groups": _canonical(self.no_groups),
            "package": canonicalize_name(self.package) if self.package else None,
            "build_env_vars": list(self.build_env_vars),
            "from_image": _canonical(self.from_image),
        }
        selection.update({name: value for name, value in added.items() if value})
        return selection

    def describe(self) -> str:
        """A short human label: `extras=vllm groups=-` for logs and `ray-uv list`."""
        extras = "all" if self.all_extras else (",".join(self.extras) or "-")
        groups = ",".join(self.only_groups or self.groups) or ("all" if self.all_groups else "-")
        label = f"extras={extras} groups={'only:' if self.only_groups else ''}{groups}"
        return label + (f" package={self.package}" if self.package else "")


def _canonical(names: tuple[str, ...]) -> list[str]:
    return sorted(canonicalize_name(name) for name in names)


_BOOL_FIELDS = tuple(f.name for f in FIELDS if f.kind == "bool")
_LIST_FIELDS = tuple(f.name for f in FIELDS if f.kind == "names")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FIELD_NAMES = tuple(f.name for f in fields(ParsedUvProject))


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


def _env_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UvProjectTypeError(
            "uv_project.build_env_vars must be a list of env var names, got "
            f"{type(value).__name__} {value!r}; e.g. {{'build_env_vars': ['CMAKE_ARGS']}}."
        )
    for item in value:
        if not isinstance(item, str) or not _ENV_NAME.fullmatch(item):
            raise UvProjectTypeError(
                f"uv_project.build_env_vars must hold env var names (letters, digits, _), got "
                f"{item!r}."
            )
    check_build_env_vars(value)
    return tuple(sorted(set(value)))


def _with_guess(name: Any) -> str:
    """An unknown field as the user wrote it, with the field it is closest to: a typo
    (`extra`, `group`, `lock`) is the usual cause."""
    close = difflib.get_close_matches(str(name), FIELD_NAMES, n=1, cutoff=0.6)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def check_field_names(names: Iterable[Any]) -> None:
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
    check_field_names(value)
    kwargs: dict[str, Any] = {}
    project = value.get("project")
    if project is not None:
        if not isinstance(project, str) or not project:
            raise UvProjectTypeError(
                f"uv_project.project must be a directory path (str), got {project!r}."
            )
        kwargs["project"] = project
    package = value.get("package")
    if package is not None:
        if not isinstance(package, str) or not package.strip():
            raise UvProjectTypeError(
                f"uv_project.package must be the name of a workspace member (str), got {package!r}."
            )
        kwargs["package"] = package.strip()
    for name in _LIST_FIELDS:
        if name in value:
            kwargs[name] = _names(name, value[name])
    if "build_env_vars" in value:
        kwargs["build_env_vars"] = _env_names(value["build_env_vars"])
    for name in _BOOL_FIELDS:
        if name in value:
            if not isinstance(value[name], bool):
                raise UvProjectTypeError(
                    f"uv_project.{name} must be true or false, got {value[name]!r}."
                )
            kwargs[name] = value[name]
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


# What an actor or task sets to choose its own interpreter or packages. Ray merges its
# runtime_env over the job's field by field, so it also inherits the job's `uv_project`.
OWN_CHOICE_FIELDS = ("py_executable", "pip", "uv", "conda")


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


class UvProject(dict):
    """A typed builder of the `uv_project` value: `runtime_env={"uv_project": UvProject(...)}`.

    It is a plain dict (Ray serializes runtime_envs as JSON), checked when it is made, holding
    only the fields that differ from the defaults. The plugin reads it as a `ParsedUvProject`.
    """

    def __init__(
        self,
        *,
        project: str | None = None,
        extras: list[str] | tuple[str, ...] = (),
        all_extras: bool = False,
        no_extras: list[str] | tuple[str, ...] = (),
        groups: list[str] | tuple[str, ...] = (),
        no_default_groups: bool = False,
        all_groups: bool = False,
        only_groups: list[str] | tuple[str, ...] = (),
        no_groups: list[str] | tuple[str, ...] = (),
        package: str | None = None,
        locked: bool | None = None,
        frozen: bool = False,
        install_project: bool = False,
        from_image: list[str] | tuple[str, ...] = (),
        build_env_vars: list[str] | tuple[str, ...] = (),
        job_default: bool = False,
    ) -> None:
        value: dict[str, Any] = {}
        for name, given in (("project", project), ("package", package)):
            if given is not None:
                value[name] = given
        lists = {
            "extras": extras,
            "no_extras": no_extras,
            "groups": groups,
            "only_groups": only_groups,
            "no_groups": no_groups,
            "from_image": from_image,
            "build_env_vars": build_env_vars,
        }
        # As given, for the dict's own check (`_names`): a string is no list of names, and
        # `extras="table"` must not become ['t', 'a', 'b', 'l', 'e']. Empty lists: the default.
        value.update({name: names for name, names in lists.items() if not _is_empty_list(names)})
        if locked is not None:
            value["locked"] = locked
        flags = {
            "all_extras": all_extras,
            "no_default_groups": no_default_groups,
            "all_groups": all_groups,
            "frozen": frozen,
            "install_project": install_project,
            "job_default": job_default,
        }
        # Only the default is left out: `all_extras=[]` is no `False`, and parse_spec says so.
        value.update({name: flag for name, flag in flags.items() if flag is not False})
        parse_spec(value)
        super().__init__({k: list(v) if k in _LIST_FIELDS else v for k, v in value.items()})


def _is_empty_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not value

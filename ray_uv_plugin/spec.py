"""The `uv_project` runtime_env value: parsed once, at the edge, into a frozen `UvProjectSpec`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from packaging.utils import canonicalize_name

FIELD = "uv_project"


class UvProjectSpecError(ValueError):
    """A `uv_project` value that cannot be used; the message says which part and how to fix it."""


class UvProjectTypeError(UvProjectSpecError, TypeError):
    """A `uv_project` field of the wrong type."""


@dataclass(frozen=True)
class UvProjectSpec:
    """What a worker asks for: which project, and which of its extras and groups."""

    project: str | None = None
    extras: tuple[str, ...] = ()
    all_extras: bool = False
    groups: tuple[str, ...] = ()
    no_default_groups: bool = False
    locked: bool = True
    frozen: bool = False
    install_project: bool = False

    def sync_args(self) -> list[str]:
        """The `uv sync` flags that select exactly this environment."""
        args = ["--frozen"] if self.frozen else (["--locked"] if self.locked else [])
        for extra in self.extras:
            args += ["--extra", extra]
        if self.all_extras:
            args.append("--all-extras")
        for group in self.groups:
            args += ["--group", group]
        if self.no_default_groups:
            args.append("--no-default-groups")
        if not self.install_project:
            args.append("--no-install-project")
        return args

    def selection(self) -> dict[str, Any]:
        """What selects the packages, normalised (`Fig` and `fig` are one extra): for the key."""
        return {
            "extras": sorted(canonicalize_name(e) for e in self.extras),
            "all_extras": self.all_extras,
            "groups": sorted(canonicalize_name(g) for g in self.groups),
            "no_default_groups": self.no_default_groups,
            "locked": self.locked,
            "frozen": self.frozen,
            "install_project": self.install_project,
        }

    def describe(self) -> str:
        """A short human label: `extras=vllm groups=-` for logs and `ray-uv list`."""
        extras = "all" if self.all_extras else (",".join(self.extras) or "-")
        return f"extras={extras} groups={','.join(self.groups) or '-'}"


_BOOL_FIELDS = ("all_extras", "no_default_groups", "locked", "frozen", "install_project")
_LIST_FIELDS = ("extras", "groups")
FIELD_NAMES = tuple(f.name for f in fields(UvProjectSpec))


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


def parse_spec(value: Any) -> UvProjectSpec:
    """Check a user's `uv_project` value and turn it into a `UvProjectSpec`."""
    if isinstance(value, UvProjectSpec):
        return value
    if not isinstance(value, dict):
        raise UvProjectTypeError(
            f"uv_project must be a dict such as {{'extras': ['vllm']}} (or {{}} for the "
            f"project's default environment), got {type(value).__name__} {value!r}."
        )
    unknown = sorted(set(value) - set(FIELD_NAMES))
    if unknown:
        raise UvProjectSpecError(
            f"uv_project has unknown field(s) {', '.join(map(repr, unknown))}; "
            f"the fields are {', '.join(FIELD_NAMES)}."
        )
    kwargs: dict[str, Any] = {}
    project = value.get("project")
    if project is not None:
        if not isinstance(project, str) or not project:
            raise UvProjectTypeError(
                f"uv_project.project must be a directory path (str), got {project!r}."
            )
        kwargs["project"] = project
    for name in _LIST_FIELDS:
        if name in value:
            kwargs[name] = _names(name, value[name])
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
    return UvProjectSpec(**kwargs)


# Other runtime_env fields that also decide the worker's Python or packages, and what to do.
_CONFLICTS = {
    "pip": "add the packages to the project instead (`uv add ...`, then `uv lock`)",
    "uv": "add the packages to the project instead (`uv add ...`, then `uv lock`)",
    "conda": "put the conda packages' PyPI equivalents into the project, or drop uv_project",
}


def is_uv_run_interpreter(py_executable: str) -> bool:
    """Whether a `py_executable` is `uv run ...`, as Ray's `uv run` driver hook sets it; a
    `uv_project` env replaces that interpreter with its venv's."""
    words = py_executable.split()
    return len(words) >= 2 and words[0].rsplit("/", 1)[-1] == "uv" and words[1] == "run"


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
    only the fields that differ from the defaults.
    """

    def __init__(
        self,
        *,
        project: str | None = None,
        extras: list[str] | tuple[str, ...] = (),
        all_extras: bool = False,
        groups: list[str] | tuple[str, ...] = (),
        no_default_groups: bool = False,
        locked: bool | None = None,
        frozen: bool = False,
        install_project: bool = False,
    ) -> None:
        value: dict[str, Any] = {}
        if project is not None:
            value["project"] = project
        if extras:
            value["extras"] = list(extras)
        if groups:
            value["groups"] = list(groups)
        if locked is not None:
            value["locked"] = locked
        flags = {
            "all_extras": all_extras,
            "no_default_groups": no_default_groups,
            "frozen": frozen,
            "install_project": install_project,
        }
        value.update({name: flag for name, flag in flags.items() if flag})
        parse_spec(value)
        super().__init__(value)

"""What the driver reads when a node cannot set up a `uv_project` env.

Ray's agent hands the driver a failed `create()` as `traceback.format_exception(e)` of the last
try (`RuntimeEnvSetupError`): its own frames and the plugin's, about 20 lines, before the one
that matters, and the paths the plugin saw, which for a working_dir are Ray's copy of it in the
node's session dir (`.../working_dir_files/_ray_pkg_<hash>`), a name the user never wrote.

`create()` raises `UvProjectSetupError` instead, whose message puts the cause and what to do
first, names the working_dir's copy `<working_dir>` (paths as the user wrote them, relative to
it), says when a relative `project` was read relative to it, and keeps the details after: uv's
output, where the working_dir and the setup log are on the node. The traceback goes to the
agent's own log, which reads it from `sys.exc_info()`, not to the driver.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import TracebackType

WORKING_DIR_NAME = "<working_dir>"  # how messages name the node's copy of the working_dir


class UvProjectSetupError(RuntimeError):
    """A node could not set up a `uv_project` env; the message's first line says why and what
    to do. The driver gets it as the text of a `RuntimeEnvSetupError`."""

    # What the driver reads after `[Node <ip>] `; the class is exported there, so that this
    # name is also where it is found.
    __module__ = "ray_uv_plugin"

    # Ray formats `e.__traceback__` for the driver: none, so the message comes first. The
    # interpreter, `sys.exc_info()` and so the agent's `logger.exception` keep the real one.
    @property  # type: ignore[override]
    def __traceback__(self) -> None:  # noqa: PLW3201
        return None

    @__traceback__.setter
    def __traceback__(self, tb: TracebackType | None) -> None:
        BaseException.__traceback__.__set__(self, tb)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Where:
    """What a setup was given, to name its paths as the user wrote them."""

    project: str | None  # `uv_project.project` as given
    working_dir: str | None  # the working_dir's path on this node
    working_dir_uri: str | None  # runtime_env["working_dir"] as Ray passed it
    setup_log: str | None  # this setup's log file on this node

    @property
    def copied(self) -> bool:
        """Whether `working_dir` is Ray's copy of an upload, not a path the user gave."""
        uri = self.working_dir_uri or ""
        return self.working_dir is not None and not uri.startswith("local://")


def setup_log(logger: logging.Logger) -> str | None:
    """The file of Ray's per-setup logger (`runtime_env_setup-<job>.log`), if it has one."""
    for handler in logger.handlers:
        name = getattr(handler, "baseFilename", None)
        if isinstance(name, str) and os.path.basename(name).startswith("runtime_env_setup"):
            return name
    return None


def _named(text: str, where: Where) -> str:
    """`text` with the node's copy of the working_dir named `<working_dir>`."""
    if not where.copied:
        return text
    assert where.working_dir is not None
    for copy in sorted({where.working_dir, os.path.realpath(where.working_dir)}, key=len)[::-1]:
        text = text.replace(copy, WORKING_DIR_NAME)
    return text


def setup_error(error: BaseException, where: Where) -> UvProjectSetupError:
    """The error `create()` raises for `error`: the cause first, then where things are."""
    message = _named(str(error) or type(error).__name__, where)
    notes = []
    project = where.project
    if project is not None and where.working_dir is not None:
        relative = not os.path.isabs(os.path.expanduser(project))
        if relative:
            shown = WORKING_DIR_NAME if where.copied else where.working_dir
            notes.append(
                f"uv_project.project {project!r} is relative, so it was read relative to the "
                f"working_dir: {shown}/{project}."
            )
    if where.copied and (WORKING_DIR_NAME in message or notes):
        notes.append(
            f"{WORKING_DIR_NAME} is the job's working_dir ({where.working_dir_uri}) as Ray "
            f"unpacked it on this node: {where.working_dir}"
        )
    if where.setup_log is not None:
        notes.append(f"This setup's log on this node: {where.setup_log}")
    return UvProjectSetupError("\n".join([message, *notes]))

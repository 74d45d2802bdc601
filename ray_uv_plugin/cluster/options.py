"""What a prepare or a watch takes (`PrepareOptions`, `WatchOptions`: frozen values) and whom
it tells how it goes (`PrepareReporter`, `WatchReporter`: protocols): one value and one object
instead of a dozen keywords and a callback per event. `Quiet` reports nothing; a caller
overrides what it shows (`ray-uv prepare` prints a line per node and a bar while shipping)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ray_uv_plugin.env.spec import ParsedUvProject

if TYPE_CHECKING:
    from ray_uv_plugin.cluster.node_result import NodeResult

DEFAULT_TIMEOUT = 3600.0
DEFAULT_INTERVAL = 10.0
MIN_INTERVAL = 2.0  # each poll is one GCS call listing every node: not a busy loop


@dataclass(frozen=True)
class PrepareOptions:
    """Which env to make ready, on which cluster, and how.

    `selection`: the parsed `uv_project` value that picks the env (`extras`, `groups`,
    `locked`, `package`...), its own `project` replaced: the project is `project` (given to
    every node as the job's working_dir, or, `shared`, by its path, which every node sees).
    `ship` (default: on unless RAY_UV_PLUGIN_SHIP=0): build on one node and send the venv to
    the others. `timeout` bounds the whole prepare (a watch: each round)."""

    project: str | Path = "."
    selection: ParsedUvProject = field(default_factory=ParsedUvProject)
    address: str | None = None
    shared: bool = False
    ship: bool | None = None
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class WatchOptions(PrepareOptions):
    """A prepare, then every `interval` seconds a look for nodes that joined. `stop_signals`:
    SIGTERM and SIGHUP stop it as Ctrl-C does (main thread only: `watch.stop_on_signals`)."""

    interval: float = DEFAULT_INTERVAL
    stop_signals: bool = False


class PrepareReporter(Protocol):
    """Told how a prepare goes, as it goes."""

    def started(self, spec: ParsedUvProject, nodes: int) -> None:
        """Connected: the env the nodes get (`spec.as_value()`: its `uv_project` value), and how
        many nodes there are."""

    def result(self, result: NodeResult) -> None:
        """A node is done (ready or failed)."""

    def progress(self, progress: Any) -> None:
        """A chunk was shipped (`ship.messages.Progress`)."""


class WatchReporter(PrepareReporter, Protocol):
    """Told how a watch goes: a prepare's events, and the watch's own."""

    def watching(self) -> None:
        """The alive nodes are prepared; the watch looks for new ones from now on."""

    def round(self, nodes: list[tuple[str, str]], source: NodeResult | None) -> None:
        """Nodes joined (id, address): shipped from `source`, or built there (None)."""


class Quiet:
    """A `WatchReporter` (and so a `PrepareReporter`) that reports nothing: subclass it to
    show only some events."""

    def started(self, spec: ParsedUvProject, nodes: int) -> None:
        pass

    def result(self, result: NodeResult) -> None:
        pass

    def progress(self, progress: Any) -> None:
        pass

    def watching(self) -> None:
        pass

    def round(self, nodes: list[tuple[str, str]], source: NodeResult | None) -> None:
        pass

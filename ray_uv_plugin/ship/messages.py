"""What crosses a process while a venv is shipped, typed: the sender's `Offer`, each
receiver's `OfferAnswer`, the `settings` it judges the offer by, the chunks' `ChunkMeta`, a
receive's `Installed`, and what the driver makes of it all (`ShipResult`, `Progress`).

Both ends import this module, and each value is built once and never changed
(`dataclasses.replace` makes another). A receiver never trusts an offer's types, though: the
sending node may run another version of the plugin, or be hostile; `actors.check_offer` reads
any value (an `Offer`, or a mapping of its fields) and builds the `Offer` it then uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_uv_plugin.agent.spec import ParsedUvProject


@dataclass(frozen=True)
class Offer:
    """The sender's description of the venv it sends (`VenvSender.describe`)."""

    key: str
    venv: str  # its path on the source node
    host: str  # the source node, as the driver names it: `10.0.0.8 (77aa00ff)`
    marker: Mapping[str, Any]  # the venv's ready marker, as the sender checked it
    platform: str  # `actors.platform_tag()` of the source node
    size: int = 0  # the venv's file bytes (the stream is about this size)
    du: int = 0  # its bytes on disk
    pid: int = 0  # the sending actor's process
    built_here: Mapping[str, str] = field(default_factory=dict)  # {distribution: wheel tag}
    target: Mapping[str, Any] | None = None  # the build target, where built_here is not empty
    distributions: tuple[str, ...] = ()  # its dist-info dirs, for a receiver's seed (`delta`)
    files: tuple[str, ...] = ()  # sha256s a receiver may take from its seed (`delta`)
    node_id: str = ""  # the source node's id: the driver sets it (`transfer.ship`)


@dataclass(frozen=True)
class ShipSettings:
    """What a receiver keys the venv with besides its node: the request's runtime_env
    `env_vars`, and its parsed `uv_project` (whether it resolves, its `build_env_vars`)."""

    env_vars: Mapping[str, str] = field(default_factory=dict)
    spec: ParsedUvProject = field(default_factory=ParsedUvProject)


@dataclass(frozen=True)
class OfferAnswer:
    """A receiver's answer to the offer: `take` (it then holds the key's build lock), `reused`,
    or `refused` with `why`. A taker names its seed and the sha256s it staged from it."""

    decision: str  # take | reused | refused
    why: str | None = None
    seed: str | None = None
    have: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkMeta:
    """What the sender says of each chunk, beside its bytes (`VenvSender.next_chunk`)."""

    index: int
    sha256: str
    size: int
    last: bool
    total: int  # bytes of the stream so far
    whole_sha256: str | None  # of the whole stream, with the last chunk


@dataclass(frozen=True)
class Installed:
    """A receiver's answer once it installed the venv (`VenvReceiver.finish`)."""

    bytes: int
    seconds: float


@dataclass(frozen=True)
class ShipResult:
    node_id: str
    outcome: str  # shipped | reused | refused | failed
    bytes: int | None = None
    seconds: float = 0.0
    why: str | None = None  # refused or failed: on which node, at which step, and why
    # shipped: seconds of each step, in order: `check` (is it there, and the actors' start,
    # unless started before: `start_actors`), `open` (the sender takes the venv and describes
    # it), `offer`, `stream` (to the last chunk of every receiver), `install` (on every one)
    phases: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    chunk: int
    sent: int  # bytes of the stream so far
    size: int  # the venv's file bytes (the stream is about this size)
    receivers: int  # still taking it
    source_pid: int  # the sending actor's process, on the source node

"""What crosses a process while a venv is shipped, typed: the sender's `Offer`, each
receiver's `OfferAnswer`, the `settings` it judges the offer by, the chunks' `ChunkMeta`, a
receive's `Installed`, and what the driver makes of it all (`ShipResult`, `Progress`).

Both ends import this module, and each value is built once and never changed
(`dataclasses.replace` makes another). A receiver never trusts an offer's types, though: the
sending node may run another version of the plugin, or be hostile; `check_offer` reads any
value (an `Offer`, or a mapping of its fields) before any part of it is used, and builds the
`Offer` the receiver then uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_uv_plugin.env.spec import ParsedUvProject
from ray_uv_plugin.ship import archive


class ShipError(RuntimeError):
    """A venv could not be sent or received; the message names the node and the step."""


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


# What a receiver reads of an offer (`VenvSender.describe`), and the type of each.
_OFFER_FIELDS = {"key": str, "venv": str, "host": str, "platform": str, "marker": dict}


def check_offer(offered: Any) -> Offer:
    """The sender's description of its venv (an `Offer`, or a mapping of its fields), checked
    before any part of it is used: one of another shape (another version's plugin, a hostile
    node) is refused naming the part. Returns the `Offer` to use from here on."""
    if isinstance(offered, Offer):
        fields = Offer.__dataclass_fields__  # a sender's of another version may lack some
        source = {name: getattr(offered, name) for name in fields if hasattr(offered, name)}
    elif isinstance(offered, dict):
        source = offered
    else:
        raise ShipError(f"the offer is a {type(offered).__name__}, not a venv's description")
    for name, kind in _OFFER_FIELDS.items():
        if not isinstance(source.get(name), kind):
            raise ShipError(
                f"the offer's {name} is {source.get(name)!r}, not a {kind.__name__}: the "
                "sending node runs another version of the plugin?"
            )
    try:
        archive.check_key(source["key"])
    except archive.ArchiveError as e:
        raise ShipError(f"the offer's key: {e}") from e
    for name in ("files", "distributions"):  # for the receiver's seed (`delta`), or absent
        value = source.get(name, [])
        if not (isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)):
            wrong = "is no list of strings"
        elif len(value) > archive.MAX_MEMBERS:
            wrong = f"lists more than {archive.MAX_MEMBERS}"
        else:
            continue
        raise ShipError(
            f"the offer's {name} {wrong}: the sending node runs another version of the plugin?"
        )
    built, target = source.get("built_here"), source.get("target")
    if built and not (
        isinstance(built, dict)
        and isinstance(target, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in built.items())
    ):
        raise ShipError(
            f"the offer's built_here {built!r} (with target {target!r}) is no map of "
            "distributions to the wheel tags built on the sending node, with that node's target"
        )
    known = {name: source[name] for name in Offer.__dataclass_fields__ if name in source}
    for name in ("distributions", "files"):
        known[name] = tuple(source.get(name, ()))
    return Offer(**{**known, "built_here": dict(built or {}), "target": target if built else None})

"""A receiver's check of the sender's offer (`messages.Offer`), before it reads any part of
it: the sending node may run another version of the plugin, or be hostile. The offer may come
as an `Offer` or as a mapping of its fields; either way the receiver goes on with the `Offer`
that `check_offer` builds."""

from __future__ import annotations

from typing import Any

from ray_uv_plugin.ship import archive, delta
from ray_uv_plugin.ship.messages import Offer


class ShipError(RuntimeError):
    """A venv could not be sent or received; the message names the node and the step."""


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
    try:
        delta.check_offered(source)
    except archive.ArchiveError as e:
        raise ShipError(f"{e}: the sending node runs another version of the plugin?") from e
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

"""The plan of a ship's fan-out: which receiver passes each chunk on to which (`relay_parents`),
in a tree of the shape that should finish soonest (`relay_fanout`), and how many chunks are in
flight (`window`).

Ray moves the bytes; left to itself, it would not spread them: receivers that pull one object
at once all pull it from the one node that holds it, and the sender's link would carry the venv
once per receiver. Through the tree it carries it once: the sender's copy goes to the first
receiver alone, and each receiver hands its own copy on to the next ones. The tree is a chain,
where every link carries the venv once and the last node is a chunk per hop behind the first,
unless it would be much deeper than the stream is long; then a tree whose receivers pass each
chunk to a few others. A receiver whose relay fails, dies or stalls takes the sender's copy
instead (after `RELAY_WAIT_SHARE` of the stall timeout, so that it never looks stalled itself).
At most `window(depth)` chunks are in flight (`MAX_WINDOW` at most), so the object store holds a
few chunks per node (the sender's, up to the window), never the venv.
"""

from __future__ import annotations

WINDOW = 4  # chunks in flight to each receiver, at least (a deep chain needs more: `window`)
MAX_WINDOW = 16  # at most: the sender's node holds this many chunks in its object store
MAX_FANOUT = 4  # receivers a receiver passes each chunk on to, at most (the sender: one)
RELAY_WAIT_SHARE = 0.25  # of the stall timeout: how long a receiver waits for its relay's copy


def relay_parents(receivers: list[str], fanout: int) -> dict[str, str | None]:
    """Who passes each chunk to whom: the sender (None) to the first receiver, and each
    receiver to the next `fanout` not yet served, in order (a chain for `fanout` 1)."""
    return {
        node: None if i == 0 else receivers[(i - 1) // fanout] for i, node in enumerate(receivers)
    }


def relay_depth(count: int, fanout: int) -> int:
    """How many hops from the sender the last of `count` receivers is in `relay_parents`."""
    depth, served, level = 0, 0, 1
    while served < count:
        served, depth, level = served + level, depth + 1, level * fanout
    return depth


def relay_fanout(chunks: int, receivers: int) -> int:
    """The `relay_parents` fanout that should get `chunks` chunks to `receivers` nodes soonest.

    A receiver passes a chunk on once it holds all of it, so each hop adds about the time one
    chunk takes over one link; a receiver that passes every chunk to f others sends f times the
    venv, f chunk-times for each. The last receiver is done after about (chunks + depth - 1) * f
    chunk-times: a chain (f = 1: every link carries the venv once) wins unless it is much
    deeper than the stream is long. Trees too deep for `MAX_WINDOW` chunks in flight are out.
    """
    allowed = [
        f
        for f in range(1, MAX_FANOUT + 1)
        if relay_depth(receivers, f) + 1 <= MAX_WINDOW or f == MAX_FANOUT
    ]
    return min(allowed, key=lambda f: (chunks + relay_depth(receivers, f) - 1) * f)


def window(depth: int) -> int:
    """Chunks in flight for a tree `depth` deep: the deepest receiver is about `depth` chunks
    behind the first, and the sender may be one more ahead without waiting for it."""
    return min(MAX_WINDOW, max(WINDOW, depth + 1))

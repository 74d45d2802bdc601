"""Which fault explains a failed job, or a leftover: a failure no fault explains is the
plugin's, and a violation ("unexplained failure", with the job's error line).

A fault explains a failed job when it acted while the job ran (its window: from the moment it
hit to the end of its hold, plus `GRACE_S` for what follows it: a build that fails, a node the
GCS counts dead), on a node the job's error names (or any node, where it names none: every job
asks on every node). A node taken down (a SIGKILLed agent or raylet, or one the round had to
start again) stays down until the round's end. A driver fault explains only the job whose
driver it hit. Times are seconds from the round's start, as the fault records and the jobs'
`started_s` and `ended_s` give them.

A leftover (a temp dir, a ticket nobody holds) is explained by a SIGKILL on its node that left
no process to clean up: of an agent, a raylet (its node's processes go with it) or a receiver,
or by the node's restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GRACE_S = 30.0  # a fault's effects after it ends: a failing build, a node counted dead
NODE_DOWN = ("agent", "raylet")  # a SIGKILL of one takes its node down until the round ends
LEAVES_BEHIND = ("agent", "raylet", "ship_receiver")  # a SIGKILL leaves their temp files


def hit_node(fault: Mapping[str, Any]) -> int | None:
    """The node a fault acted on; None if it found no target."""
    target = fault.get("target")
    if not isinstance(target, Mapping):
        return None
    return int(target.get("node", fault["node"]))


def window(fault: Mapping[str, Any], restarted: Iterable[int]) -> tuple[float, float]:
    """(from, to) in seconds from the round's start: when the fault may have made a job fail."""
    begin = float(fault.get("at_s", fault["offset_s"]))
    down = fault["action"] == "kill" and fault["kind"] in NODE_DOWN
    if down or hit_node(fault) in set(restarted):
        return begin, math.inf
    held = fault["hold_s"] if fault["action"] != "kill" else 0.0
    return begin, begin + held + GRACE_S


def explains(
    fault: Mapping[str, Any], job: Mapping[str, Any], restarted: Iterable[int], ips: Sequence[str]
) -> bool:
    """Whether `fault` may have made `job` fail (module docstring)."""
    node = hit_node(fault)
    if node is None:
        return False
    if fault["kind"] == "driver":
        return int(fault["target"].get("pid", -1)) in job.get("pids", ())
    begin, end = window(fault, restarted)
    if not (job["started_s"] <= end and begin <= job["ended_s"]):
        return False
    named = [i for i, ip in enumerate(ips) if ip and ip in str(job.get("error", ""))]
    return not named or node in named


def failed(job: Mapping[str, Any]) -> bool:
    return job["rc"] != 0 or bool(job["hung"])


def blame(
    jobs: Iterable[Mapping[str, Any]],
    faults: Sequence[Mapping[str, Any]],
    restarted: Iterable[int],
    ips: Sequence[str],
) -> tuple[dict[str, list[str]], list[str]]:
    """({failed job's name: the faults that explain it}, the unexplained failures in words).
    A fault is named `kind:action@node+at_s`."""
    restarted = list(restarted)
    blamed: dict[str, list[str]] = {}
    unexplained = []
    for job in jobs:
        if not failed(job):
            continue
        why = [name(f) for f in faults if explains(f, job, restarted, ips)]
        if why:
            blamed[job["name"]] = why
        else:
            what = "hung" if job["hung"] else f"exit {job['rc']}"
            unexplained.append(
                f"unexplained failure of {job['name']} ({what}, {job['started_s']:.0f}-"
                f"{job['ended_s']:.0f}s): {job.get('error', '')}"
            )
    return blamed, unexplained


def name(fault: Mapping[str, Any]) -> str:
    return f"{fault['kind']}:{fault['action']}@{hit_node(fault)}+{fault.get('at_s', '?')}s"


def left_by_fault(
    node: int, faults: Iterable[Mapping[str, Any]], restarted: Iterable[int]
) -> list[str]:
    """The round's faults that may have left a leftover on `node`."""
    if node in set(restarted):
        return [f"node {node} restarted"]
    return [
        name(f)
        for f in faults
        if f["action"] == "kill" and f["kind"] in LEAVES_BEHIND and hit_node(f) == node
    ]

"""Which fault explains a failed job, or a leftover: a failure no fault explains is the
plugin's, and a violation ("unexplained failure", with the job's error line).

A fault explains a failed job when it acted while the job ran (its window: from the moment it
hit to the end of its hold, plus `GRACE_S` for what follows it: a build that fails, a node the
GCS counts dead), on a node the job's error names (or any node, where it names none: every job
asks on every node), and is of a kind that causes what the error says, where it says it
(`CAUSES`: a full disk, a killed `uv sync`, a lost GCS). A node taken down (a SIGKILLed agent
or raylet, an agent killed after a marker, a node cut from the GCS, one the round had to start
again after a fault that can get it counted dead; every node, for a head restart) stays down
until the round's end. A driver fault explains only the job whose driver it hit. The faults
blamed are listed the latest first. Times are seconds from the round's start, as the fault
records and the jobs' `started_s` and `ended_s` give them.

A leftover (a temp dir, a ticket nobody holds) is explained by a SIGKILL on its node that left
no process to clean up: of an agent (after a marker too), a raylet (its node's processes go
with it), a receiver, the head's processes, or by the node's restart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GRACE_S = 30.0  # a fault's effects after it ends: a failing build, a node counted dead
# A SIGKILL of one of these takes its node down until the round ends (its heal).
NODE_DOWN = ("agent", "raylet")
# These take a node down whatever their action: an agent killed after a marker, a node the
# GCS counted dead, the head (and with it every node: a new GCS) restarted.
DOWN_ANYWAY = ("marker_kill", "gcs_partition", "head_restart")
EVERY_NODE = ("head_restart",)
# A SIGKILL of these leaves their temp files (no process left to clean up).
LEAVES_BEHIND = ("agent", "raylet", "ship_receiver", "marker_kill", "head_restart")
# What can get a node counted dead, and so restarted by the round's heal: a fault of these on a
# node that was restarted keeps it down to the round's end.
LIVENESS = ("agent", "raylet", "link_drop", "link_delay", "gcs_partition", "node_split")
# An error that names its cause is put down only to a fault of a kind that causes it.
CAUSES = (
    (re.compile(r"No space left|is full"), ("disk_full",)),
    (re.compile(r"uv was killed|`uv sync` for .* did not finish"), ("uv_sync",)),
    (re.compile(r"GCS may have been killed|GCS"), ("head_restart", "gcs_partition")),
    # A build that linked a file of uv's cache while the harness's write changed it.
    (re.compile(r"differ from their distribution's RECORD"), ("cache_write",)),
)


def hit_nodes(fault: Mapping[str, Any], nodes: int = 3) -> set[int]:
    """The nodes a fault acted on (empty: it was not sent)."""
    target = fault.get("target")
    if not isinstance(target, Mapping):
        return set()
    if fault["kind"] in EVERY_NODE:
        return set(range(nodes))
    if isinstance(target.get("nodes"), list):  # a split: both ends
        return {int(n) for n in target["nodes"]}
    return {int(target.get("node", fault["node"]))}


def takes_node_down(fault: Mapping[str, Any]) -> bool:
    return fault["kind"] in DOWN_ANYWAY or (
        fault["action"] == "kill" and fault["kind"] in NODE_DOWN
    )


def window(fault: Mapping[str, Any], restarted: Iterable[int]) -> tuple[float, float]:
    """(from, to) in seconds from the round's start: when the fault may have made a job fail."""
    begin = float(fault.get("at_s", fault["offset_s"]))
    down = fault["kind"] in LIVENESS and hit_nodes(fault) & set(restarted)
    if takes_node_down(fault) or down:
        return begin, math.inf
    held = fault.get("hold_s", 0.0) if fault["action"] != "kill" else 0.0
    return begin, begin + held + GRACE_S


def explains(
    fault: Mapping[str, Any], job: Mapping[str, Any], restarted: Iterable[int], ips: Sequence[str]
) -> bool:
    """Whether `fault` may have made `job` fail (module docstring)."""
    nodes = hit_nodes(fault, len(ips))
    if not nodes:
        return False
    if fault["kind"] == "driver":
        return int(fault["target"].get("pid", -1)) in job.get("pids", ())
    begin, end = window(fault, restarted)
    if not (job["started_s"] <= end and begin <= job["ended_s"]):
        return False
    error = str(job.get("error", ""))
    for pattern, kinds in CAUSES:
        if pattern.search(error):
            if fault["kind"] not in kinds:
                return False
            break
    named = {i for i, ip in enumerate(ips) if ip and ip in error}
    return not named or bool(nodes & named)


def failed(job: Mapping[str, Any]) -> bool:
    return job["rc"] != 0 or bool(job["hung"])


def blame(
    jobs: Iterable[Mapping[str, Any]],
    faults: Sequence[Mapping[str, Any]],
    restarted: Iterable[int],
    ips: Sequence[str],
) -> tuple[dict[str, list[str]], list[str]]:
    """({failed job's name: the faults that explain it, the latest first}, the unexplained
    failures in words). A fault is named `kind:action@nodes+at_s`."""
    restarted = list(restarted)
    blamed: dict[str, list[str]] = {}
    unexplained = []
    for job in jobs:
        if not failed(job):
            continue
        found = [f for f in faults if explains(f, job, restarted, ips)]
        found.sort(key=lambda f: -float(f.get("at_s", f["offset_s"])))  # the latest first
        why = [name(f) for f in found]
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
    nodes = ",".join(map(str, sorted(hit_nodes(fault))))
    return f"{fault['kind']}:{fault['action']}@{nodes}+{fault.get('at_s', '?')}s"


def left_by_fault(
    node: int, faults: Iterable[Mapping[str, Any]], restarted: Iterable[int]
) -> list[str]:
    """The round's faults that may have left a leftover on `node`."""
    if node in set(restarted):
        return [f"node {node} restarted"]
    return [
        name(f)
        for f in faults
        if f["kind"] in LEAVES_BEHIND
        and (f["action"] == "kill" or f["kind"] in DOWN_ANYWAY)
        and node in hit_nodes(f)
    ]

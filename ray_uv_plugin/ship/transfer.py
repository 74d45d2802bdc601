"""Shipping a ready venv from the node that has it to other nodes, through Ray's object store.

This module is the driver's side. It starts a `VenvSender` actor on the source node and a
`VenvReceiver` on each target node (`actors`), both on the node's own Ray Python (never the
driver's interpreter, nor a job's `py_executable` or job-default `uv_project`: see `ship`). It
pulls the venv's chunks (`archive`) from the sender one at a time and passes each on through a
tree of the receivers still taking it (`relay_parents`): the sender's copy goes to the first
receiver alone, and each receiver hands its own copy to at most `RELAY_FANOUT` others. Ray
moves the bytes; left to itself, it would not spread them: receivers that pull one object at
once all pull it from the one node that holds it, and the sender's link would carry the venv
once per receiver. Through the tree it carries it once, and the last node is a few chunks
behind the first. A receiver whose relay fails, dies or stalls takes the sender's copy instead
(after `RELAY_WAIT_SHARE` of `stall_timeout`, so that it never looks stalled itself). At most
`WINDOW` chunks are in flight, so the object store holds a few chunks per node (twice that on a
node that passes them on), never the venv.

What is checked, and what may go where:
- The sender holds the key's build lock shared for its whole life, so that neither `gc` nor a
  rebuild touches the venv while it is read; the stream itself is checked chunk by chunk and
  whole (`archive`), and a venv changed under the sender fails the receive.
- A receiver takes a venv only where the node's own plugin would use it: the same Ray and
  platform, the venv's key inputs (`KeyInputs`, in its marker) giving its key with the node's
  own Python interpreter, uv version and uv settings, and no ready venv of the key there yet.
- A venv holding wheels that uv built on the source node for its platform (`build_target`)
  goes only to nodes with the same build target: CPU instruction set, GPUs (unless
  TORCH_CUDA_ARCH_LIST is set), CUDA driver and toolkit. Other nodes build it themselves.
- Each receiver is judged on its own: one that does not acknowledge a chunk (or answer its
  offer, or install) within `stall_timeout` of its last answer is failed and killed, and the
  others go on.
- A receiver holds the key's build lock while it receives, so the node's plugin waits for it
  rather than building the same venv. It gives up by itself (a watchdog thread: the driver may
  be stalled or gone) once it has held the lock for RAY_UV_PLUGIN_BUILD_TIMEOUT_S, as long as
  a build may hold it, well within what a waiting request waits (that plus
  `build_lock.LOCK_MARGIN`). A receiver that dies (the node, the driver, a SIGKILL) leaves
  only a `<key>.ship-XXXX` dir that is never used and is removed by the next receive or build
  of the key.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_uv_plugin.ship import archive
from ray_uv_plugin.ship.actors import VenvReceiver, VenvSender, is_ready

SHIP_ENV = "RAY_UV_PLUGIN_SHIP"  # "0" on the driver: `prepare` and worker groups never ship
WINDOW = 4  # chunks in flight to each receiver
RELAY_FANOUT = 2  # receivers a receiver passes each chunk on to (the sender: one)
RELAY_WAIT_SHARE = 0.25  # of `stall_timeout`: how long a receiver waits for its relay's copy
STALL_TIMEOUT = 300.0  # a node that does not answer for this long is given up on, alone
ACTOR_START = 60.0  # besides, for an actor's first answer: its worker process starts first
# The actors' runtime_env where the job sets a `py_executable` or a job-default `uv_project`: an
# empty one overrides the job's (the plugin yields a job default to it), and Ray's worker setup
# then starts the node's own Python (`RuntimeEnvContext` falls back to the interpreter of the
# raylet's setup_worker for an empty py_executable).
NODE_PYTHON: dict[str, Any] = {"py_executable": ""}


def node_python_env(job_env: dict[str, Any]) -> dict[str, Any] | None:
    """The runtime_env that puts this package's own actors and tasks on each node's Ray
    Python under a job whose runtime_env is `job_env`; None where the job's own is that.

    A job `py_executable` (Ray's `uv run` hook's) may name a path that only the driver's
    machine has, and a job-default `uv_project` (our `uv run` driver hook's) would build the
    job's venv first: `NODE_PYTHON` overrides the one, and the plugin yields the other to it.
    """
    value = job_env.get("uv_project")
    job_default = isinstance(value, dict) and value.get("job_default") is True
    return dict(NODE_PYTHON) if job_env.get("py_executable") or job_default else None


def shipping_enabled() -> bool:
    return os.environ.get(SHIP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def relay_parents(receivers: list[str]) -> dict[str, str | None]:
    """Who passes each chunk to whom: the sender (None) to the first receiver, and each
    receiver to the next `RELAY_FANOUT` not yet served, in order: a tree as deep as the log
    of their number, in which each node's link carries a chunk out at most that often."""
    return {
        node: None if i == 0 else receivers[(i - 1) // RELAY_FANOUT]
        for i, node in enumerate(receivers)
    }


def _already_there(
    key: str, targets: list[str], runtime_env: dict[str, Any] | None, timeout: float
) -> dict[str, ShipResult]:
    """The targets that have the ready venv already, found by a plain task on each (all at
    once: a node that does not answer in time is for the receiver to report)."""
    refs = {is_ready.options(**_pinned(n, runtime_env)).remote(key): n for n in targets}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    for ref in pending:
        ray.cancel(ref, force=True)
    found = {}
    for ref in done:
        try:
            if ray.get(ref):
                found[refs[ref]] = ShipResult(refs[ref], "reused")
        except Exception:  # noqa: BLE001 - the receiver will say what is wrong there
            pass
    return found


@dataclass
class ShipResult:
    node_id: str
    outcome: str  # shipped | reused | refused | failed
    bytes: int | None = None
    seconds: float = 0.0
    why: str | None = None  # refused or failed: on which node, at which step, and why


@dataclass
class Progress:
    chunk: int
    sent: int  # bytes of the stream so far
    size: int  # the venv's file bytes (the stream is about this size)
    receivers: int  # still taking it
    source_pid: int  # the sending actor's process, on the source node


def _pinned(node_id: str, runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    }
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    return options


def _error(e: BaseException, node: str, step: str) -> str:
    """What went wrong on `node` at `step`: the receiver's own ShipError (which names both)
    out of Ray's wrapping, else Ray's error (the actor or its node died, ...) with both."""
    text = str(e)
    start = text.find("ShipError: ")
    if start >= 0:
        return text[start + len("ShipError: ") :].strip().splitlines()[0]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"node {node}: {step}: {type(e).__name__}: {first}"


def _addresses() -> dict[str, str]:
    return {n["NodeID"]: f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in ray.nodes()}


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def ship(
    key: str,
    source_node: str,
    targets: list[str],
    settings: dict[str, Any] | None = None,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int = archive.CHUNK_BYTES,
    timeout: float = 1800.0,
    on_progress: Callable[[Progress], None] = lambda p: None,
    stall_timeout: float = STALL_TIMEOUT,
) -> dict[str, ShipResult]:
    """Send the ready venv `key` from `source_node` to each of `targets` (node ids); returns
    each target's result. Never raises for one node's failure: it is that node's result.

    `settings`: `{"env_vars": the runtime_env's, "resolves": not locked/frozen}` (default: none,
    locked); `runtime_env`: for the actors, whose interpreter must have this package (default:
    the job's, but the node's own Python where the job sets a `py_executable` or a job-default
    `uv_project`: see `node_python_env`). `timeout` bounds the whole ship; `stall_timeout`
    each node's wait for its next answer."""
    settings = settings or {"env_vars": {}, "resolves": False}
    job_env = ray.get_runtime_context().runtime_env
    node_python = node_python_env(job_env)
    if "uv_project" in job_env and node_python is None:
        # Every actor of the job runs in that venv, and none may leave it for the node's Python.
        why = "the job's own runtime_env has uv_project (ask for it per actor to ship it)"
        return {n: ShipResult(n, "refused", why=why) for n in targets}
    if runtime_env is None:
        runtime_env = node_python
    deadline = time.monotonic() + timeout
    first_answer = min(stall_timeout + ACTOR_START, timeout)
    where = _addresses()
    results = _already_there(key, targets, runtime_env, first_answer)
    targets = [n for n in targets if n not in results]
    if not targets:
        return results  # a group whose nodes have the venv pays for no sender and receivers
    sender = VenvSender.options(**_pinned(source_node, runtime_env)).remote(key, chunk_bytes)
    receivers = {n: VenvReceiver.options(**_pinned(n, runtime_env)).remote() for n in targets}
    try:
        try:
            source = ray.get(sender.describe.remote(), timeout=first_answer)
        except Exception as e:
            why = "the source " + _error(e, where[source_node], "describing the venv")
            return {**results, **{n: ShipResult(n, "failed", why=why) for n in targets}}
        source["node_id"] = source_node
        offers = {n: r.offer.remote(source, settings) for n, r in receivers.items()}
        answers, stalled = _each(
            offers, dict.fromkeys(offers, time.monotonic()), first_answer, deadline
        )
        takers: dict[str, Any] = {}
        for n, answer in answers.items():
            if isinstance(answer, BaseException):
                results[n] = ShipResult(n, "failed", why=_error(answer, where[n], "the offer"))
            elif answer["decision"] == "take":
                takers[n] = receivers[n]
            else:
                results[n] = ShipResult(n, answer["decision"], why=answer.get("why"))
        for n, waited in stalled.items():  # killed now: it may hold the lock
            ray.kill(receivers[n])
            why = f"node {where[n]}: the offer: stalled: no answer for {waited:.0f}s"
            results[n] = ShipResult(n, "failed", why=why)
        _Stream(sender, source, takers, results, where, deadline, stall_timeout).run(on_progress)
        return results
    finally:
        for actor in [sender, *receivers.values()]:
            ray.kill(actor)


def _each(
    refs: dict[str, Any], since: dict[str, float], limit: float, deadline: float
) -> tuple[dict[str, Any], dict[str, float]]:
    """Each node's answer (its value, or the exception it raised) as it comes, waiting for each
    node until `limit` seconds after its `since` or the `deadline`; returns (answers, the
    nodes that did not answer in time: how long they were waited for)."""
    pending = {ref: node for node, ref in refs.items()}
    answers: dict[str, Any] = {}
    stalled: dict[str, float] = {}
    while pending:
        until = min(min(since[n] for n in pending.values()) + limit, deadline)
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_left(until))
        for ref in done:
            node = pending.pop(ref)
            try:
                answers[node] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the node's answer, to report
                answers[node] = e
        now = time.monotonic()
        for ref, node in list(pending.items()):
            if now >= since[node] + limit or now >= deadline:
                del pending[ref]
                stalled[node] = now - since[node]
    return answers, stalled


class _Stream:
    """The chunks from the sender to the receivers that took the venv, each receiver judged on
    its own: one that does not acknowledge a chunk within `stall_timeout` of its previous
    acknowledgement is failed and killed (it cannot even abort), and the others go on."""

    def __init__(
        self,
        sender: Any,
        source: dict[str, Any],
        takers: dict[str, Any],
        results: dict[str, ShipResult],
        where: dict[str, str],
        deadline: float,
        stall_timeout: float,
    ) -> None:
        self.sender, self.source, self.takers, self.results = sender, source, takers, results
        self.where, self.deadline, self.stall = where, deadline, stall_timeout
        self.start = time.monotonic()
        self.progress = dict.fromkeys(takers, self.start)  # each receiver's last answer
        self.aborts: list[Any] = []

    def fail(self, node: str, why: str, stalled: bool = False) -> None:
        if node not in self.takers:
            return
        actor = self.takers.pop(node)
        self.results[node] = ShipResult(node, "failed", why=why)
        if stalled:  # the kernel releases its lock; the next receive or build removes its tree
            ray.kill(actor)
        else:
            self.aborts.append(actor.abort.remote())  # removes what it unpacked

    def _stalled(self, node: str, step: str, waited: float) -> None:
        if time.monotonic() >= self.deadline:
            why = f"ran past the time limit of the whole ship ({self.deadline - self.start:.0f}s)"
        else:
            why = f"stalled: no answer for {waited:.0f}s (limit {self.stall:g}s)"
        self.fail(node, f"node {self.where[node]}: {step}: {why}; the other nodes went on", True)

    def settle(self, step: str, acks: dict[str, Any]) -> dict[str, Any]:
        """Each receiver's answer to `acks` (those still taking); fails the others."""
        acks = {n: ref for n, ref in acks.items() if n in self.takers}
        answers, stalled = _each(acks, self.progress, self.stall, self.deadline)
        done = {}
        for node, answer in answers.items():
            if isinstance(answer, BaseException):
                self.fail(node, _error(answer, self.where[node], step))
            else:
                self.progress[node] = time.monotonic()
                done[node] = answer
        for node, waited in stalled.items():
            self._stalled(node, step, waited)
        return done

    def run(self, on_progress: Callable[[Progress], None]) -> None:
        source, window = self.source, deque()
        meta: dict[str, Any] = {"index": -1}
        while self.takers:
            meta_ref, data_ref = self.sender.next_chunk.remote()
            try:
                limit = min(self.stall, _left(self.deadline))
                meta = ray.get(meta_ref, timeout=max(limit, 1))
            except Exception as e:
                step = f"sending chunk {meta['index'] + 1}"
                why = "the source " + _error(e, self.where[source["node_id"]], step)
                for node in list(self.takers):
                    self.fail(node, why)
                break
            parents = relay_parents(list(self.takers))  # parents first: a dict keeps order
            wait = max(self.stall * RELAY_WAIT_SHARE, 1.0)
            acks, copies = {}, {}
            for n, r in self.takers.items():
                sources = [copies[parents[n]], data_ref] if parents[n] else [data_ref]
                forward = n in parents.values()
                acks[n], copies[n] = r.relay.remote(
                    meta["index"], meta["sha256"], sources, forward, wait
                )
            del data_ref, copies  # the pending `relay`s hold the copies; freed when done
            window.append((meta["index"], acks))
            on_progress(
                Progress(
                    meta["index"], meta["total"], source["size"], len(self.takers), source["pid"]
                )
            )
            while window and (len(window) > WINDOW or meta["last"]):
                chunk, acks = window.popleft()
                self.settle(f"receiving chunk {chunk}", acks)
            if meta["last"]:
                break
        while window:  # what is still in flight to receivers that failed meanwhile
            chunk, acks = window.popleft()
            self.settle(f"receiving chunk {chunk}", acks)
        if self.takers:
            finishes = {
                n: r.finish.remote(meta["index"] + 1, meta["total"], meta["whole_sha256"])
                for n, r in self.takers.items()
            }
            self.progress = dict.fromkeys(self.takers, time.monotonic())
            for node, done in self.settle("installing the venv", finishes).items():
                seconds = time.monotonic() - self.start
                self.results[node] = ShipResult(node, "shipped", done["bytes"], seconds)
                del self.takers[node]
        if self.aborts:  # before `ship` kills the actors
            ray.wait(self.aborts, num_returns=len(self.aborts), timeout=60)

"""Shipping a ready venv from the node that has it to other nodes, through Ray's object store.

This module is the driver's side. It starts a `VenvSender` actor on the source node and a
`VenvReceiver` on each target node (`actors`), both on the node's own Ray Python (never the
driver's interpreter, nor a job's `py_executable` or job-default `uv_project`: see `ship`). It
pulls the venv's chunks (`archive`) from the sender one at a time and passes each on through a
tree of the receivers still taking it (`relay_parents`): the sender's copy goes to the first
receiver alone, and each receiver hands its own copy on to the next ones. Ray moves the bytes;
left to itself, it would not spread them: receivers that pull one object at once all pull it
from the one node that holds it, and the sender's link would carry the venv once per receiver.
Through the tree it carries it once. The tree's shape is the one that should finish soonest
(`relay_fanout`): a chain, where every link carries the venv once and the last node is a chunk
per hop behind the first, unless it would be much deeper than the stream is long; then a tree
whose receivers pass each chunk to a few others. A receiver whose relay fails, dies or stalls
takes the sender's copy instead (after `RELAY_WAIT_SHARE` of `stall_timeout`, so that it never
looks stalled itself). At most `window(depth)` chunks are in flight (`MAX_WINDOW` at most), so
the object store holds a few chunks per node (the sender's, up to the window), never the venv.
The actors may be started before the venv is ready (`start_actors`: `prepare` starts them
while the first node builds), and the caller hears each node's part as soon as its offer
is answered (`on_decided`), to start what waits for that node's venv.

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

import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_uv_plugin.ship import archive, delta
from ray_uv_plugin.ship.actors import VenvReceiver, VenvSender, is_ready

SHIP_ENV = "RAY_UV_PLUGIN_SHIP"  # "0" on the driver: `prepare` and worker groups never ship
# "0" on the driver: a ship sends the whole venv, never the difference from a receiver's seed
# (`delta`): where the link is faster than a node's disk copies them.
SEEDS_ENV = "RAY_UV_PLUGIN_SHIP_SEEDS"
WINDOW = 4  # chunks in flight to each receiver, at least (a deep chain needs more: `window`)
MAX_WINDOW = 16  # at most: the sender's node holds this many chunks in its object store
MAX_FANOUT = 4  # receivers a receiver passes each chunk on to, at most (the sender: one)
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


def _on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def shipping_enabled() -> bool:
    return _on(SHIP_ENV)


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
    # shipped: seconds of each step, in order: `check` (is it there, and the actors' start,
    # unless started before: `start_actors`), `open` (the sender takes the venv and describes
    # it), `offer`, `stream` (to the last chunk of every receiver), `install` (on every one)
    phases: dict[str, float] = field(default_factory=dict)


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


@dataclass
class ShipActors:
    """The sender and the receivers of a ship, started ahead of it (`start_actors`), e.g.
    while the source node builds the venv: their worker processes start meanwhile. `ship`
    stops them when it is done."""

    source_node: str
    sender: Any
    receivers: dict[str, Any]  # node id -> its receiver

    @classmethod
    def start(
        cls, source_node: str, targets: list[str], runtime_env: dict[str, Any] | None
    ) -> ShipActors:
        sender = VenvSender.options(**_pinned(source_node, runtime_env)).remote()
        receivers = {n: VenvReceiver.options(**_pinned(n, runtime_env)).remote() for n in targets}
        return cls(source_node, sender, receivers)

    def stop(self) -> None:
        for actor in [self.sender, *self.receivers.values()]:
            ray.kill(actor)


def _refused_by_job() -> str | None:
    """Why this job's actors cannot ship, or None."""
    job_env = ray.get_runtime_context().runtime_env
    if "uv_project" in job_env and node_python_env(job_env) is None:
        # Every actor of the job runs in that venv, and none may leave it for the node's Python.
        return "the job's own runtime_env has uv_project (ask for it per actor to ship it)"
    return None


def _actors_env(runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
    if runtime_env is None:
        return node_python_env(ray.get_runtime_context().runtime_env)
    return runtime_env


def start_actors(
    source_node: str, targets: list[str], runtime_env: dict[str, Any] | None = None
) -> ShipActors | None:
    """The sender on `source_node` and a receiver on each of `targets` (node ids), for a
    `ship` to come; None where this job cannot ship (`ship` then says why). `runtime_env`: as
    for `ship`."""
    if _refused_by_job() is not None:
        return None
    return ShipActors.start(source_node, targets, _actors_env(runtime_env))


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
    actors: ShipActors | None = None,
    on_decided: Callable[[str, str], None] = lambda node, decision: None,
) -> dict[str, ShipResult]:
    """Send the ready venv `key` from `source_node` to each of `targets` (node ids); returns
    each target's result. Never raises for one node's failure: it is that node's result.

    `settings`: `{"env_vars": the runtime_env's, "resolves": not locked/frozen,
    "build_env_vars": the uv_project's}` (default: none, locked); `runtime_env`: for the
    actors, whose interpreter must have this package (default:
    the job's, but the node's own Python where the job sets a `py_executable` or a job-default
    `uv_project`: see `node_python_env`). `timeout` bounds the whole ship; `stall_timeout`
    each node's wait for its next answer. `actors`: started before (`start_actors`) from
    `source_node` to the targets, no others. `on_decided(node, decision)`, once for each
    target, as soon as its part is known, before the stream: `take` (its receiver holds the
    key's build lock until it installed the venv or failed), `reused`, `refused` or
    `failed`."""
    settings = settings or {"env_vars": {}, "resolves": False}
    if actors is not None and (
        actors.source_node != source_node or set(actors.receivers) != set(targets)
    ):
        actors.stop()
        raise ValueError(
            f"the actors were started to send from {actors.source_node} to "
            f"{sorted(actors.receivers)}, not from {source_node} to {sorted(targets)}"
        )
    refused = _refused_by_job()
    if refused is not None:
        if actors is not None:
            actors.stop()
        for n in targets:
            on_decided(n, "refused")
        return {n: ShipResult(n, "refused", why=refused) for n in targets}
    deadline = time.monotonic() + timeout
    first_answer = min(stall_timeout + ACTOR_START, timeout)
    where = _addresses()
    marks = [time.monotonic()]  # when each of the steps before the stream ended
    if actors is None:
        runtime_env = _actors_env(runtime_env)
        results = _already_there(key, targets, runtime_env, first_answer)
        for n in results:
            on_decided(n, "reused")
        targets = [n for n in targets if n not in results]
        if not targets:
            return results  # a group whose nodes have the venv pays for no sender and receivers
        actors = ShipActors.start(source_node, targets, runtime_env)
    else:
        results = {}  # a receiver's offer says whether its node has the venv already
    targets = list(actors.receivers)
    marks.append(time.monotonic())
    try:
        try:
            source = ray.get(actors.sender.open.remote(key, chunk_bytes), timeout=first_answer)
        except Exception as e:
            why = "the source " + _error(e, where[source_node], "describing the venv")
            for n in targets:
                on_decided(n, "failed")
            return {**results, **{n: ShipResult(n, "failed", why=why) for n in targets}}
        source["node_id"] = source_node
        if not _on(SEEDS_ENV):
            source["files"] = []  # nothing a receiver may take from its seed: all is sent
        marks.append(time.monotonic())
        offers = {n: r.offer.remote(source, settings) for n, r in actors.receivers.items()}
        answers, stalled = _each(
            offers, dict.fromkeys(offers, time.monotonic()), first_answer, deadline
        )
        marks.append(time.monotonic())
        takers: dict[str, Any] = {}
        for n, answer in answers.items():
            if isinstance(answer, BaseException):
                results[n] = ShipResult(n, "failed", why=_error(answer, where[n], "the offer"))
            elif answer["decision"] == "take":
                takers[n] = actors.receivers[n]
            else:
                results[n] = ShipResult(n, answer["decision"], why=answer.get("why"))
        for n, waited in stalled.items():  # killed now: it may hold the lock
            ray.kill(actors.receivers[n])
            why = f"node {where[n]}: the offer: stalled: no answer for {waited:.0f}s"
            results[n] = ShipResult(n, "failed", why=why)
        for n in targets:
            on_decided(n, "take" if n in takers else results[n].outcome)
        shared = delta.shared_files([answers[n] for n in takers])
        if shared:  # what every taker has from its seed is not sent (`delta`)
            try:
                ray.get(actors.sender.refer.remote(shared), timeout=first_answer)
            except Exception:  # noqa: BLE001 - the stream says what became of the sender
                pass
        stream = _Stream(
            actors.sender, source, takers, results, where, deadline, stall_timeout, chunk_bytes
        )
        stream.run(on_progress)
        before = dict(zip(("check", "open", "offer"), _steps(marks), strict=True))
        for node, ends in stream.ends.items():
            if results[node].outcome == "shipped":
                stream_end, install_end = ends
                results[node].phases = {
                    **before,
                    "stream": round(stream_end - stream.start, 3),
                    "install": round(install_end - stream_end, 3),
                }
        return results
    finally:
        actors.stop()


def _steps(marks: list[float]) -> list[float]:
    """The seconds between consecutive time marks."""
    return [round(b - a, 3) for a, b in itertools.pairwise(marks)]


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
        chunk_bytes: int,
    ) -> None:
        self.sender, self.source, self.takers, self.results = sender, source, takers, results
        self.where, self.deadline, self.stall = where, deadline, stall_timeout
        chunks = max(1, -(-int(source["size"]) // chunk_bytes))  # about: the stream's size
        self.fanout = relay_fanout(chunks, len(takers))
        self.window = window(relay_depth(len(takers), self.fanout))
        self.start = time.monotonic()
        self.progress = dict.fromkeys(takers, self.start)  # each receiver's last answer
        self.ends: dict[str, tuple[float, float]] = {}  # shipped: its last chunk, its install
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
        source, in_flight = self.source, deque()
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
            # Parents first (a dict keeps order); a receiver that failed is left out from here on.
            parents = relay_parents(list(self.takers), self.fanout)
            wait = max(self.stall * RELAY_WAIT_SHARE, 1.0)
            acks, copies = {}, {}
            for n, r in self.takers.items():
                sources = [copies[parents[n]], data_ref] if parents[n] else [data_ref]
                forward = n in parents.values()
                acks[n], copies[n] = r.relay.remote(
                    meta["index"], meta["sha256"], sources, forward, wait
                )
            del data_ref, copies  # the pending `relay`s hold the copies; freed when done
            in_flight.append((meta["index"], acks))
            on_progress(
                Progress(
                    meta["index"], meta["total"], source["size"], len(self.takers), source["pid"]
                )
            )
            while in_flight and (len(in_flight) > self.window or meta["last"]):
                chunk, acks = in_flight.popleft()
                self.settle(f"receiving chunk {chunk}", acks)
            if meta["last"]:
                break
        while in_flight:  # what is still in flight to receivers that failed meanwhile
            chunk, acks = in_flight.popleft()
            self.settle(f"receiving chunk {chunk}", acks)
        if self.takers:
            finishes = {
                n: r.finish.remote(meta["index"] + 1, meta["total"], meta["whole_sha256"])
                for n, r in self.takers.items()
            }
            streamed = dict(self.progress)
            self.progress = dict.fromkeys(self.takers, time.monotonic())
            for node, done in self.settle("installing the venv", finishes).items():
                seconds = time.monotonic() - self.start
                self.ends[node] = (streamed[node], self.progress[node])
                self.results[node] = ShipResult(node, "shipped", done["bytes"], seconds)
                del self.takers[node]
        if self.aborts:  # before `ship` kills the actors
            ray.wait(self.aborts, num_returns=len(self.aborts), timeout=60)

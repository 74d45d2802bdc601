"""The stream of a ship: the chunks from the sender to the receivers that took the venv, along
the relay tree (`relay`), each receiver judged on its own; and waiting for each node's answer
(`each_answer`), which the offer uses too."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import ray

from ray_uv_plugin.ship.messages import ChunkMeta, Installed, Offer, Progress, ShipResult
from ray_uv_plugin.ship.options import ShipReporter
from ray_uv_plugin.ship.relay import RELAY_WAIT_SHARE, relay_depth, relay_fanout, relay_parents
from ray_uv_plugin.ship.relay import window as relay_window


def node_error(e: BaseException, node: str, step: str) -> str:
    """What went wrong on `node` at `step`: the receiver's own ShipError (which names both)
    out of Ray's wrapping, else Ray's error (the actor or its node died, ...) with both."""
    text = str(e)
    start = text.find("ShipError: ")
    if start >= 0:
        return text[start + len("ShipError: ") :].strip().splitlines()[0]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"node {node}: {step}: {type(e).__name__}: {first}"


def _time_left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def each_answer(
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
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_time_left(until))
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


class Stream:
    """The chunks from the sender to the receivers that took the venv, each receiver judged on
    its own: one that does not acknowledge a chunk within `stall_timeout` of its previous
    acknowledgement is failed and killed (it cannot even abort), and the others go on."""

    def __init__(
        self,
        sender: Any,
        source: Offer,
        takers: dict[str, Any],
        results: dict[str, ShipResult],
        where: dict[str, str],
        deadline: float,
        stall_timeout: float,
        chunk_bytes: int,
    ) -> None:
        self.sender, self.source, self.takers, self.results = sender, source, takers, results
        self.where, self.deadline, self.stall = where, deadline, stall_timeout
        chunks = max(1, -(-int(source.size) // chunk_bytes))  # about: the stream's size
        self.fanout = relay_fanout(chunks, len(takers))
        self.window = relay_window(relay_depth(len(takers), self.fanout))
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
        answers, stalled = each_answer(acks, self.progress, self.stall, self.deadline)
        done = {}
        for node, answer in answers.items():
            if isinstance(answer, BaseException):
                self.fail(node, node_error(answer, self.where[node], step))
            else:
                self.progress[node] = time.monotonic()
                done[node] = answer
        for node, waited in stalled.items():
            self._stalled(node, step, waited)
        return done

    def run(self, reporter: ShipReporter) -> None:
        source, in_flight = self.source, deque()
        meta: ChunkMeta | None = None
        while self.takers:
            meta_ref, data_ref = self.sender.next_chunk.remote()
            try:
                limit = min(self.stall, _time_left(self.deadline))
                meta = ray.get(meta_ref, timeout=max(limit, 1))
            except Exception as e:
                step = f"sending chunk {meta.index + 1 if meta else 0}"
                why = "the source " + node_error(e, self.where[source.node_id], step)
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
                acks[n], copies[n] = r.relay.remote(meta.index, meta.sha256, sources, forward, wait)
            del data_ref, copies  # the pending `relay`s hold the copies; freed when done
            in_flight.append((meta.index, acks))
            reporter.progress(
                Progress(meta.index, meta.total, source.size, len(self.takers), source.pid)
            )
            while in_flight and (len(in_flight) > self.window or meta.last):
                chunk, acks = in_flight.popleft()
                self.settle(f"receiving chunk {chunk}", acks)
            if meta.last:
                break
        while in_flight:  # what is still in flight to receivers that failed meanwhile
            chunk, acks = in_flight.popleft()
            self.settle(f"receiving chunk {chunk}", acks)
        if self.takers and meta is not None:
            self._install(meta)
        if self.aborts:  # before `ship` kills the actors
            ray.wait(self.aborts, num_returns=len(self.aborts), timeout=60)

    def _install(self, last: ChunkMeta) -> None:
        """Have each receiver still taking check the whole stream and install the venv."""
        finishes = {
            n: r.finish.remote(last.index + 1, last.total, last.whole_sha256)
            for n, r in self.takers.items()
        }
        streamed = dict(self.progress)
        self.progress = dict.fromkeys(self.takers, time.monotonic())
        for node, done in self.settle("installing the venv", finishes).items():
            installed: Installed = done
            seconds = time.monotonic() - self.start
            self.ends[node] = (streamed[node], self.progress[node])
            self.results[node] = ShipResult(node, "shipped", installed.bytes, seconds)
            del self.takers[node]

"""Shipping a ready venv from the node that has it to other nodes, through Ray's object store.

This module is the driver's side of one ship (`ship`). It starts a `VenvSender` actor on the
source node and a `VenvReceiver` on each target node (`actors`, started and stopped by
`launch`), offers each receiver the sender's description of the venv (`messages.Offer`), and
streams the venv's chunks (`archive`) to those that take it (`stream`), through a tree of the
receivers still taking it (`relay`). The actors may be started before the venv is ready
(`start_actors`), and the caller's reporter hears each node's part as soon as its offer is
answered (`ShipReporter.decided`), to start what waits for that node's venv.

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
import time
from dataclasses import replace
from typing import Any

import ray

from ray_uv_plugin.settings import NodeSettings
from ray_uv_plugin.ship import delta
from ray_uv_plugin.ship.launch import (
    ShipActors,
    actors_env,
    already_there,
    refused_by_job,
)
from ray_uv_plugin.ship.messages import OfferAnswer, ShipResult
from ray_uv_plugin.ship.options import QuietShipReporter, ShipOptions, ShipReporter
from ray_uv_plugin.ship.stream import Stream, each_answer, node_error

ACTOR_START = 60.0  # besides the stall timeout, for an actor's first answer: its process starts


def _addresses() -> dict[str, str]:
    return {n["NodeID"]: f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in ray.nodes()}


def _steps(marks: list[float]) -> list[float]:
    """The seconds between consecutive time marks."""
    return [round(b - a, 3) for a, b in itertools.pairwise(marks)]


def ship(
    key: str,
    source_node: str,
    targets: list[str],
    options: ShipOptions | None = None,
    reporter: ShipReporter | None = None,
    actors: ShipActors | None = None,
) -> dict[str, ShipResult]:
    """Send the ready venv `key` from `source_node` to each of `targets` (node ids); returns
    each target's result. Never raises for one node's failure: it is that node's result.

    `options`: how (`ShipOptions`: the receivers' settings, the actors' runtime_env, chunk
    size, time limits). `reporter` hears of each target's part once, as soon as it is known
    (`ShipReporter.decided`), and of each chunk. `actors`: started before (`start_actors`)
    from `source_node` to the targets, no others."""
    options = options or ShipOptions()
    reporter = reporter or QuietShipReporter()
    if actors is not None and (
        actors.source_node != source_node or set(actors.receivers) != set(targets)
    ):
        actors.stop()
        raise ValueError(
            f"the actors were started to send from {actors.source_node} to "
            f"{sorted(actors.receivers)}, not from {source_node} to {sorted(targets)}"
        )
    refused = refused_by_job()
    if refused is not None:
        if actors is not None:
            actors.stop()
        for n in targets:
            reporter.decided(n, "refused")
        return {n: ShipResult(n, "refused", why=refused) for n in targets}
    deadline = time.monotonic() + options.timeout
    first_answer = min(options.stall_timeout + ACTOR_START, options.timeout)
    where = _addresses()
    marks = [time.monotonic()]  # when each of the steps before the stream ended
    if actors is None:
        runtime_env = actors_env(options.runtime_env)
        results = already_there(key, targets, runtime_env, first_answer)
        for n in results:
            reporter.decided(n, "reused")
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
            offer = ray.get(
                actors.sender.open.remote(key, options.chunk_bytes), timeout=first_answer
            )
        except Exception as e:
            why = "the source " + node_error(e, where[source_node], "describing the venv")
            for n in targets:
                reporter.decided(n, "failed")
            return {**results, **{n: ShipResult(n, "failed", why=why) for n in targets}}
        offer = replace(offer, node_id=source_node)
        if not NodeSettings.read().ships_seeds():
            offer = replace(offer, files=())  # nothing a receiver may take from its seed
        marks.append(time.monotonic())
        offers = {n: r.offer.remote(offer, options.settings) for n, r in actors.receivers.items()}
        answers, stalled = each_answer(
            offers, dict.fromkeys(offers, time.monotonic()), first_answer, deadline
        )
        marks.append(time.monotonic())
        takers: dict[str, Any] = {}
        for n, answer in answers.items():
            if isinstance(answer, BaseException):
                results[n] = ShipResult(n, "failed", why=node_error(answer, where[n], "the offer"))
            elif answer.decision == "take":
                takers[n] = actors.receivers[n]
            else:
                results[n] = ShipResult(n, answer.decision, why=answer.why)
        for n, waited in stalled.items():  # killed now: it may hold the lock
            ray.kill(actors.receivers[n])
            why = f"node {where[n]}: the offer: stalled: no answer for {waited:.0f}s"
            results[n] = ShipResult(n, "failed", why=why)
        for n in targets:
            reporter.decided(n, "take" if n in takers else results[n].outcome)
        taken: list[OfferAnswer] = [answers[n] for n in takers]
        shared = delta.shared_files(taken)
        if shared:  # what every taker has from its seed is not sent (`delta`)
            try:
                ray.get(actors.sender.refer.remote(shared), timeout=first_answer)
            except Exception:  # noqa: BLE001 - the stream says what became of the sender
                pass
        stream = Stream(
            actors.sender,
            offer,
            takers,
            results,
            where,
            deadline,
            options.stall_timeout,
            options.chunk_bytes,
        )
        stream.run(reporter)
        before = dict(zip(("check", "open", "offer"), _steps(marks), strict=True))
        for node, ends in stream.ends.items():
            if results[node].outcome == "shipped":
                stream_end, install_end = ends
                phases = {
                    **before,
                    "stream": round(stream_end - stream.start, 3),
                    "install": round(install_end - stream_end, 3),
                }
                results[node] = replace(results[node], phases=phases)
        return results
    finally:
        actors.stop()

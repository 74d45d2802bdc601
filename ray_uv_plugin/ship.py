"""Shipping a ready venv from the node that has it to other nodes, through Ray's object store.

The driver starts a `VenvSender` actor on the source node and a `VenvReceiver` on each target
node (both on the node's own Python, which has this package since its raylet loads the plugin).
It pulls the venv's chunks (`venv_archive`) from the sender one at a time and hands each chunk's
object ref to every receiver still taking it; Ray moves the bytes, and a receiver may pull a
chunk from any node that already holds a copy. At most `WINDOW` chunks are in flight, so the
object store holds a few chunks per node, never the venv.

A receiver takes a venv only where the node's own plugin would use it: the same Ray, Python
interpreter, platform and uv version, and no ready venv of the key there yet. It holds the
key's build lock while it receives, so the node's plugin waits for it rather than building the
same venv, and a receiver that dies (the node, the driver, a SIGKILL) leaves only a
`<key>.ship-XXXX` dir that is never used and is removed by the next receive or build of the key.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_uv_plugin import trust, venv_archive
from ray_uv_plugin.lockfile import BuildLock
from ray_uv_plugin.request import interpreter_tag
from ray_uv_plugin.uv import uv_version
from ray_uv_plugin.uv_env import keyed_settings, sync_environment
from ray_uv_plugin.venv_cache import (
    check_ready,
    install_received,
    lock_path,
    read_marker,
    venv_root,
)

SHIP_ENV = "RAY_UV_PLUGIN_SHIP"  # "0" on the driver: `prepare` and worker groups never ship
WINDOW = 4  # chunks in flight to each receiver


class ShipError(RuntimeError):
    """A venv could not be sent or received; the message names the node and the step."""


def shipping_enabled() -> bool:
    return os.environ.get(SHIP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def platform_tag() -> str:
    """What decides which wheels run here beyond the interpreter: the platform and its libc."""
    libc, version = platform.libc_ver()
    return f"{sysconfig.get_platform()} {libc or 'no-libc'} {version}".strip()


def _where() -> str:
    """This node as the driver names it: `10.0.0.8 (77aa00ff)`."""
    context = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()} ({context.get_node_id()[:8]})"


@ray.remote(num_cpus=0, max_restarts=0)
class VenvSender:
    """On the node that has the ready venv `key`: its description, then its chunks in order."""

    def __init__(self, key: str, chunk_bytes: int) -> None:
        self.key = key
        root = venv_root()
        trust.check_root(root)
        why = check_ready(root, key)
        if why is not None:
            raise ShipError(f"{_where()}: the venv {key} to send is not ready: {why}")
        self.venv = root / key
        self.marker = read_marker(self.venv)
        self.packer = venv_archive.Packer(self.venv, chunk_bytes)

    def describe(self) -> dict[str, Any]:
        size, on_disk = venv_archive.disk_usage(self.venv)
        return {
            "key": self.key,
            "venv": str(self.venv),
            "host": _where(),
            "marker": self.marker,
            "platform": platform_tag(),
            "size": size,
            "du": on_disk,
            "pid": os.getpid(),
        }

    @ray.method(num_returns=2)
    def next_chunk(self) -> tuple[dict[str, Any], bytes]:
        chunk = self.packer.next_chunk()
        meta = {
            "index": chunk.index,
            "sha256": chunk.sha256,
            "size": len(chunk.data),
            "last": chunk.last,
            "total": self.packer.total,
            "whole_sha256": self.packer.whole_sha256 if chunk.last else None,
        }
        return meta, chunk.data


@ray.remote(num_cpus=0, max_restarts=0)
class VenvReceiver:
    """On a target node: decides whether to take the venv, then unpacks and installs it."""

    def __init__(self) -> None:
        self.root = venv_root()
        self.lock: BuildLock | None = None
        self.unpacker: venv_archive.Unpacker | None = None
        self.source: dict[str, Any] = {}
        self.start = time.monotonic()

    def _fail(self, step: str, e: BaseException) -> ShipError:
        self.abort()
        return ShipError(f"node {_where()}: {step}: {e}")

    def offer(self, source: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        """`take` (the lock is then held), `reused`, or `refused` with why. `settings`: the
        request's env_vars and whether it resolves, for the uv settings this node keys."""
        try:
            return self._offer(source, settings)
        except Exception as e:
            raise self._fail("checking the offer", e) from e

    def _offer(self, source: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        key, marker = source["key"], source["marker"]
        inputs = marker.get("inputs") or {}
        env = sync_environment(settings["env_vars"])
        uv_settings = [list(item) for item in keyed_settings(env, settings["resolves"])]
        differs = [
            (what, theirs, mine)
            for what, theirs, mine in (
                ("Ray", marker.get("ray"), ray.__version__),
                ("Python interpreter", inputs.get("interpreter"), interpreter_tag()),
                ("platform", source["platform"], platform_tag()),
                ("uv", inputs.get("uv"), uv_version()),
                ("set of uv settings", inputs.get("env"), uv_settings),
            )
            if theirs != mine
        ]
        if differs:
            what, theirs, mine = differs[0]
            why = f"another {what} here ({mine}; the venv's: {theirs})"
            return {"decision": "refused", "why": why}
        trust.make_root(self.root)
        if check_ready(self.root, key) is None:
            return {"decision": "reused"}
        lock = BuildLock(lock_path(self.root, key))
        if not lock.try_acquire():
            why = f"another build of {key} is running here ({lock.holder()})"
            return {"decision": "refused", "why": why}
        self.lock, self.source = lock, source
        if check_ready(self.root, key) is None:  # built while we looked
            self.abort()
            return {"decision": "reused"}
        venv_archive.remove_leftovers(self.root, key)
        self.unpacker = venv_archive.Unpacker(self.root, key, source["host"])
        self.start = time.monotonic()
        return {"decision": "take"}

    def add(self, index: int, sha256: str, data: bytes) -> None:
        if self.unpacker is None:
            raise ShipError(f"node {_where()}: chunk {index}: not receiving (failed before)")
        try:
            self.unpacker.add(index, sha256, data)
        except Exception as e:
            raise self._fail(f"receiving chunk {index}", e) from e

    def finish(self, chunks: int, total: int, whole_sha256: str) -> dict[str, Any]:
        if self.unpacker is None:
            raise ShipError(f"node {_where()}: finishing: not receiving (failed before)")
        try:
            tree = self.unpacker.finish(chunks, total, whole_sha256)
            meta = {
                **self.source["marker"],
                "venv": self.source["venv"],
                "shipped_from": self.source["host"],
                "received_at": time.time(),
            }
            install_received(self.root, self.source["key"], tree, meta)
        except Exception as e:
            raise self._fail("installing the received venv", e) from e
        self.unpacker = None
        seconds = time.monotonic() - self.start
        self.abort()  # releases the lock; nothing is left to remove
        return {"bytes": total, "seconds": seconds}

    def abort(self) -> None:
        """Remove what this receive made and release the lock. (A receiver that dies cannot:
        the kernel releases its lock, and the next receive or build removes its tree.)"""
        if self.unpacker is not None:
            unpacker, self.unpacker = self.unpacker, None
            unpacker.abort()
        if self.lock is not None:
            lock, self.lock = self.lock, None
            lock.release()


@ray.remote(num_cpus=0, max_retries=0)
def _is_ready(key: str) -> bool:
    try:
        root = venv_root()
        trust.check_root(root)
        return check_ready(root, key) is None
    except Exception:  # noqa: BLE001 - anything else is for the receiver to report
        return False


def _already_there(
    key: str, targets: list[str], runtime_env: dict[str, Any] | None, timeout: float
) -> dict[str, ShipResult]:
    """The targets that have the ready venv already, found by a plain task on each."""
    refs = {n: _is_ready.options(**_pinned(n, runtime_env)).remote(key) for n in targets}
    found = {}
    for node, ref in refs.items():
        try:
            if ray.get(ref, timeout=timeout):
                found[node] = ShipResult(node, "reused")
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


def ship(
    key: str,
    source_node: str,
    targets: list[str],
    settings: dict[str, Any] | None = None,
    runtime_env: dict[str, Any] | None = None,
    chunk_bytes: int = venv_archive.CHUNK_BYTES,
    timeout: float = 1800.0,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> dict[str, ShipResult]:
    """Send the ready venv `key` from `source_node` to each of `targets` (node ids); returns
    each target's result. Never raises for one node's failure: it is that node's result.

    `settings`: `{"env_vars": the runtime_env's, "resolves": not locked/frozen}` (default: none,
    locked); `runtime_env`: for the actors, whose interpreter must have this package (default:
    the job's, or this driver's interpreter where the job sets a `py_executable`)."""
    settings = settings or {"env_vars": {}, "resolves": False}
    job_env = ray.get_runtime_context().runtime_env
    if "uv_project" in job_env:  # every actor of the job would run in that venv, without us
        why = "the job's own runtime_env has uv_project (ask for it per actor to ship it)"
        return {n: ShipResult(n, "refused", why=why) for n in targets}
    if runtime_env is None and job_env.get("py_executable"):  # e.g. Ray's `uv run` hook's
        runtime_env = {"py_executable": sys.executable}
    deadline = time.monotonic() + timeout
    where = _addresses()
    results = _already_there(key, targets, runtime_env, timeout)
    targets = [n for n in targets if n not in results]
    if not targets:
        return results  # a group whose nodes have the venv pays for no sender and receivers
    sender = VenvSender.options(**_pinned(source_node, runtime_env)).remote(key, chunk_bytes)
    receivers = {n: VenvReceiver.options(**_pinned(n, runtime_env)).remote() for n in targets}
    try:
        try:
            source = ray.get(sender.describe.remote(), timeout=max(deadline - time.monotonic(), 1))
        except Exception as e:
            why = "the source " + _error(e, where[source_node], "describing the venv")
            return {n: ShipResult(n, "failed", why=why) for n in targets}
        source["node_id"] = source_node
        offers = {n: r.offer.remote(source, settings) for n, r in receivers.items()}
        takers: dict[str, Any] = {}
        for n, ref in offers.items():
            try:
                offer = ray.get(ref, timeout=max(deadline - time.monotonic(), 1))
            except Exception as e:
                results[n] = ShipResult(n, "failed", why=_error(e, where[n], "the offer"))
                continue
            if offer["decision"] == "take":
                takers[n] = receivers[n]
            else:
                results[n] = ShipResult(n, offer["decision"], why=offer.get("why"))
        _stream(sender, source, takers, results, deadline, on_progress, where)
        return results
    finally:
        for actor in [sender, *receivers.values()]:
            ray.kill(actor)


def _stream(
    sender: Any,
    source: dict[str, Any],
    takers: dict[str, Any],
    results: dict[str, ShipResult],
    deadline: float,
    on_progress: Callable[[Progress], None],
    where: dict[str, str],
) -> None:
    start = time.monotonic()
    window: deque[tuple[int, dict[str, Any]]] = deque()

    aborts = []

    def fail(node: str, why: str) -> None:
        if node in takers:
            aborts.append(takers.pop(node).abort.remote())  # removes what it unpacked
            results[node] = ShipResult(node, "failed", why=why)

    def settle(chunk: int, acks: dict[str, Any]) -> None:
        for node, ref in acks.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 1))
            except Exception as e:
                fail(node, _error(e, where[node], f"receiving chunk {chunk}"))

    meta: dict[str, Any] = {"index": -1}
    while takers:
        meta_ref, data_ref = sender.next_chunk.remote()
        try:
            meta = ray.get(meta_ref, timeout=max(deadline - time.monotonic(), 1))
        except Exception as e:
            step = f"sending chunk {meta['index'] + 1}"
            why = "the source " + _error(e, where[source["node_id"]], step)
            for node in list(takers):
                fail(node, why)
            break
        acks = {n: r.add.remote(meta["index"], meta["sha256"], data_ref) for n, r in takers.items()}
        del data_ref  # the pending `add`s hold the chunk; it is freed when they are done
        window.append((meta["index"], acks))
        on_progress(
            Progress(meta["index"], meta["total"], source["size"], len(takers), source["pid"])
        )
        while window and (len(window) > WINDOW or meta["last"]):
            settle(*window.popleft())
        if meta["last"]:
            break
    while window:  # what is still in flight to receivers that failed meanwhile
        settle(*window.popleft())
    for node in list(takers):
        try:
            done = ray.get(
                takers[node].finish.remote(meta["index"] + 1, meta["total"], meta["whole_sha256"]),
                timeout=max(deadline - time.monotonic(), 1),
            )
        except Exception as e:
            fail(node, _error(e, where[node], "installing the venv"))
            continue
        results[node] = ShipResult(node, "shipped", done["bytes"], time.monotonic() - start)
    if aborts:  # before `ship` kills the actors
        ray.wait(aborts, num_returns=len(aborts), timeout=60)

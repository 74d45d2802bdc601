"""What runs on the nodes while a venv is shipped: a `VenvSender` on the node that has it, a
`VenvReceiver` on each target, and a task that asks a node whether it has the venv already.
The driver side that starts and feeds them is `transfer`; what they say to it and to each
other is typed in `messages`.
"""

from __future__ import annotations

import os
import platform
import queue
import socket
import sysconfig
import threading
import time
from typing import Any

import ray

from ray_uv_plugin.building.phase_events import PhaseEvents
from ray_uv_plugin.env.key import KeyInputs
from ray_uv_plugin.env.uv_env import sync_environment
from ray_uv_plugin.settings import BUILD_TIMEOUT_ENV
from ray_uv_plugin.ship import archive, delta, unpack
from ray_uv_plugin.ship.build_target import build_target, local_builds, target_differs
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.messages import (
    ChunkMeta,
    Installed,
    Offer,
    OfferAnswer,
    ShipError,
    ShipSettings,
    check_offer,
)
from ray_uv_plugin.store import outcomes, trust
from ray_uv_plugin.store.build_lock import BuildLock, build_timeout, hold_shared
from ray_uv_plugin.store.disk import NO_SPACE, disk_full, venv_size
from ray_uv_plugin.store.layout import Venv, venv_root

WATCH_INTERVAL = 1.0  # how often a receiver checks how long it has held the lock
UNPACK_QUEUE = 2  # chunks a receiver holds, pulled but not yet unpacked, while it pulls the next
# How a refusal names what a node contributes to a venv's key (`KeyInputs.on_this_node`).
NODE_INPUTS = {"interpreter": "Python interpreter", "uv": "uv", "env": "set of uv settings"}


def platform_tag() -> str:
    """What decides which wheels run here beyond the interpreter: the platform and its libc."""
    libc, version = platform.libc_ver()
    return f"{sysconfig.get_platform()} {libc or 'no-libc'} {version}".strip()


def _where() -> str:
    """This node as the driver names it: `10.0.0.8 (77aa00ff)`; outside Ray (a receiver's
    checks called directly) its host name, never a Ray started for the sake of a message."""
    if not ray.is_initialized():
        return socket.gethostname()
    context = ray.get_runtime_context()
    return f"{ray.util.get_node_ip_address()} ({context.get_node_id()[:8]})"


def _keyed_env(marker: dict[str, Any]) -> dict[str, str]:
    """The uv settings the venv was built with (its key's), over this process's environment:
    the environment its build saw, as far as the build target goes."""
    inputs = KeyInputs.from_json(marker.get("inputs"))
    return {**os.environ, **dict(inputs.env if inputs is not None else ())}


@ray.remote(num_cpus=0, max_restarts=0)
class VenvSender:
    """On the node that has the ready venv: once `open`ed for a key, its description, then its
    chunks in order. It may be started before the venv is ready (while it is built).

    It holds the key's build lock shared from `open` to its end (the kernel drops it when the
    actor dies): `gc` skips the venv and no build replaces it while it is read. A venv that is
    not what its build made (`archive.DriftError`) is not sent, and is marked not whole, so
    that its next use here rebuilds it."""

    def open(self, key: str, chunk_bytes: int) -> Offer:
        """Take the ready venv `key` to send, in chunks of `chunk_bytes`; its `describe`."""
        self.key = key
        root = venv_root()
        trust.check_root(root)
        venv = Venv(root, key)
        try:
            self._lock_fd = hold_shared(venv.lock)
        except (BlockingIOError, FileNotFoundError) as e:
            raise ShipError(
                f"{_where()}: the venv {key} to send is being built or removed here, or has no "
                f"build lock ({e}): try again once `ray-uv list` shows it ready"
            ) from e
        ready = venv.check_ready()
        if not ready:
            raise ShipError(f"{_where()}: the venv {key} to send is not ready: {ready.why_not}")
        self._venv, self.venv = venv, venv.path
        self.marker = dict(ready.marker or {})  # as checked: no second read
        try:
            self.packer = archive.Packer(self.venv, chunk_bytes)
        except archive.DriftError as e:
            raise self._drifted(e) from e
        except archive.ArchiveError as e:  # one that a rebuild here would not change
            raise ShipError(f"{_where()}: the venv {key} to send: {e}") from e
        return self.describe()

    def _drifted(self, e: archive.DriftError) -> ShipError:
        try:
            self._venv.mark_not_whole(str(e))
            then = "it is rebuilt at its next use here"
        except OSError as error:
            then = f"it could not be marked for a rebuild ({error}): remove it with `ray-uv gc`"
        return ShipError(f"{_where()}: the venv {self.key} to send: {e}; not sent, and {then}")

    def describe(self) -> Offer:
        size, on_disk = venv_size(self.venv)
        built_here = local_builds(self.venv)
        return Offer(
            key=self.key,
            venv=str(self.venv),
            host=_where(),
            marker=self.marker,
            platform=platform_tag(),
            size=size,
            du=on_disk,
            pid=os.getpid(),
            built_here=built_here,
            target=build_target(_keyed_env(self.marker or {})) if built_here else None,
            distributions=tuple(delta.distributions(self.venv)),
            files=tuple(delta.offered_files(self.packer.built)),
        )

    def refer(self, sha256s: list[str]) -> int:
        """Stream the files of these sha256s as references (every receiver staged them from
        its seed: `delta`); before the first chunk. Returns how many."""
        self.packer.refer = frozenset(sha256s)
        return len(self.packer.refer)

    @ray.method(num_returns=2)
    def next_chunk(self) -> tuple[ChunkMeta, bytes]:
        try:
            chunk = self.packer.next_chunk()
        except archive.DriftError as e:
            raise self._drifted(e) from e
        meta = ChunkMeta(
            index=chunk.index,
            sha256=chunk.sha256,
            size=len(chunk.data),
            last=chunk.last,
            total=self.packer.total,
            whole_sha256=self.packer.whole_sha256 if chunk.last else None,
        )
        return meta, chunk.data


@ray.remote(num_cpus=0, max_restarts=0)
class VenvReceiver:
    """On a target node: decides whether to take the venv, then unpacks and installs it.

    Its methods run one at a time on the actor's thread. Two threads of its own beside: one
    unpacks the chunks `relay` pulled, in order, while the next one is pulled (and passed on);
    a watchdog gives the lock up once it has been held as long as a build may hold it.
    `_guard` keeps them apart."""

    def __init__(self) -> None:
        self.root = venv_root()
        self.lock: BuildLock | None = None
        self.unpacker: unpack.Unpacker | None = None
        self.source: Offer | None = None  # the offer taken
        self.events: PhaseEvents | None = None  # the receive's phases, for the readiness view
        self.start = time.monotonic()
        self.gave_up: str | None = None
        self._guard = threading.RLock()
        self._chunks: queue.Queue[tuple[int, str, bytes]] = queue.Queue(UNPACK_QUEUE)
        self._unpack_failed: BaseException | None = None

    def _fail(self, step: str, e: BaseException) -> ShipError:
        self.abort(f"{step}: {e}")
        return ShipError(f"node {_where()}: {step}: {e}")

    def offer(self, source: Any, settings: ShipSettings) -> OfferAnswer:
        """`take` (the lock is then held), `reused`, or `refused` with why. `source`: the
        sender's `Offer`, checked first (`check_offer`); `settings`: the request's, for the uv
        settings this node keys."""
        offer: Offer | None = None
        try:
            offer = check_offer(source)
            with self._guard:
                return self._offer(offer, settings)
        except OSError as e:
            if e.errno not in NO_SPACE or offer is None:
                raise self._fail("checking the offer", e) from e
            full = disk_full(self.root, f"while receiving {offer.key}")
            raise self._fail("checking the offer", OSError(full)) from e
        except Exception as e:
            raise self._fail("checking the offer", e) from e

    def _refusal(self, source: Offer, env: dict[str, str], resolves: bool) -> str | None:
        """Why this node's plugin would not use the source's venv; None if it would: where the
        venv's key inputs, with this node's interpreter, uv and uv settings, give its key."""
        marker = source.marker
        for what, venvs, ours in (
            ("Ray", marker.get("ray"), ray.__version__),
            ("platform", source.platform, platform_tag()),
        ):
            if venvs != ours:
                return f"another {what} here ({ours}; the venv's: {venvs})"
        theirs = KeyInputs.from_json(marker.get("inputs"))
        if theirs is None:
            return "its marker does not record the inputs of its key"
        mine = theirs.on_this_node(env, resolves)
        if mine.key != source.key:
            differs = mine.differs_on(theirs)  # of NODE_INPUTS alone: the rest is the venv's
            if not differs:
                return f"its marker's inputs make key {mine.key}, not {source.key}"
            name = differs[0]
            here, there = getattr(mine, name), getattr(theirs, name)
            return f"another {NODE_INPUTS[name]} here ({here}; the venv's: {there})"
        if source.built_here:
            target = dict(source.target or {})  # checked: a map where built_here is one
            return target_differs(target, build_target(env), dict(source.built_here))
        return None

    def _offer(self, source: Offer, settings: ShipSettings) -> OfferAnswer:
        key = source.key
        spec = settings.spec
        env = sync_environment(settings.env_vars, build_env_vars=spec.build_env_vars)
        why = self._refusal(source, env, spec.resolves)
        if why is not None:
            return OfferAnswer("refused", why)
        trust.make_root(self.root)
        venv = Venv(self.root, key)
        if venv.check_ready():
            return OfferAnswer("reused")
        lock = BuildLock(venv.lock)
        if not lock.try_acquire():
            why = f"another build of {key} is running here ({lock.holder()})"
            return OfferAnswer("refused", why)
        self.lock, self.source = lock, source
        if venv.check_ready():  # built while we looked
            self.abort()
            return OfferAnswer("reused")
        self.events = PhaseEvents(self.root, key)
        self.events.enter("ship bytes", "receiving", source=source.host)
        venv.remove_leftovers()
        self.unpacker = unpack.Unpacker(self.root, key, source.host, sender_venv=source.venv)
        self.unpacker.staged = delta.stage(self.root, self.unpacker.tmp, key, source)
        self.start = time.monotonic()
        limit = build_timeout()
        threading.Thread(
            target=self._watch, args=(limit,), name="ship watchdog", daemon=True
        ).start()
        threading.Thread(target=self._unpack_chunks, name="ship unpack", daemon=True).start()
        return delta.take_answer(self.unpacker.staged)

    def _unpack_chunks(self) -> None:
        """Add the chunks `relay` queued, in order; the first failure is kept for `relay` or
        `finish` to raise (`add` has aborted the receive), the rest are dropped."""
        while True:  # until the actor ends (a daemon thread)
            item = self._chunks.get()
            try:
                if self._unpack_failed is None:
                    self.add(*item)
            except BaseException as e:  # noqa: BLE001 - raised by the next relay or finish
                self._unpack_failed = e
            finally:
                self._chunks.task_done()

    def _raise_unpack_failure(self) -> None:
        if self._unpack_failed is not None:
            raise self._unpack_failed

    def _watch(self, limit: float) -> None:
        """Give the lock up once it has been held `limit` seconds: waiting requests wait that
        plus LOCK_MARGIN, then fail, and a driver that stalled may never call `abort`."""
        taken = self.start
        while self.lock is not None and time.monotonic() - taken < limit:
            time.sleep(WATCH_INTERVAL)
        with self._guard:
            if self.lock is None:  # installed or failed meanwhile
                return
            self.gave_up = (
                f"gave up after holding the build lock for {limit:.0f}s "
                f"({BUILD_TIMEOUT_ENV}, as long as a build may hold it): the receive is too "
                "slow, or the driver stalled"
            )
            self.abort(self.gave_up)

    def _receiving(self, step: str) -> unpack.Unpacker:
        if self.unpacker is None:
            why = self.gave_up or "not receiving (failed before)"
            raise ShipError(f"node {_where()}: {step}: {why}")
        return self.unpacker

    def add(self, index: int, sha256: str, data: bytes) -> None:
        with self._guard:
            unpacker = self._receiving(f"chunk {index}")
            try:
                unpacker.add(index, sha256, data)
            except Exception as e:
                raise self._fail(f"receiving chunk {index}", e) from e
            if self.events is not None:
                self.events.add_bytes(len(data))

    @ray.method(num_returns=2)
    def relay(
        self, index: int, sha256: str, sources: list[Any], forward: bool, wait: float
    ) -> tuple[None, bytes]:
        """Pull chunk `index` from the first of `sources` (object refs: the copy of the
        receiver that passes it on to this one, then the sender's) that delivers it and queue it
        to be added (unpacked by `_unpack_chunks` while the next one is pulled); returns
        (None, this node's copy for the receivers it passes the chunk on to, if `forward`):
        they need not wait for the unpack. Each of them checks the chunk's sha256 itself."""
        self._raise_unpack_failure()
        self._receiving(f"chunk {index}")
        data = _first_copy(sources, wait)
        self._raise_unpack_failure()
        self._chunks.put((index, sha256, data))  # waits while UNPACK_QUEUE chunks wait
        return None, data if forward else b""

    def finish(self, chunks: int, total: int, whole_sha256: str) -> Installed:
        self._chunks.join()  # every chunk queued is added
        self._raise_unpack_failure()
        with self._guard:
            unpacker, source = self._receiving("finishing"), self.source
            try:
                assert source is not None and self.events is not None  # taken with the unpacker
                self.events.enter("install", "receiving")
                tree = unpacker.finish(chunks, total, whole_sha256)
                meta = {
                    **source.marker,
                    "venv": source.venv,
                    "shipped_from": source.host,
                    "received_at": time.time(),
                    # How this node's venv came to be (the sender's marker says how it was built).
                    "built": delta.built(source.host, total, unpacker.staged),
                }
                install_received(self.root, source.key, tree, meta, unpacker.heads)
            except Exception as e:
                raise self._fail("installing the received venv", e) from e
            self.unpacker = None
            self.events.clear()  # ready: its marker says how it came
            outcomes.record(self.root, source.key, "shipped", total)
            self.events = None
            seconds = time.monotonic() - self.start
            self.abort()  # releases the lock; nothing is left to remove
            return Installed(total, seconds)

    def abort(self, cause: str = "the receive was stopped") -> None:
        """Remove what this receive made, record why (`cause`, for the readiness view) and
        release the lock. (A receiver that dies cannot: the kernel releases its lock, the next
        receive or build removes its tree, and its phase record says nothing once the lock is
        free.)"""
        with self._guard:
            if self.events is not None:
                events, self.events = self.events, None
                events.failed(cause)
            if self.unpacker is not None:
                unpacker, self.unpacker = self.unpacker, None
                unpacker.abort()
            if self.lock is not None:
                lock, self.lock = self.lock, None
                lock.release()


def _first_copy(sources: list[Any], wait: float) -> Any:
    """A chunk from the first of `sources` that delivers it: a relaying receiver's copy within
    `wait` seconds (one that failed, died or stalls is passed over), else the sender's."""
    for ref in sources[:-1]:
        try:
            return ray.get(ref, timeout=wait)
        except Exception:  # noqa: BLE001 - whatever became of the relay, the next source
            pass
    return ray.get(sources[-1])


@ray.remote(num_cpus=0, max_retries=0)
def is_ready(key: str) -> bool:
    try:
        root = venv_root()
        trust.check_root(root)
        return bool(Venv(root, key).check_ready())
    except Exception:  # noqa: BLE001 - anything else is for the receiver to report
        return False

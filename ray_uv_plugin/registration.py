"""Whether the Ray a driver uses loads the `uv_project` plugin, checked on the driver.

A raylet started without the plugin in `RAY_RUNTIME_ENV_PLUGINS` (never set, or set after
`ray start` or `ray.init()`) ignores the field: its runtime-env agent writes one warning into
that node's setup log and runs the actor in the node's own Python, which "succeeds" without the
project's packages. Nothing of it reaches the driver, and no code of this package runs on the
driver per actor. So the package checks where its code does run on the driver:

- right after `ray.init()` (one of Ray's post-init hooks), armed by the `uv run` driver hook
  that `ray-uv plugin-config --shell` and `setup_driver()` register, by `setup_driver()` and by
  building a `UvProject`;
- at once, where one of those runs after `ray.init()` (`setup_driver()` called too late).

What it reads is the environment each raylet of this cluster on this host started with (the
one its runtime-env agent got), in `/proc`: no task, no worker, a few ms. Where every alive
node of the cluster is such a raylet without the plugin (a local Ray, or a one-node cluster),
every `uv_project` actor would run in the wrong Python: `PluginNotLoadedError`, and a
`ray.init()` that it fails leaves nothing connected. Where only some nodes are, a warning names
them: actors placed there would. Nodes on other hosts cannot be seen from here: `ray-uv
prepare` checks every node, and worker groups check each worker.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ray_uv_plugin.cluster.auth import check_token_auth
from ray_uv_plugin.env.fields import FIELDS
from ray_uv_plugin.env.spec import keyword_default, keyword_value
from ray_uv_plugin.settings import PLUGIN_CLASS, PLUGINS_ENV

logger = logging.getLogger(__name__)

FIX = (
    'register it before that Ray starts: `eval "$(ray-uv plugin-config --shell)"` before '
    "`ray start` (then restart the node), or `ray_uv_plugin.setup_driver()` before "
    "`ray.init()` for a local Ray"
)

# GCS addresses whose raylets on this host all load the plugin: not scanned again.
_fine: set[str] = set()
# (GCS address, raylet pid) already warned about: one warning per raylet.
_warned: set[tuple[str, int]] = set()


class PluginNotLoadedError(RuntimeError):
    """The Ray this driver uses would run every `uv_project` actor in the node's Python."""


@dataclass(frozen=True)
class Raylet:
    """A raylet of this cluster on this host, as it was started."""

    pid: int
    node_ip: str
    python: str  # the node's Python, which its workers run without the plugin
    plugins: str | None  # its RAY_RUNTIME_ENV_PLUGINS

    @property
    def loads_plugin(self) -> bool:
        return loads_plugin(self.plugins)

    def describe(self) -> str:
        return f"the raylet at {self.node_ip} (pid {self.pid}, Python {self.python})"


def loads_plugin(plugins: str | None) -> bool:
    """Whether a `RAY_RUNTIME_ENV_PLUGINS` value registers this plugin."""
    try:
        entries = json.loads(plugins or "[]")
    except ValueError:
        return False
    return isinstance(entries, list) and any(
        isinstance(e, dict) and e.get("class") == PLUGIN_CLASS for e in entries
    )


def _flag(cmdline: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next((arg[len(prefix) :] for arg in cmdline if arg.startswith(prefix)), "")


def _local_raylets(gcs_address: str) -> list[Raylet]:
    """This cluster's raylets on this host whose environment this user may read."""
    import ray  # noqa: F401 - Ray vendors psutil (`ray/thirdparty_files`) and puts it on sys.path

    psutil = importlib.import_module("psutil")  # so: after Ray
    found = []
    for process in psutil.process_iter(["name"]):
        if process.info["name"] != "raylet":
            continue
        try:
            cmdline = process.cmdline()
            if _flag(cmdline, "gcs-address") != gcs_address:
                continue
            environ = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        worker_command = _flag(cmdline, "python_worker_command").split()
        found.append(
            Raylet(
                pid=process.pid,
                node_ip=_flag(cmdline, "node_ip_address") or "this host",
                python=worker_command[0] if worker_command else "unknown",
                plugins=environ.get(PLUGINS_ENV),
            )
        )
    return found


def unloaded_message(gcs_address: str, without: list[Raylet], alive: int) -> str:
    names = "; ".join(r.describe() for r in without)
    if len(without) >= alive:
        return (
            f"uv_project: the Ray at {gcs_address} does not load the uv_project plugin: "
            f"{names} started without {PLUGIN_CLASS} in {PLUGINS_ENV}, so it would run every "
            "actor or task that asks for a uv_project in its own Python, without the "
            f"project's packages, and say so only in its runtime_env setup log. To fix, {FIX}."
        )
    return (
        f"uv_project: {len(without)} of the {alive} nodes of the Ray at {gcs_address} do not "
        f"load the uv_project plugin: {names} started without {PLUGIN_CLASS} in "
        f"{PLUGINS_ENV}; an actor or task with a uv_project placed there runs in that node's "
        f"own Python, without the project's packages. On that node, {FIX}."
    )


def _check_this_ray() -> None:
    """Raise `PluginNotLoadedError` where no node of this driver's Ray loads the plugin; warn
    where some on this host do not. Nothing where Ray is not initialized."""
    import ray

    if not ray.is_initialized():
        return
    try:
        gcs_address = ray.get_runtime_context().gcs_address
        if not gcs_address or gcs_address in _fine:
            return
        without = [r for r in _local_raylets(gcs_address) if not r.loads_plugin]
    except Exception as e:  # noqa: BLE001 - a check that cannot run (Ray Client...) stays quiet
        logger.debug("uv_project: cannot check whether this Ray loads the plugin: %s", e)
        return
    if not without:
        _fine.add(gcs_address)
        return
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    message = unloaded_message(gcs_address, without, alive)
    if len(without) >= alive:
        raise PluginNotLoadedError(message)
    if any((gcs_address, r.pid) not in _warned for r in without):
        _warned.update((gcs_address, r.pid) for r in without)
        logger.warning("%s", message)


def _after_init() -> None:
    """Ray's post-init hook: a `ray.init()` whose Ray cannot run `uv_project` fails whole."""
    try:
        _check_this_ray()
    except PluginNotLoadedError:
        import ray

        ray.shutdown()
        raise


def _ray_init_address() -> str | None:
    """The GCS address (`host:port`) given to the `ray.init` this code runs inside (our
    runtime_env hook runs there, before Ray connects); None outside `ray.init`, and where Ray
    finds the cluster itself (no address, `auto`, `local`) or it is Ray Client's (`ray://`)."""
    worker = sys.modules.get("ray._private.worker")
    init = getattr(worker, "init", None)
    code = getattr(inspect.unwrap(init), "__code__", None) if callable(init) else None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    address = frame.f_locals.get("address") if frame is not None else None
    if not isinstance(address, str) or address in ("auto", "local") or "://" in address:
        return None
    return address


def _check_token_before_connect() -> None:
    """Inside `ray.init(address=...)`: raise `TokenAuthError` where that cluster requires a token
    this process does not send. Ray retries the refused handshake for 20 s and then raises a
    bare `ConnectionError`; a local `ray.init()` (the demo's too) writes `~/.ray/auth_token`, so
    a later plain `ray start` on that machine already requires one. Without an address, Ray
    finds the local cluster and turns token mode on where a token exists: nothing to check."""
    gcs = _ray_init_address()
    if gcs is None:
        return
    host, _, port = gcs.rpartition(":")
    try:  # a port that no process answers: ray.init says what it says
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return
    check_token_auth(gcs)


def watch() -> None:
    """Check this driver's Ray now if it is up, and after each later `ray.init()` in this
    process; inside `ray.init` (the driver hook), its token first. Nothing before Ray is
    imported (then the driver hook arms it at `ray.init()`)."""
    worker = sys.modules.get("ray._private.worker")
    if worker is None:
        return
    _check_token_before_connect()
    hooks = getattr(worker, "_post_init_hooks", None)  # ray_compat.DRIVER lists it
    if isinstance(hooks, list) and _after_init not in hooks:
        hooks.append(_after_init)
    _check_this_ray()


class UvProject(dict):
    """A typed builder of the `uv_project` value: `runtime_env={"uv_project": UvProject(...)}`,
    as drivers import it (`ray_uv_plugin.UvProject`); its keywords are the table's fields.

    It is a plain dict (Ray serializes runtime_envs as JSON), checked when it is made, holding
    the fields given other than as their defaults, as given (`spec.keyword_value`). The plugin
    reads it as a `ParsedUvProject`. Building one also checks that this driver's Ray loads the
    plugin (`watch`), where a plain dict cannot."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(keyword_value(fields))
        watch()


UvProject.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=keyword_default(f))
        for f in FIELDS
    ]
)

"""Which nodes have an env ready, and what the others are doing: the readiness view.

One zero-CPU task per node, pinned there (`NodeAffinitySchedulingStrategy`, hard) and run on
the node's own Ray Python with the plugin, never in the env's venv: it makes the key there from
the `uv_project` value as the node's plugin would for a request (`make_request`: the node's
interpreter, uv and settings), then reads where that key stands in the node's venv dir
(`store.setup_state`). Nothing is built, received or marked used. `ray-uv status` shows it;
worker groups place ranks by it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_uv_plugin.cluster.connect import clean_error
from ray_uv_plugin.store.units import format_bytes

if TYPE_CHECKING:
    from ray_uv_plugin.env.spec import ParsedUvProject

STATES = ("ready", "queued", "building", "receiving", "failed", "absent")


class ReadinessError(RuntimeError):
    """The view cannot be asked from this job; the message says what to do."""


@dataclass(frozen=True)
class NodeSetup:
    """Where one node stands with one env. `key`: the env's key on that node (None where it
    could not be made there: `cause` says why)."""

    node_id: str
    address: str
    key: str | None
    state: str  # ready | queued | building | receiving | failed | absent
    how: str | None = None  # ready: built, seeded or shipped
    phase: str | None = None  # building, receiving: the phase now
    seconds: float | None = None  # in that phase (or queued) so far
    bytes: int | None = None  # so far
    source: str | None = None  # receiving: the host it comes from
    cause: str | None = None  # failed: why

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def detail(self) -> str:
        """What the state says beyond its name: `building pyyaml==6.0.2 for 1m12s`, `shipped`."""
        if self.state == "ready":
            return self.how or "-"
        if self.state in ("failed", "absent"):
            return self.cause or "-"
        parts = [self.phase or self.state]
        if self.seconds is not None:
            parts.append(f"for {elapsed(self.seconds)}")
        if self.bytes:
            parts.append(format_bytes(self.bytes))
        if self.source:
            parts.append(f"from {self.source}")
        return " ".join(parts)

    def line(self) -> str:
        """`node 10.0.0.3 (8f2a01c4): building: building flash-attn==2.7.4 for 7m12s`."""
        return f"node {self.address} ({self.node_id[:8]}): {self.state}: {self.detail}"

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def elapsed(seconds: float) -> str:
    """`45s`, `7m12s`, `2h05m`: a phase's time so far."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _setup_here(
    value: Mapping[str, Any] | None, key: str | None, env_vars: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """On a node: the key of `value` there (or `key` as given), and where it stands in the
    venv dir, as `NodeSetup`'s fields less the node's. The runtime_env's working_dir, if any,
    is this worker's cwd, as it is the plugin's project dir for a request; `env_vars` go over
    its env_vars, as an actor's over its job's."""
    import ray

    from ray_uv_plugin.store import trust
    from ray_uv_plugin.store.layout import venv_root
    from ray_uv_plugin.store.setup_state import read_setup

    try:
        if key is None:
            key = _key_here(dict(value or {}), ray.get_runtime_context().runtime_env, env_vars)
    except Exception as e:  # noqa: BLE001 - the request would fail the same way: its cause
        return {"key": None, "state": "failed", "cause": f"no key here: {e}"}
    root = venv_root()
    if not os.path.lexists(root):
        return {"key": key, "state": "absent"}
    trust.check_root(root)
    return {"key": key, **read_setup(root, key).as_json()}


def _key_here(
    value: dict[str, Any], runtime_env: Mapping[str, Any], env_vars: Mapping[str, str] | None
) -> str:
    from ray_uv_plugin.env.key import make_request
    from ray_uv_plugin.env.project import load_project, resolve_project_dir
    from ray_uv_plugin.env.spec import parse_spec

    spec = parse_spec(value)
    uri = runtime_env.get("working_dir")
    working_dir = os.getcwd() if uri else None
    uploaded = spec.project is None and not str(uri).startswith("local://")
    files = load_project(resolve_project_dir(spec, working_dir), uploaded=uploaded)
    env_vars = {**(runtime_env.get("env_vars") or {}), **(env_vars or {})}
    return make_request(spec, files, env_vars).key


def node_setups(
    uv_project: Mapping[str, Any] | ParsedUvProject | None = None,
    *,
    key: str | None = None,
    nodes: Iterable[str] | None = None,
    timeout: float = 30.0,
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, NodeSetup]:
    """Where each node stands with the env of the `uv_project` value (a dict, `UvProject` or
    `ParsedUvProject`), or with `key` as given: node id -> its `NodeSetup`, for `nodes` (ids;
    default every alive node). `env_vars`: those of the runtime_env the env's workers have, over
    the job's, where they shape the venv (uv's settings, `build_env_vars`). Needs a connected
    driver; the value's project is found on each node as a request's is (the job's working_dir,
    or its `project` path). A node that does not answer within `timeout` seconds, or cannot read
    its venv dir, is `failed` with why."""
    import ray

    from ray_uv_plugin.cluster.prepare import alive_nodes
    from ray_uv_plugin.env.spec import parse_spec
    from ray_uv_plugin.ship.launch import actors_env, pinned, refused_by_job

    if (uv_project is None) == (key is None):
        raise ValueError("node_setups: give a uv_project value or a key, one of them")
    value = None if uv_project is None else parse_spec(uv_project).as_value()  # checked here
    if refused := refused_by_job():
        raise ReadinessError(
            f"node_setups cannot read the nodes from this job: {refused}. Ask from a driver "
            "whose job has no uv_project of its own."
        )
    addresses = dict(alive_nodes())
    wanted = list(addresses) if nodes is None else list(nodes)
    task = ray.remote(num_cpus=0, max_retries=0)(_setup_here)
    env = actors_env(None)
    refs = {
        task.options(**pinned(node, env)).remote(value, key, dict(env_vars or {})): node
        for node in wanted
        if node in addresses
    }
    done, pending = (
        ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
    )
    found: dict[str, NodeSetup] = {}
    for node in wanted:
        if node not in addresses:
            found[node] = NodeSetup(node, "", None, "failed", cause="not an alive node")
    for ref in pending:
        ray.cancel(ref, force=True)
        node = refs[ref]
        cause = f"the node did not answer within {timeout:.0f}s"
        found[node] = NodeSetup(node, addresses[node], None, "failed", cause=cause)
    for ref in done:
        node = refs[ref]
        try:
            fields = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the node's error is its result
            fields = {"key": None, "state": "failed", "cause": clean_error(e)}
        found[node] = NodeSetup(node, addresses[node], **fields)
    return {node: found[node] for node in wanted}

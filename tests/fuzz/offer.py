"""A sender's offer as a receiver judges it (`VenvReceiver._refusal`, then the `Unpacker` it
opens for a venv it takes): the description the sender's node made of its venv, which the
receiving node takes only where its own key inputs give the same key.

Offers hold tokens for what depends on this node (`{key}`, `{interpreter}`, `{uv}`, `{ray}`,
`{platform}`), filled per run, so a saved offer that this node takes stays one it takes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import ray
from hypothesis import strategies as st

from ray_uv_plugin.env.key import KeyInputs, interpreter_tag
from ray_uv_plugin.env.spec import ParsedUvProject
from ray_uv_plugin.env.uv import uv_version
from ray_uv_plugin.env.uv_env import UvEnvError, keyed_settings, sync_environment
from ray_uv_plugin.ship import actors, messages, unpack
from ray_uv_plugin.ship.archive import ArchiveError
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import freezing
from tests.fuzz.harness import Case, Target, Violation, refused_clearly, seeded

_Receiver = actors.VenvReceiver.__ray_metadata__.modified_class  # the class, not the actor
# The unpacker polls for an abort this often; the fuzzer's aborts need not wait 0.2 s each.
unpack._POLL_SECONDS = 0.01


def _node() -> dict[str, str]:
    """What the tokens stand for on this node."""
    inputs = _inputs({})
    return {
        "{key}": inputs.on_this_node(sync_environment({}, {}), False).key,
        "{interpreter}": interpreter_tag(),
        "{uv}": uv_version(),
        "{ray}": ray.__version__,
        "{platform}": actors.platform_tag(),
    }


def _inputs(env: dict[str, str]) -> KeyInputs:
    return KeyInputs(
        selection=ParsedUvProject().selection(),
        pyproject="0" * 64,
        lock="1" * 64,
        config=(),
        copied_sources=(),
        interpreter="{interpreter}",
        uv="{uv}",
        env=keyed_settings(sync_environment(env, {})),
        project_path=None,
    )


def taken_offer() -> dict[str, Any]:
    """An offer this node takes: the venv of a project keyed as this node keys it."""
    return {
        "key": "{key}",
        "venv": "/senders/venvs/{key}",
        "host": "10.0.0.8 (77aa00ff)",
        "marker": {"ray": "{ray}", "inputs": json.loads(json.dumps(_inputs({}).as_json()))},
        "platform": "{platform}",
        "built_here": {},
        "target": None,
    }


anything = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.text(max_size=8),
        st.sampled_from(["{key}", "{ray}", "../../x", "/senders/venvs/{key}", "0" * 16]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = ("key", "venv", "host", "marker", "platform", "built_here", "target")
INPUT_FIELDS = tuple(KeyInputs.__dataclass_fields__)
settings = st.fixed_dictionaries(
    {
        "env_vars": st.one_of(
            st.just({}),
            st.dictionaries(
                st.sampled_from(["UV_COMPILE_BYTECODE", "CMAKE_ARGS", "UV_TYPO", "PATH"]),
                st.sampled_from(["0", "1", "-DX=1"]),
                max_size=2,
            ),
        ),
        "resolves": st.booleans(),
    },
    optional={"build_env_vars": st.lists(st.sampled_from(["PATH", "CMAKE_ARGS"]), max_size=1)},
)


@st.composite
def offers(draw: Any) -> dict[str, Any]:
    """A taken offer with parts changed, dropped or of another type."""
    offer = taken_offer()
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(["offer", "marker", "inputs", "selection"]))
        marker = offer.get("marker")
        inputs = marker.get("inputs") if isinstance(marker, dict) else None
        selection = inputs.get("selection") if isinstance(inputs, dict) else None
        table = {"offer": offer, "marker": marker, "inputs": inputs, "selection": selection}[where]
        if not isinstance(table, dict):
            continue
        names = {
            "offer": FIELDS,
            "marker": ("ray", "inputs"),
            "inputs": INPUT_FIELDS,
            "selection": ("build_env_vars", "extras", "locked"),
        }[where]
        name = draw(st.sampled_from(names))
        if draw(st.booleans()):
            table.pop(name, None)
        else:
            table[name] = draw(anything)
    return offer


fresh = st.fixed_dictionaries({"offer": offers(), "settings": settings})


def _mutate(seed: Case) -> st.SearchStrategy[Case]:
    return st.builds(
        lambda name, value: {**seed, "offer": {**seed["offer"], name: value}},
        st.sampled_from(FIELDS),
        anything,
    )


def _fill(value: Any, node: dict[str, str]) -> Any:
    if isinstance(value, str):
        for token, real in node.items():
            value = value.replace(token, real)
        return value
    if isinstance(value, list):
        return [_fill(v, node) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, node) for k, v in value.items()}
    return value


_NODE: dict[str, str] | None = None


def check(case: Case) -> None:
    global _NODE
    _NODE = _NODE or _node()
    offer, settings_ = _fill(case["offer"], _NODE), case["settings"]
    receiver = _Receiver.__new__(_Receiver)
    try:
        env = sync_environment(
            settings_["env_vars"], build_env_vars=settings_.get("build_env_vars", ())
        )
    except UvEnvError:
        return  # refused before the offer is read
    try:
        checked = messages.check_offer(offer)  # `offer`'s first step: the typed offer
        why = receiver._refusal(checked, env, settings_["resolves"])
    except Exception as e:  # noqa: BLE001 - judged
        refused_clearly(e, (messages.ShipError,), "judging the offer")
        return
    if why is not None:
        if not isinstance(why, str) or not why:
            raise Violation(f"the offer's refusal is {why!r}")
        return
    _take(offer)


def _take(offer: dict[str, Any]) -> None:
    """What `_offer` makes of an offer it takes (after the lock): the receive's tree only."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fuzz-offer-", dir=shm) as tmp:
        root = Path(tmp) / "venvs"
        root.mkdir(mode=0o700)
        try:
            unpacker = Unpacker(root, offer["key"], offer["host"], sender_venv=offer["venv"])
        except Exception as e:  # noqa: BLE001 - judged
            refused_clearly(e, (ArchiveError,), "opening the receive")
            if os.listdir(root):
                raise Violation(f"a refused receive left {os.listdir(root)}") from e
            return
        unpacker.abort()
        left = os.listdir(root)
        freezing.remove_tree(root)
        if left:
            raise Violation(f"an aborted receive left {left}")


TARGET = Target(
    name="offer",
    cases=seeded("offer", fresh, _mutate),
    check=check,
    modules=(
        "ray_uv_plugin.ship.messages",
        "ray_uv_plugin.ship.actors",
        "ray_uv_plugin.env.key",
    ),
    properties=(
        "an offer of any shape is taken or refused in words (a str, or a ShipError): never "
        "another exception out of the receiver's judgement",
        "an offer taken opens a receive under <venv dir> only, or is refused with an "
        "ArchiveError leaving nothing; its abort leaves nothing",
    ),
)

"""A ship receiver's answer to an offer: it takes a venv built on another node only where the
venv's key inputs, with this node's interpreter, uv and uv settings, give the venv's key (one
definition of "the same venv": `KeyInputs`). The actor's class is used as a plain object: no
Ray is started."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from dataclasses import replace
from typing import Any

import pytest
import ray

from ray_uv_plugin.env.key import KeyInputs, make_request
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv_env import sync_environment
from ray_uv_plugin.ship.actors import VenvReceiver, platform_tag
from ray_uv_plugin.ship.messages import Offer, ShipError, ShipSettings, check_offer
from ray_uv_plugin.store import trust
from tests.env.test_key import PINNED_LOCK, PINNED_PYPROJECT


@pytest.fixture
def project(tmp_path, monkeypatch):
    for name in ("UV_NO_DEV", "UV_INDEX_URL", "MAX_JOBS"):
        monkeypatch.delenv(name, raising=False)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_bytes(PINNED_PYPROJECT)
    (proj / "uv.lock").write_bytes(PINNED_LOCK)
    return load_project(proj)


def offered(inputs: KeyInputs, key: str | None = None) -> dict[str, Any]:
    """What a sender describes of a venv built with `inputs` (its marker, through JSON)."""
    marker = {"key": inputs.key, "ray": ray.__version__, "inputs": inputs.as_json()}
    marker = json.loads(json.dumps(marker))
    return {"key": key or inputs.key, "marker": marker, "platform": platform_tag()}


def refusal(source: dict[str, Any], env_vars: dict[str, str], resolves: bool = False):
    """The receiver's judgement of an offer with these parts (unchecked: `check_offer` is
    another test's)."""
    receiver = VenvReceiver.__ray_metadata__.modified_class()
    offer = Offer(source["key"], "/senders/venv", "10.0.0.8", source["marker"], source["platform"])
    return receiver._refusal(offer, sync_environment(env_vars), resolves)


def test_the_inputs_a_marker_records_are_the_inputs(project):
    inputs = make_request(parse_spec({"extras": ["fig"]}), project, {"UV_NO_DEV": "1"}).inputs
    recorded = KeyInputs.from_json(json.loads(json.dumps(inputs.as_json())))
    assert recorded == inputs and recorded.key == inputs.key
    assert KeyInputs.from_json({**inputs.as_json(), "extra": 1}) is None
    assert KeyInputs.from_json({"env": []}) is None
    assert KeyInputs.from_json(None) is None


def test_a_node_with_the_same_inputs_takes_the_venv(project):
    request = make_request(parse_spec({}), project, {"UV_NO_DEV": "1"})
    assert request.inputs.on_this_node(request.uv_env, resolves=False) == request.inputs
    assert refusal(offered(request.inputs), {"UV_NO_DEV": "1"}) is None


def test_a_node_with_other_uv_settings_refuses_it(project):
    source = offered(make_request(parse_spec({}), project, {"UV_NO_DEV": "1"}).inputs)
    why = refusal(source, {})
    assert why.startswith("another set of uv settings here ((('UV_COMPILE_BYTECODE', "), why
    assert "('UV_NO_DEV', '1')" in why.split("the venv's: ")[1]


def test_index_settings_count_only_where_the_venv_resolves(project):
    """`locked: false` keys the indexes it resolves from; a locked venv does not."""
    env = {"UV_INDEX_URL": "https://mirror.invalid/simple"}
    resolving = make_request(parse_spec({"locked": False}), project, env).inputs
    assert refusal(offered(resolving), env, resolves=True) is None
    assert refusal(offered(resolving), {}, resolves=True).startswith("another set of uv")
    locked = make_request(parse_spec({}), project, env).inputs
    assert refusal(offered(locked), {}) is None


def test_another_interpreter_or_uv_is_named(project):
    inputs = make_request(parse_spec({}), project, {}).inputs
    elsewhere = replace(inputs, interpreter="cpython-3.99.0-x86_64-linux-/opt/python")
    why = refusal(offered(elsewhere), {})
    assert why.startswith("another Python interpreter here ("), why
    assert why.endswith("; the venv's: cpython-3.99.0-x86_64-linux-/opt/python)"), why
    assert refusal(offered(replace(inputs, uv="uv 0.0.1")), {}).startswith("another uv here")


def test_a_venv_whose_marker_does_not_give_its_key_is_refused(project):
    inputs = make_request(parse_spec({}), project, {}).inputs
    source = offered(inputs, key="0123456789abcdef")
    assert refusal(source, {}) == f"its marker's inputs make key {inputs.key}, not 0123456789abcdef"
    source = offered(inputs)
    del source["marker"]["inputs"]["uv"]
    assert refusal(source, {}) == "its marker does not record the inputs of its key"
    source["marker"]["ray"] = "0.0.1"
    assert refusal(source, {}).startswith("another Ray here (")


# --- found by the offer fuzzer (tests/fuzz/offer.py) -------------------------------------------


def whole_offer(inputs: KeyInputs) -> dict[str, Any]:
    """An offer as `VenvSender.describe` makes it, of the fields a receiver reads."""
    return {**offered(inputs), "venv": f"/senders/venvs/{inputs.key}", "host": "10.0.0.8"}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"marker": "x"}, "the offer's marker is 'x', not a dict"),
        ({"host": None}, "the offer's host is None, not a str"),
        ({"venv": ["/a"]}, r"the offer's venv is \['/a'\], not a str"),
        ({"key": "../../x"}, "the offer's key: '../../x' is no venv key"),
        ({"built_here": {"a": 1}, "target": {}}, "the offer's built_here"),
        ({"built_here": [[1], 2], "target": None}, "the offer's built_here"),
    ],
    ids=["marker", "host", "venv", "key", "built-here-tags", "built-here-list"],
)
def test_an_offer_of_another_shape_is_refused_naming_the_part(project, change, words):
    """Each once reached the driver as `checking the offer: 'marker'` (a KeyError), or a
    TypeError out of the build target's comparison."""
    source = {**whole_offer(make_request(parse_spec({}), project, {}).inputs), **change}
    with pytest.raises(ShipError, match=words):
        check_offer(source)
    whole = whole_offer(make_request(parse_spec({}), project, {}).inputs)
    assert check_offer(whole) == Offer(**whole)  # the typed offer, of the same parts
    assert check_offer(Offer(**whole)) == Offer(**whole)  # as a sender sends it


@pytest.mark.parametrize("named", [3, [[1]], "CMAKE_ARGS", [None]])
def test_a_marker_whose_build_variables_are_no_names_records_no_inputs(project, named):
    """`build_env_vars: 3` in a marker's selection once raised TypeError out of the refusal."""
    source = offered(make_request(parse_spec({}), project, {}).inputs)
    source["marker"]["inputs"]["selection"]["build_env_vars"] = named
    assert refusal(source, {}) == "its marker does not record the inputs of its key"


def test_a_receiver_on_a_full_disk_names_the_venv_dir_and_says_what_to_do(project, tmp_path):
    """The chaos run (seed 1) saw `checking the offer: [Errno 28] No space left on device` where
    a build on the same disk names the venv dir and what to do: the receiver now says the same.
    The disk: a tmpfs with every inode taken, the key's lock file left by an earlier build."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "full"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=64", "tmpfs", str(disk)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        root = trust.make_root(disk / "venvs")
        inputs = make_request(parse_spec({}), project, {}).inputs
        (root / f"{inputs.key}.lock").touch()
        for i in range(100):
            try:
                (disk / f"filler-{i}").touch()
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        else:
            pytest.fail("the tmpfs's inodes never ran out")
        receiver = VenvReceiver.__ray_metadata__.modified_class()
        receiver.root = root
        with pytest.raises(ShipError) as info:
            receiver.offer(whole_offer(inputs), ShipSettings())
        message = str(info.value)
        assert f"the disk of the venv dir {root} is full" in message, message
        assert f"while receiving {inputs.key}" in message and "ray-uv gc --max-size" in message
        assert "Errno" not in message
        assert sorted(p.name for p in root.iterdir()) == [f"{inputs.key}.lock"]
        assert receiver.lock is None  # let go
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)

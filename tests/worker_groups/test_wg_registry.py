"""The registry and the builder's choice of environment, without Ray."""

from __future__ import annotations

import pytest

from ray_uv_plugin.env.spec import UvProjectSpecError
from worker_groups import (
    ACTOR_ENVIRONMENT_REGISTRY,
    PY_EXECUTABLES,
    RayWorkerBuilder,
    UnregisteredWorkerError,
    get_actor_uv_project,
    register_actor_environment,
)
from worker_groups.registry import check_uv_project


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, "pkg.mod.Worker", PY_EXECUTABLES.VLLM)
    return ACTOR_ENVIRONMENT_REGISTRY


def test_presets_and_example_entries() -> None:
    assert PY_EXECUTABLES.SYSTEM is None
    assert PY_EXECUTABLES.BASE == {}
    # NeMo RL's preset names, as the extra of the same name; each is a valid uv_project value.
    for name in ("VLLM", "FSDP", "AUTOMODEL", "MCORE", "NEMO_GYM", "SGLANG", "TRTLLM"):
        value = getattr(PY_EXECUTABLES, name)
        assert value == {"extras": [name.lower()]}
        assert check_uv_project(value, name) == value
    assert ACTOR_ENVIRONMENT_REGISTRY["examples.torch_worker.TorchWorker"] == {"extras": ["torch"]}
    assert ACTOR_ENVIRONMENT_REGISTRY["examples.vllm_worker.VllmGenerationWorker"] == {
        "extras": ["vllm"]
    }


def test_unregistered_class_is_a_clear_error() -> None:
    with pytest.raises(UnregisteredWorkerError, match="'pkg.Nope' has no entry") as e:
        get_actor_uv_project("pkg.Nope")
    assert "ACTOR_ENVIRONMENT_REGISTRY['pkg.Nope'] = PY_EXECUTABLES.BASE" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, KeyError)
    builder = RayWorkerBuilder("pkg.Nope")  # naming it is fine: using it is not
    with pytest.raises(UnregisteredWorkerError):
        builder.runtime_env()


def test_builder_environment_precedence(registry: dict) -> None:
    builder = RayWorkerBuilder("pkg.mod.Worker", 1, lr=0.1)
    assert (builder.args, builder.kwargs) == ((1,), {"lr": 0.1})
    assert builder.runtime_env({"env_vars": {"A": "1"}}) == {
        "env_vars": {"A": "1"},
        "uv_project": {"extras": ["vllm"]},
    }
    own = builder.with_uv_project({"extras": ["torch"]})
    assert own.runtime_env()["uv_project"] == {"extras": ["torch"]}
    assert builder.runtime_env()["uv_project"] == {"extras": ["vllm"]}  # the original is unchanged
    assert "uv_project" not in builder.with_uv_project(None).runtime_env()
    explicit = own.runtime_env({"uv_project": {"groups": ["dev"]}})
    assert explicit["uv_project"] == {"groups": ["dev"]}  # the call's own value wins
    # Returned values are copies: editing one does not edit the registry.
    builder.runtime_env()["uv_project"]["extras"].append("x")
    assert registry["pkg.mod.Worker"] == {"extras": ["vllm"]}


def test_typos_fail_on_the_driver(registry: dict) -> None:
    with pytest.raises(UvProjectSpecError, match="unknown field.*'extra'"):
        RayWorkerBuilder("pkg.mod.Worker").with_uv_project({"extra": ["vllm"]})
    with pytest.raises(UvProjectSpecError, match="registry entry for pkg.Typo"):
        register_actor_environment("pkg.Typo", {"locked": True, "frozen": True})
    registry["pkg.mod.Worker"] = {"extras": "vllm"}
    with pytest.raises(TypeError, match="must be a list of strings"):
        get_actor_uv_project("pkg.mod.Worker")
    with pytest.raises(TypeError, match="runtime_env must be a dict"):
        RayWorkerBuilder("pkg.mod.Other").runtime_env(["x"])  # type: ignore[arg-type]


@pytest.mark.parametrize("fqn", ["Worker", "", "pkg.Worker ", 3])
def test_class_is_named_by_fqn(fqn: object) -> None:
    with pytest.raises(TypeError, match="fully qualified name"):
        RayWorkerBuilder(fqn)  # type: ignore[arg-type]


def test_register_then_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("worker_groups.registry.ACTOR_ENVIRONMENT_REGISTRY", {})
    from worker_groups import registry

    register_actor_environment("a.B", {"project": "/srv/proj", "groups": ["rl"]})
    assert registry.ACTOR_ENVIRONMENT_REGISTRY == {
        "a.B": {"project": "/srv/proj", "groups": ["rl"]}
    }
    assert get_actor_uv_project("a.B") == {"project": "/srv/proj", "groups": ["rl"]}


def test_a_worker_class_takes_packages_from_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """`from_image` per worker class, as any field: checked on the driver, passed unchanged."""
    monkeypatch.setattr("worker_groups.registry.ACTOR_ENVIRONMENT_REGISTRY", {})
    layered = {"extras": ["train"], "from_image": ["torch"]}
    register_actor_environment("a.Trainer", layered)
    register_actor_environment("a.Rollout", {"extras": ["vllm"]})
    assert RayWorkerBuilder("a.Trainer").runtime_env()["uv_project"] == layered
    assert "from_image" not in RayWorkerBuilder("a.Rollout").runtime_env()["uv_project"]
    with pytest.raises(TypeError, match="uv_project.from_image must be a list of strings"):
        register_actor_environment("a.Typo", {"from_image": "torch"})
    with pytest.raises(UvProjectSpecError, match="'from_image' leaves packages out"):
        RayWorkerBuilder("a.Trainer").with_uv_project({**layered, "locked": False})

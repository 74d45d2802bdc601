"""The package exports the errors a user can catch, lazily: `import ray_uv_plugin`
imports no Ray. Each export is the class the code raises; every error class of the product is
either exported or named here with why a user does not meet it."""

from __future__ import annotations

import ast
import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import ray_uv_plugin
import worker_groups

ROOT = Path(__file__).resolve().parents[1]

# Never reach a user as themselves: each becomes one of the exported errors, an exit code of
# the CLI, or a fallback that the log explains.
NOT_EXPORTED = {
    "GcError": "the CLI's `gc`: an exit code and a message",
    "UvRunParseError": "the driver hook keeps Ray's own `uv run` instead, saying why",
    "UvTimeout": "becomes a UvSyncError",
    "SeedError": "a full build instead, with a warning",
    "CompileError": "uv's own bytecode step instead, with a warning",
    "OverBudget": "becomes a UvSyncError",
    "RayInternalsChanged": "a setup's, so a UvProjectSetupError's text",
    "MissingLibraryError": "a setup's, so a UvProjectSetupError's text",
    "ShipError": "a node's result of `prepare_env`",
    "ArchiveError": "a node's result of `prepare_env`",
    "DriftError": "an ArchiveError",
    "ManifestError": "a sender refuses to ship; the node builds",
    "DiskFullError": "the build lock's; a build reports a full disk as a UvSyncError",
    "WrongTypeError": "an UntrustedPathError",
}


def error_classes() -> dict[str, str]:
    """Every exception class defined in the product, by name: its module. The CLI's (`ops/`)
    are its exit codes and messages."""
    found = {}
    for path in sorted(
        [*(ROOT / "ray_uv_plugin").rglob("*.py"), *(ROOT / "worker_groups").rglob("*.py")]
    ):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.startswith("ray_uv_plugin.ops."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(
                ("Error", "Timeout", "Changed", "Budget")
            ):
                found[node.name] = module
    return found


def test_every_error_class_is_exported_or_named_as_not_met() -> None:
    exported = set(ray_uv_plugin.EXCEPTIONS) | set(worker_groups.__all__)
    missing = sorted(set(error_classes()) - exported - set(NOT_EXPORTED))
    assert not missing, f"export these from ray_uv_plugin (or worker_groups): {missing}"
    assert set(NOT_EXPORTED) <= set(error_classes())  # no stale names here


@pytest.mark.parametrize("name", sorted(ray_uv_plugin.EXCEPTIONS))
def test_each_export_is_the_class_its_module_raises(name: str) -> None:
    exported = getattr(ray_uv_plugin, name)
    assert name in ray_uv_plugin.__all__
    assert exported is getattr(importlib.import_module(ray_uv_plugin.EXCEPTIONS[name]), name)
    assert issubclass(exported, Exception)
    namespace: dict = {}
    exec(f"from ray_uv_plugin import {name} as it", namespace)
    assert namespace["it"] is exported


def test_the_code_raises_the_exported_classes(tmp_path, monkeypatch) -> None:
    from ray_uv_plugin.env.project import load_project
    from ray_uv_plugin.env.spec import parse_spec
    from ray_uv_plugin.settings import VENV_DIR_ENV
    from ray_uv_plugin.store.layout import venv_root

    with pytest.raises(ray_uv_plugin.UvProjectTypeError):
        parse_spec({"extras": "gpu"})
    with pytest.raises(ray_uv_plugin.UvProjectSpecError):
        parse_spec({"extra": ["gpu"]})
    with pytest.raises(ray_uv_plugin.ProjectError):
        load_project(tmp_path / "nowhere")
    monkeypatch.setenv(VENV_DIR_ENV, "relative/venvs")
    with pytest.raises(ray_uv_plugin.VenvDirError):
        venv_root()
    # A worker group's plugin check is caught as the driver's own check is.
    assert issubclass(worker_groups.PluginNotLoadedError, ray_uv_plugin.PluginNotLoadedError)


def test_a_setup_error_is_named_as_exported_and_pickles() -> None:
    error = ray_uv_plugin.UvProjectSetupError("uv_project: it failed")
    assert f"{type(error).__module__}.{type(error).__qualname__}" == (
        "ray_uv_plugin.UvProjectSetupError"
    )
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ray_uv_plugin.UvProjectSetupError and str(again) == str(error)


def test_importing_the_package_and_its_errors_imports_no_ray() -> None:
    code = (
        "import sys, ray_uv_plugin\n"
        "assert 'ray' not in sys.modules, 'import ray_uv_plugin imported ray'\n"
        "from ray_uv_plugin import UvProjectSpecError, ProjectError, UvSyncError, "
        "UvProjectSetupError, VenvDirError\n"
        "assert 'ray' not in sys.modules, 'an error import imported ray'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)

"""`uv_project.from_image`: a locked venv layered on the image's own torch.

The image is a stub: an interpreter environment made for the test, holding a pure-Python
`torch` 2.8.0a0+nv (with a dependency of its own), from which Ray is started; the projects lock
`torch>=2.8.0a0` from local wheels. The pure parts (what is left out, the checks) run without
Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

import pytest

from ray_uv_plugin.env import image
from ray_uv_plugin.env.uv import UvSyncError, find_uv
from tests.agent.test_jobs import stop_own_cluster
from tests.support.uvproject import write_project, write_wheel

ROOT = Path(__file__).resolve().parents[2]
DEP = "ray-uv-test-torchdep"  # the stub torch's own dependency (no PyPI name)


def _torch_wheels(wheels: Path, version: str) -> Path:
    write_wheel(wheels, DEP.replace("-", "_"), "1.0", {"ray_uv_test_torchdep.py": b"X = 1\n"})
    code = f"__version__ = {version!r}\nimport ray_uv_test_torchdep\n".encode()
    return write_wheel(wheels, "torch", version, {"torch/__init__.py": code}, (DEP,))


def _uv(*args: str) -> None:
    done = subprocess.run([find_uv(), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


# What the driver runs in the image's Python: jobs with `from_image`, each as a task.
DRIVER = textwrap.dedent(
    """\
    import json, subprocess, sys
    import ray
    from ray.exceptions import RuntimeEnvSetupError

    @ray.remote
    def where():
        import importlib.metadata, os, sys, torch
        site = [p for p in sys.path if p.endswith("site-packages")][0]
        return {
            "prefix": sys.prefix, "torch": torch.__version__, "file": torch.__file__,
            "own": sorted(os.listdir(site)), "iniconfig": importlib.metadata.version("iniconfig"),
        }

    good, bad, ext, reinstall, temp_dir = sys.argv[1:6]
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=temp_dir)
    out = {}
    env = lambda project, n: {"uv_project": {"project": project, "from_image": ["torch"]},
                              "env_vars": {"RUN": str(n)}}
    out["first"] = ray.get(where.options(runtime_env=env(good, 1)).remote())

    @ray.remote
    def built_against():
        import ext._built
        return ext._built.TORCH

    out["ext"] = ray.get(built_against.options(runtime_env=env(ext, 4)).remote())
    try:
        ray.get(where.options(runtime_env=env(bad, 2)).remote())
    except RuntimeEnvSetupError as e:
        out["bad"] = str(e)
    try:
        absent = {"project": good, "from_image": ["ray-uv-test-absent"]}
        ray.get(where.options(runtime_env={"uv_project": absent}).remote())
    except RuntimeEnvSetupError as e:
        out["absent"] = str(e)
    subprocess.run(json.loads(reinstall), check=True, capture_output=True)
    out["changed"] = ray.get(where.options(runtime_env=env(good, 3)).remote())
    ray.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


# A package that builds against torch: its wheel records the torch its build imported.
EXT_SETUP = textwrap.dedent(
    """\
    from setuptools import setup
    from setuptools.command.build_py import build_py

    class Build(build_py):
        def run(self):
            import torch
            super().run()
            with open(self.build_lib + "/ext/_built.py", "w") as f:
                f.write(f"TORCH = {torch.__version__!r}\\n")

    setup(name="ext", version="0.1", packages=["ext"], cmdclass={"build_py": Build})
    """
)


def _ext_project(root: Path, wheels: Path, torch_wheel: Path) -> Path:
    """A project with `ext`, built without isolation (`no-build-isolation-package`); its
    metadata is given, so that `uv lock` builds nothing."""
    (root / "ext" / "ext").mkdir(parents=True)
    (root / "ext" / "ext" / "__init__.py").write_text("")
    (root / "ext" / "setup.py").write_text(EXT_SETUP)
    path = write_project(root / "withext", ["torch>=2.8.0a0", "setuptools", "ext"], lock=False)
    text = (path / "pyproject.toml").read_text()
    text += f'find-links = ["{wheels}"]\nno-build-isolation-package = ["ext"]\n\n'
    text += '[[tool.uv.dependency-metadata]]\nname = "ext"\nversion = "0.1"\nrequires-dist = []\n\n'
    text += f'[tool.uv.sources]\ntorch = {{ path = "{torch_wheel}" }}\n'
    text += f'ext = {{ path = "{root / "ext"}" }}\n'
    (path / "pyproject.toml").write_text(text)
    _uv("lock", "--quiet", "--project", str(path))
    return path


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The stub image, Ray started from it, and what its jobs saw."""
    root = tmp_path_factory.mktemp("image")
    wheels = root / "wheels"
    first = _torch_wheels(wheels, "2.8.0a0+nv")
    newer = _torch_wheels(root / "wheels-29", "2.9.0")
    changed = _torch_wheels(root / "wheels-changed", "2.8.0a0+nv2")
    write_wheel(wheels, "ray_uv_test_needs_torch29", "1.0", {"needs29.py": b""}, ("torch==2.9",))
    base = root / "base"  # the image: its own torch, and Ray and the plugin of the checkout's env
    _uv("venv", "--quiet", "--python", sys.executable, str(base))
    python = str(base / "bin" / "python")
    _uv("pip", "install", "--quiet", "--python", python, "--find-links", str(wheels), str(first))
    site = next((base / "lib").glob("python*/site-packages"))
    checkout_site = next(p for p in sys.path if p.endswith("site-packages"))
    (site / "checkout_env.pth").write_text(f"import site; site.addsitedir({checkout_site!r})\n")

    def project(name: str, torch_wheel: Path, extra: list[str]) -> Path:
        path = write_project(root / name, ["torch>=2.8.0a0", "iniconfig", *extra], lock=False)
        text = (path / "pyproject.toml").read_text()
        text += f'find-links = ["{wheels}"]\n\n[tool.uv.sources]\n'
        text += f'torch = {{ path = "{torch_wheel}" }}\n'
        (path / "pyproject.toml").write_text(text)
        _uv("lock", "--quiet", "--project", str(path))
        return path

    good = project("good", first, [])
    ext = _ext_project(root, wheels, first)
    bad = project("bad", newer, ["ray-uv-test-needs-torch29"])
    reinstall = [find_uv(), "pip", "install", "--python", python, "--find-links", str(wheels)]
    reinstall += ["--reinstall", str(changed)]
    temp_dir = tempfile.mkdtemp(prefix="ruvi-", dir="/tmp")  # short: socket paths
    proc = subprocess.Popen(
        [python, "-c", DRIVER, str(good), str(bad), str(ext), json.dumps(reinstall), temp_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        stop_own_cluster(proc, Path(temp_dir))
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-6000:]
    return {"out": json.loads(lines[-1][7:]), "site": str(site), "good": good, "python": python}


def test_the_worker_imports_the_images_torch_and_the_venv_has_none(layered: dict) -> None:
    first = layered["out"]["first"]
    assert first["torch"] == "2.8.0a0+nv"
    assert first["file"].startswith(layered["site"])
    assert first["iniconfig"]  # the lock's other package, from the venv
    own = first["own"]
    assert not [n for n in own if n.startswith(("torch", "ray_uv_test_torchdep"))], own
    assert [n for n in own if n.startswith("iniconfig-")] and image.IMAGE_PTH in own


def test_a_package_built_without_isolation_compiles_against_the_images_torch(
    layered: dict,
) -> None:
    assert layered["out"]["ext"] == "2.8.0a0+nv"


def test_a_changed_image_is_another_venv(layered: dict) -> None:
    out = layered["out"]
    assert out["changed"]["torch"] == "2.8.0a0+nv2"
    assert Path(out["changed"]["prefix"]).name != Path(out["first"]["prefix"]).name


def test_a_dependent_the_images_torch_does_not_meet_fails_the_build(layered: dict) -> None:
    message = layered["out"]["bad"]
    assert "ray_uv_test_needs_torch29 1.0 requires torch==2.9" in message, message
    assert "the image's torch is 2.8.0a0+nv" in message
    assert 'override-dependencies = ["torch>=2.8.0a0"]' in message


def test_a_package_the_image_lacks_fails_the_setup_naming_it(layered: dict) -> None:
    message = layered["out"]["absent"]
    assert "uv_project.from_image names 'ray-uv-test-absent', which this node's Python" in message
    assert "install it in the image, or drop it from from_image" in message


def test_the_venv_sees_the_image_through_its_pth_file_alone(tmp_path: Path) -> None:
    image_site = tmp_path / "image-site"
    wheel = _torch_wheels(tmp_path / "wheels", "2.8.0a0+nv")
    _uv("pip", "install", "--quiet", "--no-deps", "--target", str(image_site), str(wheel))
    venv = tmp_path / "venv"
    _uv("venv", "--quiet", "--python", sys.executable, str(venv))
    found = image.fingerprint(["torch"], [str(image_site)])
    assert found[0][:3] == ["torch", "2.8.0a0+nv", str(image_site)]
    with pytest.raises(UvSyncError, match="does not see the image's site-packages"):
        image.check_venv(venv, found, ["torch"], {})
    image.write_pth(venv, [str(image_site)])
    image.check_venv(venv, found, ["torch"], {})


def test_check_and_list_name_the_packages_from_the_image(layered: dict) -> None:
    def ray_uv(*args: str) -> subprocess.CompletedProcess[str]:
        code = "import sys; from ray_uv_plugin.ops.cli import main; sys.exit(main(sys.argv[1:]))"
        return subprocess.run(
            [layered["python"], "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    shown = f"torch 2.8.0a0+nv2 ({layered['site']})"  # the image as it is now
    check = ray_uv("check", "--dry-run", "--project", str(layered["good"]), "--from-image", "torch")
    assert f"from the image: {shown}" in check.stdout, check.stdout + check.stderr
    key = Path(layered["out"]["changed"]["prefix"]).name
    assert key in check.stdout
    rows = json.loads(ray_uv("list", "--json").stdout)["venvs"]
    assert next(r for r in rows if r["key"] == key)["from_image"] == [shown]
    assert f"{key}: from the image: {shown}" in ray_uv("list").stdout


def test_left_out_follows_extras_and_keeps_what_another_package_needs() -> None:
    lock = tomllib.loads((ROOT / "benchmarks/sets/torch/uv.lock").read_text())
    left = image.left_out(lock["package"], ["Torch"])
    assert "torch" in left and "triton" in left
    # nvidia-cublas is reached from torch only through cuda-toolkit's extras
    assert {"cuda-toolkit", "nvidia-cublas", "nvidia-nccl-cu13"} <= set(left)
    needed_by_ray = {"filelock", "packaging", "ray"}  # torch needs filelock too
    assert not needed_by_ray & set(left)
    assert image.left_out(lock["package"], ["not-in-the-lock"]) == []


def _venv_with(tmp_path: Path, *dist_infos: str) -> Path:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    for name in dist_infos:
        (site / name).mkdir(parents=True)
    site.mkdir(parents=True, exist_ok=True)
    return tmp_path / "venv"


@pytest.mark.parametrize("stray", ["nvidia_nccl_cu13-2.27.dist-info", "torch-2.13.0.dist-info"])
def test_a_stray_copy_of_a_left_out_package_fails_the_build(tmp_path: Path, stray: str) -> None:
    venv = _venv_with(tmp_path, "iniconfig-2.0.0.dist-info", stray)
    fingerprint = [["torch", "2.8.0a0+nv", "/image/site-packages", "0" * 64]]
    with pytest.raises(UvSyncError) as info:
        image.check_venv(venv, fingerprint, ["torch", "nvidia-nccl-cu13"], {})
    assert stray in str(info.value) and "leaves to the image" in str(info.value)


def test_the_locks_override_stands_for_the_requirements_it_replaces(tmp_path: Path) -> None:
    venv = _venv_with(tmp_path, "dependent-1.0.dist-info")
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "dependent-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dependent\nVersion: 1.0\nRequires-Dist: torch==2.9\n"
    )
    versions = {"torch": "2.8.0a0+nv"}
    with pytest.raises(UvSyncError, match="dependent 1.0 requires torch==2.9"):
        image._check_requirements(site, versions, {})
    override = {"manifest": {"overrides": [{"name": "torch", "specifier": ">=2.8.0a0"}]}}
    image._check_requirements(site, versions, override)  # the user said the image's will do
    narrower = {"manifest": {"overrides": [{"name": "torch", "specifier": ">=2.9"}]}}
    with pytest.raises(UvSyncError, match="override-dependencies requires torch>=2.9"):
        image._check_requirements(site, versions, narrower)


def test_the_projects_own_requirement_is_checked_with_the_extras_asked_for(tmp_path: Path) -> None:
    """The project is rarely installed: its requirements on the image's packages are the lock's."""
    site = _venv_with(tmp_path) / "lib" / "python3.11" / "site-packages"
    lock = tomllib.loads((ROOT / "benchmarks/sets/torch/uv.lock").read_text())  # torch==2.13.0
    image._check_requirements(site, {"torch": "2.8.0a0+nv"}, lock, ())  # the extra not asked
    with pytest.raises(UvSyncError, match=r"bench-torch \(the project, in uv.lock\) requires"):
        image._check_requirements(site, {"torch": "2.8.0a0+nv"}, lock, ("torch",))
    with pytest.raises(UvSyncError, match="requires torch==2.13.0, and the image's torch is"):
        image._check_requirements(site, {"torch": "2.8.0a0+nv"}, lock, None)
    image._check_requirements(site, {"torch": "2.13.0+cpu"}, lock, None)  # a local version meets ==

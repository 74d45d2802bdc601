"""The packages the cluster benchmarks install, made on this host (no index reached but our
own): generated wheels of a given size (`benchpkg_NN`), `slowbuild` (an sdist whose build takes
a fixed time, as a compiled extension's would), a mirror of Ray's wheels from PyPI (for a
simulated cluster that reaches no internet), and the uv project that requires them, locked.
`benchmarks.counting_index` serves them."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import tomllib
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import ray

from ray_uv_plugin.env.uv import find_uv

# "-2": the wheels' RECORDs in the wheel spec's hash form (the plugin checks installs against them)
WHEEL_CACHE = Path(tempfile.gettempdir()) / "ruv-bench-wheels-2"


def make_wheel(out: Path, index: int, size: int) -> Path:
    """`benchpkg_NN-1.0-py3-none-any.whl`: a module and `size` bytes of incompressible data."""
    name = f"benchpkg_{index:02d}"
    path = out / f"{name}-1.0-py3-none-any.whl"
    if path.exists():
        return path
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = '1.0'\nINDEX = {index}\n".encode(),
        f"{name}/data.bin": os.urandom(size),
        f"{dist}/METADATA": metadata(index).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for n, d in files.items():
            z.writestr(n, d)
    tmp.rename(path)
    return path


def record_hash(data: bytes) -> str:
    """A RECORD entry's hash as the wheel spec writes it (urlsafe base64, no padding): the
    plugin checks installed files against it."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def metadata(index: int) -> str:
    return f"Metadata-Version: 2.1\nName: benchpkg-{index:02d}\nVersion: 1.0\n"


# An in-tree PEP 517 backend with no build requirements (the index serves no setuptools): its
# metadata comes at once, its wheel after SECONDS, tagged for this platform as a compiled
# extension's would be (so the venv ships only to nodes of the same build target).
SLOW_BACKEND = """\
import base64, hashlib, os, sys, sysconfig, time, zipfile

SECONDS = {seconds}
NAME, VERSION = "slowbuild", "1.0"
DIST = f"{{NAME}}-{{VERSION}}.dist-info"
META = f"Metadata-Version: 2.1\\nName: {{NAME}}\\nVersion: {{VERSION}}\\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    os.makedirs(os.path.join(metadata_directory, DIST), exist_ok=True)
    with open(os.path.join(metadata_directory, DIST, "METADATA"), "w") as f:
        f.write(META)
    return DIST


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(SECONDS)  # the compiler
    py = f"cp{{sys.version_info[0]}}{{sys.version_info[1]}}"
    tag = f"{{py}}-{{py}}-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    files = {{
        f"{{NAME}}/__init__.py": f"BUILD_SECONDS = {{SECONDS}}\\n".encode(),
        f"{{DIST}}/METADATA": META.encode(),
        f"{{DIST}}/WHEEL": f"Wheel-Version: 1.0\\nRoot-Is-Purelib: false\\nTag: {{tag}}\\n"
        .encode(),
    }}
    def record_hash(d):
        digest = base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=")
        return "sha256=" + digest.decode()

    record = "".join(f"{{n}},{{record_hash(d)}},{{len(d)}}\\n" for n, d in files.items())
    files[f"{{DIST}}/RECORD"] = (record + f"{{DIST}}/RECORD,,\\n").encode()
    name = f"{{NAME}}-{{VERSION}}-{{tag}}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return name
"""


def make_slow_sdist(out: Path, seconds: int) -> Path:
    """`slowbuild-1.0.tar.gz`, whose wheel takes `seconds` to build (a fixed, known cost)."""
    path = out / "slowbuild-1.0.tar.gz"
    if path.exists():
        return path
    files = {
        "PKG-INFO": "Metadata-Version: 2.2\nName: slowbuild\nVersion: 1.0\n",
        "pyproject.toml": textwrap.dedent(
            """\
            [build-system]
            requires = []
            build-backend = "slow_backend"
            backend-path = ["."]

            [project]
            name = "slowbuild"
            version = "1.0"
            """
        ),
        "slow_backend.py": SLOW_BACKEND.format(seconds=seconds),
    }
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"slowbuild-1.0/{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(path)
    return path


def mirror_pypi(requirement: str, out: Path) -> list[Path]:
    """The wheels of `requirement` and its dependencies that suit this interpreter, from PyPI
    (fetched once into `out`, checked against the lock's sha256), for an index that has no
    internet to serve: uv locks them here, in the host's own namespace."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_text(
            f'[project]\nname = "mirror"\nversion = "0"\nrequires-python = "{this_python()}"\n'
            f'dependencies = ["{requirement}"]\n[tool.uv]\nenvironments = ["sys_platform == '
            "'linux'\"]\n"
        )
        subprocess.run([find_uv(), "lock", "-q", "--project", tmp], check=True)
        lock = tomllib.loads((Path(tmp) / "uv.lock").read_text())
    rank = {tag: i for i, tag in enumerate(sys_tags())}
    files = []
    for package in lock["package"]:
        fits = []
        for wheel in package.get("wheels", []):
            name = urllib.parse.unquote(wheel["url"].rsplit("/", 1)[1])
            tags = parse_wheel_filename(name)[3]
            best = min((rank[t] for t in tags if t in rank), default=None)
            if best is not None:
                fits.append((best, name, wheel))
        if not fits:
            continue  # the project itself, or a package only for other interpreters
        _, name, wheel = min(fits, key=lambda fit: fit[0])
        path = out / name
        if not path.exists():
            tmp_path = path.with_suffix(".part")
            urllib.request.urlretrieve(wheel["url"], tmp_path)  # noqa: S310 - PyPI's https URL
            digest = hashlib.sha256(tmp_path.read_bytes()).hexdigest()
            if f"sha256:{digest}" != wheel["hash"]:
                tmp_path.unlink()
                raise RuntimeError(f"{name} from PyPI does not match the lock's {wheel['hash']}")
            tmp_path.rename(path)
        files.append(path)
    return files


def this_python() -> str:
    return f"=={sys.version_info[0]}.{sys.version_info[1]}.*"


def write_project(
    path: Path,
    index_url: str,
    count: int,
    extra: list[str] | None = None,
    lock_prefix: list[str] | None = None,
) -> Path:
    """The benchmark's uv project: Ray and `count` generated packages, locked. Without `extra`,
    Ray comes from PyPI and the packages from the index; with `extra` (more requirements,
    `slowbuild`), the index is the only one and serves everything, and `lock_prefix` runs the
    lock where the index can be reached (a host's namespace)."""
    path.mkdir(parents=True, exist_ok=True)
    pkgs = [f"benchpkg-{i:02d}" for i in range(count)]
    deps = ", ".join(f'"{p}"' for p in [f"ray=={ray.__version__}", *pkgs, *(extra or [])])
    if extra is None:
        python = ">=3.11"
        index = f'url = "{index_url}"\nexplicit = true\n\n[tool.uv.sources]\n'
        index += "".join(f'{p} = {{ index = "bench" }}\n' for p in pkgs)
    else:
        python, index = this_python(), f'url = "{index_url}"\ndefault = true\n'
    (path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "shipbench"
            version = "0.1.0"
            requires-python = "{python}"
            dependencies = [{deps}]

            [tool.uv]
            environments = ["sys_platform == 'linux'"]

            [[tool.uv.index]]
            name = "bench"
            """
        )
        + index
    )
    (path / "benchworker.py").write_text(
        "import os\n\nclass Pinger:\n    def ping(self):\n"
        "        return os.environ.get('RAY_UV_PLUGIN_VENV')\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "UV_CACHE_DIR": cache}
        argv = [*(lock_prefix or []), find_uv(), "lock", "--project", str(path)]
        subprocess.run(argv, check=True, env=env)
    return path

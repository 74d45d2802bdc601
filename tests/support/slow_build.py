"""A local source package whose build takes as long as a test needs: an in-tree PEP 517
backend that sleeps, then writes a pure-Python wheel (or fails), with no index and no
build requirements. uv builds it as it builds any source distribution (`Building <name> @
file://...`), so a test sees a long source build, its phases and its failure for real."""

from __future__ import annotations

import textwrap
from pathlib import Path

BACKEND = """\
import base64, hashlib, os, sys, time, zipfile

NAME, VERSION, SECONDS, FAIL = {name!r}, "0.1.0", {seconds!r}, {fail!r}


def _digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(SECONDS)
    if FAIL:
        print(f"{{NAME}}: this package never builds", file=sys.stderr)
        raise SystemExit(1)
    info = f"{{NAME}}-{{VERSION}}.dist-info"
    members = {{
        f"{{NAME}}/__init__.py": b"",
        f"{{info}}/METADATA": f"Metadata-Version: 2.1\\nName: {{NAME}}\\n"
        f"Version: {{VERSION}}\\n".encode(),
        f"{{info}}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: slow\\nRoot-Is-Purelib: true\\n"
        b"Tag: py3-none-any\\n",
    }}
    record = "".join(f"{{p}},{{_digest(d)}},{{len(d)}}\\n" for p, d in members.items())
    wheel = f"{{NAME}}-{{VERSION}}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as archive:
        for path, data in members.items():
            archive.writestr(path, data)
        archive.writestr(f"{{info}}/RECORD", record + f"{{info}}/RECORD,,\\n")
    return wheel
"""


def write_slow_package(path: Path, name: str, seconds: float, fail: bool = False) -> Path:
    """A directory `path` holding source package `name` whose build sleeps `seconds`, then
    makes its wheel, or fails (`fail`) saying so on stderr."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "{name}"
            version = "0.1.0"

            [build-system]
            requires = []
            build-backend = "slow_backend"
            backend-path = ["."]
            """
        )
    )
    (path / "slow_backend.py").write_text(BACKEND.format(name=name, seconds=seconds, fail=fail))
    return path

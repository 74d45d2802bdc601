"""The driver hook's directory is trusted as the venv dir is.

`ray-uv plugin-config --shell` puts the hook's directory first on PYTHONPATH, ahead of the
standard library in every Python of that shell. Each test runs the real CLI from a copy of the
package (as an install elsewhere would be), with the copy's modes and owners set as a site
might leave them, and a second Unix user where one is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ray_uv_plugin
from ray_uv_plugin.driver.hook import check_hook_dir
from ray_uv_plugin.store.trust import UntrustedPathError

PACKAGE = Path(ray_uv_plugin.__file__).resolve().parent


def install_copy(site: Path) -> Path:
    """A copy of the package in `site` (mode 0755 dirs, 0644 files); returns its hook dir."""
    site.mkdir(mode=0o755, parents=True)
    shutil.copytree(PACKAGE, site / "ray_uv_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, filenames in os.walk(site):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    return site / "ray_uv_plugin" / "hook_path"


def shell(site: Path, script: str) -> subprocess.CompletedProcess:
    """`script` in bash, with `$RAY_UV` the CLI of the copy in `site`."""
    cli = f"{sys.executable} -m ray_uv_plugin.ops.cli"  # the copy's: first on PYTHONPATH
    env = {**os.environ, "PYTHONPATH": str(site), "RAY_UV": cli}
    env.pop("RAY_RUNTIME_ENV_HOOK", None)
    return subprocess.run(
        ["bash", "-c", script], env=env, cwd=site.parent, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


PLANTED = "open({marker!r}, 'w').write('ran')\n"


def test_a_hook_dir_another_user_owns_is_refused_and_their_json_py_never_runs(
    tmp_path: Path, other_user: tuple[str, int, int]
) -> None:
    """Shown on the code before: a second user who can write the hook's directory plants
    `json.py` there, and every Python of the shell that imports json runs it as root."""
    name, uid, gid = other_user
    hook_dir = install_copy(tmp_path / "site")
    os.chown(hook_dir, uid, gid)  # theirs: they may add anything to it
    marker = tmp_path / "planted-ran"
    planted = hook_dir / "json.py"
    planted.write_text(PLANTED.format(marker=str(marker)))
    os.chown(planted, uid, gid)
    site = tmp_path / "site"
    script = 'eval "$($RAY_UV plugin-config --shell)"; echo "$PYTHONPATH"; python3 -c "import json"'
    out = shell(site, script)
    assert out.returncode == 0 and out.stdout == f"{site}\n", out.stdout  # nothing was set
    assert f"refusing the driver hook's directory {hook_dir} for PYTHONPATH" in out.stderr
    assert f"it is owned by another user (owner {name} (uid {uid})" in out.stderr, out.stderr
    assert "install ray-uv-plugin where only you or root can write" in out.stderr
    assert not marker.exists()


ALL = "`chmod -R go-w {package}`"  # the package the hook loads, its hook dir inside


@pytest.mark.parametrize(
    ("where", "mode", "why", "fix"),
    [
        ("hook_path", 0o775, "its group can write it", ALL),
        ("hook_path", 0o1777, "others can write it", ALL),  # sticky or not
        ("hook_path/ray_uv_plugin_hook.py", 0o666, "others can write it", ALL),
        # What the hook loads from the package: every module, and the dirs of them.
        (".", 0o1777, "others can write it", ALL),
        ("__init__.py", 0o664, "its group can write it", ALL),
        ("driver/hook.py", 0o666, "others can write it", ALL),
        ("store", 0o775, "its group can write it", ALL),
        ("..", 0o777, "others can write it", "`chmod go-w {path}` (or `chmod +t {path}`"),
    ],
    ids=[
        "hook-dir-group", "hook-dir-sticky", "hook-file", "package-dir", "package-init",
        "package-module", "package-subdir", "site-dir",
    ],
)  # fmt: skip
def test_a_hook_dir_others_can_change_is_refused_with_the_fix(
    tmp_path: Path, where: str, mode: int, why: str, fix: str
) -> None:
    hook_dir = install_copy(tmp_path / "site")
    path = Path(os.path.normpath(hook_dir.parent / where))
    path.chmod(mode)
    out = shell(tmp_path / "site", "$RAY_UV plugin-config --shell")
    assert out.returncode == 1 and out.stdout == "", out.stdout
    assert f"refusing the driver hook's directory {hook_dir} for PYTHONPATH" in out.stderr
    assert why in out.stderr, out.stderr
    assert fix.format(package=hook_dir.parent, path=path) in out.stderr, out.stderr
    path.chmod(0o755 if path.is_dir() else 0o644)
    again = shell(tmp_path / "site", "$RAY_UV plugin-config --shell")
    assert again.returncode == 0 and f"export PYTHONPATH={hook_dir}" in again.stdout, again.stderr


def test_a_symlink_in_the_hook_dir_is_refused(tmp_path: Path) -> None:
    hook_dir = install_copy(tmp_path / "site")
    (hook_dir / "json.py").symlink_to(tmp_path / "anywhere.py")
    with pytest.raises(UntrustedPathError, match="json.py: it is a symlink, which Python would"):
        check_hook_dir(hook_dir)


def test_a_sticky_dir_above_the_hook_dir_is_fine(tmp_path: Path) -> None:
    """As the venv dir's ancestors: others may add entries there (as in /tmp), not replace ours."""
    hook_dir = install_copy(tmp_path / "site")
    (tmp_path / "site").chmod(0o1777)
    check_hook_dir(hook_dir)


@pytest.fixture
def root_owned_install() -> Iterator[Path]:
    """A copy of the package that root installed where every user can read it."""
    base = Path(tempfile.mkdtemp(prefix="ruv-site-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield install_copy(base / "site")
    finally:
        shutil.rmtree(base)


def test_a_root_owned_install_is_trusted_by_another_user(
    root_owned_install: Path, other_user: tuple[str, int, int]
) -> None:
    """A package in root's site-packages: the hook dir, root's, is fine for any user, as the
    dirs above the venv dir may be root's."""
    _, uid, gid = other_user
    code = (
        "import os, pathlib, sys; from ray_uv_plugin.driver.hook import check_hook_dir; "
        f"os.setgid({gid}); os.setuid({uid}); check_hook_dir(pathlib.Path(sys.argv[1])); "
        "print('trusted as', os.geteuid())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root_owned_install)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"trusted as {uid}"

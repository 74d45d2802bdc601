"""The project on disk: finding it, and the checks made before uv runs. No Ray."""

from pathlib import Path

import pytest
import ray

from ray_uv_plugin.env.project import (
    NO_LOCAL_SOURCES,
    ProjectError,
    ProjectFiles,
    check_ray_pin,
    check_request,
    copied_sources,
    load_project,
    local_sources,
    locked_sources,
    project_name,
    refers_to_project_path,
    resolve_project_dir,
)
from ray_uv_plugin.env.spec import parse_spec
from tests.support.uvproject import write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_project(
        tmp_path_factory.mktemp("p") / "proj",
        ["six"],
        extras={"fig": ["pyfiglet"]},
        groups={"lint": ["tomli-w"]},
    )


def test_project_dir_comes_from_project_or_working_dir(tmp_path):
    assert resolve_project_dir(parse_spec({}), "/wd") == Path("/wd")
    assert resolve_project_dir(parse_spec({"project": "/abs"}), "/wd") == Path("/abs")
    assert resolve_project_dir(parse_spec({"project": "sub"}), "/wd") == Path("/wd/sub")
    with pytest.raises(ProjectError, match="set runtime_env 'working_dir'"):
        resolve_project_dir(parse_spec({}), None)
    with pytest.raises(ProjectError, match="is relative"):
        resolve_project_dir(parse_spec({"project": "sub"}), None)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(ProjectError, match="does not exist"):
        load_project(tmp_path / "nope")
    with pytest.raises(ProjectError, match="no pyproject.toml"):
        load_project(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\nversion='0'\n")
    with pytest.raises(ProjectError, match="run `uv lock`"):
        load_project(tmp_path)


def test_unknown_extras_and_groups_list_what_exists(project):
    files = load_project(project)
    check_request(files, parse_spec({"extras": ["fig"], "groups": ["lint"]}))
    with pytest.raises(ProjectError, match="unknown extra.*nope.*has fig"):
        check_request(files, parse_spec({"extras": ["nope"]}))
    with pytest.raises(ProjectError, match="unknown group.*nope.*has lint"):
        check_request(files, parse_spec({"groups": ["nope"]}))


def test_requires_python_the_node_cannot_satisfy(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        "[project]\nname='x'\nversion='0'\nrequires-python='>=3.99'\n"
    )
    (tmp_path / "uv.lock").write_text("")
    with pytest.raises(ProjectError, match="requires-python '>=3.99'.*runs Python 3"):
        check_request(load_project(tmp_path), parse_spec({}))


def test_ray_pin_must_match_the_node(project, tmp_path):
    check_ray_pin(load_project(project), ray.__version__)
    with pytest.raises(ProjectError, match=f"pins ray {ray.__version__} but this node runs ray 0"):
        check_ray_pin(load_project(project), "0.0.1")
    no_ray = write_project(tmp_path / "noray", ["six"], with_ray=False)
    with pytest.raises(ProjectError, match="holds no ray.*add `ray=="):
        check_ray_pin(load_project(no_ray), ray.__version__)


def test_project_path_matters_only_when_the_venv_points_into_it(project, tmp_path):
    files = load_project(project)
    assert not refers_to_project_path(files, parse_spec({}))
    assert refers_to_project_path(files, parse_spec({"install_project": True}))
    lib = write_project(tmp_path / "lib", name="lib", with_ray=False, lock=False)
    app = tmp_path / "app"
    write_project(
        app,
        ["lib"],
        lock=False,
    )
    with (app / "pyproject.toml").open("a") as f:
        f.write(f'\n[tool.uv.sources]\nlib = {{ path = "{lib}", editable = true }}\n')
    import subprocess

    from ray_uv_plugin.env.uv import find_uv

    subprocess.run([find_uv(), "lock", "--project", str(app), "-q"], check=True)
    assert refers_to_project_path(load_project(app), parse_spec({}))


# --- uv.lock, parsed as TOML once per content --------------------------------------------------

LOCK = """version = 1
revision = 3
requires-python = ">=3.11"

[[package]]
version = "2.60.0"
name = "ray"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "app"
version = "0.1.0"
source = { editable = "." }

[[package]]
name = "vendored"
version = "1.0"
source={directory="vendor/vendored"}

[[package]]
name = "mylib"
version = "0.2"
source = { editable = "../mylib" }

[[package]]
name = "wheelish"
version = "3.0"

[package.source]
path = "dist/wheelish-3.0-py3-none-any.whl"
"""


def lock_files(tmp_path: Path, text: str) -> ProjectFiles:
    return ProjectFiles(tmp_path, b"", text.encode())


def test_the_lock_is_read_as_toml_whatever_its_key_order_and_spacing(tmp_path: Path) -> None:
    """Key order, spacing and table forms are TOML's business, not a regex's."""
    found = locked_sources(lock_files(tmp_path, LOCK))
    assert found.ray_versions == ("2.60.0",)
    assert found.refers_to_paths  # ../mylib; the project's own "." does not count
    assert found.copied == ("dist/wheelish-3.0-py3-none-any.whl", "vendor/vendored")
    assert found.copied_names == ("vendored", "wheelish")
    assert local_sources(lock_files(tmp_path, LOCK)) is found  # remembered by content


def test_a_wheel_file_source_is_keyed_by_content_not_by_the_projects_path(tmp_path: Path) -> None:
    """uv unpacks a wheel: the venv points nowhere into the project (the plugin's own wheel in a
    driver group, README "Install"), so a working_dir unpacked per Ray session keeps its venv."""
    registry_only = LOCK.split('[[package]]\nname = "app"')[0]
    wheel = LOCK.split('[[package]]\nname = "wheelish"')[1]
    found = locked_sources(
        lock_files(tmp_path, registry_only + '[[package]]\nname = "wheelish"' + wheel)
    )
    assert not found.refers_to_paths
    assert found.copied == ("dist/wheelish-3.0-py3-none-any.whl",)  # its content is keyed


def test_a_lock_without_local_sources_is_not_parsed_per_request(tmp_path: Path) -> None:
    registry_only = LOCK.split('[[package]]\nname = "app"')[0]
    files = lock_files(
        tmp_path, registry_only + '[[package]]\nname = "app"\nsource = { editable = "." }\n'
    )
    assert local_sources(files) is NO_LOCAL_SOURCES
    assert not refers_to_project_path(files, parse_spec({}))
    assert locked_sources(files).ray_versions == ("2.60.0",)  # the build's check reads it whole


def test_a_lock_that_is_not_toml_says_so(tmp_path: Path) -> None:
    files = lock_files(tmp_path, '[[package]]\nname = "x"\nsource = { path = "a" \n')
    with pytest.raises(ProjectError, match=r"uv.lock is not valid TOML .*run `uv lock` again"):
        locked_sources(files)


# --- found by the project fuzzer (tests/fuzz/project.py) ---------------------------------------


@pytest.mark.parametrize(
    ("pyproject", "words"),
    [
        ('project = ["x"]\n', r"\[project\] in .* is a list, not a table"),
        ("[project]\noptional-dependencies = 3\n", "optional-dependencies] in .* is a int"),
        ('dependency-groups = "dev"\n', r"\[dependency-groups\] in .* is a str"),
        ('[project]\nrequires-python = [">=3"]\n', "requires-python in .* is a list"),
    ],
    ids=["project", "extras", "groups", "requires-python"],
)
def test_a_pyproject_table_of_another_type_is_named(tmp_path: Path, pyproject: str, words: str):
    """Each once raised AttributeError or TypeError out of check_request (and project_name)."""
    files = ProjectFiles(tmp_path, pyproject.encode(), b"")
    with pytest.raises(ProjectError, match=words):
        check_request(files, parse_spec({}))
    assert project_name(files) in ("?", "x")


@pytest.mark.parametrize("package", ["true", '"ray"', "3", '{name = "ray"}'])
def test_a_lock_whose_packages_are_no_list_is_named(tmp_path: Path, package: str) -> None:
    """`package = true` once raised TypeError out of check_ray_pin (`bool` is not iterable)."""
    files = lock_files(tmp_path, f"version = 1\npackage = {package}\npath = 1\n")
    for check in (lambda: check_ray_pin(files, ray.__version__), lambda: local_sources(files)):
        with pytest.raises(ProjectError, match="holds no list of packages"):
            check()


def test_a_local_source_that_is_no_path_is_named(tmp_path: Path) -> None:
    """A NUL byte in a source path once raised a bare ValueError out of copied_sources."""
    lock = 'version = 1\n[[package]]\nname = "a"\nsource = { path = "a\\u0000b" }\n'
    with pytest.raises(ProjectError, match="which is no path on this node"):
        copied_sources(lock_files(tmp_path, lock))


def test_a_missing_source_inside_an_uploaded_working_dir_names_the_upload_rules(tmp_path: Path):
    """The README's wheel in `wheels/`, which the .gitignore of `uv init` ignores: the message
    said "put it inside the working_dir", where it was. Now it names the rules, as for uv.lock."""
    lock = (
        'version = 1\n[[package]]\nname = "a"\nsource = { path = "wheels/a-1-py3-none-any.whl" }\n'
    )
    uploaded = ProjectFiles(tmp_path, b"", lock.encode(), uploaded=True)
    with pytest.raises(ProjectError) as left_out:
        copied_sources(uploaded)
    said = str(left_out.value)
    assert "which does not exist on this node" in said
    assert "the working_dir's upload left it out" in said
    assert "(`git check-ignore -v wheels/a-1-py3-none-any.whl` says which rule)" in said
    assert "the .gitignore of `uv init` ignores wheels/" in said
    # A project the nodes share (no upload), or a source outside the upload: as before.
    for files in (lock_files(tmp_path, lock), lock_files(tmp_path, lock.replace("wheels/", "../"))):
        with pytest.raises(ProjectError, match="put it inside the working_dir or on a path every"):
            copied_sources(files)
    outside = ProjectFiles(tmp_path, b"", lock.replace("wheels/", "../").encode(), uploaded=True)
    with pytest.raises(ProjectError, match="put it inside the working_dir or on a path every"):
        copied_sources(outside)


@pytest.mark.parametrize(
    "source", ['"path" = "libs/a"', "'directory' = 'libs/a'", '"editable" = "libs/a"']
)
def test_a_lock_whose_keys_are_quoted_is_read_for_its_local_sources(
    tmp_path: Path, source: str
) -> None:
    """TOML's `"path" = ...` is `path = ...`: the quick check once skipped such a lock, and the
    venv's key missed the source's content (a changed source would reuse the old venv)."""
    lock = f'version = 1\n[[package]]\nname = "a"\nsource = {{ {source} }}\n'
    found = local_sources(lock_files(tmp_path, lock))
    assert found == locked_sources(lock_files(tmp_path, lock)) and found.refers_to_paths


def test_a_fifo_in_a_directory_source_is_keyed_without_reading_it(tmp_path: Path) -> None:
    """A FIFO in a source dir once blocked the node's agent in `copied_sources` for good (and
    a socket failed it with OSError)."""
    import os
    import socket
    import threading

    (tmp_path / "libs" / "a").mkdir(parents=True)
    (tmp_path / "libs" / "a" / "x.py").write_text("x = 1\n")
    os.mkfifo(tmp_path / "libs" / "a" / "pipe")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "libs" / "a" / "sock"))  # open(2) fails on one: ENXIO
    files = lock_files(
        tmp_path, 'version = 1\n[[package]]\nname = "a"\nsource = { directory = "libs/a" }\n'
    )
    found: list = []
    thread = threading.Thread(target=lambda: found.append(copied_sources(files)), daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "copied_sources blocks on the FIFO"
    ((source, digest),) = found[0]
    assert source == "libs/a" and len(digest) == 64

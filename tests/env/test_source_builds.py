"""`env.source_builds`: a lock that builds anything from source keys what that build fetches
with, its indexes, proxies and CAs; a lock of wheels keeps the key it had. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import ConfigFile, ProjectFiles, load_project
from ray_uv_plugin.env.source_builds import builds_from_source
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.env.uv_env import SOURCE_FETCH_VARS
from tests.env.test_key import write_with_mylib
from tests.support.uvproject import write_project

PROJECT = '[[package]]\nname = "proj"\nversion = "0.1.0"\nsource = { %s = "." }\n'
REGISTRY = 'source = { registry = "https://pypi.org/simple" }'
SDIST = 'sdist = { url = "https://files/x-1.0.tar.gz", hash = "sha256:00" }'
ANY_WHEEL = 'wheels = [{ url = "https://files/x-1.0-py3-none-any.whl", hash = "sha256:00" }]'
WINDOWS_WHEEL = 'wheels = [{ url = "https://files/x-1.0-cp311-cp311-win_amd64.whl" }]'
LOCKS = {
    # name: (a package's lines, built from source here)
    "wheel": (f"{REGISTRY}\n{SDIST}\n{ANY_WHEEL}", False),
    "wheels only, of another platform": (f"{REGISTRY}\n{WINDOWS_WHEEL}", False),
    "sdist only": (f"{REGISTRY}\n{SDIST}", True),
    "sdist, wheels of another platform": (f"{REGISTRY}\n{SDIST}\n{WINDOWS_WHEEL}", True),
    "git": ('source = { git = "https://github.com/o/x?rev=main#0123abcd" }', True),
    "directory": ('source = { directory = "../x" }', True),
    "editable": ('source = { editable = "../x" }', True),
    "path wheel": ('source = { path = "dist/x-1.0-py3-none-any.whl" }', False),
    "path sdist": ('source = { path = "dist/x-1.0.tar.gz" }', True),
    "url sdist": (f'source = {{ url = "https://h/x-1.0.tar.gz" }}\n{SDIST}', True),
    "url wheel": (f'source = {{ url = "https://h/x-1.0-py3-none-any.whl" }}\n{ANY_WHEEL}', False),
}


def files_of(package: str, project: str = "virtual", pyproject: str = "") -> ProjectFiles:
    lock = f'version = 1\n\n{PROJECT % project}\n[[package]]\nname = "x"\nversion = "1.0"\n'
    return ProjectFiles(Path("/p"), pyproject.encode(), (lock + package + "\n").encode())


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_what_builds_from_source(name: str) -> None:
    package, built = LOCKS[name]
    assert builds_from_source(files_of(package), (), {}, install_project=False) is built


def test_the_project_itself_is_built_only_when_installed() -> None:
    wheel = LOCKS["wheel"][0]
    assert not builds_from_source(files_of(wheel, "editable"), (), {}, install_project=False)
    assert builds_from_source(files_of(wheel, "editable"), (), {}, install_project=True)
    assert not builds_from_source(files_of(wheel, "virtual"), (), {}, install_project=True)


def test_no_binary_builds_every_package_from_source(tmp_path: Path) -> None:
    wheel = LOCKS["wheel"][0]
    assert builds_from_source(files_of(wheel), (), {"UV_NO_BINARY": "1"}, False)
    assert builds_from_source(files_of(wheel), (), {"UV_NO_BINARY_PACKAGE": "x"}, False)
    tool_uv = "[tool.uv]\nno-binary-package = ['x']\n"
    assert builds_from_source(files_of(wheel, pyproject=tool_uv), (), {}, False)
    config = tmp_path / "uv.toml"
    config.write_text("no-binary = true\n")
    uv_toml = (ConfigFile(config, "uv.toml", "-"),)
    assert builds_from_source(files_of(wheel), uv_toml, {}, False)
    assert builds_from_source(files_of(wheel), (), {"UV_CONFIG_FILE": str(config)}, False)


# --- the key --------------------------------------------------------------------------------

PROXY = {"HTTPS_PROXY": "http://user:s3cret@proxy-a:3128", "HTTP_PROXY": "http://proxy-a:3128"}


@pytest.fixture
def no_fetch_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No index, proxy or CA setting in the node's environment (this machine's sets CAs)."""
    for name in SOURCE_FETCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def mylib_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with a path source (`../mylib`, built with hatchling from the index)."""
    return write_with_mylib(tmp_path_factory.mktemp("source"), editable=False)


def key(project: Path, env_vars: dict[str, str] | None = None) -> str:
    return make_request(parse_spec({}), load_project(project), env_vars or {}).key


@pytest.mark.parametrize(
    "setting",
    [PROXY, {"SSL_CERT_FILE": "/job/ca.pem"}, {"UV_INDEX_URL": "https://mirror.invalid/simple"}],
    ids=["proxy", "ca", "index"],
)
def test_a_path_source_keys_the_jobs_fetch_settings(
    mylib_project: Path, no_fetch_settings: pytest.MonkeyPatch, setting: dict[str, str]
) -> None:
    """A build hook of ../mylib that downloads a file gets the proxy's answer, and hatchling
    comes from the index: a job with another proxy or index gets a venv of its own."""
    plain = key(mylib_project)
    assert key(mylib_project, setting) != plain
    # The node's setting too: every build of the node's fetches with it.
    for name, value in setting.items():
        no_fetch_settings.setenv(name, value)
    assert key(mylib_project) == key(mylib_project, setting) != plain


def test_a_proxys_credentials_are_not_keyed_and_its_host_is(
    mylib_project: Path, no_fetch_settings: pytest.MonkeyPatch
) -> None:
    request = make_request(parse_spec({}), load_project(mylib_project), PROXY)
    assert "s3cret" not in json.dumps(request.inputs.as_json())
    assert key(mylib_project, {**PROXY, "HTTPS_PROXY": "http://other:pw@proxy-a:3128"}) == (
        request.key
    )
    assert key(mylib_project, {**PROXY, "HTTPS_PROXY": "http://proxy-b:3128"}) != request.key


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("wheels") / "six", ["six"])


def test_a_lock_of_wheels_keeps_its_key_whatever_fetches_it(
    six: Path, no_fetch_settings: pytest.MonkeyPatch
) -> None:
    """Every file comes by the URL and hash in uv.lock: a proxy or index decides whether the
    build succeeds, never what it installs, and the key is the one it was before."""
    plain = key(six)
    settings = {**PROXY, "SSL_CERT_FILE": "/ca.pem", "UV_INDEX_URL": "https://m.invalid/simple"}
    assert key(six, settings) == plain


def test_a_receiver_keys_the_fetch_settings_where_the_sender_did(
    mylib_project: Path, no_fetch_settings: pytest.MonkeyPatch
) -> None:
    """A node offered a venv keys it from the sender's record of its inputs, which has no lock:
    a fetch setting in that record says the lock builds from source."""
    request = make_request(parse_spec({}), load_project(mylib_project), PROXY)
    assert request.inputs.on_this_node(request.uv_env, resolves=False) == request.inputs
    other = make_request(parse_spec({}), load_project(mylib_project), {"HTTP_PROXY": "http://b"})
    assert request.inputs.on_this_node(other.uv_env, resolves=False).key != request.key
    # Built without any: its key says so, whatever this node's proxy.
    plain = make_request(parse_spec({}), load_project(mylib_project), {})
    assert plain.inputs.on_this_node(request.uv_env, resolves=False) == plain.inputs

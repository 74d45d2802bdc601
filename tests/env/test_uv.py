"""`env.uv` without running uv: timings as uv prints them, and what a failed sync says."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ray_uv_plugin.env.uv import UvResult, format_duration, sync_failure

PROJECT = Path("/srv/project")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.0004, "0.4ms"), (0.4321, "432.1ms"), (1.0, "1.00s"), (2.414, "2.41s")]
)
def test_durations_read_as_uv_prints_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_tail_keeps_the_last_lines_without_trailing_blank_ones() -> None:
    result = UvResult(1, "".join(f"line {i}\n" for i in range(40)) + "\n\n", 1.0)
    assert result.tail(3) == "line 37\nline 38\nline 39"
    assert len(result.tail().splitlines()) == 25


@pytest.mark.parametrize(
    ("output", "says", "transient"),
    [
        ("error: The lockfile at `uv.lock` needs to be updated, but `--locked`", "uv lock", False),
        ("No interpreter found for Python >=3.14", "requires-python", False),
        ("Hash mismatch for `six==1.16.0`", "uv lock --refresh", False),
        ("error: Failed to fetch: `https://pypi.org/simple/six/`", "UV_INDEX_URL", True),
        ("dns error: failed to lookup address", "ray-uv prepare", True),
        ("Extra `gpu` is not defined in the project's `optional-dependencies`", "extras", False),
        ("Group `dev` is not defined in the project's `dependency-groups`", "groups", False),
        ("something uv has never said", "uv sync --locked", False),
    ],
)
def test_a_failed_sync_says_what_to_do_and_whether_to_try_again(
    output: str, says: str, transient: bool
) -> None:
    error = sync_failure(PROJECT, UvResult(2, f"Resolved 3 packages\n{output}\n", 0.5))
    message = str(error)
    assert message.startswith(f"uv_project: `uv sync` failed for {PROJECT} (exit 2): ")
    assert says in message.split("\n", 1)[0]
    assert message.endswith(f"--- uv output (last lines) ---\nResolved 3 packages\n{output}")
    assert error.transient is transient


def test_the_first_matching_hint_wins() -> None:
    output = "lockfile needs to be updated\nFailed to fetch"
    error = sync_failure(PROJECT, UvResult(1, output, 0.1))
    assert "run `uv lock`" in str(error) and not error.transient


@pytest.mark.parametrize(
    ("returncode", "name"), [(-int(signal.SIGKILL), "SIGKILL"), (-99, "signal 99")]
)
def test_a_uv_killed_by_a_signal_is_named_and_transient(returncode: int, name: str) -> None:
    error = sync_failure(PROJECT, UvResult(returncode, "Downloading torch\n", 3.0))
    assert f"uv was killed by {name} (not by the plugin" in str(error)
    assert str(error).endswith("Downloading torch")
    assert error.transient

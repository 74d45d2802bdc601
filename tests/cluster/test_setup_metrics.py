"""Setup metrics (`cluster.setup_metrics`): what each node's venv dir says of every key, as
gauges on the node's Prometheus endpoint, scraped here from a real Ray's metrics agent."""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from ray_uv_plugin.cluster.setup_metrics import export_setup_metrics, samples
from ray_uv_plugin.store import outcomes, phases
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.layout import Venv
from tests.store.test_setup_state import ready_venv

# --- pure ------------------------------------------------------------------------------------


def setup(state: str, **fields: object) -> SimpleNamespace:
    base = {"how": None, "phase": None, "seconds": None, "bytes": None, "source": None}
    return SimpleNamespace(state=state, **{**base, **fields})


def test_samples_are_each_keys_state_phase_and_bytes() -> None:
    found = samples(
        {
            "a" * 16: setup("ready", how="shipped", bytes=2048, source="node-a"),
            "b" * 16: setup("building", phase="building flash-attn", seconds=432.0, bytes=10),
            "c" * 16: setup("failed", phase="download"),
        }
    )
    a, b, c = "a" * 16, "b" * 16, "c" * 16
    assert found[("uv_project_setup_state", (("how", "shipped"), ("key", a), ("state", "ready")))]
    assert found[("uv_project_shipped_bytes", (("key", a), ("source", "node-a")))] == 2048
    phase = (("key", b), ("phase", "building flash-attn"), ("state", "building"))
    assert found[("uv_project_setup_phase_seconds", phase)] == 432.0
    assert found[("uv_project_setup_bytes", (("key", b), ("state", "building")))] == 10
    assert found[("uv_project_setup_state", (("how", ""), ("key", c), ("state", "failed")))] == 1
    assert found[("uv_project_venvs", (("how", "shipped"),))] == 1
    assert found[("uv_project_venvs", (("how", "built"),))] == 0  # every `how`, even at 0


# --- a real Ray's metrics endpoint -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_with_metrics() -> Iterator[int]:
    port = free_port()
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    try:
        yield port
    finally:
        ray.shutdown()


def scrape_until(port: int, pattern: str, timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            text = ""
        if found := re.search(pattern, text, re.M):
            return found.group(0)
        time.sleep(0.5)
    lines = [line for line in text.splitlines() if "uv_project" in line]
    raise AssertionError(f"no {pattern!r} on the endpoint in {timeout}s: {lines}")


def test_the_nodes_endpoint_shows_each_keys_setup(ray_with_metrics: int) -> None:
    root = Path(os.environ["RAY_UV_PLUGIN_VENV_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    ready, building = f"{time.monotonic_ns():016x}"[-16:], "9" * 16
    ready_venv(root, ready, {"how": "shipped", "from": "node-a", "bytes": 4096})
    lock = BuildLock(Venv(root, building).lock)
    assert lock.try_acquire()
    try:
        since = time.time() - 30
        phases.write_record(
            root, building, {"state": "building", "phase": "building slowpkg", "since": since}
        )
        export_setup_metrics(interval=0.5)
        port = ray_with_metrics
        scrape_until(port, rf'^ray_uv_project_setup_state\{{.*key="{ready}".*state="ready".*\}} 1')
        scrape_until(port, rf'^ray_uv_project_shipped_bytes\{{.*key="{ready}".*\}} 4096')
        line = scrape_until(
            port, r'^ray_uv_project_setup_phase_seconds\{.*phase="building slowpkg".*\} \S+'
        )
        assert float(line.rsplit(" ", 1)[1]) >= 30
        phases.write_record(root, building, {"state": "building", "phase": "install", "since": 0})
        scrape_until(port, r'^ray_uv_project_setup_phase_seconds\{.*phase="install".*\} \S+')
        for outcome in ("built", "reused", "reused"):
            outcomes.record(root, ready, outcome)
        outcomes.record(root, ready, "shipped", 1000)
        found = [
            scrape_until(
                port, rf'^ray_uv_project_setups\w*\{{.*key="{ready}".*outcome="{o}".*\}} {n}$'
            )
            for o, n in (("reused", r"2(\.0)?"), ("built", r"1(\.0)?"), ("shipped", r"1(\.0)?"))
        ]
        found.append(
            scrape_until(
                port, rf'^ray_uv_project_received_bytes\w*\{{.*key="{ready}".*\}} 1000(\.0)?$'
            )
        )
        print("\n".join(found))  # the names as this Ray exports them
    finally:
        lock.release()
        phases.remove_record(root, building)

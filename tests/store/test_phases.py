"""The phase record `.phase-<key>` (`store.phases`): written whole by the key's lock holder,
read back only as the plugin wrote it, and removed by `gc` once its writer is gone."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ray_uv_plugin.store import phases
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.inventory import scan
from ray_uv_plugin.store.layout import Venv

KEY = "0123456789abcdef"


def test_a_record_is_read_back_as_written_and_names_its_writer(tmp_path: Path) -> None:
    since = time.time()
    assert phases.write_record(
        tmp_path, KEY, {"state": "building", "phase": "download", "since": since}
    )
    record = phases.read_record(tmp_path, KEY)
    assert record is not None
    assert (record["state"], record["phase"], record["since"]) == ("building", "download", since)
    assert record["pid"] == os.getpid() and record["key"] == KEY
    assert os.listdir(tmp_path) == [f".phase-{KEY}"]  # no temporary file left
    assert phases.write_record(tmp_path, KEY, {"state": "receiving", "phase": "ship bytes"})
    assert phases.read_record(tmp_path, KEY)["state"] == "receiving"  # replaced whole


def test_a_record_that_is_not_the_plugins_is_not_read(tmp_path: Path) -> None:
    path = phases.record_path(tmp_path, KEY)
    for text in (
        "not json",
        "[]",
        json.dumps({"format": 1, "key": "f" * 16, "state": "building"}),
        json.dumps({"format": 1, "key": KEY, "state": "dancing"}),
    ):
        path.write_text(text)
        assert phases.read_record(tmp_path, KEY) is None, text
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)  # never followed
    assert phases.read_record(tmp_path, KEY) is None
    path.unlink()
    path.write_text(json.dumps({"format": 1, "key": KEY, "state": "building"}))
    path.chmod(0o666)  # writable by others: untrusted
    assert phases.read_record(tmp_path, KEY) is None


def test_a_record_that_cannot_be_written_leaves_none(tmp_path: Path) -> None:
    assert phases.write_record(tmp_path, KEY, {"state": "building", "phase": "download"})
    os.mkdir(phases.record_path(tmp_path, KEY).with_name(f".phase-{KEY}.tmp"))  # in the way
    assert not phases.write_record(tmp_path, KEY, {"state": "building", "phase": "install"})
    assert phases.read_record(tmp_path, KEY) is None  # not the old phase: nothing


def test_gc_removes_records_whose_writer_is_gone_and_keeps_a_recent_failure(tmp_path: Path) -> None:
    live, dead, failed, old = "a" * 16, "b" * 16, "c" * 16, "d" * 16
    lock = BuildLock(Venv(tmp_path, live).lock)
    assert lock.try_acquire()
    try:
        phases.write_record(tmp_path, live, {"state": "building", "phase": "install"})
        phases.write_record(tmp_path, dead, {"state": "building", "phase": "install"})
        phases.write_record(tmp_path, failed, {"state": "failed", "cause": "no wheel"})
        phases.write_record(tmp_path, old, {"state": "failed", "cause": "no wheel"})
        day_ago = time.time() - phases.FAILED_KEPT_SECONDS - 1
        os.utime(phases.record_path(tmp_path, old), (day_ago, day_ago))
        (tmp_path / f".phase-{dead}.tmp").write_text("{")  # a writer that died mid-write
        assert phases.remove_stale(tmp_path) == 3
        left = sorted(n for n in os.listdir(tmp_path) if n.startswith(".phase-"))
        assert left == [f".phase-{live}", f".phase-{failed}"]
        assert scan(tmp_path).others == []  # no venv, and nothing `list` calls foreign
    finally:
        lock.release()
    assert phases.remove_stale(tmp_path) == 1  # its writer let go without a failure


def test_ray_uv_gc_removes_a_record_whose_writer_is_gone(tmp_path: Path) -> None:
    from ray_uv_plugin.store import gc

    tmp_path.chmod(0o700)
    phases.write_record(tmp_path, KEY, {"state": "building", "phase": "install"})
    gc.collect(tmp_path, dry_run=True)
    assert phases.record_path(tmp_path, KEY).exists()  # a dry run removes nothing
    gc.collect(tmp_path)
    assert not phases.record_path(tmp_path, KEY).exists()

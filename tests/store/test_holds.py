"""`holds`: a venv that Ray's agent holds for a live job is in use for `gc` and the budget
until the agent releases it or dies. No Ray, no uv: the records alone."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ray_uv_plugin.store import gc, holds, inventory
from tests.store.test_gc import made_by_plugin

KEY, OTHER = "0123456789abcdef", "fedcba9876543210"


def hold_in_a_process(root: Path, key: str) -> subprocess.Popen:
    """A process that holds `key` as Ray's agent does, until it is killed."""
    code = (
        "import sys, time; from pathlib import Path\n"
        "from ray_uv_plugin.store.holds import Hold\n"
        "Hold(Path(sys.argv[1]), sys.argv[2]); print('held', flush=True); time.sleep(300)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(root), key], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def records(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(".held-"))


def test_a_held_venv_is_in_use_by_its_agent_until_released(tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    venv = made_by_plugin(root, KEY, marker={"project": "/p"}, hours=2)  # idle: gc would take it
    made_by_plugin(root, OTHER, marker={"project": "/q"}, hours=2)
    hold = holds.Hold(root, KEY)
    (record,) = records(root)
    assert holds.RECORD.match(record) and record.startswith(f".held-{KEY}-{os.getpid()}-")
    assert stat.S_IMODE(os.lstat(root / record).st_mode) == 0o600  # whatever the umask
    assert holds.holders(root) == {os.path.realpath(venv): {os.getpid()}}
    inv = inventory.scan(root)
    assert inv.others == [] and inv.garbage == []  # the record is ours, and no venv
    assert {e.key: e.users for e in inv.venvs} == {KEY: (os.getpid(),), OTHER: ()}

    report = gc.collect(root, older_than_days=0)
    assert [d.entry.key for d in report.removed] == [OTHER]
    assert {d.entry.key: d.reason for d in report.kept} == {KEY: f"in use by pid {os.getpid()}"}
    assert venv.exists() and records(root) == [record]

    hold.release()
    hold.release()  # once Ray released it, a second release is nothing
    assert records(root) == [] and holds.holders(root) == {}
    assert [d.entry.key for d in gc.collect(root, older_than_days=0).removed] == [KEY]


def test_the_record_of_an_agent_that_died_holds_nothing_and_gc_removes_it(tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    alive, dead = (made_by_plugin(root, k, marker={"project": "/p"}, hours=2) for k in (KEY, OTHER))
    living = hold_in_a_process(root, KEY)
    killed = hold_in_a_process(root, OTHER)
    try:
        killed.send_signal(signal.SIGKILL)  # an agent dies with its raylet: nothing released
        killed.wait()
        assert len(records(root)) == 2
        assert holds.holders(root) == {os.path.realpath(alive): {living.pid}}
        assert gc.collect(root, older_than_days=0, dry_run=True).removed  # the dry run ...
        assert len(records(root)) == 2  # ... leaves the records as they are
        report = gc.collect(root, older_than_days=0)
        assert [d.entry.key for d in report.removed] == [OTHER] and not dead.exists()
        assert {d.entry.key: d.reason for d in report.kept} == {KEY: f"in use by pid {living.pid}"}
        (left,) = records(root)
        assert left.startswith(f".held-{KEY}-{living.pid}-")
    finally:
        living.kill()
        living.wait()
    assert holds.holders(root) == {}
    assert [d.entry.key for d in gc.collect(root, older_than_days=0).removed] == [KEY]
    assert records(root) == []


def test_a_half_made_record_holds_nothing_and_goes_once_old(tmp_path: Path) -> None:
    root = tmp_path / "venvs"
    venv = made_by_plugin(root, KEY, marker={"project": "/p"}, hours=2)
    fresh = root / f".held-new-{KEY}-4242-0000aaaa"
    old = root / f".held-new-{KEY}-4243-0000bbbb"
    fresh.touch()
    old.touch()
    t = time.time() - 2 * holds.STALE_NEW_SECONDS
    os.utime(old, (t, t))
    assert holds.holders(root) == {}
    assert holds.remove_dead(root) == 1
    assert records(root) == [fresh.name] and venv.exists()
    assert inventory.scan(root).others == []


def test_only_records_of_the_plugins_form_count() -> None:
    assert holds.is_record(f".held-{KEY}-12-0123abcd")
    assert holds.is_record(f".held-new-{KEY}-12-0123abcd")
    for name in (f".held-{KEY}-12", f".held-{KEY[:-1]}-12-0123abcd", f".held-{KEY}-x-0123abcd"):
        assert not holds.is_record(name), name

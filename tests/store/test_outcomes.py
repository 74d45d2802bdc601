"""`.outcomes` (`store.outcomes`): a line per setup, appended whole, counted from where the
exporter left off, rotated once large, and never read where it is not the user's file."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ray_uv_plugin.store import outcomes

A, B = "a" * 16, "b" * 16


def test_lines_are_counted_from_where_the_last_read_ended(tmp_path: Path) -> None:
    outcomes.record(tmp_path, A, "built")
    outcomes.record(tmp_path, A, "reused")
    outcomes.record(tmp_path, B, "shipped", 4096)
    counts, shipped, offset = outcomes.read_from(tmp_path, 0)
    assert counts == Counter({(A, "built"): 1, (A, "reused"): 1, (B, "shipped"): 1})
    assert shipped == Counter({B: 4096})
    outcomes.record(tmp_path, A, "reused")
    with open(tmp_path / outcomes.OUTCOMES, "a") as f:
        f.write(f"{A} reu")  # a line being written: counted once whole
    counts, _, offset = outcomes.read_from(tmp_path, offset)
    assert counts == Counter({(A, "reused"): 1})
    with open(tmp_path / outcomes.OUTCOMES, "a") as f:
        f.write("sed 0\nnot a line\n")
    assert outcomes.read_from(tmp_path, offset)[0] == Counter({(A, "reused"): 1})


def test_a_large_file_is_rotated_and_counting_starts_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(outcomes, "ROTATE_BYTES", 100)
    for _ in range(5):
        outcomes.record(tmp_path, A, "reused")
    counts, _, offset = outcomes.read_from(tmp_path, 0)
    assert counts[(A, "reused")] == 5 and offset == 0
    assert (tmp_path / outcomes.OLD).exists() and not (tmp_path / outcomes.OUTCOMES).exists()
    outcomes.record(tmp_path, A, "failed")
    assert outcomes.read_from(tmp_path, offset)[0] == Counter({(A, "failed"): 1})


def test_a_file_that_is_not_ours_is_neither_read_nor_written(tmp_path: Path) -> None:
    os.symlink(tmp_path / "elsewhere", tmp_path / outcomes.OUTCOMES)
    outcomes.record(tmp_path, A, "built")  # never fails a setup
    assert not (tmp_path / "elsewhere").exists()
    assert outcomes.read_from(tmp_path, 0) == (Counter(), Counter(), 0)

"""`benchmarks.node_disks`: a disk of its own for each simulated node, made for real (a loop
device, as root) and removed however the block ends. Skipped with the reason where loop mounts
cannot be made (not root, no mkfs.ext4, a container without loop devices)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import node_disks

WHY_NOT = node_disks.unavailable()
needs_disks = pytest.mark.skipif(WHY_NOT is not None, reason=f"no loop mounts: {WHY_NOT}")


def mounts_under(path: Path) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(path))]


@needs_disks
def test_each_node_gets_its_own_filesystem_and_nothing_is_left(tmp_path: Path) -> None:
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    with node_disks.mounted(nodes, tmp_path, size="64M"):
        devices = {os.stat(p).st_dev for p in nodes}
        assert len(devices) == 2 and os.stat(tmp_path).st_dev not in devices
        (nodes[0] / "venvs").mkdir()
        (nodes[0] / "venvs" / "file").write_bytes(b"x" * 4096)
        assert not (nodes[1] / "venvs").exists()
        assert sorted(mounts_under(tmp_path)) == [str(p) for p in nodes]
    assert mounts_under(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0", "node1"]  # the images went
    assert list(nodes[0].iterdir()) == []  # what was written lived on the node's disk only


@needs_disks
def test_a_failing_block_or_a_failing_mkfs_leaves_nothing_mounted(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with node_disks.mounted([tmp_path / "a", tmp_path / "b"], tmp_path, size="64M"):
            raise RuntimeError("boom")
    assert mounts_under(tmp_path) == []
    with pytest.raises(node_disks.DiskError, match="mkfs.ext4"):
        with node_disks.mounted([tmp_path / "c", tmp_path / "d"], tmp_path, size="1K"):
            pass  # too small for ext4: the first node's mkfs fails
    assert mounts_under(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]

"""Which bundles a group takes, without Ray: from workers_per_node or an explicit list."""

from __future__ import annotations

import pytest

from worker_groups.placement import bundles_from_workers_per_node, check_bundle_indices


def test_workers_per_node() -> None:
    assert bundles_from_workers_per_node([2, 1], None) == [(0, [0]), (0, [1]), (1, [0])]
    assert bundles_from_workers_per_node([2, 2], 1) == [(0, [0]), (1, [0])]
    assert bundles_from_workers_per_node([2, 2], [0, 2]) == [(1, [0]), (1, [1])]
    with pytest.raises(ValueError, match="one count per node"):
        bundles_from_workers_per_node([2, 2], [1])
    with pytest.raises(ValueError, match="asks for 3 workers on node 0, which has 2 bundles"):
        bundles_from_workers_per_node([2, 2], 3)


def test_explicit_tied_groups_per_node() -> None:
    assert check_bundle_indices([2, 2], [(0, [0, 1]), (1, (1,))]) == [(0, [0, 1]), (1, [1])]
    with pytest.raises(ValueError, match=r"node 2 not in 0..1"):
        check_bundle_indices([2, 2], [(2, [0])])
    with pytest.raises(ValueError, match="bundle 2 is not in node 1's bundles 0..1"):
        check_bundle_indices([2, 2], [(1, [2])])
    with pytest.raises(ValueError, match="bundle 0 of node 0 is used twice"):
        check_bundle_indices([2, 2], [(0, [0]), (0, [0, 1])])
    with pytest.raises(TypeError, match=r"use \(node_idx, \[bundle, ...\]\)"):
        check_bundle_indices([2, 2], [0, 1])
    with pytest.raises(ValueError, match="has no bundles"):
        check_bundle_indices([2, 2], [(0, [])])
    with pytest.raises(ValueError, match="is empty"):
        check_bundle_indices([2, 2], [])


def test_one_unified_group_node_index_is_a_label() -> None:
    # NeMo RL's policy on a unified group: (i // gpus_per_node, [sorted bundle i]).
    groups = [(0, [3]), (0, [1]), (1, [0]), (1, [2])]
    assert check_bundle_indices([4], groups) == groups
    with pytest.raises(ValueError, match="bundle 3 of node 1 is used twice"):
        check_bundle_indices([4], [(0, [3]), (1, [3])])  # one group: the same bundle
    with pytest.raises(ValueError, match="bundle 4 is not in node 1's bundles 0..3"):
        check_bundle_indices([4], [(1, [4])])

"""Dispatch planning and result dedup without Ray: who is called with which slice, whose result
comes back, and which bad inputs fail before anything is sent."""

from __future__ import annotations

import pytest

from worker_groups import NamedSharding, ShardingError
from worker_groups.dispatch import (
    WorkerCall,
    check_layout_covers,
    check_per_worker_data,
    check_sharded_value,
    map_slices,
    plan_sharded_dispatch,
    take,
    workers_on_axis_zero,
)
from worker_groups.futures import dedup_indices

DP_TP = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])


def test_sharded_dp_replicated_tp_returns_one_result_per_dp_shard() -> None:
    plan = plan_sharded_dispatch(DP_TP, ["dp"], ["tp"], ["tp"])
    assert plan.calls == (
        WorkerCall(0, (0,)),
        WorkerCall(1, (0,)),
        WorkerCall(2, (1,)),
        WorkerCall(3, (1,)),
    )
    assert plan.return_from_workers == (0, 2)


def test_free_axis_calls_only_index_zero_unless_dummy_calls() -> None:
    plan = plan_sharded_dispatch(DP_TP, ["dp"])
    assert plan.called_workers == [0, 2] and plan.return_from_workers == (0, 2)
    dummy = plan_sharded_dispatch(DP_TP, ["dp"], make_dummy_calls_to_free_axes=True)
    assert dummy.calls == (
        WorkerCall(0, (0,)),
        WorkerCall(1, None),
        WorkerCall(2, (1,)),
        WorkerCall(3, None),
    )
    assert dummy.return_from_workers == (0, 2)


def test_fully_sharded_returns_every_worker_and_nests_in_axis_order() -> None:
    plan = plan_sharded_dispatch(DP_TP, ["tp", "dp"])
    assert [c.data_index for c in plan.calls] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert plan.return_from_workers == (0, 1, 2, 3)


def test_replicated_output_without_replicated_input() -> None:
    plan = plan_sharded_dispatch(DP_TP, ["dp", "tp"], output_is_replicated=["tp"])
    assert plan.called_workers == [0, 1, 2, 3] and plan.return_from_workers == (0, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"in_sharded_axes": ["data_parallel"]},
            r"in_sharded_axes: unknown axis \['data_parallel'\]",
        ),
        ({"replicate_on_axes": ["pp"]}, "replicate_on_axes: unknown axis"),
        ({"output_is_replicated": ["x"]}, "output_is_replicated: unknown axis"),
        ({"in_sharded_axes": ["dp"], "replicate_on_axes": ["dp"]}, "both in_sharded_axes and"),
        ({"in_sharded_axes": "dp"}, "is a string"),
    ],
)
def test_bad_axes(kwargs: dict, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        plan_sharded_dispatch(DP_TP, **kwargs)


def test_data_shape_checks() -> None:
    check_sharded_value("batch", [[1], [2]], DP_TP, ["dp"])
    check_sharded_value("batch", [[1, 2], [3, 4]], DP_TP, ["dp", "tp"])
    with pytest.raises(
        ShardingError, match=r"batch has 3 slices along axis 'dp', which has size 2"
    ):
        check_sharded_value("batch", [1, 2, 3], DP_TP, ["dp"])
    with pytest.raises(ShardingError, match=r"batch\[1\] has 1 slices along axis 'tp'"):
        check_sharded_value("batch", [[1, 2], [3]], DP_TP, ["dp", "tp"])
    with pytest.raises(ShardingError, match=r"batch is a int, expected a list of 2 slices"):
        check_sharded_value("batch", 5, DP_TP, ["dp"])


def test_take_and_map_slices() -> None:
    data = [["a", "b"], ["c", "d"]]
    assert take(data, (1, 0)) == "c"
    assert map_slices(data, 1, tuple) == [("a", "b"), ("c", "d")]
    assert map_slices(data, 2, str.upper) == [["A", "B"], ["C", "D"]]


def test_layout_must_cover_the_group() -> None:
    check_layout_covers(DP_TP, 4)
    with pytest.raises(ShardingError, match="group has 6 workers"):
        check_layout_covers(DP_TP, 6)


def test_rank_zero_only_axes() -> None:
    assert workers_on_axis_zero(DP_TP, 4, None) == [0, 1, 2, 3]
    assert workers_on_axis_zero(DP_TP, 4, ["tp"]) == [0, 2]
    assert workers_on_axis_zero(DP_TP, 4, ["dp", "tp"]) == [0]
    with pytest.raises(ShardingError, match="needs sharding_annotations"):
        workers_on_axis_zero(None, 4, ["tp"])


def test_per_worker_data_checks() -> None:
    check_per_worker_data([[1, 2]], {"x": [3, 4]}, 2)
    with pytest.raises(ValueError, match="x has 3 entries but 2 workers"):
        check_per_worker_data([], {"x": [1, 2, 3]}, 2)
    with pytest.raises(TypeError, match="x is a int: pass a list"):
        check_per_worker_data([], {"x": 1}, 2)
    with pytest.raises(ValueError, match="use run_all_workers_single_data"):
        check_per_worker_data([], {}, 2)


def test_dedup_follows_return_from_workers_through_called_workers() -> None:
    # Futures of workers 0 and 2 only (free axis), results wanted from 0 and 2.
    assert dedup_indices(2, [0, 2], [0, 2], None) == [0, 1]
    # Worker 1 is in return_from_workers but was not called: skipped, not an index error.
    assert dedup_indices(2, [0, 1, 2], [0, 2], None) == [0, 1]
    assert dedup_indices(4, [0, 2], None, None) == [0, 2]


def test_dedup_by_tied_group_when_dispatch_did_not_choose() -> None:
    tied = {0: 0, 1: 0, 2: 1, 3: 1}
    assert dedup_indices(4, None, None, tied) == [0, 2]
    assert dedup_indices(2, None, [1, 3], tied) == [0, 1]
    assert dedup_indices(4, None, None, None) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="called_workers has 1 entries for 2 futures"):
        dedup_indices(2, None, [0], tied)

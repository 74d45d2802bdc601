"""NamedSharding without Ray: shape, coordinates, sub-shardings, and every bad layout."""

from __future__ import annotations

import pytest

from worker_groups import NamedSharding, ShardingError


def test_three_axes_shape_coords_and_ranks() -> None:
    s = NamedSharding([[[0, 1, 2, 3], [4, 5, 6, 7]]], ["dp", "pp", "tp"])
    assert s.shape == {"dp": 1, "pp": 2, "tp": 4}
    assert (s.names, s.ndim, s.size) == (["dp", "pp", "tp"], 3, 8)
    assert s.get_worker_coords(6) == {"dp": 0, "pp": 1, "tp": 2}
    assert s.get_ranks_by_coord(pp=1) == [4, 5, 6, 7]
    assert s.get_ranks_by_coord(tp=0) == [0, 4]
    sub = s.get_ranks(dp=0, pp=1)
    assert isinstance(sub, NamedSharding)
    assert sub.layout.tolist() == [4, 5, 6, 7] and sub.names == ["tp"]
    assert s.get_ranks(dp=0, pp=0, tp=3) == 3
    assert s.get_axis_size("tp") == 4 and s.get_axis_index("pp") == 1


def test_non_contiguous_layout_round_trips() -> None:
    s = NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert s.layout.tolist() == [[0, 2], [1, 3]]
    assert s.get_worker_coords(1) == {"dp": 1, "tp": 0}
    assert s == NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert s != NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    assert "names=['dp', 'tp']" in repr(s)


def test_numpy_layout_is_accepted() -> None:
    np = pytest.importorskip("numpy")
    s = NamedSharding(np.arange(4).reshape(2, 2), ["dp", "tp"])
    assert s.get_worker_coords(3) == {"dp": 1, "tp": 1}


@pytest.mark.parametrize(
    ("layout", "names", "message"),
    [
        ([[0, 1], [2]], ["dp", "tp"], "ragged"),
        ([[0, 1], [2, 3]], ["dp"], "one name per dimension"),
        ([[0, 1], [1, 2]], ["dp", "tp"], r"ranks \[1\] appear twice"),
        ([[0, "a"]], ["dp", "tp"], "integer ranks"),
        ([[0, 1.5]], ["dp", "tp"], "integer ranks"),
        ([], ["dp"], "empty"),
        ([[0, 1]], ["dp", "dp"], "repeat"),
        ([[0, 1]], "dp", "is a string"),
    ],
)
def test_bad_layouts_name_the_problem(layout: list, names: list, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        NamedSharding(layout, names)


def test_bad_lookups() -> None:
    s = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    with pytest.raises(ShardingError, match=r"unknown axis \['pp'\]; this sharding has"):
        s.get_ranks_by_coord(pp=0)
    with pytest.raises(IndexError, match="out of range for axis 'tp' of size 2"):
        s.get_ranks(tp=2)
    with pytest.raises(ShardingError, match="worker 7 is not in the layout"):
        s.get_worker_coords(7)
    assert isinstance(ShardingError("x"), ValueError)


def test_layout_is_a_numpy_array_and_repr_shows_the_shape() -> None:
    np = pytest.importorskip("numpy")
    s = NamedSharding(np.arange(8).reshape(1, 2, 4), ["dp", "pp", "tp"])
    assert isinstance(s.layout, np.ndarray) and s.layout.shape == (1, 2, 4)
    s.layout[0, 0, 0] = 99  # a copy: the sharding is unchanged
    assert s.get_worker_coords(0) == {"dp": 0, "pp": 0, "tp": 0}
    assert "shape=(1, 2, 4)" in repr(s) and "names=['dp', 'pp', 'tp']" in repr(s)
    assert "[[[0 1 2 3]" in repr(s)
    assert s.get_ranks(dp=0, tp=2) == NamedSharding(np.array([2, 6]), ["pp"])


def test_integral_floats_are_ranks() -> None:
    s = NamedSharding([[0.0, 1.0], [2.0, 3.0]], ["dp", "tp"])
    assert s.layout.dtype.kind == "i" and s.get_worker_coords(3) == {"dp": 1, "tp": 1}
    with pytest.raises(ShardingError, match=r"non-integer ranks \[2.5\]"):
        NamedSharding([[0.0, 2.5]], ["dp", "tp"])


def test_out_of_range_coordinate_matches_no_rank() -> None:
    s = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    assert s.get_ranks_by_coord(dp=2) == [] and s.get_ranks_by_coord(dp=0, tp=5) == []
    assert s.get_ranks_by_coord() == [0, 1, 2, 3]
    with pytest.raises(ShardingError, match="unknown axis"):
        s.get_ranks_by_coord(pp=0)  # a wrong name is still an error, not an empty match


def test_leader_check_on_replicated_axes() -> None:
    from worker_groups import REPLICATED_AXES

    assert REPLICATED_AXES == ("tensor_parallel", "context_parallel", "pipeline_parallel")
    s = NamedSharding([[0, 1], [2, 3]], ["data_parallel", "tensor_parallel"])
    leaders = [r for r in s.ranks if NamedSharding.is_axis_zero(s.get_worker_coords(r))]
    assert leaders == [0, 2]
    assert NamedSharding.is_axis_zero({"dp": 1}, ["tp"])  # a missing axis counts as 0
    assert not NamedSharding.is_axis_zero({"dp": 1, "tp": 0}, ["dp"])

"""`NamedSharding`: an N-dimensional layout of worker ranks with a name per axis.

RL frameworks think in axes ("data_parallel", "tensor_parallel", ...), not in rank lists; the
dispatch in `RayWorkerGroup.run_all_workers_sharded_data` asks this layout where each worker sits.
The layout is a numpy array, as in NeMo RL, so code that slices ``sharding.layout`` keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    import numpy as np
except ImportError as e:  # not among Ray's own requirements
    raise ImportError(
        "worker_groups needs numpy on the driver (NamedSharding layouts are numpy arrays, as in "
        "NeMo RL): install it into the driver's environment, e.g. `uv add numpy`"
    ) from e

# Axes along which every rank holds the same data: a worker at index 0 of all of them is the
# leader that NeMo RL's dispatch code gates on (``NamedSharding.is_axis_zero``).
REPLICATED_AXES: tuple[str, ...] = ("tensor_parallel", "context_parallel", "pipeline_parallel")


class ShardingError(ValueError):
    """A layout, axis name or data shape that does not fit the sharding."""


def _to_rank_array(layout: Any) -> np.ndarray:
    """A rectangular integer array of ranks; integral floats (``1.0``) are accepted."""
    if isinstance(layout, str | bytes):
        raise ShardingError(f"layout is the string {layout!r}: pass nested lists of integer ranks")
    try:
        array = np.array(layout)
    except ValueError:  # numpy refuses ragged nesting
        raise ShardingError(
            "layout is ragged: every row along an axis must have the same length"
        ) from None
    if array.dtype == object:
        raise ShardingError(
            "layout is ragged or holds non-numbers: a layout is a rectangular nest of integer ranks"
        )
    if array.size == 0:
        raise ShardingError(f"layout {layout!r} is empty: every axis needs at least one rank")
    if array.dtype == bool or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise ShardingError(
            f"layout holds {array.dtype} values: a layout holds nested lists of integer ranks"
        )
    if np.issubdtype(array.dtype, np.floating):
        bad = array[~np.isfinite(array) | (array != np.floor(array))]
        if bad.size:
            raise ShardingError(f"layout holds non-integer ranks {bad.tolist()}: use integers")
        array = array.astype(np.int64)
    return array


class NamedSharding:
    """Ranks arranged on named axes, e.g. ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])``.

    ``shape`` is ``{"dp": 2, "tp": 2}``; ``get_worker_coords(3)`` is ``{"dp": 1, "tp": 1}``;
    ``get_ranks(dp=1)`` is the 1-D sharding ``[2, 3]`` on ``["tp"]``.
    """

    def __init__(self, layout: Sequence[Any] | np.ndarray, names: Sequence[str]) -> None:
        if isinstance(names, str):
            raise ShardingError(f"names={names!r} is a string: pass a list such as ['dp', 'tp']")
        names = list(names)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ShardingError(f"axis name {n!r} must be a non-empty string")
        if len(set(names)) != len(names):
            raise ShardingError(f"axis names {names} repeat a name: each axis needs its own")
        array = _to_rank_array(layout)
        if array.ndim != len(names):
            raise ShardingError(
                f"layout has {array.ndim} dimension(s) (shape {array.shape}) but {len(names)} "
                f"name(s) {names}: give one name per dimension, outermost first"
            )
        ranks, counts = np.unique(array, return_counts=True)
        if (counts > 1).any():
            raise ShardingError(
                f"ranks {ranks[counts > 1].tolist()} appear twice in the layout: each rank sits "
                "at exactly one place"
            )
        self._layout = array
        self._layout.setflags(write=False)
        self._names = names
        self._coords = {int(self._layout[i]): i for i in np.ndindex(self._layout.shape)}

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, self._layout.shape, strict=True))

    @property
    def ndim(self) -> int:
        return self._layout.ndim

    @property
    def size(self) -> int:
        return int(self._layout.size)

    @property
    def ranks(self) -> list[int]:
        """All ranks, sorted."""
        return sorted(self._coords)

    @property
    def layout(self) -> np.ndarray:
        """A writable copy of the layout."""
        return self._layout.copy()

    def check_axes(self, axes: Sequence[str], what: str = "axes") -> list[str]:
        """Validate axis names once, at the edge, with a message that lists the valid ones."""
        if isinstance(axes, str):
            raise ShardingError(f"{what}={axes!r} is a string: pass a list such as [{axes!r}]")
        axes = list(axes)
        unknown = [a for a in axes if a not in self._names]
        if unknown:
            raise ShardingError(f"{what}: unknown axis {unknown}; this sharding has {self._names}")
        if len(set(axes)) != len(axes):
            raise ShardingError(f"{what}={axes} names an axis twice")
        return axes

    def get_axis_index(self, name: str) -> int:
        self.check_axes([name])
        return self._names.index(name)

    def get_axis_size(self, name: str) -> int:
        return int(self._layout.shape[self.get_axis_index(name)])

    def contains_worker_id(self, worker_id: int) -> bool:
        return worker_id in self._coords

    def get_worker_coords(self, worker_id: int) -> dict[str, int]:
        """Where a rank sits, as ``{axis: index}``."""
        if worker_id not in self._coords:
            raise ShardingError(
                f"worker {worker_id} is not in the layout (ranks {self.ranks[0]}..{self.ranks[-1]})"
            )
        return {n: int(i) for n, i in zip(self._names, self._coords[worker_id], strict=True)}

    @staticmethod
    def is_axis_zero(coords: dict[str, int], axes: Sequence[str] = REPLICATED_AXES) -> bool:
        """Whether ``coords`` sit at index 0 of every axis in ``axes`` (an axis missing from
        ``coords`` counts as 0): the leader-rank check of NeMo RL's dispatch code."""
        return all(coords.get(axis, 0) == 0 for axis in axes)

    def _index(self, coords: dict[str, int], out_of_range: str) -> tuple[Any, ...] | None:
        """The numpy index for ``coords``; ``None`` when an index is out of range and
        ``out_of_range`` is ``"empty"``, an IndexError when it is ``"raise"``."""
        self.check_axes(list(coords), "coordinates")
        index: list[Any] = [slice(None)] * self.ndim
        for name, i in coords.items():
            size = self.get_axis_size(name)
            if isinstance(i, bool) or not isinstance(i, int | np.integer):
                raise ShardingError(f"index {i!r} for axis {name!r} must be an int")
            if not 0 <= i < size:
                if out_of_range == "empty":
                    return None
                raise IndexError(f"index {i!r} is out of range for axis {name!r} of size {size}")
            index[self._names.index(name)] = int(i)
        return tuple(index)

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """Sorted ranks whose coordinates match ``coords`` (unnamed axes match any index; an
        index outside its axis matches nothing)."""
        index = self._index(coords, "empty")
        if index is None:
            return []
        return sorted(int(r) for r in np.ravel(self._layout[index]))

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The sub-sharding at ``coords``: an int when every axis is fixed."""
        index = self._index(coords, "raise")
        assert index is not None
        sub = self._layout[index]
        keep = [n for n in self._names if n not in coords]
        return int(sub) if not keep else NamedSharding(sub, keep)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.shape, self._layout.tobytes()))

    def __repr__(self) -> str:
        shape = ", ".join(str(s) for s in self._layout.shape)
        layout = np.array2string(self._layout, separator=" ")
        return f"NamedSharding(shape=({shape}), names={self._names}, layout={layout})"

"""`NamedSharding`: an N-dimensional layout of worker ranks with a name per axis.

RL frameworks think in axes ("data_parallel", "tensor_parallel", ...), not in rank lists; the
dispatch in `RayWorkerGroup.run_all_workers_sharded_data` asks this layout where each worker sits.
Pure Python on purpose: the driver needs nothing beyond the standard library to plan a dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product
from numbers import Integral
from typing import Any


class ShardingError(ValueError):
    """A layout, axis name or data shape that does not fit the sharding."""


def _infer_shape(layout: Any, depth: int, path: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of a rectangular nested list of ints; a ragged or non-int layout is an error."""
    if isinstance(layout, bool) or not isinstance(layout, Sequence | Integral):
        raise ShardingError(
            f"layout{list(path)} is {layout!r}: a layout holds nested lists of integer ranks"
        )
    if isinstance(layout, Integral):
        return ()
    if isinstance(layout, str):
        raise ShardingError(
            f"layout{list(path)} is the string {layout!r}: a layout holds nested lists of "
            "integer ranks"
        )
    if len(layout) == 0:
        raise ShardingError(f"layout{list(path)} is empty: every axis needs at least one rank")
    shapes = {_infer_shape(item, depth + 1, (*path, i)) for i, item in enumerate(layout)}
    if len(shapes) != 1:
        raise ShardingError(
            f"layout{list(path)} is ragged (sub-shapes {sorted(shapes)}): every row along an "
            "axis must have the same length"
        )
    return (len(layout), *shapes.pop())


def _at(nested: Any, index: Sequence[int]) -> Any:
    for i in index:
        nested = nested[i]
    return nested


class NamedSharding:
    """Ranks arranged on named axes, e.g. ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])``.

    ``shape`` is ``{"dp": 2, "tp": 2}``; ``get_worker_coords(3)`` is ``{"dp": 1, "tp": 1}``;
    ``get_ranks(dp=1)`` is the 1-D sharding ``[2, 3]`` on ``["tp"]``.
    """

    def __init__(self, layout: Sequence[Any], names: Sequence[str]) -> None:
        if isinstance(names, str):
            raise ShardingError(f"names={names!r} is a string: pass a list such as ['dp', 'tp']")
        if hasattr(layout, "tolist"):  # a numpy array, as NeMo RL passes
            layout = layout.tolist()
        names = list(names)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ShardingError(f"axis name {n!r} must be a non-empty string")
        if len(set(names)) != len(names):
            raise ShardingError(f"axis names {names} repeat a name: each axis needs its own")
        shape = _infer_shape(layout, 0, ())
        if len(shape) != len(names):
            raise ShardingError(
                f"layout has {len(shape)} dimension(s) (shape {shape}) but {len(names)} name(s) "
                f"{names}: give one name per dimension, outermost first"
            )
        self._names = names
        self._shape = shape
        self._coords: dict[int, tuple[int, ...]] = {}
        for index in product(*(range(s) for s in shape)):
            rank = int(_at(layout, index))
            if rank in self._coords:
                raise ShardingError(
                    f"rank {rank} appears twice in the layout (at {list(self._coords[rank])} and "
                    f"{list(index)}): each rank sits at exactly one place"
                )
            self._coords[rank] = index

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, self._shape, strict=True))

    @property
    def ndim(self) -> int:
        return len(self._names)

    @property
    def size(self) -> int:
        return len(self._coords)

    @property
    def ranks(self) -> list[int]:
        """All ranks, sorted."""
        return sorted(self._coords)

    @property
    def layout(self) -> list[Any]:
        """A fresh nested-list copy of the layout."""
        flat = sorted(self._coords, key=self._coords.__getitem__)

        def build(dims: tuple[int, ...], start: int) -> Any:
            if not dims:
                return flat[start]
            step = 1
            for d in dims[1:]:
                step *= d
            return [build(dims[1:], start + i * step) for i in range(dims[0])]

        return build(self._shape, 0)

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
        return self._shape[self.get_axis_index(name)]

    def contains_worker_id(self, worker_id: int) -> bool:
        return worker_id in self._coords

    def get_worker_coords(self, worker_id: int) -> dict[str, int]:
        """Where a rank sits, as ``{axis: index}``."""
        if worker_id not in self._coords:
            raise ShardingError(
                f"worker {worker_id} is not in the layout (ranks {self.ranks[0]}..{self.ranks[-1]})"
            )
        return dict(zip(self._names, self._coords[worker_id], strict=True))

    def _check_coords(self, coords: dict[str, int]) -> None:
        self.check_axes(list(coords), "coordinates")
        for name, index in coords.items():
            size = self.get_axis_size(name)
            if not isinstance(index, int) or not 0 <= index < size:
                raise IndexError(
                    f"index {index!r} is out of range for axis {name!r} of size {size}"
                )

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """Sorted ranks whose coordinates match ``coords`` (unnamed axes match any index)."""
        self._check_coords(coords)
        fixed = {self._names.index(n): i for n, i in coords.items()}
        return sorted(
            r for r, c in self._coords.items() if all(c[a] == i for a, i in fixed.items())
        )

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The sub-sharding at ``coords``: an int when every axis is fixed."""
        self._check_coords(coords)
        sub = self.layout
        keep = [n for n in self._names if n not in coords]

        def cut(nested: Any, depth: int) -> Any:
            name = self._names[depth] if depth < self.ndim else None
            if name is None:
                return nested
            if name in coords:
                return cut(nested[coords[name]], depth + 1)
            return [cut(item, depth + 1) for item in nested]

        sub = cut(sub, 0)
        return sub if not keep else NamedSharding(sub, keep)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and self._coords == other._coords

    def __hash__(self) -> int:
        return hash((tuple(self._names), tuple(sorted(self._coords.items()))))

    def __repr__(self) -> str:
        return f"NamedSharding(layout={self.layout}, names={self._names})"

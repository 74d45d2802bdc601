"""Dispatch planning: which worker gets which slice of the data, and whose result comes back.

Kept apart from `RayWorkerGroup` and free of Ray so the rules (sharded, replicated and free axes,
tied-group dedup) are unit-tested on their own, and every bad input fails before a task is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker_groups.sharding import NamedSharding, ShardingError


@dataclass(frozen=True)
class WorkerCall:
    """One call: ``data_index`` indexes the sharded data (one entry per in-sharded axis);
    ``None`` means a dummy call whose data arguments are all ``None``."""

    worker_idx: int
    data_index: tuple[int, ...] | None


@dataclass(frozen=True)
class DispatchPlan:
    calls: tuple[WorkerCall, ...]
    return_from_workers: tuple[int, ...]

    @property
    def called_workers(self) -> list[int]:
        return [c.worker_idx for c in self.calls]


def check_layout_covers(sharding: NamedSharding, num_workers: int) -> None:
    """A sharding must name every worker of the group exactly once, as ranks 0..n-1."""
    if sharding.ranks != list(range(num_workers)):
        raise ShardingError(
            f"sharding_annotations has ranks {sharding.ranks} but the group has {num_workers} "
            f"workers: the layout must hold exactly the ranks 0..{num_workers - 1}"
        )


def plan_sharded_dispatch(
    sharding: NamedSharding,
    in_sharded_axes: Sequence[str] = (),
    replicate_on_axes: Sequence[str] = (),
    output_is_replicated: Sequence[str] = (),
    make_dummy_calls_to_free_axes: bool = False,
) -> DispatchPlan:
    """The rules of NeMo RL's documented API: a sharded axis picks the worker's slice, a
    replicated axis sends the same slice to every index on it, a free axis (in neither list)
    sends data only to index 0. Results come back from index 0 of free axes and of
    ``output_is_replicated`` axes."""
    sharded = sharding.check_axes(in_sharded_axes, "in_sharded_axes")
    replicated = sharding.check_axes(replicate_on_axes, "replicate_on_axes")
    out_rep = sharding.check_axes(output_is_replicated, "output_is_replicated")
    overlap = sorted(set(sharded) & set(replicated))
    if overlap:
        raise ShardingError(
            f"axes {overlap} are in both in_sharded_axes and replicate_on_axes: an axis is either "
            "sharded (each index gets its slice) or replicated (each index gets the same data)"
        )
    free = [a for a in sharding.names if a not in sharded and a not in replicated]
    calls: list[WorkerCall] = []
    returns: list[int] = []
    for worker in sharding.ranks:
        coords = sharding.get_worker_coords(worker)
        on_free_zero = all(coords[a] == 0 for a in free)
        if on_free_zero:
            calls.append(WorkerCall(worker, tuple(coords[a] for a in sharded)))
            if all(coords[a] == 0 for a in out_rep):
                returns.append(worker)
        elif make_dummy_calls_to_free_axes:
            calls.append(WorkerCall(worker, None))
    return DispatchPlan(tuple(calls), tuple(returns))


def workers_on_axis_zero(
    sharding: NamedSharding | None, num_workers: int, axes: Sequence[str] | None
) -> list[int]:
    """Workers at index 0 of every axis in ``axes`` (all workers when ``axes`` is empty)."""
    if not axes:
        return list(range(num_workers))
    if sharding is None:
        raise ShardingError(
            f"run_rank_0_only_axes={list(axes)} needs sharding_annotations on the worker group"
        )
    axes = sharding.check_axes(axes, "run_rank_0_only_axes")
    return [
        w for w in range(num_workers) if all(sharding.get_worker_coords(w)[a] == 0 for a in axes)
    ]


def check_sharded_value(
    name: str, value: Any, sharding: NamedSharding, in_sharded_axes: Sequence[str]
) -> None:
    """Data for N in-sharded axes is nested N deep, each level as long as its axis."""

    def walk(v: Any, depth: int, path: tuple[int, ...]) -> None:
        if depth == len(in_sharded_axes):
            return
        axis = in_sharded_axes[depth]
        size = sharding.get_axis_size(axis)
        where = f"{name}{''.join(f'[{i}]' for i in path)}"
        if not hasattr(v, "__len__") or not hasattr(v, "__getitem__") or isinstance(v, str):
            raise ShardingError(
                f"{where} is a {type(v).__name__}, expected a list of {size} slices along axis "
                f"{axis!r} (in_sharded_axes={list(in_sharded_axes)})"
            )
        if len(v) != size:
            raise ShardingError(
                f"{where} has {len(v)} slices along axis {axis!r}, which has size {size}: split "
                f"the data into exactly {size} parts (in_sharded_axes={list(in_sharded_axes)})"
            )
        for i in range(size):
            walk(v[i], depth + 1, (*path, i))

    walk(value, 0, ())


def take(value: Any, index: Sequence[int]) -> Any:
    for i in index:
        value = value[i]
    return value


def map_slices(value: Any, depth: int, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every slice ``depth`` levels down (e.g. one ``ray.put`` per slice)."""
    if depth == 0:
        return fn(value)
    return [map_slices(v, depth - 1, fn) for v in value]


def check_per_worker_data(args: Sequence[Any], kwargs: Mapping[str, Any], expected: int) -> None:
    """``run_all_workers_multiple_data`` takes one list entry per called worker, per argument."""
    if not args and not kwargs:
        raise ValueError(
            "run_all_workers_multiple_data needs at least one per-worker list argument; "
            "use run_all_workers_single_data to send the same data to every worker"
        )
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise TypeError(
                f"{name} is a {type(value).__name__}: pass a list with one entry per worker"
            )
        if len(value) != expected:
            raise ValueError(
                f"{name} has {len(value)} entries but {expected} workers will be called: "
                "pass exactly one entry per worker"
            )

"""The dispatch helpers an RL loop calls every step on a `RayWorkerGroup` (its base class
`WorkerDispatch`): one call per worker, the same or per-worker data, or data sharded over the
group's `NamedSharding`; the plan (who gets which slice) is `dispatch`'s, free of Ray."""

from __future__ import annotations

from typing import Any

import ray
from ray.actor import ActorHandle

from worker_groups.dispatch import (
    check_per_worker_data,
    check_sharded_value,
    map_slices,
    plan_sharded_dispatch,
    take,
    workers_on_axis_zero,
)
from worker_groups.futures import MultiWorkerFuture
from worker_groups.sharding import NamedSharding, ShardingError


class UnknownWorkerMethodError(AttributeError, ValueError):
    """A dispatch names a method the worker class does not have."""


class WorkerDispatch:
    """Calls on a group's workers, each checked before anything is sent."""

    _workers: list[ActorHandle]
    sharding_annotations: NamedSharding | None
    ray_actor_class_fqn: str

    def _method(self, worker: ActorHandle, method_name: str) -> Any:
        return getattr(worker, method_name)

    def _check_method(self, method_name: str) -> None:
        if not self._workers:
            raise RuntimeError("this worker group has no workers: it was shut down")
        if not isinstance(method_name, str) or not hasattr(self._workers[0], method_name):
            methods = sorted(
                m
                for m in getattr(self._workers[0], "_ray_method_signatures", {})
                if not m.startswith("__")
            )
            raise UnknownWorkerMethodError(
                f"{self.ray_actor_class_fqn} has no method {method_name!r}; its methods are "
                f"{methods}"
            )

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        self._check_method(method_name)
        if not isinstance(worker_idx, int) or not 0 <= worker_idx < len(self._workers):
            raise IndexError(f"worker_idx {worker_idx!r} not in 0..{len(self._workers) - 1}")
        return self._method(self._workers[worker_idx], method_name).remote(*args, **kwargs)

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """The same arguments to every worker (or to index 0 of ``run_rank_0_only_axes``);
        each argument is stored once with ``ray.put``, not serialized once per worker."""
        self._check_method(method_name)
        called = workers_on_axis_zero(
            self.sharding_annotations, len(self._workers), run_rank_0_only_axes
        )
        if len(called) > 1:
            args = tuple(ray.put(a) for a in args)
            kwargs = {k: ray.put(v) for k, v in kwargs.items()}
        return [self._method(self._workers[w], method_name).remote(*args, **kwargs) for w in called]

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Entry ``i`` of every list argument goes to the ``i``-th called worker."""
        self._check_method(method_name)
        called = workers_on_axis_zero(
            self.sharding_annotations, len(self._workers), run_rank_0_only_axes
        )
        check_per_worker_data(args, kwargs, len(called))
        common = self._check_common(common_kwargs, kwargs)
        return [
            self._method(self._workers[w], method_name).remote(
                *(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()}, **common
            )
            for i, w in enumerate(called)
        ]

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        *args: Any,
        in_sharded_axes: list[str] | None = None,
        replicate_on_axes: list[str] | None = None,
        output_is_replicated: list[str] | None = None,
        make_dummy_calls_to_free_axes: bool = False,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> MultiWorkerFuture:
        """Data nested by ``in_sharded_axes`` (outermost first): each worker gets its slice;
        ``replicate_on_axes`` send the slice to every index on them (one ``ray.put`` per slice);
        other axes are free: only their index 0 is called (others get ``None`` data with
        ``make_dummy_calls_to_free_axes``). Results: one per index 0 of free and
        ``output_is_replicated`` axes. Everything is checked before anything is sent."""
        self._check_method(method_name)
        sharding = self.sharding_annotations
        if sharding is None:
            raise ShardingError(
                "run_all_workers_sharded_data needs the group's sharding_annotations "
                "(a NamedSharding over its workers)"
            )
        sharded = list(in_sharded_axes or [])
        plan = plan_sharded_dispatch(
            sharding,
            sharded,
            replicate_on_axes or [],
            output_is_replicated or [],
            make_dummy_calls_to_free_axes,
        )
        for i, a in enumerate(args):
            check_sharded_value(f"args[{i}]", a, sharding, sharded)
        for k, v in kwargs.items():
            check_sharded_value(k, v, sharding, sharded)
        common = self._check_common(common_kwargs, kwargs)
        replicas = 1
        for axis in replicate_on_axes or []:
            replicas *= sharding.get_axis_size(axis)
        if replicas > 1:
            args = tuple(map_slices(a, len(sharded), ray.put) for a in args)
            kwargs = {k: map_slices(v, len(sharded), ray.put) for k, v in kwargs.items()}
        futures = []
        for call in plan.calls:
            if call.data_index is None:
                call_args, call_kwargs = [None] * len(args), dict.fromkeys(kwargs)
            else:
                call_args = [take(a, call.data_index) for a in args]
                call_kwargs = {k: take(v, call.data_index) for k, v in kwargs.items()}
            method = self._method(self._workers[call.worker_idx], method_name)
            futures.append(method.remote(*call_args, **call_kwargs, **common))
        return MultiWorkerFuture(
            futures=futures,
            return_from_workers=list(plan.return_from_workers),
            called_workers=plan.called_workers,
        )

    @staticmethod
    def _check_common(common_kwargs: dict[str, Any] | None, kwargs: dict[str, Any]) -> dict:
        common = dict(common_kwargs or {})
        clash = sorted(set(common) & set(kwargs))
        if clash:
            raise ValueError(f"{clash} given both per worker and in common_kwargs: pick one")
        return common

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """One result per data-parallel shard, as the dispatch decided (see MultiWorkerFuture)."""
        return future_bundle.get_results(self, return_generators_as_proxies)

"""`MultiWorkerFuture`: the futures of one dispatch plus which workers they came from.

The dispatch knows which results are duplicates (tied workers, replicated outputs); keeping that
knowledge beside the futures lets the caller fetch them later and still get one result per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import ray


class TiedGroups(Protocol):
    """What a result dedup needs of a worker group (a `RayWorkerGroup`): which tied group each
    worker is in. A protocol, so that this lower module does not import `group`."""

    worker_to_tied_group_index: dict[int, int]


def dedup_indices(
    num_futures: int,
    return_from_workers: list[int] | None,
    called_workers: list[int] | None,
    worker_to_tied_group_index: dict[int, int] | None,
) -> list[int]:
    """Positions in ``futures`` whose results are returned, in order.

    With ``return_from_workers`` the dispatch already chose; otherwise keep the first result of
    each tied group (as NeMo RL's documented API says), or everything when no group mapping is
    known.
    ``called_workers[i]`` is the worker of future ``i`` (``i`` itself when not given).
    """
    workers = list(called_workers) if called_workers is not None else list(range(num_futures))
    if len(workers) != num_futures:
        raise ValueError(
            f"called_workers has {len(workers)} entries for {num_futures} futures: "
            "give one worker index per future"
        )
    position = {w: i for i, w in enumerate(workers)}
    if return_from_workers is not None:
        return [position[w] for w in return_from_workers if w in position]
    if worker_to_tied_group_index is None:
        return list(range(num_futures))
    seen: set[int] = set()
    keep = []
    for i, w in enumerate(workers):
        group = worker_to_tied_group_index.get(w, -1 - w)  # unknown workers stay on their own
        if group not in seen:
            seen.add(group)
            keep.append(i)
    return keep


@dataclass
class MultiWorkerFuture:
    """Futures of one dispatch; ``get_results`` returns one result per data-parallel shard."""

    futures: list[Any]
    return_from_workers: list[int] | None = None
    called_workers: list[int] | None = None

    def get_results(
        self, worker_group: TiedGroups | None = None, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """Fetch (or, with ``return_generators_as_proxies``, hand back) the chosen results.

        An ``ObjectRefGenerator`` future (a streaming method) is consumed in full and its items
        are returned in order, without dedup: each item is a distinct chunk of the stream.
        """
        tied = worker_group.worker_to_tied_group_index if worker_group is not None else None
        keep = dedup_indices(len(self.futures), self.return_from_workers, self.called_workers, tied)
        if return_generators_as_proxies:
            return [self.futures[i] for i in keep]
        refs: list[ray.ObjectRef] = []
        streaming = False
        for fut in self.futures:
            if isinstance(fut, ray.ObjectRefGenerator):
                refs.extend(fut)
                streaming = True
            else:
                refs.append(fut)
        results = ray.get(refs)
        if streaming:
            return results
        return [results[i] for i in keep]

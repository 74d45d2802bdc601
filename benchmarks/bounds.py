"""The simulated cluster's lower bounds on a ship, and the CPU samplers that record where its
time went.

`benchmarks.cluster_ship --netns` runs every simulated node on this one host, so two things can
set the best time a ship could have, and the benchmark judges "within 1.5 x" against the larger:

- the **link bound**: the first node's build, then the venv's stream over one node's link (what
  N machines with their own CPUs would be limited by);
- the **data-plane floor**: the first node's build, then the least work any code must do to ship
  the venv, spread over the host's cores (what N nodes sharing these cores are limited by):
  the sender packs and hashes the venv's bytes once, and each receiver receives, hashes and
  unpacks them and starts one worker (the check that a worker starts on the node cannot come
  before the venv is there). Its figures are measured apart from the code it judges, on the
  same cluster after the ship (`benchmarks.data_plane`: a tar pipe with sha256 between two of
  the nodes' namespaces over their shaped link, and a plain Ray actor's start), so the floor
  does not rise with the code's own overheads. It is at least that pipe's wall time (one
  receiver's bytes cannot arrive sooner).

The CPU that the nodes used during the ship (`NodeCgroups`, `NodeCpu`: each node's `ray start`
in a cpuacct cgroup of its own, cgroup v1, whose usage counts every process the node ever ran;
without cpuacct, the CPU times in /proc of the processes under each `ray start`) and how busy
the host was (`HostCpu`) are recorded next to the bounds: they say where the time went, never
what the ship is judged against, since they rise with every inefficiency of the code.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self


def link_bound(first_build: float, stream_bytes: int, link_mbit: float) -> float:
    """The first build, then the stream over one node's link."""
    return round(first_build + stream_bytes * 8 / (link_mbit * 1e6), 2)


def data_plane_floor(
    first_build: float,
    receivers: int,
    pipe_seconds: float,
    send_cpu_seconds: float,
    receive_cpu_seconds: float,
    worker_start_cpu_seconds: float,
    cores: int,
) -> float:
    """The first build, then the larger of one pipe's wall time and the data plane's CPU
    seconds over the host's cores: one send, and each receiver's receive and worker start."""
    per_receiver = receive_cpu_seconds + worker_start_cpu_seconds
    spread = (send_cpu_seconds + receivers * per_receiver) / max(cores, 1)
    return round(first_build + max(pipe_seconds, spread), 2)


def judge(ready: float, link: float, floor: float | None) -> dict[str, float | bool]:
    """The larger bound, the ship against it, and whether that is within 1.5 x."""
    larger = max(link, floor or 0.0)
    over = round(ready / larger, 2)
    return {
        "larger_bound_seconds": larger,
        "ship_over_bound": over,
        "within_1_5x_bound": over <= 1.5,
    }


def tree_cpu_seconds(roots: Sequence[int]) -> list[float]:
    """CPU seconds (user + system) used so far by each root and every process below it, those
    that exited included: a parent's cutime and cstime hold its reaped children's."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after the command's name
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    totals = []
    for root in roots:
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            total += ticks.get(pid, 0)
            todo += children.get(pid, [])
        totals.append(total / os.sysconf("SC_CLK_TCK"))
    return totals


class _Sampler:
    """A thread that calls `_sample_once` every `every` seconds while a block runs."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class HostCpu(_Sampler):
    """How busy the host's cores are while a block runs: each second's busy share of all of
    them (`/proc/stat`: everything but idle and iowait; kernel work that no process is charged
    for, such as the links' packet processing, included)."""

    def __init__(self, every: float = 1.0) -> None:
        super().__init__(every)
        self.shares: list[float] = []

    @staticmethod
    def _ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        idle = values[3] + values[4]  # idle, iowait
        return sum(values[:8]) - idle, sum(values[:8])

    def _run(self) -> None:
        busy, total = self._ticks()
        while not self._stop.wait(self.every):
            now_busy, now_total = self._ticks()
            self.shares.append(round((now_busy - busy) / max(now_total - total, 1), 2))
            busy, total = now_busy, now_total

    def mean(self, start: float, end: float) -> float | None:
        """The mean busy share from `start` to `end` seconds into the block."""
        window = self.shares[int(start / self.every) : int(end / self.every)]
        return round(sum(window) / len(window), 2) if window else None


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class NodeCgroups:
    """A cpuacct cgroup (v1) per node, named `<prefix>n<i>`: a process joins one before it execs
    (`wrap`), and everything it starts stays in it; `usage` reads each one's CPU seconds.
    `available` is False where there is no writable cpuacct hierarchy (no cgroups made)."""

    def __init__(self, prefix: str, nodes: int) -> None:
        self.dirs = [CPUACCT / f"{prefix}n{i}" for i in range(nodes)]
        try:
            for d in self.dirs:
                d.mkdir()
            self.available = True
        except OSError:
            self.remove()
            self.available = False

    def wrap(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run so that it joins node's cgroup before it execs (a shell that joins, then
        execs it: no preexec_fn in a process with threads)."""
        if not self.available:
            return argv
        procs = str(self.dirs[node] / "cgroup.procs")
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def usage(self) -> list[float]:
        return [int((d / "cpuacct.usage").read_text()) / 1e9 for d in self.dirs]

    def remove(self) -> None:
        """Once their processes are gone (a few tries: the last ones may still be exiting)."""
        for d in self.dirs:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.5)


class NodeCpu(_Sampler):
    """Each node's CPU seconds so far (`read()`, or `tree_cpu_seconds` of each root where there
    is no reader), sampled when the block starts, every `every` seconds, and when it ends;
    `used` reads a window off the samples."""

    def __init__(
        self,
        roots: Sequence[int],
        every: float = 1.0,
        read: Callable[[], list[float]] | None = None,
    ) -> None:
        super().__init__(every)
        self.roots = tuple(roots)
        self.read = read or (lambda: tree_cpu_seconds(self.roots))
        self.samples: list[tuple[float, list[float]]] = []  # (seconds into the block, per node)
        self._start = 0.0

    def _take(self) -> None:
        self.samples.append((time.monotonic() - self._start, self.read()))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._take()

    def __enter__(self) -> Self:
        self._start = time.monotonic()
        self._take()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._take()

    def at(self, seconds: float) -> list[float]:
        """Each node's CPU seconds at the last sample taken at or before `seconds`."""
        taken = [cpu for when, cpu in self.samples if when <= seconds]
        return taken[-1] if taken else self.samples[0][1]

    def used(self, start: float, end: float | None = None) -> list[float]:
        """Each node's CPU seconds from `start` seconds into the block to `end` (the end)."""
        last = self.samples[-1][1] if end is None else self.at(end)
        return [round(b - a, 2) for a, b in zip(self.at(start), last, strict=True)]

"""Load held: many jobs at once on one real Ray node with the node-wide build limit
on, while `ray-uv gc` runs in a loop and `ray-uv prepare --watch` runs throughout.

A head node is `ray start --head`ed as a subprocess with Ray's defaults (its own free ports and
temp dir, so that other clusters on the machine are untouched), token auth on, the plugin
registered, `RAY_UV_PLUGIN_MAX_BUILDS` set (the default: the usable cores) and a venv dir budget
(`RAY_UV_PLUGIN_VENV_DIR_MAX_BYTES`). The keys are two small uv projects (Ray, and `six` or
`tomli-w`) with four extras each, one small package per extra: 8 keys from 2 locks. Before the
run a first cluster (no budget) builds the warm keys, and three other keys, with `ray-uv
prepare --shared`; those three are then made to look last used an hour ago, so that the cold
keys' builds must remove them to fit the budget: room for the run's 8 venvs and one more.

The run: `--drivers` driver processes at once, each `ray.init(address=...)`, create the
`--actors` actors between them, each in one key's venv (driver i's j-th actor takes key i+j).
The node cannot hold them all live (2 cores, 24 GiB), so each driver creates its actors in
waves of `--wave`: starts them, calls each once, kills them, then the next wave. Meanwhile
`ray-uv gc --max-size <budget>` runs every `--gc-every` seconds and `ray-uv prepare --watch`
(one warm key) runs from start to end.

Measured: request to ready (actor creation to its first method answered), p50 and p99, for
the warm keys and the cold ones, and per request by what it found (its venv ready, or built
during the request: the venv's marker's `built_at` after the request); the errors, by kind; the
runtime-env agent's RSS and open fds every second from /proc (first, last, max, slope, and
whether they stayed flat: `load_stats.flatness`); the venv dir's size (what the budget counts)
every 2 s against the budget; the gc loop's and the watch's runs; the load average.

    uv run python -m benchmarks.load [--drivers 20] [--actors 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from ray_uv_plugin.store import disk
from ray_uv_plugin.store.build_slots import default_max_builds
from ray_uv_plugin.store.freezing import remove_tree
from ray_uv_plugin.store.layout import MARKER, Venv
from ray_uv_plugin.store.units import format_bytes
from tests.support.uvproject import write_project

from .build_limits import held
from .load_node import BIN, GcLoop, Head, Sampler, agent_sample, node_env
from .load_stats import FD_TOLERANCE, RSS_TOLERANCE, flatness, percentile

PROJECTS = {  # name: (its own dependency, its extras: one small package each)
    "loada": ("six", ["idna", "certifi", "attrs", "iniconfig"]),
    "loadb": ("tomli-w", ["packaging", "pluggy", "toolz", "more-itertools"]),
    "loadc": ("tabulate", ["idna", "attrs"]),  # the old venvs' project: no run key's
}
RUN = ["loada", "loadb"]
WARM = {"loada": ["idna", "attrs"], "loadb": ["packaging", "toolz"]}
# Venvs last used an hour ago, which the budget must remove to make room. They are of a third
# project, so that the run's builds do not seed from them: a build marks its seed used, and a
# venv used in the last 2 minutes is never removed (see docs/reliability.md, "Load held").
OLD = [("loadc", []), ("loadc", ["idna"]), ("loadc", ["attrs"])]


@dataclass(frozen=True)
class Key:
    name: str
    project: Path
    extras: tuple[str, ...]
    warm: bool

    def value(self) -> dict[str, Any]:
        return {"project": str(self.project), "extras": list(self.extras)}

    def prepare_args(self) -> list[str]:
        return ["--project", str(self.project), "--shared", *(f"--extra={x}" for x in self.extras)]


def write_keys(work: Path) -> tuple[list[Key], list[Key]]:
    """(the run's keys, the old keys) over the two projects, locked by the real uv."""
    run, old = [], []
    for name, (dep, extras) in PROJECTS.items():
        path = write_project(work / name, [dep], {x: [x] for x in extras}, name=name)
        if name in RUN:
            run += [Key(f"{name}[{x}]", path, (x,), x in WARM[name]) for x in extras]
        old += [Key(f"{n}[{','.join(xs)}]", path, tuple(xs), True) for n, xs in OLD if n == name]
    return run, old


DRIVER = textwrap.dedent(
    """\
    import json, os, sys, time
    import ray
    address, plan, wave, timeout = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), 900
    start = time.time()
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:
        print("DRIVER " + json.dumps({"error": type(e).__name__, "message": str(e)[:400]}))
        sys.exit(1)
    print("DRIVER " + json.dumps({"init_s": time.time() - start}), flush=True)

    @ray.remote
    class Probe:
        def ready(self):
            try:
                with open(os.path.join(sys.prefix, MARKER)) as f:
                    built_at = json.load(f).get("built_at")
            except (OSError, ValueError):
                built_at = None
            return {"prefix": sys.prefix, "built_at": built_at}

    for first in range(0, len(plan), wave):
        pending = {}
        for item in plan[first : first + wave]:
            requested = time.time()
            actor = Probe.options(runtime_env={"uv_project": item["value"]}).remote()
            pending[actor.ready.remote()] = (item["key"], requested, actor)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not done:
                for key, requested, actor in pending.values():
                    out = {"key": key, "requested": requested, "error": "Hang", "message":
                           f"no answer within {timeout}s"}
                    print("ACTOR " + json.dumps(out), flush=True)
                break
            key, requested, actor = pending.pop(done[0])
            out = {"key": key, "requested": requested}
            try:
                out.update(ray.get(done[0]), ready=time.time())
            except Exception as e:
                out.update(error=type(e).__name__, message=str(e)[-3000:], failed=time.time())
            print("ACTOR " + json.dumps(out), flush=True)
            ray.kill(actor)
    """
).replace("MARKER", repr(MARKER))


def run_drivers(
    head: Head, keys: list[Key], args: argparse.Namespace, work: Path, procs: list
) -> dict:
    """Start every driver at once (each added to `procs`, for the caller to end should the run
    be stopped); their ACTOR lines, their own failures."""
    for i in range(args.drivers):
        count = args.actors // args.drivers + (i < args.actors % args.drivers)
        plan = [{"key": (k := keys[(i + j) % len(keys)]).name, "value": k.value()}
                for j in range(count)]  # fmt: skip
        command = [sys.executable, "-c", DRIVER, head.gcs, json.dumps(plan), str(args.wave)]
        with open(work / f"driver-{i}.err", "w") as err:
            driver = subprocess.Popen(
                command, env=head.env, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True,
            )  # fmt: skip
        procs.append(driver)
    records, failures, inits = [], [], []
    for i, proc in enumerate(procs[-args.drivers :]):
        out, _ = proc.communicate(timeout=3600)
        for line in out.splitlines():
            tag, _, body = line.partition(" ")
            if tag == "ACTOR":
                records.append(json.loads(body))
            elif tag == "DRIVER" and "init_s" in json.loads(body):
                inits.append(json.loads(body)["init_s"])
        if proc.returncode != 0:
            err = (work / f"driver-{i}.err").read_text()[-600:]
            failures.append({"rc": proc.returncode, "stderr": err})
    return {"records": records, "driver_failures": failures, "init_s": inits}


def latencies(records: list[dict], warm_keys: set[str]) -> dict[str, Any]:
    """p50/p99 of request to ready: by the key's state before the run, and by what the request
    found (its venv ready, or built while it waited)."""
    ok = [r for r in records if "ready" in r]
    groups = {
        "warm_keys": [r for r in ok if r["key"] in warm_keys],
        "cold_keys": [r for r in ok if r["key"] not in warm_keys],
        "found_ready": [r for r in ok if (r["built_at"] or 0) < r["requested"]],
        "built_meanwhile": [r for r in ok if (r["built_at"] or 0) >= r["requested"]],
    }
    out = {}
    for name, group in groups.items():
        seconds = [r["ready"] - r["requested"] for r in group]
        out[name] = {
            "n": len(seconds),
            "p50_s": percentile(seconds, 50),
            "p99_s": percentile(seconds, 99),
            "max_s": max(seconds, default=None),
        }
    return out


def error_kinds(records: list[dict], failures: list[dict]) -> dict[str, int]:
    kinds: collections.Counter[str] = collections.Counter()
    for r in records:
        if "error" in r:
            lines = [x.strip() for x in r["message"].splitlines() if x.strip()]
            first = next((x for x in lines if "uv_project" in x), lines[-1] if lines else "")
            kinds[f"{r['error']}: {first.strip()[:160]}"] += 1
    for f in failures:
        kinds[f"driver exited {f['rc']}"] += 1
    return dict(kinds)


def prebuild(keys: list[Key], venvs: Path, work: Path) -> dict[str, float]:
    """Build `keys` with `ray-uv prepare --shared` on a first cluster (no budget); seconds each."""
    head = Head(node_env(venvs, None), work / "ray-start-prebuild.log")
    took = {}
    try:
        for key in keys:
            start = time.monotonic()
            args = [str(BIN / "ray-uv"), "prepare", "--address", head.gcs, *key.prepare_args()]
            out = subprocess.run(args, env=head.env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"prepare {key.name} failed:\n{out.stdout}\n{out.stderr}")
            took[key.name] = round(time.monotonic() - start, 2)
    finally:
        head.stop()
    return took


def make_old(venvs: Path, old: list[Key]) -> None:
    """The venvs of `old` look last used an hour ago (their marker's mtime, as `gc` reads it)."""
    wanted = {(str(k.project), tuple(sorted(k.extras))) for k in old}
    then = time.time() - 3600
    for venv in venvs.iterdir():
        meta = Venv.at(venv).read_marker() if venv.is_dir() else None
        if meta and (meta.get("project"), tuple(sorted(meta.get("extras", ())))) in wanted:
            os.utime(venv / MARKER, (then, then))


def load(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    keys, old = write_keys(work / "projects")
    venvs = work / "venvs"
    prebuilt = prebuild(old + [k for k in keys if k.warm], venvs, work)  # warm: built last
    make_old(venvs, old)
    own = held(venvs) - held(venvs, [next(p for p in venvs.iterdir() if (p / MARKER).exists())])
    own //= len(prebuilt) - 1  # what one more venv adds: the rest are shared hardlinks
    # Room for the run's keys and `--budget-slack` venvs more: the old venvs must go to make it.
    budget = held(venvs) + (sum(not k.warm for k in keys) - len(old) + args.budget_slack) * own
    head = Head(node_env(venvs, budget), work / "ray-start.log")
    procs: list[subprocess.Popen] = []  # the watch and the drivers: ended if the run is stopped
    try:
        ready = disk.ReadyTrees()
        agent = Sampler(lambda: agent_sample(head), 1.0)
        sizes = Sampler(lambda: held(venvs, ready=ready), 2.0)
        loadavg = Sampler(lambda: os.getloadavg()[0], 5.0)
        watch_log = open(work / "watch.log", "w")  # noqa: SIM115 - lives with the watch
        watch_key = next(k for k in keys if k.warm)
        watch = subprocess.Popen(
            [str(BIN / "ray-uv"), "prepare", "--watch", "--interval", "2", "--address", head.gcs,
             *watch_key.prepare_args()],
            env=head.env, stdout=watch_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        procs.append(watch)
        gc = GcLoop(head.env, budget, args.gc_every)
        agent_pid = head.agent_pid()
        agent_cmdline = Path(f"/proc/{agent_pid}/cmdline").read_bytes().decode().split("\0")[:3]
        start = time.monotonic()
        run = run_drivers(head, keys, args, work, procs)
        wall = time.monotonic() - start
        gc_runs = gc.stop()
        watch.send_signal(signal.SIGTERM)
        watch_rc = watch.wait(timeout=60)
        agent_points, size_points, loads = agent.stop(), sizes.stop(), loadavg.stop()
        end_bytes = held(venvs)
        left = [Venv.at(p).read_marker() for p in venvs.iterdir() if p.is_dir()]
    finally:
        head.stop(procs)
    t = [p[0] for p in agent_points]
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"}
        | {"max_builds": default_max_builds(), "budget_bytes": budget},
        "keys": {k.name: "warm" if k.warm else "cold" for k in keys},
        "old_keys": [k.name for k in old],
        "prebuild_s": prebuilt,
        "venv_own_bytes": own,
        "wall_s": round(wall, 1),
        "actors": len(run["records"]),
        "answered": sum("ready" in r for r in run["records"]),
        "latency": latencies(run["records"], {k.name for k in keys if k.warm}),
        "errors": error_kinds(run["records"], run["driver_failures"]),
        "driver_init_s": {
            "p50": percentile(run["init_s"], 50),
            "max": max(run["init_s"], default=None),
        },
        "agent": {
            "pids": sorted({p[1]["pid"] for p in agent_points}),
            "cmdline": agent_cmdline,
            "rss_kib": flatness(t, [p[1]["rss_kib"] for p in agent_points], *RSS_TOLERANCE),
            "fds": flatness(t, [p[1]["fds"] for p in agent_points], *FD_TOLERANCE),
            "samples": agent_points,
        },
        "venv_dir": {
            "budget_bytes": budget,
            "max_sampled_bytes": max((p[1] for p in size_points), default=None),
            "end_bytes": end_bytes,
            "venvs_at_end": sorted(f"{m['name']}{m['extras']}" for m in left if m),
            "samples": size_points,
        },
        "gc_loop": gc_runs,
        "watch": {"rc": watch_rc, "tail": (work / "watch.log").read_text()[-1500:]},
        "loadavg": {"max_1min": max((p[1] for p in loads), default=None)},
        "records": run["records"],
    }


def summary(r: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    rows = ["| requests | n | p50 s | p99 s | max s |", "|---|---:|---:|---:|---:|"]
    for name, m in r["latency"].items():
        rows.append(f"| {name} | {m['n']} | {s(m['p50_s'])} | {s(m['p99_s'])} | {s(m['max_s'])} |")
    a, v = r["agent"], r["venv_dir"]
    rows += [
        "",
        f"actors answered: {r['answered']} of {r['actors']} in {r['wall_s']} s; errors: "
        f"{sum(r['errors'].values())} {json.dumps(r['errors'])}",
        f"agent pids {a['pids']}; RSS KiB first/last/max {a['rss_kib'].get('first')}/"
        f"{a['rss_kib'].get('last')}/{a['rss_kib'].get('max')}, slope "
        f"{a['rss_kib'].get('slope_per_min')}/min, flat: {a['rss_kib'].get('flat')}",
        f"agent fds first/last/max {a['fds'].get('first')}/{a['fds'].get('last')}/"
        f"{a['fds'].get('max')}, slope {a['fds'].get('slope_per_min')}/min, flat: "
        f"{a['fds'].get('flat')}",
        f"venv dir: budget {format_bytes(v['budget_bytes'])}, largest sampled "
        f"{format_bytes(v['max_sampled_bytes'] or 0)}, at end {format_bytes(v['end_bytes'])}",
        f"gc loop: {json.dumps(r['gc_loop'])}; watch exit {r['watch']['rc']}",
        f"load average: {json.dumps(r['machine'].get('loadavg_start'))} at start, max 1-min "
        f"{r['loadavg']['max_1min']}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drivers", type=int, default=20)
    parser.add_argument("--actors", type=int, default=200)
    parser.add_argument("--wave", type=int, default=2, help="actors live at once per driver")
    parser.add_argument("--gc-every", type=float, default=5.0)
    parser.add_argument(
        "--budget-slack",
        type=int,
        default=1,
        help="the budget's room, in venvs, beyond the run's keys (the old venvs are over it)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="load-"))
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "ray": ray.__version__,
               "loadavg_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                       time.gmtime())}  # fmt: skip
    try:
        result = {"machine": machine, **load(args, work)}
    finally:
        remove_tree(work)  # venvs are read-only (frozen as root): not for shutil.rmtree
    machine["loadavg_end"] = os.getloadavg()
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

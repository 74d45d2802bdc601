"""The chaos run's traffic: small uv projects (one `uv lock`, a key per variant) and the four
ways a job asks for a venv, each a driver process in the head's namespace with a timeout.

- `actors`: plain actors with `uv_project`, one pinned to each node;
- `group`: a worker group (`worker_groups`), one worker per node;
- `prepare`: `ray-uv prepare` with shipping (one node builds, the others receive);
- `uv_run`: a driver started with `uv run` under the plugin's driver hook, two actors with the
  job's venv;
- `cold`: plain actors on a fresh key, one on each node, started at a `uv_sync` fault's moment
  (`chaos_faults.cold_starts`): three builds, so that a sync fault finds a sync to hit;
  `cold_ship`: `prepare` with shipping on a fresh key, at a ship fault's moment.

Every worker reports, as it starts, its `sys.prefix`, `RAY_UV_PLUGIN_VENV`, the venv's marker as
it read it then, the dist-info dirs of its site-packages, its Ray job and the `uv_project` value
it was started with (`chaos_invariants.ran_in_ready` checks them). Each driver says, before it
waits, how many workers it started (`STARTED `), so a worker that never reported is seen. A
job's result is its exit status, its time, and what it printed after `RESULT `.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.raylets import BIN, driver_env
from ray_uv_plugin.env.uv import find_uv
from tests.support.uvproject import write_project

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 420  # a job not ended by then hung (a build's bound, 240 s, and margin)
# What a driver's ray.get waits: past the hang bound, so that a setup that hangs is killed by the
# harness at JOB_TIMEOUT_S and counted as a hang, never given up on as a failed job first.
GET_TIMEOUT_S = JOB_TIMEOUT_S + 120

WORKER = textwrap.dedent(
    """\
    import json, os, sys, sysconfig, time

    REPORTS = {reports!r}  # every worker's report, also of a job that fails


    def report():
        import ray
        try:
            with open(os.path.join(sys.prefix, ".ray-uv-ready")) as f:
                marker = json.load(f)
        except Exception as e:  # noqa: BLE001 - reported, then judged by the harness
            marker = f"unreadable: {e!r}"
        try:
            dist_infos = [d for d in os.listdir(sysconfig.get_paths()["purelib"])
                          if d.endswith(".dist-info")]
        except OSError as e:
            dist_infos = [f"unreadable: {e!r}"]
        context = ray.get_runtime_context()
        runtime_env = context.runtime_env
        found = {"pid": os.getpid(), "prefix": sys.prefix, "marker": marker,
                 "venv_env": os.environ.get("RAY_UV_PLUGIN_VENV"), "at": time.time(),
                 "job_id": f"{context.gcs_address}/{context.get_job_id()}",  # as its driver's
                 "asked": runtime_env.get("uv_project"),
                 "env_vars": runtime_env.get("env_vars") or {}, "dist_infos": dist_infos}
        with open(os.path.join(REPORTS, f"{os.getpid()}-{time.time_ns()}.json"), "w") as f:
            json.dump(found, f)
        return found


    class Pinger:
        def __init__(self):
            self.started = report()  # at the worker's start, before any call

        def ping(self):
            return self.started
    """
)

ACTORS = textwrap.dedent(
    """\
    import json, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    gcs, timeout, projects = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, projects[0])
    ray.init(address=gcs, runtime_env={"working_dir": projects[0]}, logging_level="ERROR")
    context = ray.get_runtime_context()  # a job id, unique across head restarts:
    job_id = f"{context.gcs_address}/{context.get_job_id()}"  # a new GCS counts from 1
    from chaosworker import Pinger
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    print("STARTED " + json.dumps({"job_id": job_id,
                                   "workers": len(projects) * len(nodes), "project": projects[0]}),
          flush=True)
    actors = []
    for project in projects:
        for node in nodes:
            actors.append(ray.remote(Pinger).options(
                num_cpus=0, runtime_env={"uv_project": {"project": project}},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote())
    reports = ray.get([a.ping.remote() for a in actors], timeout=timeout)
    print("RESULT " + json.dumps({"reports": reports}))
    """
)

GROUP = textwrap.dedent(
    """\
    import json, sys
    import ray
    from worker_groups import (ACTOR_ENVIRONMENT_REGISTRY, RayVirtualCluster, RayWorkerBuilder,
                               RayWorkerGroup)
    gcs, timeout, project = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    ray.init(address=gcs, runtime_env={"working_dir": project}, logging_level="ERROR")
    context = ray.get_runtime_context()  # a job id, unique across head restarts:
    job_id = f"{context.gcs_address}/{context.get_job_id()}"  # a new GCS counts from 1
    ACTOR_ENVIRONMENT_REGISTRY["chaosworker.Pinger"] = {}
    print("STARTED " + json.dumps({"job_id": job_id,
                                   "workers": 3, "project": project}), flush=True)
    cluster = RayVirtualCluster([1] * 3, use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("chaosworker.Pinger"))
    reports = ray.get(group.run_all_workers_single_data("ping"), timeout=timeout)
    group.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps({"reports": reports}))
    """
)

UV_RUN = textwrap.dedent(
    """\
    import json, os, sys
    import ray
    from chaosworker import Pinger
    gcs, timeout = sys.argv[1], float(sys.argv[2])
    ray.init(address=gcs, logging_level="ERROR")
    context = ray.get_runtime_context()  # a job id, unique across head restarts:
    job_id = f"{context.gcs_address}/{context.get_job_id()}"  # a new GCS counts from 1
    print("STARTED " + json.dumps({"job_id": job_id,
                                   "workers": 2, "project": os.getcwd()}), flush=True)
    actors = [ray.remote(Pinger).options(num_cpus=0).remote() for _ in range(2)]
    reports = ray.get([a.ping.remote() for a in actors], timeout=timeout)
    print("RESULT " + json.dumps({"reports": reports}))
    """
)


@dataclass
class Job:
    kind: str
    round: int
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float = 0.0
    log: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)
    tag: str = ""  # tells apart a round's jobs of one kind (its log's name)
    seen_pids: set[int] = field(default_factory=set)  # its drivers, as a fault looked for them

    def start(self, logs: Path) -> None:
        self.log = logs / f"r{self.round:03d}-{self.name}.log"
        out = open(self.log, "w")  # noqa: SIM115 - the job's own, closed with it
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        out.close()

    def pids(self) -> list[int]:
        """The driver's Python process (below `uv run` for that kind) while it runs."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        found = [self.proc.pid] if self.kind != "uv_run" else children(self.proc.pid)
        found = found or [self.proc.pid]
        self.seen_pids.update(found)
        return found

    @property
    def name(self) -> str:
        return f"{self.kind}{self.tag}"

    def wait(self, deadline: float) -> None:
        """Until it ends or `deadline` (monotonic); past it, it hung: killed, and said so."""
        assert self.proc is not None and self.log is not None
        try:
            rc = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            hung = False
        except subprocess.TimeoutExpired:
            stop_group(self.proc)
            rc, hung = self.proc.wait(), True
        self.ended = time.monotonic()
        text = self.log.read_text(errors="replace")
        found = [x for x in text.splitlines() if x.startswith("RESULT ")]
        said = [json.loads(x[8:]) for x in text.splitlines() if x.startswith("STARTED ")]
        self.result = {
            "job": self.kind,
            "name": self.name,
            "round": self.round,
            "rc": rc,
            "seconds": round(self.ended - self.started, 1),
            "hung": hung,
            "reports": json.loads(found[-1][7:]).get("reports", []) if found else [],
            "pids": sorted(self.seen_pids | {self.proc.pid}),
        }
        if said:
            self.result["job_id"] = said[-1].get("job_id")
            self.result["workers_started"] = said[-1].get("workers")
            self.result["project"] = said[-1].get("project")
        if rc != 0:
            self.result["error"] = _last_error(text)


def _last_error(text: str) -> str:
    """The error the driver ended with: a traceback's last line (`ray.exceptions.X: ...`) or
    `ray-uv`'s `error: ...`, else its last line (Ray's log lines in between are not it)."""
    lines = [x for x in text.splitlines() if x.strip()]
    ended = [x for x in lines if re.match(r"^(error: |[\w.]+(Error|Exception|Timeout)\b)", x)]
    return (ended[-1] if ended else (lines[-1] if lines else ""))[-300:]


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return


def take_reports(where: Path) -> list[dict[str, Any]]:
    """The workers' reports written since the last call (each file read once, then removed)."""
    found = []
    for path in sorted(where.glob("*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except ValueError:
            found.append({"pid": path.name, "prefix": "", "marker": "report cut short"})
        path.unlink()
    return found


class Projects:
    """The run's projects: one locked base (Ray and `six` from the run's index), and variants of
    it that differ by a comment (a key each, the same lock)."""

    def __init__(self, where: Path, index_url: str, lock_prefix: list[str]) -> None:
        self.where = where
        self.reports = where / "worker-reports"
        self.reports.mkdir(parents=True)
        worker = WORKER.replace("{reports!r}", repr(str(self.reports)))
        self.base = write_project(
            where / "base", ["six"], lock=False, name="chaosproj",
            requires_python=f"=={sys.version_info[0]}.{sys.version_info[1]}.*",
            files={"chaosworker.py": worker, "uv_run_driver.py": UV_RUN},
        )  # fmt: skip
        with open(self.base / "pyproject.toml", "a") as f:
            f.write(f'\n[[tool.uv.index]]\nname = "chaos"\nurl = "{index_url}"\ndefault = true\n')
        with tempfile.TemporaryDirectory() as cache:
            argv = [*lock_prefix, find_uv(), "lock", "--quiet", "--project", str(self.base)]
            subprocess.run(argv, check=True, env={**os.environ, "UV_CACHE_DIR": cache})

    def variant(self, tag: str) -> Path:
        path = self.where / tag
        if not path.exists():
            shutil.copytree(self.base, path, ignore=shutil.ignore_patterns(".venv"))
            with open(path / "pyproject.toml", "a") as f:
                f.write(f"# {tag}\n")
        return path


def uv_run_env() -> dict[str, str]:
    """A driver's environment under `ray-uv plugin-config --shell`, the README's set-up."""
    out = subprocess.run(
        [str(BIN / "ray-uv"), "plugin-config", "--shell"], capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    env = {k: v for k, v in driver_env().items() if k != "VIRTUAL_ENV"}
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    return env


def jobs_for_round(
    round_no: int, gcs: str, prefix: list[str], projects: Projects, uv_project: Path
) -> list[Job]:
    """The round's four jobs: fresh keys for `prepare` and the actors, the base's for the group,
    the `uv run` project's for its driver."""
    py, t = sys.executable, str(GET_TIMEOUT_S)
    env = driver_env()
    prep = projects.variant(f"r{round_no}-prepare")
    fresh = projects.variant(f"r{round_no}-actors")
    ray_uv = [str(BIN / "ray-uv"), "prepare", "--address", gcs, "--project", str(prep), "--json"]
    return [
        Job("prepare", round_no, [*prefix, *ray_uv], ROOT, env),
        Job("actors", round_no, [*prefix, py, "-c", ACTORS, gcs, t, str(fresh)], ROOT, env),
        Job("group", round_no, [*prefix, py, "-c", GROUP, gcs, t, str(projects.base)], ROOT, env),
        Job(
            "uv_run",
            round_no,
            [*prefix, find_uv(), "run", "python", "uv_run_driver.py", gcs, t],
            uv_project,
            uv_run_env(),
        ),  # fmt: skip
    ]


def cold_job(
    round_no: int, i: int, kind: str, gcs: str, prefix: list[str], projects: Projects
) -> Job:
    """A fresh key asked for when the job starts, at a fault's moment: by actors on every node
    (`cold`: three builds), or by `prepare` with shipping (`cold_ship`: a build, two ships)."""
    project = projects.variant(f"r{round_no}-cold{i}")
    if kind == "cold":
        argv = [*prefix, sys.executable, "-c", ACTORS, gcs, str(GET_TIMEOUT_S), str(project)]
    else:
        argv = [*prefix, str(BIN / "ray-uv"), "prepare", "--address", gcs,
                "--project", str(project), "--json"]  # fmt: skip
    return Job(kind, round_no, argv, ROOT, driver_env(), tag=str(i))


def verify_job(round_no: int, gcs: str, prefix: list[str], projects: list[Path]) -> Job:
    """Once the faults are gone: an actor on every node in every key the round asked for."""
    argv = [*prefix, sys.executable, "-c", ACTORS, gcs, str(GET_TIMEOUT_S), *map(str, projects)]
    return Job("verify", round_no, argv, ROOT, driver_env())

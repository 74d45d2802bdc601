"""Faults at random on a real multi-node cluster: does anything get lost?

A 3-node `ray start` cluster in network namespaces, token auth on, node 2's venv dir and uv
cache on a small loop device with no blocks kept for root (`chaos_cluster`). Each round starts
four jobs at once, each asking for a venv its own way (`chaos_jobs`: plain actors and `prepare`
with shipping on fresh keys, a worker group and a `uv run` driver on warm ones; at the moment
of each fault that needs a build or a ship to meet, actors or a `prepare` on a fresh key), and
meanwhile injects the round's faults at random moments (`chaos_faults`: SIGKILL, or SIGSTOP
then SIGCONT, of a `uv sync`, an agent, a raylet, a ship sender or receiver, a driver; a link
dropped or delayed; the loop disk filled for root at a chosen step; a GCS partition; nodes 1
and 2 split; gc; a write through uv's cache; node 1's clock moved; then, past the window, what
takes a node down: agents and raylets SIGKILLed, the agent killed after a fresh marker, the
head restarted). A fault counts only where it met its operation (`met`, apart from `sent`).
Then it lets every fault go, starts again the nodes that went down, asks once more for every
key of the round (an actor on each node), and checks the invariants (`chaos_invariants`).

    uv run python -m benchmarks.chaos --seed 1 --faults 200 \\
        --out benchmarks/results/chaos-1.jsonl

Writes one JSON line per fault (the planned fault, what it met and when, the round's
invariants), one per job, and a last line with the summary. The plan depends on the seed alone.
Needs root (namespaces, `tc`, a loop mount); everything it makes is removed however it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

import ray

from benchmarks import netns, node_disks
from benchmarks.chaos_blame import blame, left_by_fault
from benchmarks.chaos_cluster import (
    BUILD_TIMEOUT_S,
    HEALTH,
    LOOP_NODE,
    NODE_MBIT,
    NODES,
    SKEWED_NODE,
    ChaosCluster,
    Node,
)
from benchmarks.chaos_faults import (
    KINDS,
    MEETS,
    Injector,
    LateGate,
    cold_faults,
    cold_starts,
    plan,
)
from benchmarks.chaos_invariants import (
    Checks,
    asked_keys,
    collect_garbage,
    locks,
    locks_at_end,
    missing_workers,
    ran_in_ready,
)
from benchmarks.chaos_jobs import (
    JOB_TIMEOUT_S,
    Job,
    Projects,
    cold_job,
    jobs_for_round,
    take_reports,
    verify_job,
)
from benchmarks.clock_skew import Clock
from benchmarks.counting_index import CountingIndex
from benchmarks.package_set import WHEEL_CACHE, mirror_pypi
from benchmarks.raylets import BIN, remove
from ray_uv_plugin.env.uv import find_uv, uv_version

INVARIANTS = ("whole", "ran_in_ready", "locks", "leftovers", "no_hang", "next_round", "blame")
LOOP_SIZE = "3G"
SHIPPED = re.compile(r"^\S+ \(\w+\): uv_project \w+: shipped ", re.M)
FIRST_ROUND_S = 240.0  # a round's length on this machine, until the first one is timed


def check_round(
    cluster: ChaosCluster,
    jobs: list[Job],
    verify: Job,
    checks: Checks,
    reports: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    restarted: list[int],
    start: float,
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Every invariant's violations after a round (empty lists: it held), and what the round
    line says beside them: the faults blamed for each failed job, the leftovers a fault
    explains. `reports`: what every worker that started said of its venv (`chaos_jobs.WORKER`);
    `faults`: the round's fault records; `start`: the round's start (monotonic)."""
    dirs = [n.venv_dir for n in cluster.nodes]
    for job in [*jobs, verify]:
        job.result["started_s"] = round(job.started - start, 2)
        job.result["ended_s"] = round(job.ended - start, 2)
    ips = [n.host.ip for n in cluster.nodes]
    blamed, unexplained = blame([j.result for j in jobs], faults, restarted, ips)
    by_job = {str(j.result.get("job_id")): j.result for j in [*jobs, verify]}
    requests = []
    for r in reports:
        asked = r.get("asked") if isinstance(r.get("asked"), dict) else {}
        project = str(by_job.get(str(r.get("job_id")), {}).get("project", ""))
        requests.append((asked, asked.get("project") or project, r.get("env_vars") or {}))
    selected: dict[str, Any] = {}
    for r, request, key in zip(
        reports, requests, asked_keys(requests, cluster.nodes[0].env()), strict=True
    ):
        r["asked_key"] = key
        if key not in selected:
            selected[key] = checks.selected_for(request[0], request[1])
    after = [r for r in reports if str(r.get("job_id")) == str(verify.result.get("job_id"))]
    during = [r for r in reports if r not in after]
    found: dict[str, list[str]] = {
        "no_hang": [
            f"{j.name} hung past {JOB_TIMEOUT_S}s" for j in [*jobs, verify] if j.result["hung"]
        ],
        "next_round": (
            [] if verify.result["rc"] == 0 and not verify.result["hung"]
            else [f"the requests after the faults failed: {verify.result.get('error', '')}"]
        ) + ran_in_ready(after, dirs, selected)
        + missing_workers([verify.result], after, set()),
        "ran_in_ready": ran_in_ready(during, dirs, selected)
        + missing_workers([j.result for j in jobs], during, set(blamed)),
        "whole": checks.whole(dirs),
        "locks": locks(dirs, BUILD_TIMEOUT_S),
        "blame": unexplained,
        "leftovers": [],
    }  # fmt: skip
    left = []
    for node in cluster.nodes:
        for what in checks.leftovers(node.venv_dir):
            why = left_by_fault(node.index, faults, restarted)
            if why:
                left.append(f"{what}, after {', '.join(why)}")
            else:
                found["leftovers"].append(what)
        found["leftovers"] += collect_garbage(node.venv_dir, node.env(), str(BIN / "ray-uv"))
    return found, {"blamed": blamed, "left": left}


def one_round(
    round_no: int,
    args: argparse.Namespace,
    cluster: ChaosCluster,
    projects: Projects,
    uv_project: Path,
    logs: Path,
    checks: Checks,
    out: TextIO,
) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    prefix = cluster.driver_prefix
    first = jobs_for_round(round_no, cluster.gcs, prefix, projects, uv_project)
    faults = plan(args.seed, round_no, args.per_round, args.window, NODES)
    starts = cold_starts(faults)
    cold = [
        cold_job(round_no, i, kind, cluster.gcs, prefix, projects)
        for i, (_, kind) in enumerate(starts)
    ]
    jobs = [*first, *cold]
    injector = Injector(
        cluster, lambda: [p for j in jobs for p in j.pids()], projects.reports, str(BIN / "ray-uv")
    )
    done = threading.Event()
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    ships = [j for j in first if j.kind == "prepare"]
    ships += [
        j
        for j, (s, _) in zip(cold, starts, strict=True)
        if j.kind == "cold_ship" and s < args.window
    ]

    def ships_ended() -> bool:
        return all(j.proc is not None and j.proc.poll() is not None for j in ships)

    gate = injector.gate = LateGate(start, args.window, ships_ended, done)
    injector.plan_round(faults)
    for job in first:
        job.start(logs)

    def inject(fault: Any) -> None:
        records.append(injector.run(fault, start, done))

    def start_cold(job: Job, fault: Any) -> None:
        injector.begin(fault, start, done)  # a late fault's job: in its stage, as the fault
        job.start(logs)

    threads = [threading.Thread(target=inject, args=(f,), daemon=True) for f in faults]
    starters = [
        threading.Thread(target=start_cold, args=(j, f), daemon=True)
        for j, f in zip(cold, cold_faults(faults), strict=True)
    ]
    try:
        for t in [*threads, *starters]:
            t.start()
        for t in starters:
            t.join()  # within the window: every job has started before any is waited for
        deadline = start + JOB_TIMEOUT_S
        for job in jobs:  # a job started late (a second wave's) has its own bound
            job.wait(max(deadline, job.started + JOB_TIMEOUT_S))
        done.set()
        for t in threads:
            t.join()
    finally:
        done.set()
        injector.release()
        for job in jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.kill()
    restarted = injector.healed + cluster.heal()
    keys = [projects.variant(f"r{round_no}-prepare"), projects.variant(f"r{round_no}-actors")]
    keys += [projects.variant(f"r{round_no}-cold{i}") for i in range(len(cold))]
    verify = verify_job(round_no, cluster.gcs, prefix, [*keys, projects.base])
    verify.start(logs)
    verify.wait(time.monotonic() + JOB_TIMEOUT_S)
    reports = take_reports(projects.reports)
    found, notes = check_round(cluster, jobs, verify, checks, reports, records, restarted, start)
    found["whole"] += [  # the venv was whole again by now: `whole` had to say so at the time
        f"whole did not see a write through uv's cache into {r['target']['file']}"
        for r in records
        if r["kind"] == "cache_write" and r["met"] and not r.get("whole_saw_it")
    ]
    held = {name: not v for name, v in found.items()}
    for record in sorted(records, key=lambda r: r["offset_s"]):
        out.write(json.dumps({"type": "fault", **record, "invariants_held": held}) + "\n")
    for job in [*jobs, verify]:
        line = {k: v for k, v in job.result.items() if k != "reports"}
        line["shipped"] = shipped(job)
        out.write(json.dumps({"type": "job", **line, "workers": len(job.result["reports"])}) + "\n")
    out.write(json.dumps({"type": "round", "round": round_no, "restarted": restarted,
                          "seconds": round(time.monotonic() - start, 1),
                          "workers_started": len(reports), **notes,
                          "late_from_s": round(gate.open_at() - start, 1) if gate.opened else None,
                          "violations": {k: v for k, v in found.items() if v}}) + "\n")  # fmt: skip
    out.flush()
    return records, found


def shipped(job: Job) -> int:
    """How many nodes a `prepare` job's venv was shipped to: its line per node in its log
    (`<address> (<node>): uv_project <key>: shipped <size> in <time>`), also of a `prepare`
    that failed on another node (no `--json` output then)."""
    if job.kind not in ("prepare", "cold_ship") or job.log is None or not job.log.exists():
        return 0
    return len(SHIPPED.findall(job.log.read_text(errors="replace")))


def summarize(
    faults: list[dict[str, Any]], rounds: int, violations: list[dict[str, Any]], jobs: Counter
) -> dict[str, Any]:
    """Faults planned, sent (carried out) and met (their operation was there), per kind."""
    sent = [f for f in faults if f.get("sent", f["target"] is not None)]
    met = [f for f in sent if f.get("met")]
    by_kind = Counter(f"{f['kind']}:{f['action']}" for f in met)
    return {
        "type": "summary",
        "rounds": rounds,
        "faults_planned": len(faults),
        "faults_sent": len(sent),
        "faults_met": len(met),
        "faults_sent_per_kind": dict(sorted(Counter(f["kind"] for f in sent).items())),
        "faults_met_per_kind": dict(sorted(Counter(f["kind"] for f in met).items())),
        "faults_met_per_kind_action": dict(sorted(by_kind.items())),
        "invariants": list(INVARIANTS),
        "violations": violations,
        "jobs": dict(sorted(jobs.items())),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    files = [*mirror_pypi(f"ray=={ray.__version__}", WHEEL_CACHE / "pypi")]
    files += mirror_pypi("six", WHEEL_CACHE / "pypi")
    base = Path(tempfile.mkdtemp(prefix=f"{netns.PREFIX}chaos-", dir="/tmp"))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    faults: list[dict[str, Any]] = []
    violations: list[dict[str, Any]] = []
    jobs: Counter = Counter()
    rounds = 0
    began = time.monotonic()
    last_round = FIRST_ROUND_S  # a guess until one has run
    with open(out_path, "w") as out, ExitStack() as stack:
        stack.callback(remove, base)
        net = stack.enter_context(netns.network())
        index_host = net.add_host("index", 1000, 1000)
        hosts = [net.add_host(f"n{i}", NODE_MBIT, NODE_MBIT) for i in range(NODES)]
        with netns.inside(index_host):
            index = CountingIndex(files, bind=index_host.ip)
        # A download cut by a fault (a killed sync, a dropped link) is no error of the run's.
        index.server.handle_error = lambda request, address: None  # type: ignore[method-assign]
        stack.callback(index.server.server_close)
        stack.callback(index.server.shutdown)
        loop_dir = base / f"node{LOOP_NODE}"
        stack.enter_context(
            node_disks.mounted([loop_dir], base, size=LOOP_SIZE, reserved_percent=0)
        )  # no blocks kept for root: the nodes run as root, a full disk is full for them
        stack.callback(_kill_namespaces, net)  # before the unmount: nothing holds the disk
        nodes = [
            Node(i, h, base / f"node{i}" / "venvs", base / f"node{i}" / "uv-cache")
            for i, h in enumerate(hosts)
        ]
        for n in nodes:
            n.venv_dir.mkdir(parents=True, exist_ok=True)
        temp = base / "ray"
        temp.mkdir()
        os.environ.update(HEALTH)  # the drivers' too (`driver_env` copies it)
        cluster = ChaosCluster(net, nodes, temp, clock=Clock.make(base / "clock"))
        if cluster.clock is not None:
            nodes[SKEWED_NODE].extra_env = cluster.clock.env()
        stack.callback(cluster.close)
        projects = Projects(base / "projects", index.url, hosts[0].exec())
        uv_project = projects.variant("uv-run")
        subprocess_env = {**os.environ, "UV_CACHE_DIR": str(base / "driver-uv-cache")}
        _run([*hosts[0].exec(), find_uv(), "sync", "--quiet", "--project", str(uv_project)],
             subprocess_env)  # fmt: skip
        for n in nodes:
            cluster.start(n)
            if n.index == 0:
                time.sleep(3)
        cluster.heal(grace=120)  # nodes just started: their own time to join
        logs = base.parent / f"{base.name}-logs"
        logs.mkdir(exist_ok=True)
        out.write(json.dumps({"type": "setup", "seed": args.seed, "ray": ray.__version__,
                              "uv": uv_version(), "machine": f"{os.cpu_count()} CPUs",
                              "logs": str(logs), "loop_disk": LOOP_SIZE, "network": net.run_id,
                              "link_mbit": NODE_MBIT}) + "\n")  # fmt: skip
        checks = Checks()
        interrupted = False
        try:
            while sum(bool(f.get("met")) for f in faults) < args.faults:
                if args.minutes and time.monotonic() - began > args.minutes * 60:
                    break
                if args.rounds and rounds >= args.rounds:
                    break
                if args.stop_at and time.time() + last_round > args.stop_at:
                    break  # the next round would end past it
                round_began = time.monotonic()
                records, found = one_round(
                    rounds, args, cluster, projects, uv_project, logs, checks, out
                )
                faults += records
                for name, items in found.items():
                    violations += [{"round": rounds, "invariant": name, "what": v} for v in items]
                rounds += 1
                last_round = time.monotonic() - round_began
                sent = sum(f["target"] is not None for f in faults)
                met = sum(bool(f.get("met")) for f in faults)
                bad = sum(bool(v) for v in found.values())
                print(f"round {rounds}: {met} faults met, {sent} sent so far, "
                      f"{bad} invariants broken", flush=True)  # fmt: skip
        except KeyboardInterrupt:  # the rounds done so far are summed up; the teardown runs
            interrupted = True
        if rounds and not interrupted:  # the last round's locks: judged once past their bound
            held = locks_at_end([n.venv_dir for n in nodes], BUILD_TIMEOUT_S)
            violations += [{"round": rounds - 1, "invariant": "locks", "what": v} for v in held]
            out.write(json.dumps({"type": "locks_at_end", "violations": held}) + "\n")
        jobs.update(
            json.loads(line)["job"] + (":ok" if json.loads(line)["rc"] == 0 else ":failed")
            for line in out_path.read_text().splitlines()
            if '"type": "job"' in line
        )
        summary = summarize(faults, rounds, violations, jobs)
        summary["seconds"] = round(time.monotonic() - began)
        summary["interrupted"] = interrupted
        out.write(json.dumps(summary) + "\n")
    return summary


def report(path: Path) -> str:
    """A run's figures as markdown: per kind the faults planned, sent and met (and what a met
    one met), jobs and the venvs they shipped, rounds, violations."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    faults = [x for x in lines if x["type"] == "fault"]
    summary = next((x for x in lines if x["type"] == "summary"), None)
    rows = ["| kind | planned | sent | met | met: what it met |",
            "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        sent = [f for f in mine if f.get("sent", f["target"] is not None)]
        met = [f for f in sent if f.get("met")]
        rows.append(f"| `{kind}` | {len(mine)} | {len(sent)} | {len(met)} | {MEETS[kind]} |")
    jobs = [x for x in lines if x["type"] == "job"]
    counts = Counter(
        (x["job"], "ok" if x["rc"] == 0 else ("hung" if x["hung"] else "failed")) for x in jobs
    )
    rows += ["", "| job | succeeded | failed | hung |", "| --- | ---: | ---: | ---: |"]
    for job in ("actors", "group", "prepare", "uv_run", "cold", "cold_ship", "verify"):
        ok, failed, hung = (counts[(job, s)] for s in ("ok", "failed", "hung"))
        rows.append(f"| `{job}` | {ok} | {failed} | {hung} |")
    rounds = [x for x in lines if x["type"] == "round"]
    sent = sum(f.get("sent", f["target"] is not None) for f in faults)
    met = sum(bool(f.get("met")) for f in faults)
    fills = sum(bool(f.get("met")) for f in faults if f["kind"] == "disk_full")
    rows += [
        "",
        f"{len(rounds)} rounds, {len(faults)} faults planned, {sent} sent, {met} met; "
        f"{sum(x.get('shipped', 0) for x in jobs)} venvs shipped (nodes a `prepare` shipped "
        f"to), {fills} fills that left root without room; "
        f"{sum(x.get('workers_started', 0) for x in rounds)} workers checked, "
        f"{sum(len(x['restarted']) for x in rounds)} node restarts, "
        f"{sum(len(v) for x in rounds for v in x['violations'].values())} violations"
        + (f", {summary['seconds']} s" if summary else " (no summary: the run was cut)"),
    ]
    return "\n".join(rows)


def _run(argv: list[str], env: dict[str, str]) -> None:
    import subprocess

    subprocess.run(argv, check=True, env=env, timeout=600)


def _kill_namespaces(net: netns.Network) -> None:
    for pid in net.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1)


def _epoch(hhmm: str) -> float:
    now = time.gmtime()
    hours, minutes = (int(x) for x in hhmm.split(":"))
    midnight = time.time() - (now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec)
    return midnight + hours * 3600 + minutes * 60


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=200, help="stop once this many faults met")
    p.add_argument("--per-round", type=int, default=2 * len(KINDS), help="faults per round")
    p.add_argument("--window", type=float, default=40.0, help="seconds of a round faults fall in")
    p.add_argument("--minutes", type=float, default=0, help="stop after the round past this")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds")
    p.add_argument(
        "--stop-at", type=_epoch, default=None,
        help="HH:MM (UTC, today): start no round that the last one's length would end past it",
    )  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/chaos.jsonl")
    p.add_argument("--report", type=Path, help="print a finished run's figures, run nothing")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces, tc, a loop mount)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, netns.interrupted)  # the teardown runs
    summary = run(args)
    print(json.dumps(summary, indent=1))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

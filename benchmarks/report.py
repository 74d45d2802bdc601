"""Reporting: medians and spreads per case, the targets read off them, table, JSON and chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.runner import Sample
from benchmarks.scenarios import BY_ID, HAND_SYNC

SCENARIO_INFO = {**BY_ID, HAND_SYNC.id: HAND_SYNC}
ORDER = {sid: i for i, sid in enumerate(SCENARIO_INFO)}
# The startup targets: warm at most 1.05x the floor; a new venv at most the floor plus 1.1x
# a hand-run `uv sync` of the same venv; ours above the floor at most 10% of `uv run`'s.
WARM_RATIO = 1.05
COLD_FACTOR = 1.1


@dataclass(frozen=True)
class Row:
    """The samples of one case, summarized."""

    set_name: str
    actors: int
    topology: str
    scenario: str
    median: float | None
    low: float | None
    high: float | None
    ok: int
    runs: int
    syncs: int | None  # the most `uv sync` runs seen in one sample
    errors: tuple[str, ...]
    import_s: float | None = None  # median over samples of the workers' median import time

    @property
    def group(self) -> tuple[str, int, str]:
        return (self.set_name, self.actors, self.topology)


def summarize(samples: list[Sample]) -> list[Row]:
    cases: dict[tuple[str, int, str, str], list[Sample]] = {}
    for s in samples:
        cases.setdefault((s.set_name, s.actors, s.topology, s.scenario), []).append(s)
    rows = []
    for (set_name, actors, topology, scenario), group in cases.items():
        times = [s.seconds for s in group if s.ok and s.seconds is not None]
        syncs = [s.syncs for s in group if s.syncs is not None]
        imports = [statistics.median(s.import_s) for s in group if s.ok and s.import_s]
        rows.append(
            Row(
                set_name,
                actors,
                topology,
                scenario,
                statistics.median(times) if times else None,
                min(times) if times else None,
                max(times) if times else None,
                len(times),
                len(group),
                max(syncs) if syncs else None,
                tuple(sorted({s.error.splitlines()[0][:200] for s in group if s.error})),
                statistics.median(imports) if imports else None,
            )
        )
    return rows


def _find(rows: list[Row], group: tuple[str, int, str], scenario: str) -> Row | None:
    for row in rows:
        if row.group == group and row.scenario == scenario and row.median is not None:
            return row
    return None


def _floor(rows: list[Row], group: tuple[str, int, str]) -> float | None:
    row = _find(rows, group, "floor")
    return row.median if row else None


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    met: bool | None  # None: not measured in this run
    why: str = ""


def _why(ours: Row, floor: Row, theirs_over: float | None, plugin_ms: float | None) -> str:
    """Why an overhead target was missed, from what the run measured."""
    reasons = []
    if theirs_over is not None and theirs_over <= 0:
        reasons.append("theirs is not above the floor here, so there is no overhead to beat")
    fewest = min(ours.ok, floor.ok)
    if fewest < 3:
        reasons.append(f"{fewest} sample(s) only: too few to tell a gap from noise")
    elif ours.low <= floor.high and floor.low <= ours.high:  # type: ignore[operator]
        reasons.append("the min-max spreads overlap: the gap is within run-to-run noise")
    if plugin_ms is not None:
        reasons.append(f"the plugin's own cost for a ready venv is {plugin_ms:.2f} ms")
    return "; ".join(reasons)


def _build_cost(rows: list[Row], set_name: str) -> str:
    """What the node's one build costs by hand, with and without bytecode (a new venv's share)."""
    # Hand syncs are 1-actor rows only, so these are the set's whatever the target's N.
    by_id = {r.scenario: r.median for r in rows if r.set_name == set_name and r.median is not None}
    if "hand-sync" not in by_id:
        return ""
    text = f"it includes the node's one build: uv sync by hand takes {by_id['hand-sync']:.2f}s"
    if "hand-sync-nobc" in by_id:
        text += f", {by_id['hand-sync-nobc']:.2f}s without compiling bytecode"
    return text


def _overhead_target(
    name: str, ours: Row, theirs: Row, floor: Row, their_label: str, plugin_ms: float | None
) -> Target:
    """Ours above the floor must be at most 10% of theirs above the floor."""
    ours_over = ours.median - floor.median  # type: ignore[operator]
    their_over = theirs.median - floor.median  # type: ignore[operator]
    met = their_over > 0 and ours_over <= 0.10 * their_over
    return Target(
        name,
        f"ours {ours_over:+.2f}s vs {their_label} {their_over:+.2f}s above the floor",
        met,
        "" if met else _why(ours, floor, their_over, plugin_ms),
    )


def targets(rows: list[Row], plugin_cost: dict[str, Any]) -> list[Target]:
    found: list[Target] = []
    plugin_ms = plugin_cost.get("median_ms")
    single = sorted({r.group for r in rows if r.actors == 1})
    for group in single:
        set_name = group[0]
        floor, warm = _find(rows, group, "floor"), _find(rows, group, "warm")
        if floor and warm:
            ratio = warm.median / floor.median  # type: ignore[operator]
            met = ratio <= WARM_RATIO
            found.append(
                Target(
                    f"{set_name}: warm <= {WARM_RATIO}x the floor",
                    f"warm {warm.median:.2f}s / floor {floor.median:.2f}s = {ratio:.2f}x",
                    met,
                    "" if met else _why(warm, floor, None, plugin_ms),
                )
            )
        cold, hand = _find(rows, group, "cold-venv"), _find(rows, group, "hand-sync")
        if floor and cold and hand:
            bound = floor.median + COLD_FACTOR * hand.median  # type: ignore[operator]
            met = cold.median <= bound  # type: ignore[operator]
            found.append(
                Target(
                    f"{set_name}: cold venv <= floor + {COLD_FACTOR}x hand-run uv sync",
                    f"cold venv {cold.median:.2f}s vs {floor.median:.2f}s + {COLD_FACTOR} x "
                    f"{hand.median:.2f}s = {bound:.2f}s",
                    met,
                    ""
                    if met
                    else f"in Ray the build adds {cold.median - floor.median:.2f}s to the floor, "  # type: ignore[operator]
                    f"by hand it takes {hand.median:.2f}s; floor spread "
                    f"{floor.low:.2f}-{floor.high:.2f}s",
                )
            )
        for theirs_id in ("ray-uv", "ray-uv-cache"):
            theirs = _find(rows, group, theirs_id)
            if floor and warm and theirs:
                found.append(
                    _overhead_target(
                        f"{set_name}: warm's overhead <= 10% of Ray `uv` field's "
                        f"({SCENARIO_INFO[theirs_id].number})",
                        warm,
                        theirs,
                        floor,
                        "theirs",
                        plugin_ms,
                    )
                )
    multi = sorted({r.group for r in rows if r.actors > 1})
    largest = {g[2]: max(x[1] for x in multi if x[2] == g[2]) for g in multi}
    for group in multi:
        if group[1] != largest[group[2]]:
            continue
        set_name, n, topology = group
        floor, uv_run = _find(rows, group, "floor"), _find(rows, group, "uv-run")
        for ours_id in ("warm", "cold-venv"):
            ours = _find(rows, group, ours_id)
            if floor and uv_run and ours:
                target = _overhead_target(
                    f"{set_name}, {n} actors, {topology}: {ours_id}'s overhead <= 10% of "
                    "`uv run`'s",
                    ours,
                    uv_run,
                    floor,
                    "uv run",
                    None,
                )
                if ours_id == "cold-venv" and not target.met:
                    why = "; ".join(filter(None, [_build_cost(rows, set_name), target.why]))
                    target = replace(target, why=why)
                found.append(target)
    synced = [r for r in rows if r.syncs is not None]
    if synced:
        worst = max(synced, key=lambda r: (r.syncs, r.actors))
        expected = {"warm": 0, "warm-nobc": 0}
        bad = [r for r in synced if r.syncs > expected.get(r.scenario, 1)]  # type: ignore[operator]
        found.append(
            Target(
                "one `uv sync` per node (per shared venv dir) for any N, none when warm",
                f"most syncs in one sample: {worst.syncs} ({worst.scenario}, {worst.actors} "
                f"actors, {worst.topology})",
                not bad,
                "; ".join(f"{r.scenario} {r.actors} actors {r.topology}: {r.syncs}" for r in bad),
            )
        )
    if plugin_cost:
        ms = plugin_cost["median_ms"]
        measured = f"in-process lookup median {ms:.3f} ms (p99 {plugin_cost['p99_ms']:.3f} ms)"
        if "logged_median_ms" in plugin_cost:  # only runs with warm samples log a reuse
            logged = plugin_cost["logged_median_ms"]
            measured += f"; setup logs say reused in {logged:.1f} ms (median)"
        found.append(Target("a ready venv costs the plugin < 5 ms", measured, ms < 5))
    return found


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(console: Console, rows: list[Row], found: list[Target]) -> None:
    groups = sorted({r.group for r in rows}, key=lambda g: (g[2] != "local", g[0], g[1]))
    order = ORDER
    for group in groups:
        set_name, n, topology = group
        table = Table(
            title=f"set {set_name}: {n} actor{'s' if n > 1 else ''} at once, {topology}",
            title_justify="left",
        )
        for col in ("#", "scenario", "median s", "min-max s", "above floor", "x floor"):
            table.add_column(col, justify="left" if col == "scenario" else "right")
        table.add_column("syncs", justify="right")
        table.add_column("import s", justify="right")
        table.add_column("ok", justify="right")
        floor = _floor(rows, group)
        for row in sorted((r for r in rows if r.group == group), key=lambda r: order[r.scenario]):
            info = SCENARIO_INFO[row.scenario]
            above = ratio = "-"
            if floor and row.median is not None and not info.hand:
                above, ratio = f"{row.median - floor:+.2f}", f"{row.median / floor:.2f}"
            table.add_row(
                info.number,
                info.short,
                _fmt(row.median),
                f"{_fmt(row.low)}-{_fmt(row.high)}",
                above,
                ratio,
                "-" if row.syncs is None else str(row.syncs),
                _fmt(row.import_s),
                f"{row.ok}/{row.runs}",
            )
        console.print(table)
        for row in rows:
            if row.group == group and row.errors:
                console.print(f"  [red]{row.scenario}[/red]: {row.errors[0]}")
    console.print(
        "scenarios: " + "; ".join(f"{s.number} {s.label}" for s in SCENARIO_INFO.values()),
        highlight=False,
    )
    table = Table(title="targets", title_justify="left")
    for col in ("target", "measured", "met", "why not"):
        table.add_column(col)
    for t in found:
        met = "n/a" if t.met is None else ("[green]yes[/green]" if t.met else "[red]no[/red]")
        table.add_row(t.name, t.measured, met, t.why)
    console.print(table)


def markdown(rows: list[Row], found: list[Target]) -> str:
    """The same tables as Markdown, for RESULTS.md."""
    groups = sorted({r.group for r in rows}, key=lambda g: (g[2] != "local", g[0], g[1]))
    order = ORDER
    out = []
    for group in groups:
        set_name, n, topology = group
        out.append(f"**set {set_name}, {n} actor{'s' if n > 1 else ''} at once, {topology}**\n")
        out.append(
            "| # | scenario | median s | min-max s | above floor s | x floor | syncs | "
            "import s | ok |"
        )
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        floor = _floor(rows, group)
        for row in sorted((r for r in rows if r.group == group), key=lambda r: order[r.scenario]):
            info = SCENARIO_INFO[row.scenario]
            above = ratio = "-"
            if floor and row.median is not None and not info.hand:
                above, ratio = f"{row.median - floor:+.2f}", f"{row.median / floor:.2f}"
            syncs = "-" if row.syncs is None else str(row.syncs)
            out.append(
                f"| {info.number} | {info.label} | {_fmt(row.median)} | "
                f"{_fmt(row.low)}-{_fmt(row.high)} | {above} | {ratio} | {syncs} | "
                f"{_fmt(row.import_s)} | {row.ok}/{row.runs} |"
            )
        out.append("")
    out.append("| target | measured | met | why not |")
    out.append("|---|---|---|---|")
    for t in found:
        met = "n/a" if t.met is None else ("yes" if t.met else "**no**")
        out.append(f"| {t.name} | {t.measured} | {met} | {t.why} |")
    return "\n".join(out) + "\n"


def machine() -> dict[str, Any]:
    """What the figures were taken on; the load shows whether others shared the machine."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line
        )
        meminfo = Path("/proc/meminfo").read_text().split()
        info["memory_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    import ray

    from ray_uv_plugin.env.uv import find_uv

    info["ray"] = ray.__version__
    try:
        info["uv"] = subprocess.run(
            [find_uv(), "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def write_json(
    path: Path,
    meta: dict[str, Any],
    samples: list[Sample],
    rows: list[Row],
    found: list[Target],
    plugin_cost: dict[str, Any],
) -> None:
    data = {
        "meta": meta,
        "plugin_cost": plugin_cost,
        "summary": [asdict(r) for r in rows],
        "targets": [asdict(t) for t in found],
        "samples": [s.to_json() for s in samples],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def plot(path: Path, rows: list[Row], title: str) -> None:
    """One panel per (set, N, topology): median time to first call, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r.group for r in rows}, key=lambda g: (g[2] != "local", g[0], g[1]))
    order = ORDER
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(9, 0.45 * len(rows) + 1.1 * len(groups) + 0.5), squeeze=False
    )
    for ax, group in zip(axes[:, 0], groups, strict=True):
        group_rows = sorted(
            (r for r in rows if r.group == group and r.median is not None),
            key=lambda r: order[r.scenario],
            reverse=True,
        )
        labels = [
            f"{SCENARIO_INFO[r.scenario].number} {SCENARIO_INFO[r.scenario].label}"
            for r in group_rows
        ]
        medians = [r.median for r in group_rows]
        errors = [
            [r.median - r.low for r in group_rows],  # type: ignore[operator]
            [r.high - r.median for r in group_rows],  # type: ignore[operator]
        ]
        colors = [
            "#4c72b0" if SCENARIO_INFO[r.scenario].uv_project else "#999999" for r in group_rows
        ]
        ax.barh(labels, medians, xerr=errors, color=colors, capsize=3)
        for y, row in enumerate(group_rows):
            ax.text(row.high, y, f"  {row.median:.2f}s", va="center", fontsize=8)
        ax.set_xlim(0, max(r.high for r in group_rows) * 1.15)  # type: ignore[type-var]
        set_name, n, topology = group
        ax.set_title(f"set {set_name}, {n} actor{'s' if n > 1 else ''}, {topology}", fontsize=10)
        ax.set_xlabel("seconds to first method call (all actors)")
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The scenarios of the growth chart, as lines: (id, label, color).
GROWTH_LINES = (
    ("floor", "floor (prebuilt venv)", "#333333"),
    ("warm", "uv_project, venv ready", "#4c72b0"),
    ("cold-venv", "uv_project, new venv", "#55a868"),
    ("uv-run", "uv run --locked per worker", "#dd8452"),
    ("ray-uv", "Ray `uv` field", "#c44e52"),
)


def plot_growth(path: Path, rows: list[Row], lock_sizes: dict[str, int], title: str) -> None:
    """Time to first call against N (one panel per set), and above the floor against the lock's
    size (one panel per N): how each way's cost grows. Medians, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    local = [r for r in rows if r.topology in ("local", "address") and r.median is not None]
    sets = sorted({r.set_name for r in local}, key=lambda s: lock_sizes.get(s, 0))
    ns = sorted({r.actors for r in local})
    width = max(len(sets), len(ns))
    fig, axes = plt.subplots(2, width, figsize=(4.2 * width, 8), squeeze=False)
    by = {(r.set_name, r.actors, r.scenario): r for r in local}
    for ax, set_name in zip(axes[0], sets, strict=False):
        for sid, label, color in GROWTH_LINES:
            pts = [by[(set_name, n, sid)] for n in ns if (set_name, n, sid) in by]
            if not pts:
                continue
            xs, ys = [r.actors for r in pts], [r.median for r in pts]
            err = [[r.median - r.low for r in pts], [r.high - r.median for r in pts]]  # type: ignore[operator]
            ax.errorbar(xs, ys, yerr=err, label=label, color=color, marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_title(f"set {set_name} ({lock_sizes.get(set_name, '?')} locked packages)")
        ax.set_xlabel("actors started at once")
        ax.set_ylabel("s to first call (all actors)")
        ax.grid(alpha=0.3)
    for ax, n in zip(axes[1], ns, strict=False):
        for sid, label, color in GROWTH_LINES[1:]:
            pts = []
            for set_name in sets:
                row, floor = by.get((set_name, n, sid)), by.get((set_name, n, "floor"))
                if row and floor:
                    pts.append((lock_sizes.get(set_name, 0), row.median - floor.median))  # type: ignore[operator]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label, color=color, marker="o")
        ax.axhline(0, color="#333333", lw=0.8)
        ax.set_xscale("log")
        sizes = sorted({lock_sizes[s] for s in sets if s in lock_sizes})
        ax.set_xticks(sizes, [str(x) for x in sizes])
        ax.minorticks_off()
        ax.set_title(f"{n} actor{'s' if n > 1 else ''}: above the floor")
        ax.set_xlabel("packages in the lock")
        ax.set_ylabel("s above the floor (medians)")
        ax.grid(alpha=0.3)
    for ax in [*axes[0][len(sets) :], *axes[1][len(ns) :]]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Print the tables and redraw the charts of saved runs: `python -m benchmarks.report X.json`
    (several runs' samples are pooled, e.g. one run per package set)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.report")
    p.add_argument("json", type=Path, nargs="+")
    p.add_argument("--plot", type=Path)
    p.add_argument("--growth-plot", type=Path, help="time against N and lock size")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables instead")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.json]
    samples = [Sample(**s) for data in runs for s in data["samples"]]
    rows = summarize(samples)
    found = targets(rows, runs[0].get("plugin_cost") or {})
    if args.markdown:
        print(markdown(rows, found), end="")
    else:
        print_report(Console(width=120), rows, found)
    meta = runs[0]["meta"]
    title = f"ray-uv bench, {meta['date']}, {meta.get('cpu', '')} x{meta['cpus']}"
    if args.plot:
        plot(args.plot, rows, title)
    if args.growth_plot:
        sizes = {
            k: v["locked_packages"] for d in runs for k, v in d["meta"].get("sets", {}).items()
        }
        plot_growth(args.growth_plot, rows, sizes, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

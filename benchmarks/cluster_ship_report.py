"""What `cluster_ship` reports from its runs: the simulated cluster's summary per N (both modes'
times, the bounds and the targets read off them), and the charts of either mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.bounds import judge


def summarize_netns(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: both modes' times, the link bound and the data-plane floor, and the issue's
    targets read off them ("within 1.5 x" of the larger). Older runs without a floor are
    judged against the link bound alone (their CPU bound measured the code it judged)."""
    rows = []
    for nodes in sorted({r["nodes"] for r in runs}):
        by = {r["scenario"]: r for r in runs if r["nodes"] == nodes}
        sync, ship = by.get("per-node sync"), by.get("ship")
        row: dict[str, Any] = {"nodes": nodes}
        if sync:
            row["sync_seconds"] = sync["ready_seconds"]
            row["sync_index_bytes"] = sync["index_bytes"]
            row["sync_builds"] = sync["builds"]
        if ship:
            row["ship_seconds"] = ship["ready_seconds"]
            row["ship_index_bytes"] = ship["index_bytes"]
            row["ship_builds"] = ship["builds"]
            row["source_sent_bytes"] = ship["source_sent_bytes"]
            receivers = ship.get("node_cpu_seconds", [])[1:]
            if receivers:
                row["receiver_cpu_seconds"] = round(sum(receivers) / len(receivers), 2)
            row["stream_bytes"] = ship.get("stream_bytes")
            row["host_cpu_busy_after_build"] = ship.get("host_cpu_busy_after_build")
            row["bound_seconds"] = ship.get("bound_seconds")  # the link bound
            row["floor_seconds"] = ship.get("floor_seconds")  # none in older runs
            if ship.get("bound_seconds"):
                bounds = ship["bound_seconds"], ship.get("floor_seconds")
                row.update(judge(ship["ready_seconds"], *bounds))
            row["built_once"] = ship["builds"] == 1 and ship["shipped"] == nodes - 1
        if sync and ship:
            row["ship_below_sync"] = ship["ready_seconds"] < sync["ready_seconds"]
        rows.append(row)
    return rows


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = [r["scenario"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = [
        ("index_bytes", 1024**3, "GiB served by the package index"),
        ("ready_seconds", 1, "seconds until every node is ready"),
        ("first_call_seconds", 1, "seconds to a 4-node group's first call"),
    ]
    for ax, (field, scale, title) in zip(axes, panels, strict=True):
        values = [r[field] / scale for r in runs]
        bars = ax.bar(names, values, color=["#999999", "#3b7dd8"][: len(names)])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(title, fontsize=9)
    wheels = results["wheels"]
    fig.suptitle(
        f"{results['nodes']} raylets, {wheels['count']} wheels x {wheels['mb']} MB "
        "(+ Ray from PyPI), one run",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_netns(results: dict[str, Any], path: Path) -> None:
    """Time to all nodes ready against N for each scenario and the bounds, the index's bytes,
    and what the source node sent against a star's (N-1) streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, rows = results["runs"], results["summary"]
    names = list(dict.fromkeys(r["scenario"] for r in runs))
    known = {"per-node sync": ("#999999", "o"), "ship": ("#3b7dd8", "s")}
    styles = {name: known.get(name, ("#d8533b", "d")) for name in names}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))

    def draw(ax: Any, field: str, scale: float, only_shipped: bool = False) -> None:
        for name in names:
            points = [
                (r["nodes"], r[field] / scale)
                for r in runs
                if r["scenario"] == name
                and r.get(field) is not None
                and (r.get("stream_bytes") or not only_shipped)
            ]
            if points:
                color, marker = styles[name]
                ax.plot(*zip(*points, strict=True), marker=marker, color=color, label=name)

    draw(axes[0], "ready_seconds", 1)
    bounds = [
        ("bound_seconds", "--", "#2a9d4b", "link bound: one build + the venv over one link"),
        ("floor_seconds", "-.", "#c98a1b", "data-plane floor: one build + pipes, worker starts"),
    ]
    for field, line, color, label in bounds:
        points = [(r["nodes"], r[field]) for r in rows if r.get(field)]
        if points:
            axes[0].plot(*zip(*points, strict=True), line, color=color, label=label)
    larger = [
        (r["nodes"], max(r["bound_seconds"], r.get("floor_seconds") or 0))
        for r in rows
        if r.get("bound_seconds")
    ]
    if larger:
        axes[0].plot(
            *zip(*[(n, 1.5 * b) for n, b in larger], strict=True),
            ":",
            color="#444444",
            label="1.5 x the larger bound (the target)",
        )
    axes[0].set(xlabel="nodes", ylabel="seconds until every node is ready")
    draw(axes[1], "index_bytes", 1e9)
    axes[1].set(xlabel="nodes", ylabel="GB served by the index")
    draw(axes[2], "source_sent_bytes", 1e9, only_shipped=True)
    star = [
        (r["nodes"], (r["nodes"] - 1) * r["stream_bytes"] / 1e9)
        for r in rows
        if r.get("stream_bytes")
    ]
    if star:
        axes[2].plot(
            *zip(*star, strict=True), ":", color="#444444", label="(N-1) x the venv's stream"
        )
    axes[2].set(xlabel="nodes", ylabel="GB the source node sent")
    for ax in axes:
        ax.set_xticks(sorted({r["nodes"] for r in runs}))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    links = results["links"]
    fig.suptitle(
        f"Simulated cluster: nodes at {links['node_mbit']} Mbit/s, the index's uplink "
        f"{links['index_uplink_mbit']} Mbit/s shared; {results['wheels']['bytes'] / 1e9:.2f} GB "
        f"of wheels + an sdist that builds in {results['build_seconds']} s; one run each\n"
        f"{results.get('node_disks', 'one filesystem for every node')}; "
        f"{results['machine']}, shared by every node",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)

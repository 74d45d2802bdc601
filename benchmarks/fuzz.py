"""The fuzzers' long runs: many cases per target, each target in a process of its own under
coverage.py (line and branch coverage of the modules it is meant to reach), every failing input
saved to the target's corpus. What the targets check: tests/fuzz/, docs/reliability.md.

    nice -n 19 uv run python -m benchmarks.fuzz --target all --cases 100000 --jobs 2

Cases are drawn in batches, each a hypothesis run with a seed of its own (`--seed` + batch
number), so a run can be repeated and continued (`--seed` past the last). Writes
benchmarks/results/fuzz.json (`--json`): per target the cases run, the time, the failures, the
coverage reached and (stream) what the receiver made of the cases.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The slowest first: with --jobs 2, the stream runs beside all the others.
NAMES = ("stream", "offer", "venv_files", "uv_env", "uv_run", "spec", "project")
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "fuzz.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fuzz", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", default="all", help=f"one of {', '.join(NAMES)}, or all")
    p.add_argument("--cases", type=int, default=100_000, help="cases per target (at least)")
    p.add_argument("--batch", type=int, default=5_000, help="cases per hypothesis run")
    p.add_argument("--seed", type=int, default=0, help="the first batch's seed")
    p.add_argument("--jobs", type=int, default=1, help="targets run at once (--target all)")
    p.add_argument("--max-failures", type=int, default=20, help="stop a target after so many")
    p.add_argument("--no-coverage", action="store_true", help="skip coverage.py (faster)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the results go")
    p.add_argument(
        "--report", type=Path, nargs="+", help="print the table of these result files, run nothing"
    )
    return p.parse_args(argv)


def _module_files(modules: tuple[str, ...]) -> list[str]:
    found = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        found.append(spec.origin)
    return found


def run_target(
    name: str, args: argparse.Namespace, on_batch: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Fuzz one target in this process; coverage starts before its modules are imported.
    `on_batch` gets the result so far after each batch (a run stopped early keeps its figures)."""
    fuzz_module = importlib.util.find_spec(f"tests.fuzz.{name}")
    assert fuzz_module is not None, name
    cov = None
    if not args.no_coverage:
        import coverage

        # The modules are named in the target; find them without importing the target.
        text = Path(fuzz_module.origin).read_text()
        modules = tuple(m for m in _declared_modules(text))
        cov = coverage.Coverage(
            data_file=None, branch=True, include=_module_files(modules), config_file=False
        )
        cov.start()
    from hypothesis import Phase, given, seed, settings

    from tests.fuzz.harness import HEALTH, save

    module = importlib.import_module(f"tests.fuzz.{name}")
    target = module.TARGET
    count, failures, last_failing = 0, [], [None]
    start = time.monotonic()
    batch = 0
    while count < args.cases and len(failures) < args.max_failures:

        @seed(args.seed + batch)
        @settings(
            max_examples=min(args.batch, args.cases - count),
            database=None,
            deadline=None,
            suppress_health_check=HEALTH,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
        )
        @given(target.cases)
        def one(case: dict) -> None:
            nonlocal count
            count += 1
            try:
                target.check(case)
            except BaseException:
                last_failing[0] = case  # the last is the shrunk one
                raise

        try:
            one()
        except Exception as e:  # noqa: BLE001 - recorded, and the input saved
            path = save(name, last_failing[0]) if last_failing[0] is not None else None
            failures.append(
                {
                    "batch": batch,
                    "error": f"{type(e).__name__}: {str(e)[:2000]}",
                    "saved": str(path.relative_to(ROOT)) if path else None,
                }
            )
        batch += 1
        elapsed = time.monotonic() - start
        print(f"fuzz {name}: {count} cases in {elapsed:.0f}s", file=sys.stderr, flush=True)
        result = _result(name, args, module, count, batch, elapsed, failures, cov)
        on_batch(result)
    return _result(name, args, module, count, batch, time.monotonic() - start, failures, cov)


def _result(
    name: str,
    args: argparse.Namespace,
    module: Any,
    count: int,
    batch: int,
    seconds: float,
    failures: list[dict[str, Any]],
    cov: Any,
) -> dict[str, Any]:
    target = module.TARGET
    result: dict[str, Any] = {
        "target": name,
        "cases": count,
        "batches": batch,
        "seeds": [args.seed, args.seed + batch - 1],
        "seconds": round(seconds, 1),
        "cases_per_second": round(count / seconds, 1) if seconds else None,
        "failures": failures,
        "properties": list(target.properties),
    }
    if hasattr(module, "OUTCOMES"):
        result["outcomes"] = dict(Counter(module.OUTCOMES).most_common())
    if cov is not None:
        cov.stop()  # reported between batches, then measuring again
        result["coverage"] = _coverage(cov)
        cov.start()
    return result


def _declared_modules(source: str) -> list[str]:
    """The module names in a target's `modules=(...)`, read from its source."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "modules":
            return [ast.literal_eval(elt) for elt in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError("no modules=(...) in the target")


def _coverage(cov: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cov.json"
        cov.json_report(outfile=str(out))
        report = json.loads(out.read_text())
    files = {}
    for path, data in report["files"].items():
        s = data["summary"]
        files[os.path.relpath(path, ROOT)] = {
            "lines": f"{s['covered_lines']}/{s['num_statements']}",
            "line_percent": round(100 * s["covered_lines"] / max(s["num_statements"], 1), 1),
            "branches": f"{s['covered_branches']}/{s['num_branches']}",
            "branch_percent": round(100 * s["covered_branches"] / max(s["num_branches"], 1), 1),
        }
    return files


def _children(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """Each target in a process of its own (its own coverage), `--jobs` at once."""
    results: dict[str, Any] = {}
    pending = list(names)
    running: list[tuple[str, subprocess.Popen, Path]] = []
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-results-"))
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            out = tmp / f"{name}.json"
            cmd = [sys.executable, "-m", "benchmarks.fuzz", "--target", name, "--json", str(out)]
            cmd += [
                "--cases",
                str(args.cases),
                "--batch",
                str(args.batch),
                "--seed",
                str(args.seed),
            ]
            cmd += ["--max-failures", str(args.max_failures)]
            cmd += ["--no-coverage"] if args.no_coverage else []
            print(f"fuzz {name}: started", flush=True)
            running.append((name, subprocess.Popen(cmd, cwd=ROOT), out))
        time.sleep(1)
        for item in list(running):
            name, proc, out = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if out.is_file():
                results[name] = json.loads(out.read_text())["targets"][name]
            else:
                results[name] = {"target": name, "error": f"exited {proc.returncode}"}
            print(f"fuzz {name}: {_line(results[name])}", flush=True)
    return results


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return r["error"]
    cov = r.get("coverage", {})
    covered = ", ".join(
        f"{Path(p).stem} {c['line_percent']}% lines {c['branch_percent']}% branches"
        for p, c in cov.items()
    )
    return (
        f"{r['cases']} cases in {r['seconds']}s ({r['cases_per_second']}/s), "
        f"{len(r['failures'])} failures; {covered}"
    )


def report(paths: list[Path]) -> str:
    """The figures of result files as docs/reliability.md gives them: a row per target (its
    cases summed over the files), then each module's coverage in the run that measured it."""
    runs = [json.loads(p.read_text()) for p in paths]
    rows = ["| target | cases | seconds | cases/s | failures | coverage (lines, branches) |"]
    rows.append("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in NAMES:
        found = [run["targets"][name] for run in runs if "cases" in run["targets"].get(name, {})]
        if not found:
            continue
        cases = sum(r["cases"] for r in found)
        seconds = sum(r["seconds"] for r in found)
        failures = sum(len(r["failures"]) for r in found)
        best: dict[str, dict[str, Any]] = {}  # per module, the run that reached most
        for r in found:
            for path, c in r.get("coverage", {}).items():
                key = (c["line_percent"], c["branch_percent"])
                if path not in best or key > (
                    best[path]["line_percent"],
                    best[path]["branch_percent"],
                ):
                    best[path] = c
        covered = "; ".join(
            f"`{Path(path).name}` {c['lines']} ({c['line_percent']}%), {c['branches']} "
            f"({c['branch_percent']}%)"
            for path, c in best.items()
        )
        rate = f"{cases / seconds:.0f}" if seconds else "-"
        rows.append(f"| `{name}` | {cases:,} | {seconds:,.0f} | {rate} | {failures} | {covered} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    names = list(NAMES) if args.target == "all" else [args.target]
    unknown = set(names) - set(NAMES)
    if unknown:
        raise SystemExit(f"unknown target(s) {sorted(unknown)}: the targets are {NAMES}")
    from benchmarks.report import machine

    doc = {
        "command": "python -m benchmarks.fuzz "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "targets": {},
    }

    def write(results: dict[str, Any]) -> None:
        doc["targets"] = results
        doc["written"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")

    if len(names) == 1:
        results = {names[0]: run_target(names[0], args, lambda r: write({names[0]: r}))}
        print(f"fuzz {names[0]}: {_line(results[names[0]])}", flush=True)
    else:
        results = _children(args, names)
    write(results)
    failed = sum(len(r.get("failures", [])) + ("error" in r) for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

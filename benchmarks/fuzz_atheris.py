"""Coverage-guided runs of the fuzz targets: atheris (libFuzzer) drives a target's hypothesis
strategy (`fuzz_one_input`), keeping the inputs that reach new branches of the target's modules
and mutating them further; the same properties are checked as in `benchmarks.fuzz`.

    nice -n 19 uv run --with atheris python -m benchmarks.fuzz_atheris --target stream \\
        --json benchmarks/results/fuzz-atheris-stream.json -atheris_runs=50000

atheris is no dependency of the project: `uv run --with atheris` brings it for the run (its
wheels are for some CPython versions only, and the default suite does not need it). Arguments
after the ours go to libFuzzer (`-atheris_runs=N`, `-max_total_time=S`). A failing input is
saved to the target's corpus, as `benchmarks.fuzz` does.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.fuzz import NAMES, ROOT, _declared_modules


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_atheris")
    p.add_argument("--target", required=True, choices=NAMES)
    p.add_argument("--json", type=Path, required=True, help="where the results go")
    args, libfuzzer = p.parse_known_args()
    import atheris

    source = (ROOT / "tests" / "fuzz" / f"{args.target}.py").read_text()
    with atheris.instrument_imports(include=[m for m in _declared_modules(source)]):
        for name in _declared_modules(source):
            importlib.import_module(name)
    from hypothesis import given, settings

    from tests.fuzz.harness import HEALTH, save

    module = importlib.import_module(f"tests.fuzz.{args.target}")
    target = module.TARGET
    state: dict[str, Any] = {"target": args.target, "engine": "atheris", "cases": 0}
    state["failures"] = []
    start = time.monotonic()

    @settings(database=None, deadline=None, suppress_health_check=HEALTH)
    @given(target.cases)
    def one(case: dict) -> None:
        state["cases"] += 1
        try:
            target.check(case)
        except BaseException as e:
            path = save(args.target, case)
            state["failures"].append(
                {"error": f"{type(e).__name__}: {str(e)[:2000]}", "saved": str(path)}
            )
            raise

    def report() -> None:
        state["seconds"] = round(time.monotonic() - start, 1)
        state["libfuzzer_args"] = libfuzzer
        if hasattr(module, "OUTCOMES"):
            state["outcomes"] = dict(module.OUTCOMES.most_common())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(state, indent=1) + "\n")

    atexit.register(report)
    # Inputs long enough for a whole case from the start (libFuzzer begins at 4 bytes, which
    # hypothesis rejects as too short); the caller's own flags come after, and win.
    defaults = ["-max_len=65536", "-len_control=0"]
    atheris.Setup([sys.argv[0], *defaults, *libfuzzer], one.hypothesis.fuzz_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

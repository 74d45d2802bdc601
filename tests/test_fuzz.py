"""The fuzz targets in the default suite (docs/reliability.md, "Fuzzing"): each replays its
saved corpus (real inputs, the attacks the other tests know, every input a fuzzer found) and
runs a short hypothesis run, derandomized so that a run is the same on every machine. The long
runs, which draw many more cases, are `python -m benchmarks.fuzz`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.fuzz.harness import HEALTH, corpus
from tests.fuzz.targets import TARGETS

# A short run: the whole file stays well under a minute on the 2-core machine.
SHORT_RUN: dict[str, int] = {}  # per target, where it differs
DEFAULT_RUN = 300


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_saved_corpus_keeps_every_property(name: str) -> None:
    seeds = corpus(name)
    assert len(seeds) >= 8, f"{name}: its corpus holds {len(seeds)} cases"
    for file, case in seeds:
        try:
            TARGETS[name].check(case)
        except AssertionError as e:
            raise AssertionError(f"tests/fuzz/corpus/{name}/{file}: {e}") from e


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_short_run_keeps_every_property(name: str) -> None:
    target = TARGETS[name]

    @settings(
        max_examples=SHORT_RUN.get(name, DEFAULT_RUN),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=HEALTH,
        print_blob=True,
    )
    @given(target.cases)
    def run(case: dict) -> None:
        target.check(case)

    run()


def test_an_honest_stream_in_the_corpus_is_installed() -> None:
    """The stream target's liveness: a venv a build could make, sent whole, is taken (a
    receiver refusing everything would keep every other property)."""
    from tests.fuzz import stream

    before = stream.OUTCOMES["installed"]
    honest = [case for _, case in corpus("stream") if case.get("honest")]
    for case in honest:
        stream.check(case)
    assert stream.OUTCOMES["installed"] - before == len(honest) >= 3

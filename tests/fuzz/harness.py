"""What every fuzz target is: a hypothesis strategy of JSON-able cases, a check that raises
`Violation` when a property breaks, the modules it is meant to reach, and a saved corpus.

A case is JSON (bytes as base64 text) so that the corpus is plain files: real inputs and the
attacks the tests know, replayed by the default suite, and every failing input a long run
finds (`save`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck
from hypothesis import strategies as st

CORPUS = Path(__file__).resolve().parent / "corpus"
Case = dict[str, Any]
# A slow case (a stream, a project on disk) or a large one is what these targets are for.
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


class Violation(AssertionError):
    """A property of a target broke: the message says which, for which input."""


@dataclass(frozen=True)
class Target:
    name: str
    cases: st.SearchStrategy[Case]
    check: Callable[[Case], None]
    modules: tuple[str, ...]  # what the target exercises, for the long run's coverage
    properties: tuple[str, ...]  # in words: the doc lists them


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def corpus(target: str) -> list[tuple[str, Case]]:
    """The saved cases of `target`: (file name, case), in name order."""
    folder = CORPUS / target
    return [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def save(target: str, case: Case, prefix: str = "found") -> Path:
    """Write `case` into `target`'s corpus (named by its content), so every later run replays
    it; returns the file."""
    text = json.dumps(case, indent=1, sort_keys=True) + "\n"
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    path.write_text(text)
    return path


def seeded(target: str, fresh: st.SearchStrategy[Case], mutate: Callable[[Case], Any]):
    """Cases drawn fresh, or from the saved corpus and mutated (`mutate(seed)` returns a
    strategy of cases), or the seeds as they are."""
    seeds = [case for _, case in corpus(target)]
    if not seeds:
        return fresh
    from_seeds = st.sampled_from(seeds)
    return st.one_of(fresh, from_seeds, from_seeds.flatmap(mutate))


def refused_clearly(error: BaseException, allowed: tuple[type[BaseException], ...], what: str):
    """A refusal must be one of the module's own errors, with a message."""
    if not isinstance(error, allowed):
        names = ", ".join(a.__name__ for a in allowed)
        raise Violation(
            f"{what} raised {type(error).__name__}: {error!r}, not one of {names}"
        ) from error
    if not str(error).strip():
        raise Violation(f"{what} raised {type(error).__name__} without a message") from error


def toml_value(value: Any) -> str:
    """`value` as a TOML inline value (strings as JSON escapes them, which TOML reads too;
    None, which TOML lacks, as an empty inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value).replace("Infinity", "inf").replace("NaN", "nan")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items())
            + "}"
        )
    return "{}"


def toml_text(doc: dict[str, Any]) -> str:
    """A TOML document of top-level keys with inline values: any table shape TOML can hold."""
    return "".join(f"{json.dumps(str(k))} = {toml_value(v)}\n" for k, v in doc.items())


class _Hang(BaseException):
    """Raised in the main thread by the alarm: no `except Exception` of the code under test
    takes it for a refusal."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang


def bounded(call: Callable[[], Any], seconds: float, what: str) -> Any:
    """`call()`, or a `Violation` if it still runs after `seconds`: a SIGALRM in the main
    thread (no thread per case, which a loaded machine makes slow to start and join). An
    alarm set before (pytest-timeout's) is put back, less the time spent here."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("bounded() runs in the main thread (it uses SIGALRM)")
    handler = signal.getsignal(signal.SIGALRM)
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, delay) if delay else seconds)
    try:
        return call()
    except _Hang:
        if delay and delay <= seconds:
            signal.signal(signal.SIGALRM, handler)
            handler(signal.SIGALRM, None)  # the earlier alarm's own
        raise Violation(f"{what} still runs after {seconds:.0f}s: a hang") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if delay:
            left = delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), interval)

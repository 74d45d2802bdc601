"""A logging handler that keeps each message, so a benchmark or a test can count what the builder
logged (waits for a slot, venvs removed for the budget) rather than parse stderr. One place, used
by benchmarks/build_limits.py and the build-slot and budget tests."""

from __future__ import annotations

import logging
import time


class Lines(logging.Handler):
    """Every message logged through it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def having(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]

    def count(self, text: str) -> int:
        return len(self.having(text))

    def keys(self, text: str) -> int:
        """How many keys logged a line with `text` (`uv_project <key>: ...`)."""
        return len({line.split(":")[0] for line in self.having(text)})

    def budget_checks(self) -> list[float]:
        """The seconds each build took to make room within the budget."""
        found = [line.rsplit("(checked in ", 1) for line in self.having("(checked in ")]
        return [float(part[1].rstrip("s)")) for part in found]


def capturing_logger(name: str, propagate: bool = True) -> tuple[logging.Logger, Lines]:
    """A fresh INFO logger (its name made unique) whose messages `Lines` keeps."""
    logger = logging.getLogger(f"{name}-{time.monotonic_ns()}")
    logger.setLevel(logging.INFO)
    logger.propagate = propagate
    lines = Lines()
    logger.addHandler(lines)
    return logger, lines

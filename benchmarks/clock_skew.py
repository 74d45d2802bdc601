"""One node's wall clock set off from the host's, for the chaos run's `clock_skew` fault.

The nodes share the host's kernel, and a time namespace moves only the monotonic and boot
clocks, never the wall clock; libfaketime is not installed here. So a small library of ours,
put before libc with `LD_PRELOAD` in the node's `ray start` (its raylet, agent, workers and
`uv` inherit it), answers `clock_gettime(CLOCK_REALTIME*)`, `gettimeofday` and `time` with the
host's time plus an offset it reads, at each call, from a file it maps (8 bytes, seconds): the
run sets the offset for a fault's hold and back to 0, with no restart. A program that reads
the clock without libc's functions (a static binary, the vDSO called directly) is not moved.

`Clock.make(where)` compiles it with the host's C compiler (None if there is none).
"""

from __future__ import annotations

import mmap
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OFFSET_FILE_ENV = "CHAOS_CLOCK_OFFSET_FILE"

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *offset_s;
static int (*real)(clockid_t, struct timespec *);

__attribute__((constructor)) static void init(void) {
    real = dlsym(RTLD_NEXT, "clock_gettime");
    const char *path = getenv("CHAOS_CLOCK_OFFSET_FILE");
    if (!path) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    void *p = mmap(NULL, 8, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p != MAP_FAILED) offset_s = p;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    if (rc == 0 && offset_s && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE))
        ts->tv_sec += *offset_s;
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    if (tv == NULL) return 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
"""


@dataclass
class Clock:
    library: Path
    offset_file: Path

    @classmethod
    def make(cls, where: Path) -> Clock | None:
        """The library, compiled into `where`, and its offset file (0); None if no C compiler."""
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        where.mkdir(parents=True, exist_ok=True)
        source, library = where / "clock_skew.c", where / "libclockskew.so"
        source.write_text(SOURCE)
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
            check=True, capture_output=True,
        )  # fmt: skip
        clock = cls(library, where / "clock-offset")
        clock.offset_file.write_bytes(struct.pack("<q", 0))
        return clock

    def env(self) -> dict[str, str]:
        """What a process needs in its environment to read this clock."""
        return {"LD_PRELOAD": str(self.library), OFFSET_FILE_ENV: str(self.offset_file)}

    def set(self, seconds: int) -> None:
        """Every process with `env()` reads the wall clock `seconds` off from now on."""
        with open(self.offset_file, "r+b") as f, mmap.mmap(f.fileno(), 8) as m:
            m[:8] = struct.pack("<q", seconds)


def loaded(pid: int) -> bool:
    """Whether process `pid` has the library mapped (it reads the offset)."""
    try:
        return "libclockskew.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def probe(prefix: list[str], env: dict[str, str]) -> float:
    """How far a Python started with `env` (under `prefix`: a node's namespace) finds the wall
    clock from this process's, in seconds."""
    code = "import time; print(time.time())"
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True,
        check=True, timeout=60,
    )  # fmt: skip
    return float(out.stdout.strip()) - time.time()

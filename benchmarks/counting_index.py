"""A package index the benchmarks run themselves: it serves the files it is given (PEP 503,
with PEP 658 metadata so `uv lock` downloads no wheel) and counts the bytes of files it served,
the figure a per-node sync and a ship are compared by."""

from __future__ import annotations

import hashlib
import re
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def project_name(filename: str) -> str:
    """The PEP 503 normalised project name of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        raw = filename.split("-")[0]
    else:
        raw = filename.removesuffix(".tar.gz").rsplit("-", 1)[0]
    return re.sub(r"[-_.]+", "-", raw).lower()


class CountingIndex:
    """A PEP 503 index of `files` (wheels and sdists) with PEP 658 metadata for the wheels (so
    `uv lock` downloads none), counting the file bytes it serves. `bind`: the address to serve
    on; the caller may make it in a network namespace (`netns.inside`)."""

    def __init__(self, files: list[Path], bind: str = "127.0.0.1") -> None:
        self.files = {f.name: f for f in files}
        self.projects: dict[str, list[Path]] = {}
        for f in files:
            self.projects.setdefault(project_name(f.name), []).append(f)
        self.hashes: dict[str, str] = {}
        self.served = 0
        self.lock = threading.Lock()
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = [p for p in self.path.split("/") if p]
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                    self.send_file(index.files[parts[1]])
                    return
                body = index.answer(parts)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def send_file(self, path: Path) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with path.open("rb") as f:
                    while block := f.read(1024 * 1024):
                        self.wfile.write(block)
                        with index.lock:
                            index.served += len(block)

        self.server = ThreadingHTTPServer((bind, 0), Handler)
        self.url = f"http://{bind}:{self.server.server_port}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sha256(self, path: Path) -> str:
        with self.lock:
            if path.name not in self.hashes:
                self.hashes[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self.hashes[path.name]

    def answer(self, parts: list[str]) -> bytes | None:
        if len(parts) == 2 and parts[0] == "simple" and parts[1] in self.projects:
            links = []
            for f in self.projects[parts[1]]:
                attrs = ""
                if f.name.endswith(".whl"):
                    meta = hashlib.sha256(wheel_metadata(f)).hexdigest()
                    attrs = f' data-dist-info-metadata="sha256={meta}" '
                    attrs += f'data-core-metadata="sha256={meta}"'
                links.append(
                    f'<a href="/files/{f.name}#sha256={self.sha256(f)}"{attrs}>{f.name}</a>'
                )
            return f"<html><body>{''.join(links)}</body></html>".encode()
        if len(parts) == 2 and parts[0] == "files" and parts[1].endswith(".whl.metadata"):
            wheel = self.files.get(parts[1].removesuffix(".metadata"))
            return wheel_metadata(wheel) if wheel else None
        return None

    def reset(self) -> None:
        with self.lock:
            self.served = 0


def wheel_metadata(wheel: Path) -> bytes:
    """The wheel's own METADATA file, as PEP 658 serves it."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name)

"""A venv layered on the image's torch (`from_image`) against the full one, on the
`torch` set: the build's seconds and the venv's size.

The image is an interpreter environment made for the run: the CPU torch wheel of the machine
(`--torch-wheel`, with its dependencies) and Ray and the plugin of the checkout's env (a `.pth`
naming its site-packages). `ray-uv check` builds the set's venv from that Python, as the
plugin on a node would; `--full` builds the full one too (the CUDA wheels: ~2.8 GB to download
where uv's cache lacks them).

    uv run python -m benchmarks.image_layer --torch-wheel /opt/wheels/torch-2.13.0+cpu-...whl \\
        --json benchmarks/results/image-layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ray_uv_plugin.env.uv import find_uv
from ray_uv_plugin.store.freezing import thaw

SET = Path(__file__).resolve().parent / "sets" / "torch"
CLI = "import sys; from ray_uv_plugin.ops.cli import main; sys.exit(main(sys.argv[1:]))"


def _image(root: Path, wheel: str) -> str:
    """The image's Python: the torch wheel and its dependencies, and the checkout's Ray."""
    base = root / "image"
    uv = find_uv()
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(base)], check=True)
    python = str(base / "bin" / "python")
    subprocess.run([uv, "pip", "install", "--quiet", "--python", python, wheel], check=True)
    site = next((base / "lib").glob("python*/site-packages"))
    checkout = next(p for p in sys.path if p.endswith("site-packages"))
    (site / "checkout_env.pth").write_text(f"import site; site.addsitedir({checkout!r})\n")
    return python


def _size(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def _build(python: str, venvs: Path, layered: bool) -> dict:
    args = ["check", "--project", str(SET), "--extra", "torch"]
    args += ["--from-image", "torch"] if layered else []
    env = {**os.environ, "RAY_UV_PLUGIN_VENV_DIR": str(venvs)}
    start = time.perf_counter()
    done = subprocess.run([python, "-c", CLI, *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: a Ray library the set lacks
        raise RuntimeError(done.stdout + done.stderr)
    venv = next(p for p in venvs.iterdir() if p.is_dir())
    return {
        "layered": layered,
        "seconds": round(seconds, 2),
        "bytes": _size(venv),
        "files": sum(len(files) for _, _, files in os.walk(venv)),
        "from_image": [
            line.strip() for line in done.stdout.splitlines() if "from the image" in line
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-wheel", required=True, help="the image's torch (a wheel file)")
    parser.add_argument("--full", action="store_true", help="build the full venv too")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="image-layer-") as tmp:
        root = Path(tmp)
        python = _image(root, args.torch_wheel)
        runs = []
        for layered in (True, False) if args.full else (True,):
            venvs = root / ("layered" if layered else "full")
            venvs.mkdir(mode=0o700)
            runs.append(_build(python, venvs, layered))
            print(json.dumps(runs[-1]))
        thaw(root)  # the venvs are read-only (and immutable, as root)
    if args.json:
        args.json.write_text(json.dumps({"set": "torch", "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

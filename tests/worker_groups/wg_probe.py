"""What a worker can see: its interpreter and which of the test distributions it can import."""

import importlib.util
import os
import sys


def probe() -> dict:
    return {
        "executable": sys.executable,
        "virtual_env": os.environ.get("RAY_UV_PLUGIN_VENV"),
        "importable": {
            m: importlib.util.find_spec(m) is not None for m in ("tabulate", "termcolor")
        },
        "rank": os.environ.get("RANK"),
        "master_port": os.environ.get("MASTER_PORT"),
        "gpu_ids": [str(g) for g in __import__("ray").get_gpu_ids()],
        "node_id": __import__("ray").get_runtime_context().get_node_id(),
    }

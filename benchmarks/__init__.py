"""Startup benchmarks: `ray-uv bench` or `uv run python -m benchmarks.startup`."""

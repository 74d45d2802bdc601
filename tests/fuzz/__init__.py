"""Fuzz targets for what comes from outside: one module per target (`TARGETS`), its saved
corpus under `corpus/<target>/`. tests/test_fuzz.py replays the corpus and runs a short
hypothesis run of each; `python -m benchmarks.fuzz` runs the long ones (docs/reliability.md)."""

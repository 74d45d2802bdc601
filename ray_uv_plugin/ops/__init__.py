"""What an operator runs: the `ray-uv` CLI, `prepare` and `--watch`, `check`, `demo`, `list`
and `gc` (over `store`'s inventory and gc), and the probe that runs inside a venv. May import
every other layer."""

"""What an operator runs: the `ray-uv` CLI, `prepare` and `--watch`, `check`, `demo`, `list`
(the inventory), `gc`, and the probe that runs inside a venv. May import every other layer."""

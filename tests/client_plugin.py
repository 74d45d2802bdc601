"""The `uv_project` plugin with the libraries hook that plugin.py is to call after a venv is found
or built (`libraries.check_libraries`), for tests only: tests/test_client.py registers it to show
a job-level uv_project over Ray Client failing at once, with the reason, when the env's Ray lacks
`ray[client]`. Once plugin.py makes the call itself, this subclass only repeats it."""

from __future__ import annotations

import logging

from ray_uv_plugin import UvProjectPlugin
from ray_uv_plugin.libraries import check_libraries

PLUGIN = {"class": "tests.client_plugin.CheckedUvProjectPlugin"}


class CheckedUvProjectPlugin(UvProjectPlugin):
    async def create(self, uri, runtime_env, context, logger: logging.Logger) -> float:
        result = await super().create(uri, runtime_env, context, logger)
        outcome = self._venvs[id(context)]
        try:
            check_libraries(outcome.key, outcome.path, logger)
        except Exception:
            self._venvs.pop(id(context), None)
            raise
        return result

"""A runtime_env plugin for tests only: `{"test_sleep": seconds}` makes a setup slow, as a slow
plugin of Ray's (its `uv` or `pip` field) would, before the `uv_project` plugin runs."""

from __future__ import annotations

import asyncio
import logging

from ray._private.runtime_env.plugin import RuntimeEnvPlugin

PLUGIN = {"class": "tests.support.sleep_plugin.SleepPlugin"}


class SleepPlugin(RuntimeEnvPlugin):
    name = "test_sleep"
    priority = 1  # before uv_project's 5

    async def create(self, uri, runtime_env, context, logger: logging.Logger) -> float:
        await asyncio.sleep(float(runtime_env[self.name]))
        return 0

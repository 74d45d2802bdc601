"""One simulated machine's plugin state for a raylet of `ray.cluster_utils.Cluster`: its own
venv dir and uv (a counting wrapper), as two machines have; uv's cache is the machine's, shared,
so only the syncs tell a build from a receive."""

from __future__ import annotations

from pathlib import Path

from tests.support.uvproject import CountingUv


class Raylet:
    def __init__(self, base: Path) -> None:
        self.venvs = base / "venvs"
        self.uv = CountingUv(base / "uv")

    def env(self) -> dict[str, str]:
        """The raylet's environment (`add_node(env_vars=...)`), which its plugin reads."""
        return {"RAY_UV_PLUGIN_VENV_DIR": str(self.venvs), "RAY_UV_PLUGIN_UV": str(self.uv.path)}

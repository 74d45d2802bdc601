"""`ray-uv demo`: a local Ray with the plugin, one actor per extra of `examples/demo_project`
(the checkout's, or the copy in the wheel).

What it shows: each actor runs in its own venv (its own `sys.executable`, only its extra's
package), the first run builds each venv once, a second run reuses them in milliseconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray_uv_plugin.cluster.auth import DEFAULT_TOKEN_FILE, MODE_ENV
from ray_uv_plugin.cluster.connect import init_unhooked
from ray_uv_plugin.cluster.prepare import EXCLUDES
from ray_uv_plugin.cluster.probe import EnvironmentReport
from ray_uv_plugin.schema import SCHEMAS_ENV, schemas_setting
from ray_uv_plugin.settings import PLUGINS_ENV, VENV_ENV, plugins_setting
from ray_uv_plugin.store.layout import MARKER

DEMO_EXTRAS = ("banner", "toml")
DEMO_PACKAGES = ("pyfiglet", "tomli-w", "ray")
# The wheel's copy of the checkout's examples/demo_project (pyproject's force-include); a
# checkout has none here, and the package never looks for the checkout around it.
PACKAGED = Path(__file__).resolve().parent / "demo_project"
# Where Ray logs that a local Ray turned token authentication on: in the middle of the demo's
# output, so the demo says it once, after its results (`token_note`).
RAY_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


class DemoError(RuntimeError):
    """The demo cannot run; the message says what to do."""


@dataclass(frozen=True)
class EnvResult:
    extra: str
    seconds: float  # from asking for the actor to its first answer
    built: bool
    report: EnvironmentReport
    output: str  # what the actor made with its extra's package

    @property
    def key(self) -> str:
        return str((self.report["marker"] or {}).get("key", "?"))


def find_demo_project(project: Path | None = None) -> Path:
    """`--project`, else `examples/demo_project` under the cwd, else the copy in the wheel."""
    candidates = [project] if project else [Path("examples/demo_project"), PACKAGED]
    for path in candidates:
        if path is not None and (path / "pyproject.toml").is_file():
            return path.resolve()
    raise DemoError(
        "cannot find examples/demo_project (the wheel has a copy; a source checkout has it at "
        "its root): run `uv run ray-uv demo` from the repository root, or pass --project DIR "
        f"with a uv project that has the extras {', '.join(DEMO_EXTRAS)}."
    )


def register_plugin(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """What `export $(ray-uv plugin-config --shell)` does, for the Ray this process starts."""
    environ[PLUGINS_ENV] = plugins_setting(environ.get(PLUGINS_ENV))
    environ[SCHEMAS_ENV] = schemas_setting(environ.get(SCHEMAS_ENV))
    # The demo driver's own venv is not what the actors need: each asks for its uv env.
    environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def token_note(mode_before: str | None) -> str | None:
    """What to say where the demo's local Ray turned token authentication on by itself (Ray's
    default since 2.59, with the token it wrote to ~/.ray/auth_token): a later `ray start` on
    this machine requires that token too."""
    if mode_before is not None or os.environ.get(MODE_ENV) != "token":
        return None
    return (
        f"Ray ran this local Ray with token authentication, its default ({DEFAULT_TOKEN_FILE} "
        "holds the token): a `ray start` on this machine now requires it too, and so does a "
        f"driver that connects to that Ray by address ({MODE_ENV}=token; README, Token "
        "authentication)."
    )


def run(
    project: Path,
    on_result: Callable[[EnvResult], None] = lambda r: None,
    timeout: float = 600.0,
) -> list[EnvResult]:
    """Start a local Ray, one actor per extra at once, and shut Ray down again."""
    register_plugin()
    import ray

    from ray_uv_plugin.cluster import probe
    from ray_uv_plugin.registration import UvProject

    token_setup = logging.getLogger(RAY_TOKEN_SETUP_LOGGER)
    level = token_setup.level
    token_setup.setLevel(logging.ERROR)
    try:
        init_unhooked(  # the actors ask for their envs: no `uv run` driver hook applies
            address="local",
            num_cpus=len(DEMO_EXTRAS),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="WARNING",
            runtime_env={"working_dir": str(project), "excludes": EXCLUDES},
        )
    finally:
        token_setup.setLevel(level)
    try:
        probe.pickle_by_value()
        probe_cls = ray.remote(num_cpus=1)(probe.Probe)
        start = time.perf_counter()
        pending = {}
        for extra in DEMO_EXTRAS:
            actor = probe_cls.options(
                runtime_env={"uv_project": UvProject(extras=[extra])}
            ).remote()
            pending[actor.report.remote(DEMO_PACKAGES, VENV_ENV, MARKER)] = (extra, actor)
        results = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                raise DemoError(f"the actors did not start within {timeout:.0f}s")
            took = time.perf_counter() - start
            extra, actor = pending.pop(ready[0])
            report = ray.get(ready[0])
            if extra == "banner":
                output = ray.get(actor.banner.remote("ray-uv"))
            else:
                output = ray.get(
                    actor.toml.remote({"env": {"extra": extra, "python": report["python"]}})
                )
            result = EnvResult(
                extra, took, probe.was_built_within(report, took + 1.0), report, output
            )
            results.append(result)
            on_result(result)
        return results
    finally:
        ray.shutdown()

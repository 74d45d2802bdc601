"""The Ray glue: the `uv_project` runtime_env plugin, over `env.key` and `building.ensure`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import urlparse

# The one import of Ray's plugin API that must work for Ray's agent to load the plugin at all;
# every other internal it uses is checked at load (`ray_compat`), and a Ray without one fails
# each setup with what is missing.
from ray._private.runtime_env.plugin import RuntimeEnvPlugin

from ray_uv_plugin.agent import ray_compat
from ray_uv_plugin.agent.ray_libraries import check_libraries
from ray_uv_plugin.agent.setup_error import Where, setup_error, setup_log
from ray_uv_plugin.building.ensure import Outcome, ensure_venv_async
from ray_uv_plugin.building.failed_builds import RememberedFailure
from ray_uv_plugin.env.key import make_request
from ray_uv_plugin.env.project import load_project, resolve_project_dir
from ray_uv_plugin.env.spec import (
    FIELD,
    check_siblings,
    is_uv_run_interpreter,
    parse_spec,
    yields_to,
)
from ray_uv_plugin.env.uv import UvSyncError, format_duration
from ray_uv_plugin.settings import VENV_ENV, NodeSettings
from ray_uv_plugin.store.holds import Hold
from ray_uv_plugin.store.layout import venv_root
from ray_uv_plugin.store.units import built_label

if TYPE_CHECKING:
    from ray._private.runtime_env.context import RuntimeEnvContext

default_logger = logging.getLogger(__name__)

# Emptied (uv reads an empty value as unset): pointing at the shared venv they would invite a
# worker's `uv pip install` or `uv run` to change it for every later job, and inherited from the
# raylet they would point at the node's own environment.
EMPTIED = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")
# Ray's working_dir plugin sets this process-wide around the other plugins' `create`: with
# several setups at once it may name another request's dir, so it is only a last resort.
WORKING_DIR_ENV = "RAY_RUNTIME_ENV_CREATE_WORKING_DIR"
# Failed requests remembered, to tell Ray's retries of one (1 s apart) from a new request.
FAILED_REQUESTS_KEPT = 256
# What `create` tells Ray's agent a URI of ours takes: more than its URI cache may keep
# (RAY_RUNTIME_ENV_UV_PROJECT_CACHE_SIZE_GB, 10 GiB by default), so that the agent "deletes" a
# URI as soon as no job or worker refers to it (`delete_uri`): the venv's hold goes then, and
# the venv itself stays for later jobs.
RELEASED_AT_ONCE = 1 << 62


def _runtime_env_dir() -> str | None:
    """The agent's `--runtime-env-dir`, under which Ray unpacks each working_dir URI."""
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--runtime-env-dir="):
            return arg.split("=", 1)[1]
        if arg == "--runtime-env-dir" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return None


def _runtime_env_uri(runtime_env: dict) -> str:
    """The URI by which Ray's agent counts the jobs and workers that refer to a runtime_env of
    ours: a digest of the whole runtime_env, so that two with one URI get one venv.

    Ray's agent counts a runtime_env as it came, and asks again while it sets it up: so the
    digest leaves out what the setup changes in it, the `uv run` interpreter that `create` takes
    out and the PYTHONPATH that Ray's working_dir plugin extends in place before this plugin
    runs (on every try). A job's PYTHONPATH never reaches uv (`uv_env.INTERPRETER_VARS`), so
    two runtime_envs that differ in it alone have one venv."""
    kept = dict(runtime_env)
    if is_uv_run_interpreter(str(kept.get("py_executable") or "")):
        del kept["py_executable"]
    env_vars = kept.get("env_vars")
    if isinstance(env_vars, dict) and "PYTHONPATH" in env_vars:
        kept["env_vars"] = {k: v for k, v in env_vars.items() if k != "PYTHONPATH"}
    text = json.dumps(kept, sort_keys=True, default=repr)
    return f"{FIELD}://{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _request_working_dir(runtime_env: dict) -> str | None:
    """This request's own working_dir on this node, from its URI."""
    uri = runtime_env.get("working_dir")
    if not uri:
        return None
    from ray._private.runtime_env.packaging import get_local_dir_from_uri

    if uri.startswith("local://"):  # a dir that exists on every node: `local:///abs/path`
        return urlparse(uri).path
    base = _runtime_env_dir()
    if base is None:
        return os.environ.get(WORKING_DIR_ENV)
    return str(get_local_dir_from_uri(uri, os.path.join(base, "working_dir_files")))


class UvProjectPlugin(RuntimeEnvPlugin):
    name = FIELD
    # Smaller runs earlier (Ray's own pip, uv, conda and py_executable plugins have 10): the
    # fields that conflict with uv_project are refused before any of them spends time, and the
    # `uv run ...` interpreter of Ray's `uv run` driver hook is taken out of the runtime_env
    # (see `create`) before Ray's py_executable plugin would set it.
    priority = 5
    # What the plugin uses of Ray's internals, checked when Ray's agent loads it.
    ray_internals: tuple[ray_compat.RayInternal, ...] = ray_compat.AGENT

    def __init__(self) -> None:
        self._venvs: dict[int, Outcome] = {}  # id(context) -> venv, from create to modify_context
        # The last failed setups' runtime_envs (held, so that no other object takes their id)
        # and the error each showed.
        self._failed: deque[tuple[dict, str]] = deque(maxlen=FAILED_REQUESTS_KEPT)
        # URI -> its venv (None: it yielded) and the venv's hold, from `create` until Ray's
        # agent no longer refers to the URI (`delete_uri`). While it does, the agent skips
        # `create` for the URI and calls `modify_context` alone.
        self._by_uri: dict[str, Outcome | None] = {}
        self._holds: dict[str, Hold] = {}
        # Never raised here: Ray's agent would fail to start, and the node with it. Each
        # setup fails instead, with the message, and the agent's log has it once.
        self._ray_changed = ray_compat.check(type(self).ray_internals)
        if self._ray_changed is not None:
            default_logger.error("%s", self._ray_changed)

    @staticmethod
    def validate(runtime_env_dict: dict) -> None:
        # Ray's agent formats what `validate` raises for the driver as it does for `create`,
        # traceback first: the same `setup_error` puts the cause on the line after `[Node <ip>]`.
        try:
            spec = parse_spec(runtime_env_dict[FIELD])
            if yields_to(spec, runtime_env_dict) is None:
                check_siblings(runtime_env_dict)
        except Exception as e:
            default_logger.error("uv_project: the runtime_env is refused", exc_info=e)
            raise setup_error(e, Where(None, None, None, None)) from None

    def get_uris(self, runtime_env: dict) -> list[str]:
        """One URI per runtime_env of ours. Ray's agent asks for it of every runtime_env, on
        every reference a job or worker takes or drops: it never raises."""
        try:
            if runtime_env.get(FIELD) is None:
                return []
            return [_runtime_env_uri(runtime_env)]
        except Exception:  # noqa: BLE001 - a runtime_env that `validate` then refuses
            return []

    async def create(
        self,
        uri: str | None,
        runtime_env: dict,
        context: RuntimeEnvContext,
        logger: logging.Logger = default_logger,
    ) -> float:
        try:
            outcome = await self._create(runtime_env, context, logger)
            if uri is not None:
                self._hold(uri, outcome, logger)
        except Exception as e:
            # Ray gives the driver this error's text: the cause first, paths as the user wrote
            # them (`setup_error`). The traceback goes to the setup log that it names.
            logger.error("uv_project: the setup failed", exc_info=e)
            # Ray's agent tries a failed request again on the same `runtime_env` object and shows
            # the driver the last try's error: for the user it is one try, so its first's.
            first = next((said for r, said in self._failed if r is runtime_env), None)
            shown = UvSyncError(first) if first and isinstance(e, RememberedFailure) else e
            self._failed.append((runtime_env, str(shown)))
            raise setup_error(shown, self._where(runtime_env, logger)) from None
        if outcome is not None:
            self._venvs[id(context)] = outcome
        return 0 if uri is None else RELEASED_AT_ONCE

    @staticmethod
    def _where(runtime_env: dict, logger: logging.Logger) -> Where:
        value = runtime_env.get(FIELD)
        project = value.get("project") if isinstance(value, dict) else None
        uri = runtime_env.get("working_dir")
        try:
            working_dir = _request_working_dir(runtime_env)
        except Exception:  # noqa: BLE001 - the error being reported says what is wrong
            working_dir = None
        return Where(
            project=project if isinstance(project, str) else None,
            working_dir=working_dir,
            working_dir_uri=uri if isinstance(uri, str) else None,
            setup_log=setup_log(logger),
        )

    async def _create(
        self, runtime_env: dict, context: RuntimeEnvContext, logger: logging.Logger
    ) -> Outcome | None:
        if self._ray_changed is not None:
            raise ray_compat.RayInternalsChanged(self._ray_changed)
        start = time.perf_counter()
        spec = parse_spec(runtime_env[FIELD])
        own_choice = yields_to(spec, runtime_env)
        if own_choice is not None:
            # The job's default env (a `uv run` driver's) under an actor that chose its own
            # interpreter or packages: Ray's own plugin for that field decides, as without us.
            logger.info(
                "uv_project: the job's default env yields to this runtime_env's %r", own_choice
            )
            return None
        if is_uv_run_interpreter(runtime_env.get("py_executable") or ""):
            # Ray's `uv run` hook's interpreter: ours replaces it. Ray sets up plugins one by one
            # on this object, so its py_executable plugin then has nothing to set.
            del runtime_env["py_executable"]
        working_dir = _request_working_dir(runtime_env)
        uploaded = spec.project is None and not str(runtime_env.get("working_dir")).startswith(
            "local://"
        )
        files = load_project(resolve_project_dir(spec, working_dir), uploaded=uploaded)
        node = NodeSettings.read()  # the node's settings, read once for this request
        root = venv_root(node)
        request = make_request(spec, files, runtime_env.get("env_vars") or {})
        outcome = await ensure_venv_async(request, root, logger, settings=node)
        verb = "built" if outcome.built else "reused"
        took = time.perf_counter() - start
        # A reused venv says how it came to be: built here, seeded, or shipped from a node.
        made = f" (made: {built_label(outcome.marker)})" if outcome.marker else ""
        logger.info(
            "uv_project %s: %s in %s -> %s%s",
            outcome.key,
            verb,
            format_duration(took),
            outcome.path,
            made,
        )
        # Ray libraries the node's Ray has and this env's lacks: a warning in this setup log;
        # a Ray Client server whose env lacks ray[client]: an error, at once.
        check_libraries(outcome.key, outcome.path, logger)
        return outcome

    def _hold(self, uri: str, outcome: Outcome | None, logger: logging.Logger) -> None:
        """Hold the venv handed to Ray for `uri` until Ray no longer refers to it: `gc` and
        the budget keep a held venv (`store.holds`)."""
        new = None
        if outcome is not None:
            try:
                new = Hold(outcome.venv.root, outcome.key)
            except OSError as e:
                # A venv dir this user may read but not write (a trusted group's), or a full
                # disk: the venv is usable, its hold unrecorded, as its last use then is.
                logger.warning(
                    "uv_project %s: cannot record that Ray holds this venv (%s): gc and the "
                    "venv dir's budget may remove it while this job's workers on the node are "
                    "all gone",
                    outcome.key,
                    e,
                )
        old = self._holds.pop(uri, None)
        if new is not None:
            self._holds[uri] = new
        self._by_uri[uri] = outcome
        if old is not None:
            old.release()

    def delete_uri(self, uri: str, logger: logging.Logger = default_logger) -> float:
        """Ray's agent: no job or worker refers to `uri` any more. Its venv stays for later
        jobs; its hold goes, so that `gc` and the budget may remove it once unused."""
        self._by_uri.pop(uri, None)
        hold = self._holds.pop(uri, None)
        if hold is not None:
            hold.release()
            logger.info("uv_project %s: released by Ray (%s)", hold.key, uri)
        return RELEASED_AT_ONCE

    def modify_context(
        self,
        uris: list[str],
        runtime_env: dict,
        context: RuntimeEnvContext,
        logger: logging.Logger = default_logger,
    ) -> None:
        outcome = self._venvs.pop(id(context), None)
        if outcome is None and uris:  # a URI Ray still holds: `create` was not called again
            outcome = self._by_uri.get(uris[0])
        if outcome is None:  # a job default that yielded (see `create`)
            return
        venv = outcome.path
        context.py_executable = str(venv / "bin" / "python")
        # Ray's context holds the runtime_env's own env_vars: a copy keeps the runtime_env as
        # Ray counted it (`runtime_env_uri`) for a later try of the same setup.
        context.env_vars = dict(context.env_vars)
        context.env_vars[VENV_ENV] = str(venv)
        context.env_vars.update(dict.fromkeys(EMPTIED, ""))
        # After the job's own PATH, if it set one, so that its tools stay reachable.
        context.env_vars["PATH"] = f"{venv / 'bin'}:{context.env_vars.get('PATH', '${PATH}')}"

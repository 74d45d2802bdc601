"""Every Ray internal the package uses, with the shape it relies on, checked at plugin load.

Ray's runtime_env plugin API is `ray._private` (a DeveloperAPI), with no promise between
releases, and pyproject.toml puts no cap on Ray, so that a new Ray installs beside the plugin on
its release day. What the plugin takes from Ray is therefore listed here, each piece with what
of it the plugin uses, and `UvProjectPlugin` checks `AGENT` when Ray's agent loads it. On a Ray
where one has moved or changed, every `uv_project` setup fails with `RayInternalsChanged`,
which names the Ray version and each piece, rather than a plugin that half works (Ray's own
`uv run` hook quietly taking over, a request reading another job's working_dir, a failed build
run three times). The checks are cheap: modules Ray's agent imports anyway, attributes,
signatures and two source lines; no subprocess.

`DRIVER` lists what drivers use of Ray's internals (the package's own drivers, the hook, the
check that a cluster loads the plugin); where one is missing they fall back or say so where
they use it. tests/agent/test_ray_compat.py checks both lists on every Ray CI runs: the oldest in
pyproject's range and the newest on the registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The oldest Ray CI tests (pyproject.toml's floor) and the one uv.lock pins, which the whole
# suite runs on: the message of a mismatch suggests it. tests/agent/test_ray_compat.py keeps
# both true.
OLDEST_RAY = "2.44.1"
LOCKED_RAY = "2.60.0"
# The first Ray whose placement groups take a label selector per bundle (every node carries
# `ray.io/node-id`): worker groups place by readiness from it, and on older Rays only gate.
LABEL_SELECTORS_SINCE = "2.50"


class RayInternalsChanged(RuntimeError):
    """This node's Ray lacks, or changed, a Ray internal the plugin uses."""


@dataclass(frozen=True)
class RayInternal:
    """One Ray internal: where it is (`module.attr.attr`), what of it the package uses (for the
    message), and a check of its shape that returns what is wrong, or None."""

    path: str
    uses: str
    check: Callable[[Any], str | None] = lambda obj: None
    since: str | None = None  # the Ray version that brought it: not looked for in older ones
    # A module that runs as a script (the agent's main): its file's text is checked, unimported.
    script: bool = False
    # Absent from some supported Rays, and its user does without it there: only its shape counts.
    optional: bool = False


def resolve(path: str) -> Any:
    """The object at `path`: the longest importable module prefix, then attributes. Raises
    LookupError saying which part is missing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[:i])} has no {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module {parts[0]!r}")


def _script_text(module: str) -> str:
    """The source of a module that must not be imported here (it changes sys.path and runs
    a process's start-up); raises LookupError if there is none."""
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        raise LookupError(f"no module {module!r}")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _parameters(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def _takes(*names: str, coroutine: bool = False) -> Callable[[Any], str | None]:
    """A check that a function's parameters start with `names` (in order)."""

    def check(func: Any) -> str | None:
        if not callable(func):
            return f"is a {type(func).__name__}, not a function"
        if coroutine and not inspect.iscoroutinefunction(func):
            return "is no longer a coroutine function (async def)"
        found = _parameters(func)
        if found[: len(names)] != list(names):
            return f"takes ({', '.join(found)}), not ({', '.join(names)}, ...)"
        return None

    return check


def _has_parameter(name: str) -> Callable[[Any], str | None]:
    """A check that a function takes a parameter `name` (anywhere in its signature)."""

    def check(func: Any) -> str | None:
        return None if name in _parameters(func) else f"has no parameter {name!r}"

    return check


def _equals(expected: object) -> Callable[[Any], str | None]:
    return lambda value: None if value == expected else f"is {value!r}, not {expected!r}"


def _is(kind: type) -> Callable[[Any], str | None]:
    return lambda value: None if isinstance(value, kind) else f"is a {type(value).__name__}"


def _source_says(text: str) -> Callable[[Any], str | None]:
    """A check that an object's source (a module's or a function's) still holds `text`, for
    what Ray keeps in code rather than in a name: where it unpacks working_dirs, its flags."""

    def check(obj: Any) -> str | None:
        try:
            source = obj if isinstance(obj, str) else inspect.getsource(obj)
        except (OSError, TypeError):
            return "has no source to check"
        return None if text in source else f"no longer has {text!r}"

    return check


def _plugin_base(cls: Any) -> str | None:
    if not inspect.isclass(cls):
        return "is not a class"
    for method, check in (
        ("validate", _takes("runtime_env_dict")),
        ("create", _takes("self", "uri", "runtime_env", "context", "logger", coroutine=True)),
        ("modify_context", _takes("self", "uris", "runtime_env", "context", "logger")),
        ("get_uris", _takes("self", "runtime_env")),
        ("delete_uri", _takes("self", "uri", "logger")),
    ):
        if not hasattr(cls, method):
            return f"has no {method}()"
        problem = check(getattr(cls, method))
        if problem is not None:
            return f"{method}() {problem}"
    return None


def _context(cls: Any) -> str | None:
    try:
        context = cls()
    except Exception as e:  # noqa: BLE001 - any failure is the message
        return f"cannot be made without arguments ({type(e).__name__}: {e})"
    for attr, kind in (("py_executable", str), ("env_vars", dict)):
        if not isinstance(getattr(context, attr, None), kind):
            return f"has no {attr} ({kind.__name__})"
    return None


_CONSTANTS = "ray._private.ray_constants"
_RUNTIME_ENV = "ray._private.runtime_env"

# What Ray's runtime-env agent gives the plugin, and what the plugin relies on there.
AGENT: tuple[RayInternal, ...] = (
    RayInternal(
        f"{_RUNTIME_ENV}.plugin.RuntimeEnvPlugin",
        "the plugin base class: validate(runtime_env_dict), async create(uri, runtime_env, "
        "context, logger), modify_context(uris, runtime_env, context, logger), "
        "get_uris(runtime_env), delete_uri(uri, logger)",
        _plugin_base,
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.plugin.RuntimeEnvPluginManager.create_uri_cache_for_plugin",
        "each plugin's URI cache, which deletes a URI through the plugin's delete_uri (where "
        "a venv's hold for a live job goes)",
        _source_says("URICache(plugin.delete_uri"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.uri_cache.URICache._evict_if_needed",
        "a URI cache deletes the URIs that no job or worker refers to while over its size "
        "(the plugin's URIs say they take more, so they go, and their holds, at once)",
        _source_says("self.get_total_size_bytes() > self.max_total_size_bytes"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.agent.runtime_env_agent.RuntimeEnvAgent.unused_uris_processor",
        "the agent marks a URI unused in its plugin's cache once no job or worker refers to it",
        _source_says("uri_cache.mark_unused(uri)"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.plugin.create_for_plugin_if_needed",
        "how the agent runs a plugin (validate, create, then modify_context on one context)",
        _takes("runtime_env", "plugin", "uri_cache", "context", "logger", coroutine=True),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.context.RuntimeEnvContext",
        "the worker's interpreter (py_executable) and environment (env_vars) set in modify_context",
        _context,
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.constants.RAY_RUNTIME_ENV_PLUGINS_ENV_VAR",
        "the variable that registers the plugin",
        _equals("RAY_RUNTIME_ENV_PLUGINS"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.packaging.get_local_dir_from_uri",
        "the dir a request's working_dir URI is unpacked to",
        _takes("uri", "base_directory"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.working_dir.WorkingDirPlugin.__init__",
        "working_dirs unpacked under <runtime-env-dir>/working_dir_files",
        _source_says('"working_dir_files"'),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.agent.main",
        "the agent's --runtime-env-dir flag, read from its command line",
        _source_says('"--runtime-env-dir"'),
        script=True,
    ),
    RayInternal(
        f"{_CONSTANTS}.RAY_RUNTIME_ENV_CREATE_WORKING_DIR_ENV_VAR",
        "the variable Ray's working_dir plugin sets around other plugins' create (a last "
        "resort for the request's working_dir)",
        _equals("RAY_RUNTIME_ENV_CREATE_WORKING_DIR"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.uv_runtime_env_hook.hook",
        "Ray's `uv run` driver hook, which the package's hook calls first: hook(runtime_env)",
        _takes("runtime_env"),
    ),
    RayInternal(
        f"{_CONSTANTS}.RAY_ENABLE_UV_RUN_RUNTIME_ENV",
        "the switch of Ray's `uv run` hook, which the setup turns off (else Ray's hook runs "
        "instead of the package's)",
        _is(bool),
        since="2.47",
    ),
    RayInternal(
        f"{_CONSTANTS}.RAY_RUNTIME_ENV_HOOK",
        "the variable that names a driver's runtime_env hook",
        _equals("RAY_RUNTIME_ENV_HOOK"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.agent.runtime_env_consts.BAD_RUNTIME_ENV_CACHE_TTL_SECONDS",
        "how long the agent's failure cache answers an identical failed runtime_env",
        _is(int),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.agent.runtime_env_consts.RUNTIME_ENV_RETRY_TIMES",
        "the agent's retries of a failed setup, which failed builds answer from memory",
        _is(int),
    ),
)

# What drivers use: the package's own drivers, the schema, worker groups, the plugin check.
DRIVER: tuple[RayInternal, ...] = (
    RayInternal(
        "ray._private.worker._post_init_hooks",
        "the callbacks ray.init runs once connected: the check that the cluster loads the plugin",
        _is(list),
    ),
    RayInternal(
        "ray._private.worker.init",
        "ray.init(_skip_env_hook=True) for the package's own drivers (prepare, demo)",
        _source_says("_skip_env_hook"),
    ),
    RayInternal(
        f"{_RUNTIME_ENV}.constants.RAY_RUNTIME_ENV_PLUGIN_SCHEMAS_ENV_VAR",
        "the variable that registers the field's JSON schema",
        _equals("RAY_RUNTIME_ENV_PLUGIN_SCHEMAS"),
    ),
    RayInternal(
        "ray._private.services.canonicalize_bootstrap_address",
        "the GCS address `ray.init(address='auto')` would connect to, which the package's "
        "drivers check before connecting",
        _takes("addr"),
    ),
    RayInternal(
        "ray._private.authentication.authentication_token_setup"
        ".maybe_enable_token_auth_if_token_available",
        "the token mode `ray.init` would connect in (Rays before token authentication lack it)",
        _takes("warn_if_disabled"),
        optional=True,
    ),
    RayInternal(
        f"{_CONSTANTS}.DEBUG_AUTOSCALING_STATUS",
        "the autoscaler's status key, which worker groups read to say why a group waits",
        _is(str),
    ),
    RayInternal(
        "ray.util.placement_group.placement_group",
        "placement_group(bundle_label_selector=[{'ray.io/node-id': 'in(...)'}]): worker groups "
        "place their bundles on the nodes whose env is ready",
        _has_parameter("bundle_label_selector"),
        since=LABEL_SELECTORS_SINCE,
    ),
)


def _older(version: str, than: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(than)
    except InvalidVersion:
        return False


def has_label_selectors(ray_version: str) -> bool:
    """Whether a Ray places bundles by label (`LABEL_SELECTORS_SINCE`); DRIVER checks that
    such a Ray still takes `bundle_label_selector`."""
    return not _older(ray_version, LABEL_SELECTORS_SINCE)


def problems(internals: Sequence[RayInternal], ray_version: str) -> list[str]:
    """What is missing or changed of `internals` in this Ray, one line each."""
    found = []
    for internal in internals:
        if internal.since is not None and _older(ray_version, internal.since):
            continue
        try:
            found_at = _script_text if internal.script else resolve
            problem = internal.check(found_at(internal.path))
        except (LookupError, OSError) as e:
            problem = None if internal.optional else f"is missing ({e})"
        if problem is not None:
            found.append(f"{internal.path} {problem}; the plugin uses it for {internal.uses}")
    return found


def _mismatch_message(found: Sequence[str], ray_version: str, plugin_version: str) -> str:
    lines = "\n".join(f"  - {line}" for line in found)
    return (
        f"uv_project: ray-uv-plugin {plugin_version} cannot run on this node's Ray "
        f"{ray_version}: Ray's internals that it uses (ray._private, which may change in any "
        f"release) changed:\n{lines}\n"
        f"It is tested with Ray {OLDEST_RAY} and later releases, up to the newest its CI "
        f"has run (its uv.lock: Ray {LOCKED_RAY}). Install a newer ray-uv-plugin on the nodes, "
        f"or a tested Ray (e.g. `uv pip install 'ray[default]=={LOCKED_RAY}'`) and restart them."
    )


def check(internals: Sequence[RayInternal] = AGENT) -> str | None:
    """The message of `RayInternalsChanged` for this process's Ray, or None if it has
    everything the plugin uses."""
    import ray

    found = problems(internals, ray.__version__)
    if not found:
        return None
    try:
        from importlib.metadata import version

        plugin_version = version("ray-uv-plugin")
    except Exception:  # noqa: BLE001 - a checkout without its metadata
        plugin_version = "(unknown version)"
    return _mismatch_message(found, ray.__version__, plugin_version)

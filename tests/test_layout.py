"""The package's layout is a contract: each folder says where its code runs, and lower layers
import nothing above them. Read from the source (ast), without importing it or starting Ray.

    settings       the settings and the names shared with Ray (`ray_uv_plugin.settings`):
                   imports nothing of the package; every layer may import it
    store          the venv dir every role reads: imports only store
    env            the requested env as a value (fields, spec, project, key, uv and its
                   environment), used by every role: store and env
    building       building a venv on a node (reuse or build, its steps, its record, seeding,
                   bytecode, failed builds): store, env and building
    agent          Ray's runtime-env agent, on every request: the above and agent
    ship           moving venvs between nodes: store, env, building and ship
    cluster        driving a running cluster (connect, prepare, watch, the probe): the above
    driver         the driver's process (the `uv run` hook): store, env, driver, registration
    ops            an operator's commands: anything but the public API's module
    worker_groups  the worker-group API: every layer but the CLI (`ops`) and the driver hook

The top modules are in the contract too, each by name: `schema` (the field's JSON schema, from
env's table), `registration` (does the driver's Ray load the plugin), `driver_hook` (the hook's
public name: driver's) and `api`, the package's `__init__` (the public API): it may import
anything, and nothing of the package imports it.

Besides, no product code imports the checkout's `benchmarks`, and none finds files through the
checkout (a `Path(__file__)` climbed out of its own package to reach `examples/` and the like):
a wheel has neither. No module-level imports run in a circle, in the package or the benchmarks.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout: tests may read it
PACKAGE = ROOT / "ray_uv_plugin"
PRODUCT = (PACKAGE, ROOT / "worker_groups")
LAYERS = ("store", "env", "building", "agent", "ship", "cluster", "driver", "ops")
TOP = ("registration", "schema", "driver_hook")  # the top modules but `settings` and `api`
ALLOWED = {
    "settings": set(),
    "store": {"settings", "store"},
    "env": {"settings", "store", "env"},
    "building": {"settings", "store", "env", "building"},
    "agent": {"settings", "store", "env", "building", "agent"},
    "ship": {"settings", "store", "env", "building", "ship"},
    "cluster": {"settings", "store", "env", "building", "ship", "cluster"},
    # the hook waits for the plugin's registration
    "driver": {"settings", "store", "env", "driver", "registration"},
    # ops may use the top modules (the schema, the registration's checks)
    "ops": {*LAYERS, "settings", *TOP},
    "worker_groups": {*LAYERS, "settings", *TOP, "worker_groups"} - {"ops", "driver_hook"},
    "schema": {"settings", "env"},
    # its token check before a driver connects is the cluster's
    "registration": {"settings", "store", "env", "cluster"},
    "driver_hook": {"driver"},
    "api": {*LAYERS, "settings", *TOP},
}


def modules(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def dotted(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module `node` imports from, where `package` is the importer's."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return base


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module `path` imports, at any depth (in functions and TYPE_CHECKING blocks too),
    as (line, dotted name); `from a import b` yields `a.b` too, where b may be a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = dotted(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def layer_of(name: str) -> str | None:
    """The layer (`store` ... `ops`) of a module of the package's folders; the module's name for
    a top module (`settings`, `registration`, `schema`, `driver_hook`; a name it defines too);
    `api` for the package's `__init__` and a name it exports; `worker_groups` for that package's;
    None outside both."""
    parts = name.split(".")
    if parts[0] == "worker_groups":
        return "worker_groups"
    if parts[0] != "ray_uv_plugin":
        return None
    if len(parts) > 1 and parts[1] in (*LAYERS, *TOP, "settings"):
        return parts[1]
    return "api"


def test_every_product_module_sits_in_a_layer_or_is_named_here() -> None:
    """A module added beside the layers is a choice to make here, not by default."""
    top = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "driver_hook.py", "registration.py", "schema.py", "settings.py"}
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file()


def folder(layer: str) -> list[Path]:
    if layer in ("settings", *TOP):
        return [PACKAGE / f"{layer}.py"]
    if layer == "api":
        return [PACKAGE / "__init__.py"]
    return modules(ROOT / "worker_groups" if layer == "worker_groups" else PACKAGE / layer)


@pytest.mark.parametrize("layer", ["settings", *LAYERS, "worker_groups", *TOP, "api"])
def test_lower_layers_import_nothing_above_them(layer: str) -> None:
    """Every module of a layer imports only what `ALLOWED` gives its layer; a name of the
    package's `__init__` (`from ray_uv_plugin import X`, X not a module) is the `api`, which
    no layer imports. (`ray_uv_plugin` itself, the base of every import of the package, is
    not an arrow.)"""
    wrong = []
    for path in folder(layer):
        for line, name in imports(path):
            target = layer_of(name)
            if target is None or name == "ray_uv_plugin" or target in ALLOWED[layer]:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({target})")
    assert not wrong, "\n".join(wrong)


def test_the_probe_imports_only_the_standard_library_at_module_level() -> None:
    """It runs in a job's venv, which need not hold ray_uv_plugin (Ray pickles it by value)."""
    tree = ast.parse((PACKAGE / "cluster" / "probe.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("ray_uv_plugin", "worker_groups", "ray")]


REVIEW_LINES = 500  # a hint for review, not a rule: a module holds one concept whatever its length


def too_long(paths: list[Path], limit: int = REVIEW_LINES) -> dict[Path, int]:
    """The modules of `paths` over `limit` lines, with their length."""
    lengths = {path: len(path.read_text().splitlines()) for path in paths}
    return {path: n for path, n in lengths.items() if n > limit}


def test_a_module_past_the_review_length_is_named_for_review() -> None:
    """A module past `REVIEW_LINES` is worth a look (does it hold two concepts?); it is not split
    by size alone, so this warns and never fails."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p, n in too_long(modules(*PRODUCT)).items()]
    if long:
        warnings.warn("does each hold one concept?\n" + "\n".join(long), stacklevel=1)


def test_the_length_hint_sees_a_long_module(tmp_path: Path) -> None:
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (REVIEW_LINES + 1))
    short.write_text("x = 1\n" * REVIEW_LINES)
    assert too_long([long, short]) == {long: REVIEW_LINES + 1}


def test_no_product_code_imports_the_benchmarks() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in modules(*PRODUCT)
        for line, name in imports(path)
        if name.split(".")[0] == "benchmarks"
    ]
    assert not wrong, "\n".join(wrong)


def loaded(path: Path, known: set[str], root: Path = ROOT) -> Iterator[str]:
    """The modules of `known` that importing `path` imports: its module-level imports (in `if`
    and `try` blocks too), not those in functions or under `TYPE_CHECKING`, which run later or
    never. `from a import b` is `a.b` where that is a module, else `a`."""
    name = dotted(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(nodes: list[ast.stmt]) -> Iterator[str]:
        for node in nodes:
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = imported_from(node, package)
                for alias in node.names:
                    yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from walk(node.orelse)
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef):
                for field in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    yield from walk(handler.body)

    yield from (n for n in walk(ast.parse(path.read_text()).body) if n in known and n != name)


def import_cycles(paths: list[Path], root: Path = ROOT) -> list[list[str]]:
    """Each circle of module-level imports among `paths`, as the modules along it."""
    names = {dotted(p, root): p for p in paths}
    graph = {n: sorted(set(loaded(p, set(names), root))) for n, p in names.items()}
    cycles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append([*path[path.index(name) :], name])
            return
        if name in done:
            return
        for target in graph[name]:
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return cycles


def test_no_import_circle_among_the_package_and_the_benchmarks() -> None:
    """A module imports only modules that can be imported before it; a circle works, or not,
    by the order in which its modules happen to be imported first."""
    cycles = import_cycles(modules(*PRODUCT, ROOT / "benchmarks"))
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_circle_check_sees_a_circle(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "b" / "driver.py").write_text("from b.after import main\n")
    (tmp_path / "b" / "after.py").write_text("from b import driver\n")
    (tmp_path / "b" / "lazy.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import quiet\n"
    )
    (tmp_path / "b" / "quiet.py").write_text("def f():\n    from b import lazy\n")
    found = import_cycles(sorted(tmp_path.rglob("*.py")), tmp_path)
    assert found == [["b.after", "b.driver", "b.after"]]


def _climbs(node: ast.AST) -> int | None:
    """How many directories an expression climbs from `__file__`: `Path(__file__)` with
    `.resolve()`, `.parent` and `.parents[n]` after it, or `os.path.dirname` around it;
    None if it does not start from `__file__`."""
    if isinstance(node, ast.Name) and node.id == "__file__":
        return 0
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "Path" and node.args:
            return _climbs(node.args[0])
        if isinstance(func, ast.Attribute) and func.attr in ("resolve", "absolute"):
            return _climbs(func.value)
        if isinstance(func, ast.Attribute) and func.attr in ("dirname", "realpath", "abspath"):
            inner = _climbs(node.args[0]) if node.args else None
            return None if inner is None else inner + (func.attr == "dirname")
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _climbs(node.value)
        return None if inner is None else inner + 1
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        if node.value.attr == "parents":
            inner = _climbs(node.value.value)
            index = node.slice
            if inner is not None and isinstance(index, ast.Constant):
                return inner + index.value + 1
            return None if inner is None else 99  # a computed index: assume the worst
    return None


def test_no_product_code_finds_files_through_the_checkout() -> None:
    """Paths from `__file__` stay within the module's own top-level package: the package data
    it ships (schemas/, hook_path/, uv_config/), never the checkout around it."""
    wrong = []
    for path in modules(*PRODUCT):
        depth = len(path.relative_to(ROOT).parts) - 1  # climbs to the checkout's root
        for node in ast.walk(ast.parse(path.read_text())):
            climbs = _climbs(node)
            if climbs is not None and climbs > depth:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} climbs {climbs} dirs")
    assert not wrong, "\n".join(wrong)


def test_the_climb_check_sees_what_it_looks_for() -> None:
    """The checks above pass on the package; here they must fail on what they forbid."""

    def climbs(code: str) -> int | None:
        return _climbs(ast.parse(code, mode="eval").body)

    assert climbs("Path(__file__).resolve().parents[1]") == 2
    assert climbs("Path(__file__).parent.parent / 'x'") is None  # the `/` is outside the chain
    assert climbs("Path(__file__).parent.parent") == 2
    assert climbs("os.path.dirname(os.path.dirname(__file__))") == 2
    assert climbs("Path(x).parent") is None
    path = ROOT / "tests" / "test_layout.py"
    assert ("tests.test_layout" == dotted(path)) and layer_of("ray_uv_plugin.ops.cli") == "ops"
    assert layer_of("ray_uv_plugin.driver_hook") == "driver_hook" and layer_of("ray") is None
    assert layer_of("ray_uv_plugin.UvProject") == "api"
    assert layer_of("ray_uv_plugin.cluster.prepare") == "cluster"
    assert layer_of("worker_groups.group") == "worker_groups"


@pytest.mark.parametrize(
    ("literal", "name", "module"),
    [
        ('"RAY_UV_PLUGIN_VENV"', "VENV_ENV", "ray_uv_plugin/settings.py"),
        ('".ray-uv-ready"', "MARKER", "ray_uv_plugin/store/layout.py"),
        ("16", "KEY_LENGTH", "ray_uv_plugin/store/layout.py"),
    ],
)
def test_store_constants_are_defined_once(literal: str, name: str, module: str) -> None:
    """The venv variable lives in `settings`, the marker's name and the key's length in
    `store.layout`; other modules import them (the probe takes them as arguments)."""
    where = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in modules(*PRODUCT)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    ]
    assert [w.rsplit(":", 1)[0] for w in where] == [module], where
    assert f"{name} = {literal}" in (ROOT / module).read_text()
    if literal.startswith('"'):
        copies = [
            str(p.relative_to(ROOT))
            for p in modules(*PRODUCT)
            if literal in p.read_text()
            and p.relative_to(ROOT).as_posix() != module
            and p.name != "_initializer.py"
        ]
        assert not copies


def _string_constants(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_every_plugin_variable_is_a_setting_defined_once() -> None:
    """Every `RAY_UV_PLUGIN_*` name the product mentions (in code, messages or docs) is one that
    `settings` defines, and only there is it written as a value of its own; the
    initializer's copy of the venv variable is checked against it below."""
    import re

    from ray_uv_plugin import settings

    defined = {
        value
        for name, value in vars(settings).items()
        if name.isupper() and isinstance(value, str) and value.startswith("RAY_UV_PLUGIN_")
    }
    assert set(settings.VARIABLES.values()) <= defined
    undefined, copies = [], []
    for path in modules(*PRODUCT):
        where = path.relative_to(ROOT)
        for name in set(re.findall(r"RAY_UV_PLUGIN_[A-Z0-9_]*[A-Z0-9]", path.read_text())):
            if name not in defined:
                undefined.append(f"{where}: {name}")
        if path.name in ("settings.py", "_initializer.py"):
            continue
        copies += [f"{where}:{n} {v}" for n, v in _string_constants(path) if v in defined]
    assert not undefined, undefined
    assert not copies, copies


def test_the_initializers_copy_of_the_venv_variable_agrees() -> None:
    """worker_groups' initializer runs where ray_uv_plugin may not be installed, so it writes
    the name out; it must be the plugin's. Read from the source: importing it imports Ray."""
    from ray_uv_plugin.settings import VENV_ENV

    tree = ast.parse((ROOT / "worker_groups" / "_initializer.py").read_text())
    (value,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PLUGIN_VENV_ENV"]
        and isinstance(node.value, ast.Constant)
    ]
    assert value == VENV_ENV


def test_the_initializers_copy_of_the_own_choice_fields_agrees() -> None:
    """The fields with which a worker chose its own Python are `settings.OWN_CHOICE_FIELDS`; the
    initializer, which runs where ray_uv_plugin may not be installed, writes them out."""
    from ray_uv_plugin.env.spec import FIELD
    from ray_uv_plugin.settings import OWN_CHOICE_FIELDS

    tree = ast.parse((ROOT / "worker_groups" / "_initializer.py").read_text())
    (value,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PLUGIN_FIELDS"]
    ]
    assert value == (FIELD, *OWN_CHOICE_FIELDS)


def test_the_tests_mirror_the_modules() -> None:
    """tests/<layer>/ holds the tests of ray_uv_plugin/<layer>/, tests/worker_groups/ and
    tests/benchmarks/ those of the packages of the same name, tests/support/ the helpers they
    share (no tests), tests/fuzz/ the fuzz targets and their corpus; at the top only the tests
    of the package's top modules and of the checkout as a whole (its layout, docs, packaging)."""
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    mirrored = {*LAYERS, "worker_groups", "benchmarks"}
    assert folders - mirrored == {"support", "fuzz", "data"}, folders
    for layer in LAYERS:
        assert (PACKAGE / layer).is_dir() and (tests / layer / "__init__.py").is_file(), layer
    assert not list((tests / "support").glob("test_*.py"))
    top = {p.name for p in tests.glob("test_*.py")}
    assert top == {
        "test_layout.py",  # the checkout's layout
        "test_docs.py",  # the README and docs/
        "test_packaging.py",  # the wheel
        "test_fuzz.py",  # the fuzz targets of tests/fuzz/, over every layer
        "test_wording.py",  # words across the code and docs
        "test_registration.py",  # ray_uv_plugin/registration.py
        "test_schema.py",  # ray_uv_plugin/schema.py
        "test_settings.py",  # ray_uv_plugin/settings.py
        "test_exports.py",  # ray_uv_plugin/__init__.py
        "test_driver_group.py",  # the README's driver dependency group, end to end
    }, top


def test_pytest_collects_every_test_folder(pytestconfig: pytest.Config) -> None:
    """A folder pytest skips by default (`build`, `dist`, `venv`...) would drop its tests without
    a word: no test folder, and so no layer, may be named like one."""
    import fnmatch

    skipped = pytestconfig.getini("norecursedirs")
    folders = [p.name for p in (ROOT / "tests").iterdir() if p.is_dir()]
    assert [f for f in folders for pattern in skipped if fnmatch.fnmatch(f, pattern)] == []
    assert "build" in skipped  # what the check looks for is there to see

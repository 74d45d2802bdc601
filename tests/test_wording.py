"""The word "shipped" has one meaning: a venv that came over the link from another
node (`ship/`). Ray pickling a module is "by value", the schema is "packaged", a project that
Ray takes to the nodes as a working_dir is "uploaded". Read from the code, the docs and the
CLI's help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# "shipped" (or "ship") in one of the other senses.
OTHER_SENSES = re.compile(
    r"ship(ped|s)?[ _](it to Ray )?by[ _]value"  # Ray's pickling of a module
    r"|shipped (in|with) the (package|plugin)"  # package data
    r"|shipped (to (the nodes|this node) )?as (the job's )?`?working_dir"  # Ray's upload
    r"|Ray shipped|shipped (working_dir|project)"
    r"|ship (the (new )?lock|`uv\.lock`|it with the project)",  # the user's files
    re.IGNORECASE,
)


def texts() -> dict[str, str]:
    paths = [
        *(ROOT / "ray_uv_plugin").rglob("*.py"),
        *(ROOT / "worker_groups").rglob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
    found = {str(p.relative_to(ROOT)): p.read_text() for p in paths}
    for command in (["--help"], ["prepare", "--help"], ["check", "--help"], ["list", "--help"]):
        help_text = subprocess.run(
            [sys.executable, "-m", "ray_uv_plugin.ops.cli", *command],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        ).stdout
        found[f"ray-uv {' '.join(command)}"] = help_text
    return found


def test_the_check_finds_the_other_senses() -> None:
    for phrase in (
        "this module is shipped by value",
        "(`ship_by_value`)",
        "the builder ships it to Ray by value",
        "the JSON schema, shipped in the package",
        "an empty config shipped with the plugin",
        "shipped to the nodes as working_dir",
        "the working_dir Ray shipped to this node",
        "a shipped working_dir, unpacked per Ray session",
        "run `uv lock` in the project and ship the new lock",
        "ship it with the project or make it a path every node sees",
    ):
        assert OTHER_SENSES.search(phrase), phrase
    for phrase in ("the venv is shipped to the other nodes", "1 built, 3 shipped, 0 reused"):
        assert not OTHER_SENSES.search(phrase), phrase


def test_shipped_means_a_venv_from_another_node_only() -> None:
    found = {
        where: [m.group(0) for m in OTHER_SENSES.finditer(text)] for where, text in texts().items()
    }
    assert {where: hits for where, hits in found.items() if hits} == {}
    assert any("shipped" in text for text in texts().values())  # the word itself stays

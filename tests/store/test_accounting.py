"""Ready means accounted for: each file of a venv is listed by a RECORD of a
distribution of the lock, bytecode its build compiled, uv's scaffolding, or the plugin's own.
Pure logic on small trees made here; the builds and receives that use it: test_seeding.py,
test_venv_manifest.py."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import marshal
import os
import sys
from pathlib import Path

import pytest

from ray_uv_plugin.store import accounting, manifest

SITE = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
TAG = sys.implementation.cache_tag


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _pyc(source: Path, flags: int = 0, body: bytes | None = None) -> bytes:
    """A `.pyc` for `source`: timestamp (flags 0), or hash-based (1: unchecked, 3: checked)."""
    data = source.read_bytes()
    if flags == 0:
        st = source.stat()
        tail = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (
            st.st_size & 0xFFFFFFFF
        ).to_bytes(4, "little")
    else:
        tail = importlib.util.source_hash(data)
    code = body if body is not None else marshal.dumps(compile(data, str(source), "exec"))
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + tail + code


def make_venv(root: Path) -> Path:
    """A venv as uv makes one: scaffolding, one distribution `six` with a console script, its
    RECORD listing what it installed (one file without a hash, as uv lists a wheel's unlisted
    ones), and a `.pyc` compiled from its module."""
    venv = root / "0123456789abcdef"
    site = venv / SITE
    (site / "six-1.17.0.dist-info").mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55")
    (venv / "bin" / "activate").write_text("# activate\n")
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "lib64").symlink_to("lib")
    six = b"X = 1\n"
    script = b"#!/venv/bin/python\nimport six\n"
    (site / "six.py").write_bytes(six)
    (venv / "bin" / "six-tool").write_bytes(script)
    (site / "six-1.17.0.dist-info" / "METADATA").write_text("Name: six\nVersion: 1.17.0\n")
    (site / "six-1.17.0.dist-info" / "extra.txt").write_text("unhashed")
    (site / "six-1.17.0.dist-info" / "RECORD").write_text(
        f"six.py,{_hash(six)},{len(six)}\n"
        f"../../../bin/six-tool,{_hash(script)},{len(script)}\n"
        f"six-1.17.0.dist-info/METADATA,"
        f"{_hash((site / 'six-1.17.0.dist-info' / 'METADATA').read_bytes())},27\n"
        "six-1.17.0.dist-info/extra.txt,,8\n"
        "six-1.17.0.dist-info/RECORD,,\n"
        "../../../../../etc/outside,sha256=AAAA,1\n"
    )
    (site / "__pycache__").mkdir()
    (site / "__pycache__" / f"six.{TAG}.pyc").write_bytes(_pyc(site / "six.py"))
    return venv


LOCK = b"""
version = 1
[[package]]
name = "six"
version = "1.17.0"
[[package]]
name = "proj"
source = { editable = "." }
"""

COMPILED = frozenset({f"{SITE}/__pycache__/six.{TAG}.pyc"})


def check(venv: Path, compiled: frozenset[str] | None = COMPILED) -> accounting.Accounting:
    files = manifest.scan(venv)
    locked = accounting.locked_distributions(LOCK)
    foreign = accounting.foreign_distributions(venv, locked)
    return accounting.account(venv, files, accounting.read_records(venv), compiled, foreign)


def test_a_venv_as_uv_makes_it_is_accounted_for_at_a_build_and_a_receive(tmp_path) -> None:
    venv = make_venv(tmp_path)
    assert check(venv) == accounting.Accounting([], [])
    assert check(venv, compiled=None) == accounting.Accounting([], [])  # by its header


def test_records_name_paths_in_the_venv_and_leave_out_what_is_outside_it(tmp_path) -> None:
    venv = make_venv(tmp_path)
    recorded = accounting.read_records(venv)
    assert recorded.hashes["bin/six-tool"] is not None  # `../../../bin/...` of site-packages
    assert recorded.hashes[f"{SITE}/six-1.17.0.dist-info/extra.txt"] is None
    assert not [p for p in recorded.hashes if "etc/outside" in p or p.startswith("..")]
    assert recorded.owners[f"{SITE}/six.py"] == "six-1.17.0.dist-info"


@pytest.mark.parametrize(
    "plant",
    [
        "stray.txt",  # any file no RECORD lists
        f"{SITE}/__pycache__/six.{TAG}.opt-1.pyc",  # bytecode at a level the build never made
        f"{SITE}/__pycache__/other.{TAG}.pyc",  # bytecode of a source no RECORD lists
        f"{SITE}/evil.pth",
        "bin/activate-evil",
    ],
)
def test_a_file_that_is_none_of_the_four_is_unaccounted_and_named(tmp_path, plant) -> None:
    venv = make_venv(tmp_path)
    (venv / plant).write_bytes(b"planted")
    assert check(venv).unaccounted == [plant]
    assert check(venv, compiled=None).unaccounted == [plant]
    note = accounting.unaccounted_note(check(venv))
    assert note.startswith("1 files that no distribution of the lock installed") and plant in note


def test_bytecode_the_build_did_not_compile_is_unaccounted_though_its_header_matches(
    tmp_path,
) -> None:
    """At a build, only what its compile step wrote or its seed gave: a `.pyc` written by
    anything else (a `.pth` file run by uv's bytecode step) is not its, header or not."""
    venv = make_venv(tmp_path)
    assert check(venv, compiled=frozenset()).unaccounted == [f"{SITE}/__pycache__/six.{TAG}.pyc"]


def test_a_received_pyc_counts_only_with_the_header_of_its_source(tmp_path) -> None:
    venv = make_venv(tmp_path)
    source = venv / SITE / "six.py"
    pyc = venv / SITE / "__pycache__" / f"six.{TAG}.pyc"
    for flags, body, accepted in [
        (3, None, True),  # checked hash-based, as SOURCE_DATE_EPOCH makes
        (1, marshal.dumps(compile("PLANTED = 1", "x", "exec")), False),  # unchecked: never
        (0, b"", True),  # the header is what counts: the build's compile step made the body
    ]:
        pyc.write_bytes(_pyc(source, flags, body))
        assert (check(venv, compiled=None).unaccounted == []) is accepted, flags
    pyc.write_bytes(_pyc(source))
    os.utime(source, (1, 1))  # the source changed since: a stale header
    assert check(venv, compiled=None).unaccounted == [f"{SITE}/__pycache__/six.{TAG}.pyc"]
    assert accounting.header_matches(str(pyc), str(source)) is False
    assert accounting.header_matches(str(venv / "missing.pyc"), str(source)) is False


def test_a_distribution_of_no_package_of_the_lock_accounts_for_nothing(tmp_path) -> None:
    venv = make_venv(tmp_path)
    info = venv / SITE / "evil-1.0.dist-info"
    info.mkdir()
    (venv / SITE / "evil.py").write_bytes(b"E = 1\n")
    (info / "RECORD").write_text(
        f"evil.py,{_hash(b'E = 1' + bytes([10]))},6\nevil-1.0.dist-info/RECORD,,\n"
    )
    assert accounting.foreign_distributions(venv, accounting.locked_distributions(LOCK)) == [
        "evil-1.0.dist-info"
    ]
    assert check(venv).unaccounted == [f"{SITE}/evil-1.0.dist-info/RECORD", f"{SITE}/evil.py"]
    # Another version of a locked package is no package of the lock either.
    os.rename(venv / SITE / "six-1.17.0.dist-info", venv / SITE / "six-1.16.0.dist-info")
    assert "six-1.16.0.dist-info" in accounting.foreign_distributions(
        venv, accounting.locked_distributions(LOCK)
    )


def test_a_locked_package_with_a_dynamic_version_matches_any(tmp_path) -> None:
    locked = accounting.locked_distributions(LOCK)
    assert locked["six"] == frozenset({"1.17.0"}) and locked["proj"] is None
    venv = make_venv(tmp_path)
    (venv / SITE / "proj-0.3.dev1.dist-info").mkdir()
    assert accounting.foreign_distributions(venv, locked) == []


def test_a_file_listed_with_another_hash_or_missing_is_not_as_recorded(tmp_path) -> None:
    """What fails a build (`building.record`: most likely a file changed in uv's cache)."""
    venv = make_venv(tmp_path)
    (venv / SITE / "six.py").write_bytes(b"X = 2\n")
    (venv / "bin" / "six-tool").unlink()
    assert check(venv, COMPILED).not_as_recorded == [
        "bin/six-tool (six-1.17.0.dist-info)",
        f"{SITE}/six.py (six-1.17.0.dist-info)",
    ]


def test_a_wheels_pyc_that_the_build_compiled_again_is_the_builds(tmp_path) -> None:
    """A wheel may install a `.pyc` (listed in its RECORD) that the build's compile step writes
    again from its source: the build's, not a file changed in uv's cache. Only where the build
    wrote it and its header is its source's."""
    venv = make_venv(tmp_path)
    pyc = f"{SITE}/__pycache__/six.{TAG}.pyc"
    shipped = _pyc(venv / SITE / "six.py", 1, marshal.dumps(compile("PLANTED = 1", "x", "exec")))
    record = venv / SITE / "six-1.17.0.dist-info" / "RECORD"
    with open(record, "a") as f:
        f.write(f"__pycache__/six.{TAG}.pyc,{_hash(shipped)},{len(shipped)}\n")
    assert check(venv) == accounting.Accounting([], [])  # compiled again: a timestamp header
    assert check(venv, compiled=frozenset()).not_as_recorded == [f"{pyc} (six-1.17.0.dist-info)"]
    os.utime(venv / SITE / "six.py", (1, 1))  # no longer its source's header
    heads: dict[str, bytes] = {}  # as the build's manifest pass reads them
    files = manifest.scan(venv, heads=heads)
    checked = accounting.account(venv, files, accounting.read_records(venv), COMPILED, (), heads)
    assert checked.not_as_recorded == [f"{pyc} (six-1.17.0.dist-info)"]


@pytest.mark.parametrize(
    ("path", "source"),
    [
        (f"a/__pycache__/m.{TAG}.pyc", "a/m.py"),
        (f"a/b/__pycache__/m.{TAG}.opt-2.pyc", "a/b/m.py"),
        (f"__pycache__/m.{TAG}.pyc", "m.py"),
        ("a/__pycache__/m.cpython-27.pyc", None),  # another interpreter's: none of this one's
        (f"a/m.{TAG}.pyc", None),  # not in a __pycache__
        ("a/m.py", None),
    ],
)
def test_bytecode_names_its_source(path, source) -> None:
    assert accounting.bytecode_source(path) == source


def test_bytecode_the_build_compiled_counts_only_with_its_sources_header(tmp_path) -> None:
    """The headers the manifest pass read (`manifest.scan`'s `heads`) are checked: a `.pyc` of
    the compile step's list whose source changed since, or that is no timestamp or checked
    one, is not the build's."""
    venv = make_venv(tmp_path)
    pyc = f"{SITE}/__pycache__/six.{TAG}.pyc"
    heads: dict[str, bytes] = {}
    files = manifest.scan(venv, heads=heads)
    assert list(heads) == [pyc] and heads[pyc] == (venv / pyc).read_bytes()[:16]
    recorded = accounting.read_records(venv)
    assert accounting.account(venv, files, recorded, COMPILED, (), heads).unaccounted == []
    os.utime(venv / SITE / "six.py", (1, 1))
    assert accounting.account(venv, files, recorded, COMPILED, (), heads).unaccounted == [pyc]
    unchecked = _pyc(venv / SITE / "six.py", flags=1)[:16]
    assert accounting.account(venv, files, recorded, COMPILED, (), {pyc: unchecked}).unaccounted


def test_a_receiver_judges_a_pyc_by_the_header_it_wrote(tmp_path) -> None:
    """The headers `unpack` kept as it wrote each `.pyc` stand for a read of the file."""
    venv = make_venv(tmp_path)
    files, recorded = manifest.scan(venv), accounting.read_records(venv)
    pyc = f"{SITE}/__pycache__/six.{TAG}.pyc"
    good = (venv / pyc).read_bytes()[:16]
    assert accounting.account(venv, files, recorded, None, (), {pyc: good}).unaccounted == []
    bad = _pyc(venv / SITE / "six.py", flags=1)[:16]
    assert accounting.account(venv, files, recorded, None, (), {pyc: bad}).unaccounted == [pyc]

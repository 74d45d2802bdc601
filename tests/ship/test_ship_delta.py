"""Shipping sends the difference (`ship.delta`): a receiver with a ready venv near the shipped
one takes the unchanged files from it, and the result is the venv a full ship gives.

The stream tests build two real venvs (ray, six and tomli-w; B has another six) under one venv
dir, ship A whole to a second venv dir (the receiver's seed), then B to it seeded and B whole
to a third dir, without Ray; they compare the trees. The cluster test does the same through
`prepare_nodes` on two raylets (`tests.ship.test_ship`'s fixture)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from ray_uv_plugin.building.ensure import ensure_venv
from ray_uv_plugin.cluster.options import PrepareOptions
from ray_uv_plugin.cluster.prepare import prepare_nodes
from ray_uv_plugin.env.project import load_project
from ray_uv_plugin.env.spec import parse_spec
from ray_uv_plugin.ship import delta
from ray_uv_plugin.ship.archive import ArchiveError, Packer
from ray_uv_plugin.ship.install import install_received
from ray_uv_plugin.ship.messages import Offer, OfferAnswer
from ray_uv_plugin.ship.unpack import Unpacker
from ray_uv_plugin.store import freezing, manifest
from ray_uv_plugin.store.build_lock import BuildLock
from ray_uv_plugin.store.layout import Venv
from ray_uv_plugin.store.units import built_label
from tests.ship.test_ship import live_nodes, run_on, two_nodes  # noqa: F401 - the cluster fixture
from tests.support.uvproject import write_project

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Ready venvs A and B on the sending side, differing in one pure-Python package."""
    base = tmp_path_factory.mktemp("delta")
    venvs = []
    for name, six in (("a", "six==1.16.0"), ("b", "six==1.17.0")):
        project = write_project(base / name, [six, "tomli-w==1.0.0"], name=f"delta{name}")
        spec = parse_spec({"project": str(project)})
        venvs.append(ensure_venv(spec, load_project(project), root=base / "sender").path)
    return venvs[0], venvs[1]


def ship_stream(venv: Path, root: Path, seeded: bool = False) -> tuple[Packer, delta.Staged | None]:
    """Ship `venv` to the venv dir `root` as the actors do (offer, answer, stream, install),
    without Ray; with `seeded`, the receiver stages what it can from its nearest venv."""
    root.mkdir(mode=0o700, exist_ok=True)
    key = venv.name
    lock = BuildLock(Venv(root, key).lock)  # as a receiver holds it (and a seed's is there)
    assert lock.try_acquire()
    packer = Packer(venv, 4 * MiB)
    unpacker = Unpacker(root, key, "test", sender_venv=str(venv))
    try:
        source = Offer(
            key,
            str(venv),
            "test",
            {},
            "",
            files=tuple(delta.offered_files(packer.built)),
            distributions=tuple(delta.distributions(venv)),
        )
        if seeded:
            unpacker.staged = delta.stage(root, unpacker.tmp, key, source)
        packer.refer = frozenset(delta.take_answer(unpacker.staged).have)
        chunk = packer.next_chunk()
        count = 0
        while True:
            unpacker.add(chunk.index, chunk.sha256, chunk.data)
            count += 1
            if chunk.last:
                break
            chunk = packer.next_chunk()
        tree = unpacker.finish(count, packer.total, packer.whole_sha256)
        meta = {
            **Venv.at(venv).read_marker(),
            "venv": str(venv),
            "built": delta.built("test", packer.total, unpacker.staged),
        }
        install_received(root, key, tree, meta)
    except BaseException:
        unpacker.abort()
        raise
    finally:
        lock.release()
    return packer, unpacker.staged


def ready(venv: Path) -> bool:
    """A ready venv: marked with its key, and what is there is what its manifest lists (`tree`
    checks the latter)."""
    marker = Venv.at(venv).read_marker()
    return bool(marker) and marker.get("key") == venv.name and "not_whole" not in marker


def tree(venv: Path) -> dict[str, tuple]:
    """Every entry of a venv as its manifest lists it, with a file's mtime (a `.pyc` checks
    its source's) but for the scripts that relocation rewrote when it was installed: what two
    venvs at one path must share to be the same."""
    marker = Venv.at(venv).read_marker()
    files = manifest.load(venv, marker["manifest"])
    assert manifest.scan(venv) == files  # what is there is what the manifest says
    return {
        path: (*entry, mtime(venv, path) if entry.kind == "file" else 0)
        for path, entry in files.items()
    }


def mtime(venv: Path, path: str) -> int:
    relocated = path.startswith("bin/") and str(venv).encode() in (venv / path).read_bytes()
    return 0 if relocated else int(os.lstat(venv / path).st_mtime)


def full_ship_tree(venv: Path, root: Path) -> tuple[Packer, dict[str, tuple]]:
    """The tree a full ship of `venv` to `root` gives, in place of the one there."""
    freezing.remove_tree(root / venv.name)
    packer, _ = ship_stream(venv, root)
    return packer, tree(root / venv.name)


def flip_byte(path: Path, offset: int) -> None:
    """Damage a read-only file of a ready venv in place: one byte inverted, its mode kept."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    os.chmod(path, mode | stat.S_IWUSR)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, mode)


def test_a_seeded_ship_sends_the_difference_and_gives_the_full_ships_venv(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = pair
    receiver = tmp_path / "receiver"
    whole_a, staged = ship_stream(a, receiver, seeded=True)
    assert staged is None  # nothing there yet: a full stream, as without seeding
    assert "seed" not in Venv.at(receiver / a.name).read_marker()["built"]
    seeded, staged = ship_stream(b, receiver, seeded=True)
    got, built = tree(receiver / b.name), Venv.at(receiver / b.name).read_marker()["built"]
    assert ready(receiver / b.name)
    assert not list(receiver.glob("*.ship-*")) and not list(receiver.rglob(delta.SEED_DIR))
    full, expected = full_ship_tree(b, receiver)
    # Only what differs went: six's new version and the scripts that name their venv.
    assert seeded.total < full.total / 10, (seeded.total, full.total)
    assert staged is not None and staged.seed == a.name and staged.dropped == 0
    assert got == expected
    assert built == {
        "how": "shipped",
        "from": "test",
        "bytes": seeded.total,
        "seed": a.name,
        "reused_files": staged.reused_files,
        "reused_bytes": staged.reused_bytes,
    }
    assert staged.reused_bytes > full.total * 0.8
    # The seed is as it was.
    assert manifest.scan(receiver / a.name) == manifest.load(
        receiver / a.name, Venv.at(receiver / a.name).read_marker()["manifest"]
    )


def largest_shared_file(a: Path, b: Path) -> str:
    """The largest file that venvs A and B have alike (a Ray extension module)."""
    fa = manifest.load(a, Venv.at(a).read_marker()["manifest"])
    fb = manifest.load(b, Venv.at(b).read_marker()["manifest"])
    same = [p for p, e in fa.items() if e.kind == "file" and fb.get(p) == e]
    return max(same, key=lambda p: fa[p].size)


def test_a_damaged_seed_never_leaks(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """One byte of a seed file changed after the seed was made ready (root can write a frozen
    file): that file is sent, the rest is taken from the seed, and the venv is the full ship's."""
    a, b = pair
    receiver = tmp_path / "receiver"
    ship_stream(a, receiver)
    damaged = receiver / a.name / largest_shared_file(a, b)
    flip_byte(damaged, 1000)
    seeded, staged = ship_stream(b, receiver, seeded=True)
    got = tree(receiver / b.name)
    assert ready(receiver / b.name)
    full, expected = full_ship_tree(b, receiver)
    assert staged is not None and staged.dropped == 1
    # The damaged file's bytes went over the link; the others did not.
    assert os.lstat(damaged).st_size <= seeded.total < full.total / 2
    assert got == expected


def test_a_reference_to_a_file_not_staged_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """A stream that refers to a seed file the receiver did not stage (a hostile or confused
    sender) fails the receive, which leaves nothing."""
    _, b = pair
    root = tmp_path / "receiver"
    root.mkdir(mode=0o700)
    packer = Packer(b, 4 * MiB)
    packer.refer = frozenset(delta.offered_files(packer.built))
    unpacker = Unpacker(root, b.name, "test", sender_venv=str(b))
    with pytest.raises(ArchiveError, match="did not take from a seed"):
        try:
            while True:
                chunk = packer.next_chunk()
                unpacker.add(chunk.index, chunk.sha256, chunk.data)
                if chunk.last:
                    break
            unpacker.finish(chunk.index + 1, packer.total, packer.whole_sha256)
        except BaseException:
            unpacker.abort()
            raise
    assert os.listdir(root) == []


def take(*have: str) -> OfferAnswer:
    return OfferAnswer("take", seed="s" if have else None, have=have)


def test_offered_files_skip_small_ones_and_shared_files_intersect() -> None:
    files = {
        "x": manifest.file_entry(0o644, delta.MIN_BYTES, "a" * 64),
        "y": manifest.file_entry(0o644, delta.MIN_BYTES - 1, "b" * 64),
        "z": manifest.DIR,
    }
    assert delta.offered_files(files) == ["a" * 64]
    answers = [take("1", "2", "3"), take("2", "3"), take("3", "4")]
    assert delta.shared_files(answers) == ["3"]
    assert delta.shared_files([take("1"), take()]) == []  # one without a seed
    assert delta.shared_files([]) == []


# --- two raylets, through Ray ----------------------------------------------------------------


def two_locks(tmp_path: Path) -> tuple[Path, Path]:
    """Projects A and B of their own (on no node yet), differing in one pure-Python package."""
    tag = time.monotonic_ns()
    return tuple(
        write_project(tmp_path / n, [six, "tomli-w==1.0.0"], name=f"delta{n}{tag}")
        for n, six in (("a", "six==1.16.0"), ("b", "six==1.17.0"))
    )


def prepared(project: Path) -> list:
    results = prepare_nodes(
        parse_spec({"project": str(project)}),
        live_nodes(),
        PrepareOptions(timeout=600),
        chunk_bytes=8 * MiB,
    )
    assert [r.outcome for r in results] == ["built", "shipped"], results
    return results


def test_a_node_with_a_near_venv_is_sent_the_difference(two_nodes, tmp_path: Path) -> None:  # noqa: F811
    _, _, node_b = two_nodes
    project_a, project_b = two_locks(tmp_path)
    _, to_b = prepared(project_a)
    first = Venv.at(node_b.venvs / to_b.key).read_marker()["built"]
    assert first["how"] == "shipped" and "seed" not in first  # no seed there: the whole venv
    _, seeded = prepared(project_b)
    venv = node_b.venvs / seeded.key
    built = Venv.at(venv).read_marker()["built"]
    assert seeded.shipped_bytes < to_b.shipped_bytes / 10, (seeded, to_b)
    assert built["bytes"] == seeded.shipped_bytes and built["seed"] == to_b.key
    assert built["reused_bytes"] > to_b.shipped_bytes * 0.8 and built["reused_files"] > 1000
    assert built_label(Venv.at(venv).read_marker()).endswith(f"from seed {to_b.key})")
    assert run_on(seeded.node_id, project_b)["venv"] == str(venv)
    got = tree(venv)
    # The same venv as a full ship: node B without the seed (nor B's venv) is sent it whole.
    freezing.remove_tree(venv)
    freezing.remove_tree(node_b.venvs / to_b.key)
    again = prepare_nodes(
        parse_spec({"project": str(project_b)}),
        live_nodes(),
        PrepareOptions(timeout=600),
        chunk_bytes=8 * MiB,
    )
    assert [r.outcome for r in again] == ["reused", "shipped"], again
    assert "seed" not in Venv.at(venv).read_marker()["built"]
    assert again[1].shipped_bytes > seeded.shipped_bytes * 10
    assert tree(venv) == got


def test_a_damaged_seed_on_a_node_never_leaks(two_nodes, tmp_path: Path) -> None:  # noqa: F811
    _, node_a, node_b = two_nodes
    project_a, project_b = two_locks(tmp_path)
    # Other tests' venvs on node B (the same packages as B) would be nearer seeds than A.
    for venv in node_b.venvs.iterdir() if node_b.venvs.is_dir() else ():
        if venv.is_dir() and ready(venv):
            freezing.remove_tree(venv)
    _, to_b = prepared(project_a)
    seed = node_b.venvs / to_b.key
    largest = max(
        (p for p in seed.rglob("*.so") if p.is_file() and not p.is_symlink()),
        key=lambda p: p.stat().st_size,
    )
    flip_byte(largest, 4096)
    _, seeded = prepared(project_b)
    venv = node_b.venvs / seeded.key
    assert ready(node_b.venvs / seeded.key)
    built = Venv.at(venv).read_marker()["built"]
    assert built["seed"] == to_b.key  # the rest came from the seed; that file went over the link
    assert largest.stat().st_size < seeded.shipped_bytes < to_b.shipped_bytes / 2
    rel = largest.relative_to(seed)
    assert (venv / rel).read_bytes() == (node_a.venvs / seeded.key / rel).read_bytes()
    assert run_on(seeded.node_id, project_b)["venv"] == str(venv)

"""KubeRay's CRD schemas, to check examples/kuberay against what a KubeRay API server accepts.

`tests/data/kuberay/<kind>.v1.json.gz` is the `openAPIV3Schema` of the `ray.io/v1` version of
KubeRay's CRD (`ray-operator/config/crd/bases/ray.io_<kind>.yaml`, KubeRay v1.6.0, Apache-2.0),
with its `description` fields left out: the structure only (types, fields, enums, patterns).
Made from a KubeRay checkout by

    uv run python -m tests.support.kuberay_crd /path/to/kuberay v1.6.0

An API server prunes fields a structural schema does not name, and `kubectl apply` only warns;
`validator` makes them errors, so that a misspelt field fails the test instead of vanishing.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "kuberay"
KUBERAY_VERSION = "v1.6.0"  # the oldest KubeRay whose token auth the examples use
KINDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}


def structure(schema: Any) -> Any:
    """The schema without its prose."""
    if isinstance(schema, dict):
        return {k: structure(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [structure(v) for v in schema]
    return schema


def strict(schema: Any) -> Any:
    """Unknown fields are errors where the schema lists the fields (as `kubectl apply
    --validate=strict` has them), not where it keeps unknown ones or is a map."""
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> Any:
    """A JSON-schema validator of `kind`'s `ray.io/v1` objects."""
    import jsonschema

    with gzip.open(DATA / f"{KINDS[kind]}.v1.json.gz", "rt") as f:
        schema = json.load(f)
    return jsonschema.Draft7Validator(strict(schema))


def extract(checkout: Path, ref: str) -> None:
    """Write the data files from a KubeRay git checkout at `ref`."""
    import yaml

    for plural in KINDS.values():
        path = f"ray-operator/config/crd/bases/ray.io_{plural}.yaml"
        text = subprocess.run(
            ["git", "-C", str(checkout), "show", f"{ref}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        crd = yaml.safe_load(text)
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = structure(version["schema"]["openAPIV3Schema"])
        DATA.mkdir(parents=True, exist_ok=True)
        data = json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()
        (DATA / f"{plural}.v1.json.gz").write_bytes(gzip.compress(data, 9, mtime=0))


if __name__ == "__main__":
    extract(Path(sys.argv[1]), sys.argv[2])

#!/bin/sh
# Install ray-uv-plugin (and with it uv) into the Python that runs Ray, keeping that Python's Ray.
#
#   sh install-plugin.sh DIR        DIR holds the wheel that `uv build --wheel` made
#
# PYTHON: the Python that runs Ray (default: `python` on PATH, as in Ray's images).
# EXPECT_PLUGIN_DIR: if set, fail unless the package lands there (the KubeRay example's env
# vars name files inside it).
#
# The Dockerfile beside this script runs it; tests/test_docs.py runs it into a fresh venv.
set -eu

dist="$(cd "$1" && pwd)"
python="${PYTHON:-python}"
bin="$(cd "$(dirname "$(command -v "$python")")" && pwd)"
cd /  # so that `python -c` imports what is installed, not a package in the current directory
set -- "$dist"/ray_uv_plugin-*.whl
if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
    echo "want exactly one ray_uv_plugin-*.whl in $dist, found: $*" \
        "(empty it, then \`uv build --wheel --out-dir $dist\` in the repository)" >&2
    exit 1
fi
wheel="$1"

# The image's Ray is the Ray the nodes run: pin it, so pip never swaps it for another version.
ray_version="$("$python" -c 'import ray; print(ray.__version__)')"
"$python" -m pip install --no-cache-dir --disable-pip-version-check \
    "$wheel" "ray[default]==$ray_version"

# What the nodes need at run time: the CLI, the plugin importable by Ray, and a uv binary.
"$bin/ray-uv" plugin-config >/dev/null
"$python" -c 'import ray_uv_plugin.agent.plugin'
"$python" -m uv --version

if [ -n "${EXPECT_PLUGIN_DIR:-}" ]; then
    installed="$("$python" -c 'import os, ray_uv_plugin; print(os.path.dirname(ray_uv_plugin.__file__))')"
    if [ "$installed" != "$EXPECT_PLUGIN_DIR" ]; then
        echo "ray_uv_plugin is in $installed, not $EXPECT_PLUGIN_DIR: update PLUGIN_DIR in the" \
            "Dockerfile and the paths in examples/kuberay/raycluster.yaml" \
            "(\`ray-uv plugin-config --shell\` in the image prints them)" >&2
        exit 1
    fi
fi
echo "ray-uv-plugin installed for Ray $ray_version ($python)"

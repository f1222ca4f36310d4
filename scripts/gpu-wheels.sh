#!/usr/bin/env bash
# Run HERE, where PyPI is reachable, before the device check (scripts/gpu-check.sh): the packages
# kvxferd needs that the device image lacks, as wheels for its Python, into .gpu-wheels/ (ignored
# by git; the device tool carries it when named: carry=[".gpu-wheels"]).
#
# The image has torch, cuda-bindings, cupy, numpy, typer (click, rich), uvloop,
# prometheus-client and pytest already (docs of the device tool: KINDS.md); it lacks NIXL,
# msgspec and pyzmq. Its python3 is 3.12 (GPU_PYTHON_VERSION to change it). Versions: those the
# suite runs with here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=${GPU_PYTHON_VERSION:-3.12}
DEST=.gpu-wheels
# The tree (~2 MiB) and the wheels travel together within 64 MiB.
MAX_MIB=${GPU_WHEELS_MAX_MIB:-56}

rm -rf "$DEST"
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$DEST" nixl==1.5.1 nixl-cu13==1.5.1 msgspec==0.23.0 pyzmq==27.3.0

# nixl-cu13's wheel is ~56 MiB, half of it expert-parallel kernels kvxferd never imports.
python3 scripts/gpu_check.py slim-wheel "$DEST"/nixl_cu13-*.whl

ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "wheels: $((total / 1024 / 1024)) MiB ($total B) for Python $PYVER"
if (( total > MAX_MIB * 1024 * 1024 )); then
    echo "over $MAX_MIB MiB: the tree and the wheels would not travel within 64 MiB" >&2
    exit 1
fi

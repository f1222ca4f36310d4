#!/usr/bin/env bash
# The device check (issue 39): one prepared command for a lent H100/H200, which runs it in a copy
# of the repository root with nothing outside reachable (no package index):
#
#   here, once:   scripts/gpu-wheels.sh                  (NIXL, msgspec, pyzmq into .gpu-wheels/)
#   the device:   bash scripts/gpu-check.sh              (carry .gpu-wheels; timeout_s 600)
#
# Steps, each under a timeout of its own inside one budget (GPU_CHECK_BUDGET_S, 450 s: under
# 8 minutes with the table), a failing one reported and the next one run:
#   install    the carried wheels into a folder of their own (the image's packages untouched)
#   env        GPU, driver, versions (UCX's too), GPUDirect RDMA / dma-buf attributes, RDMA NICs
#   probe      kvxferd.memory: the gpuDirectRDMACapable flag, the daemon's pointer attribute, dma-buf
#   pair       two daemons through UCX (UCX_PROTO_INFO=y): the protocol that carries the READ
#              (the cliff shown or cleared) against raw NIXL and a device-to-device copy
#   same-node  one daemon's own lane (loop) against a torch copy and gather of the same bytes
#   shared-kv  shared_kv.share on CUDA tensors
#   pytest     the gpu tests (tests/test_gpu.py)
#   bench      kvxferd bench data --device cuda-vmm, one page size (docs/benchmarks.md's table)
# then one table. Everything is kept under $OUT when it is set (the device tool's folder).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
WORK=${GPU_CHECK_WORK:-/tmp/kvxferd-gpu-check}
SITE=$WORK/site
LOG=$WORK/gpu-check.log
START=$(date +%s)
failed=0

rm -rf "$WORK"
mkdir -p "$WORK"
: >"$WORK/steps.tsv"
export PYTHONUNBUFFERED=1

# step NAME LIMIT_S COMMAND...: COMMAND under the smaller of LIMIT_S and what the budget has left
# (30 s kept for the table), its output on the console, in the log and in WORK/NAME.out.
# timeout signals COMMAND's whole process group: daemons and raw NIXL sides it started end with it.
step() {
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$((BUDGET_S - ($(date +%s) - START) - 30))
    if ((left < 20)); then
        echo "== $name: skipped, the budget is spent" | tee -a "$LOG"
        printf '%s\tskipped\t0\n' "$name" >>"$WORK/steps.tsv"
        failed=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit} s)" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$WORK/$name.out" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$WORK/steps.tsv"
    if ((rc == 124)); then
        failed=1
        echo "== $name: timed out after $limit s" | tee -a "$LOG"
    elif ((rc != 0)); then
        failed=1
        echo "== $name: exit $rc" | tee -a "$LOG"
    fi
}

{
    echo "kvxferd device check, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')" \
        "+ work tree changes: $(git status --porcelain 2>/dev/null | wc -l)"
    "$PY" -V
    nvidia-smi -L || true
} 2>&1 | tee -a "$LOG"

if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .gpu-wheels/*.whl
else
    echo "== install: no .gpu-wheels/*.whl: run scripts/gpu-wheels.sh here and carry .gpu-wheels" | tee -a "$LOG"
    printf 'install\tmissing\t0\n' >>"$WORK/steps.tsv"
    failed=1
fi
# kvxferd from this tree (daemons start as `python -m kvxferd`, so they find it too)
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

step env 60 "$PY" scripts/gpu_check.py env "$WORK"
step probe 60 "$PY" scripts/gpu_check.py probe "$WORK"
step pair 120 "$PY" scripts/gpu_check.py pair "$WORK"
step same-node 120 "$PY" scripts/gpu_check.py same-node "$WORK"
step shared-kv 60 "$PY" scripts/gpu_check.py shared-kv "$WORK"
step pytest 300 "$PY" -m pytest -v -m gpu -rs --durations=10 -p no:cacheprovider tests/test_gpu.py
step bench 120 env UCX_PROTO_INFO=y "$PY" -m kvxferd bench data --device cuda-vmm --page-kib 1024 --mib 64 \
    --rounds 1 --repeats 3

timeout 30 "$PY" scripts/gpu_check.py table "$WORK" 2>&1 | tee "$WORK/table.txt" | tee -a "$LOG"
if ((PIPESTATUS[0] != 0)); then  # the table's own fallback: the steps as they ended
    column -t -s $'\t' "$WORK/steps.tsv" | tee -a "$LOG"
fi
echo "whole check: $(($(date +%s) - START)) s" | tee -a "$LOG"

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
    # At most 8 files come back: the log, the table, the figures, the tests' and the daemons' output.
    cp "$LOG" "$WORK/table.txt" "$OUT/" 2>/dev/null
    [[ -f "$WORK/results.json" ]] && cp "$WORK/results.json" "$OUT/"
    [[ -f "$WORK/pytest.out" ]] && cp "$WORK/pytest.out" "$OUT/pytest.log"
    for logs in pair-logs same-node-logs; do
        for f in "$WORK/$logs"/*.log; do
            [[ -f "$f" ]] || continue
            echo "==> $(basename "$f") (its last 4 MiB)"
            tail -c 4M "$f"
        done >"$OUT/$logs.log"
    done
fi
exit "$failed"

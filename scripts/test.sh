#!/usr/bin/env bash
# Install what the tests need, check types and lint, and run the tests:
#  - Debian's Prometheus/promtool (the observability checks use the real tools),
#  - the Python test tools (pip install -e '.[test]'), mypy and ruff as pyproject.toml configures them,
#  - vLLM's CPU build in its own environment (scripts/vllm-env.sh), for the real-vLLM tests.
# Without arguments: the tests without vLLM two at a time (pytest-xdist; they wait on daemons more
# than they compute), then the real-vLLM tests one at a time (each world starts several servers,
# all 2 cores take). Both run; the script fails if either failed.
# Extra arguments go to one pytest run instead (e.g. -m 'not vllm and not gpu' while iterating).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >/dev/null
fi
pip install -q -e '.[test]'
mypy
ruff check kvxferd tests bench fuzz
KVXFERD_VLLM_PYTHON="$(./scripts/vllm-env.sh | tail -n 1)"
export KVXFERD_VLLM_PYTHON
if [ $# -gt 0 ]; then
    exec python -m pytest -q --durations=25 "$@"
fi
rc=0
python -m pytest -q --durations=25 -n 2 --dist loadgroup -m 'not vllm and not gpu' || rc=$?
python -m pytest -q --durations=25 -m 'vllm and not gpu' || rc=$?
exit $rc

#!/usr/bin/env bash
# Install what the tests need (Python packages, and the real tools that validate the
# deployment artifacts: Prometheus/promtool from Debian) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >/dev/null
fi
pip install -q -e '.[test]'
python -m pytest -q "$@"

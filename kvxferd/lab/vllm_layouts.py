"""Ask vLLM's own allocator how it lays out a GPU backend's KV cache (run in vLLM's environment).

    python -m kvxferd.lab.vllm_layouts '[{"layout": "BLHNC", "kind": "full", "layers": 2, "blocks": 10,
                                          "heads": 4, "head_size": 8, "block_size": 16}, ...]'

prints, per case, each layer's [B, H, N, C] view: shape, strides (elements) and byte offset in
the buffer, exactly as vLLM 0.32's `create_kv_cache_views` makes them for FlashAttention,
FlashInfer and Triton (`full`) or FlashMLA and Triton MLA (`mla`, one 576-wide latent). The
tests compare `kvxferd.vllm.layout.layer_caches` with it, so host memory built from kvxferd's
description is the memory those backends use.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def views(case: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    if case["kind"] == "mla":
        spec: Any = MLAAttentionSpec(block_size=case["block_size"], num_kv_heads=1, head_size=case["head_size"],
                                     dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=case["block_size"], num_kv_heads=case["heads"],
                                 head_size=case["head_size"], dtype=dtype)
    layout = KVCacheLayout[case["layout"]]
    layers, blocks = case["layers"], case["blocks"]
    strides = compute_layout_strides(spec, blocks, layers, layout)
    size = spec.page_size_bytes * blocks * layers
    tensor = KVCacheTensor(size=size, offset=0, layers=[f"model.layers.{i}.attn" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    out = []
    for view in create_kv_cache_views(raw, spec, blocks, layout, tensor):
        out.append({"shape": list(view.shape), "stride": list(view.stride()), "itemsize": view.element_size(),
                    "offset": (view.data_ptr() - raw.data_ptr()), "buffer": size})
    return out


def main() -> None:
    print(json.dumps([views(case) for case in json.loads(sys.argv[1])]))


if __name__ == "__main__":
    main()

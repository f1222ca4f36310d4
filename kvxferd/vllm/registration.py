"""Worker start: vLLM's KV cache -> shareable memory -> kvxferd geometry -> the daemon.

Reads vLLM's own description (KV cache config, cache specs, the tensors' shapes and strides)
and hands the pure `layout.geometry` plain numbers.
"""

from __future__ import annotations

import logging
from typing import Any

from . import layout, shared_kv
from .options import ConnectorOptions
from .worker import WorkerSide

log = logging.getLogger("kvxferd.vllm")


def register_worker(worker: WorkerSide, vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, Any],
                    options: ConnectorOptions) -> None:
    from vllm.v1.kv_cache_interface import AttentionSpec

    model_config = vllm_config.model_config
    group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    groups = [layout.GroupSpec("attention" if isinstance(s, AttentionSpec) and not model_config.use_mla else "state",
                               s.block_size, model_config.get_total_num_kv_heads(),
                               getattr(s, "head_size", 0), type(s).__name__) for s in specs]
    buffers, placed = shared_kv.share(kv_caches, _bound_caches(vllm_config))
    layers = [layout.LayerCache(name, group_of[name], *placed[name], tuple(t.shape), tuple(t.stride()),
                                t.element_size())
              for name, t in kv_caches.items() if name in group_of]
    kv_dtype = str(specs[0].dtype) if specs else str(model_config.dtype)
    geometry = layout.geometry(model_identity(vllm_config), kv_dtype, worker.tp_size, worker.rank,
                               [b.nbytes for b in buffers], groups, layers,
                               weights=weights_identity(vllm_config) if options.enforce_handshake_compat else "")
    log.info("kvxferd: %d layers in %d cache groups, %d buffers, dtype %s", len(layers), len(geometry.groups),
             len(buffers), geometry.dtype)
    worker.register(geometry, buffers, options.connect_timeout_s)


def _bound_caches(vllm_config: Any) -> list[Any]:
    """The caches vLLM bound to its attention layers (they may be other views of the same memory)."""
    out: list[Any] = []
    for layer in vllm_config.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        out.extend(cache if isinstance(cache, (list, tuple)) else [cache])
    return [c for c in out if c is not None]


def model_identity(vllm_config: Any) -> str:
    """The architecture and the device's cache format: what must agree beyond the geometry."""
    import torch

    mc = vllm_config.model_config
    device = vllm_config.device_config.device_type
    cache_format = f"cpu-{torch.backends.cpu.get_cpu_capability()}" if device == "cpu" else device
    return " ".join([f"vllm:{','.join(mc.architectures or [])}", cache_format,
                     f"layers={mc.hf_config.num_hidden_layers}", f"kv_heads={mc.get_total_num_kv_heads()}",
                     f"head={mc.get_head_size()}"])


def weights_identity(vllm_config: Any) -> str:
    """Which weights: compared unless an engine sets enforce_handshake_compat=false."""
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision or '-'}"

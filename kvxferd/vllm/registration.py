"""Worker start: vLLM's KV cache -> shareable memory -> kvxferd geometry -> the daemon.

Reads vLLM's own description (KV cache config, cache specs, the tensors' shapes and strides)
and hands the pure `layout.geometry` plain numbers.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any

from . import layout, shared_kv
from .options import ConnectorOptions
from .worker import WorkerSide

log = logging.getLogger("kvxferd.vllm")


def register_worker(worker: WorkerSide, vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, Any],
                    options: ConnectorOptions) -> None:
    model_config = vllm_config.model_config
    group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
    device = vllm_config.device_config.device_type
    groups = [group_spec(g.kv_cache_spec, g.layer_names, model_config, worker.tp_size, device,
                         vllm_config.cache_config.cache_dtype) for g in kv_cache_config.kv_cache_groups]
    buffers, placed = shared_kv.share(kv_caches, _bound_caches(vllm_config))
    layers = [layout.LayerCache(name, group_of[name], *placed[name], tuple(t.shape), tuple(t.stride()),
                                t.element_size())
              for name, t in kv_caches.items() if name in group_of]
    _check_state_placement(vllm_config, groups, layers)
    geometry = layout.geometry(model_identity(vllm_config), kv_dtype(kv_cache_config, model_config), worker.tp_size,
                               worker.rank, [b.nbytes for b in buffers], groups, layers,
                               weights=weights_identity(vllm_config) if options.enforce_handshake_compat else "")
    log.info("kvxferd: %d layers in %d cache groups (%s), %d buffers, dtype %s", len(layers), len(geometry.groups),
             ", ".join(f"{g.kind} {g.tokens_per_block or 'state'}" for g in geometry.groups), len(buffers),
             geometry.dtype)
    worker.register(geometry, buffers, options.connect_timeout_s)


def group_spec(spec: Any, layer_names: list[str], model_config: Any, tp_size: int, device: str,
               cache_dtype: str = "auto") -> layout.GroupSpec:
    """One cache group's spec, as plain numbers (`layout.GroupSpec`)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):  # one spec type with per-layer details: all must agree
        specs = {repr(group_spec(s, [n], model_config, tp_size, device, cache_dtype))
                 for n, s in spec.kv_cache_specs.items()}
        if len(specs) != 1:
            raise layout.GeometryError(f"cache group of {name}: its layers differ in heads or sizes")
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, MambaSpec):
        return layout.GroupSpec(
            "state", spec.block_size, type(spec).__name__, mamba_type=_mamba_type(spec.mamba_type),
            states=tuple(layout.StateTensor(tuple(s), d.itemsize) for s, d in zip(spec.shapes, spec.dtypes)),
            conv_layout=_conv_layout(), replicated=bool(spec.tp_replicated))
    if isinstance(spec, AttentionSpec):
        return layout.GroupSpec(
            "attention", spec.block_size, name,
            total_kv_heads=total_kv_heads(spec, layer_names, model_config, tp_size),
            head_bytes=spec.state_content_size_bytes,
            # vLLM's CPU attention keeps a head's K, then its V (MLA latents are rows)
            kv_split=cpu_kv_split(spec.dtype, spec.block_size, spec.head_size, cache_dtype)
            if device == "cpu" and not isinstance(spec, MLAAttentionSpec) else "")
    raise layout.GeometryError(f"cache group of {name} ({', '.join(layer_names[:3])}): kvxferd describes "
                               "attention (full, sliding-window, MLA) and Mamba/GDN state groups")


@functools.cache  # once per kind of page: group_spec asks per group, and per layer of a uniform-spec group
def cpu_kv_split(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """How vLLM's CPU attention orders a head's keys (`layout.KV_SPLITS`), found by writing known
    keys and values into one page with the kernel itself: its order depends on the ISA it picks."""
    import torch
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        gen = torch.Generator().manual_seed(0)
        key, value = (torch.randn(block_size, 1, head_size, generator=gen).to(dtype) for _ in range(2))
        page = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
        k_area, v_area = page.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_area, v_area, torch.arange(block_size), isa,
                                       kv_cache_dtype=cache_dtype)
    except Exception as exc:  # another vLLM, or a cache format the kernel converts: move whole heads
        log.info("kvxferd: CPU attention's key order not probed (%s): heads move whole", exc)
        return "sealed"
    keys = k_area[0, 0].reshape(-1)
    if not torch.equal(v_area[0, 0], value[:, 0]):
        split = "sealed"
    elif torch.equal(keys, key[:, 0].T.reshape(-1)):
        split = "k_transposed"
    elif torch.equal(keys, key[:, 0].reshape(-1)):
        split = "k_rows"
    else:
        split = "sealed"
    log.info("kvxferd: CPU attention (%s, block %d, head %d) orders keys %s", isa, block_size, head_size, split)
    return split


def _check_state_placement(vllm_config: Any, groups: list[layout.GroupSpec], layers: list[layout.LayerCache]) -> None:
    """The states a Mamba-style layer bound (vLLM's views of its page) start where the geometry
    says: each right after the one before, from the page's first byte, one page apart."""
    context = vllm_config.compilation_config.static_forward_context
    for layer in layers:
        spec = groups[layer.group]
        module = context.get(layer.name)
        if spec.kind != "state" or module is None:
            continue
        bound = _tensors(getattr(module, "kv_cache", None))
        at = 0
        for state, tensor in zip(spec.states, bound[:len(spec.states)]):
            offset = tensor.storage_offset() * tensor.element_size() - layer.offset
            stride = tensor.stride()[0] * tensor.element_size()
            if offset != at or stride != layer.stride[0] * layer.itemsize:
                raise layout.GeometryError(
                    f"layer {layer.name}: vLLM bound a state at byte {offset} of its page, {stride} B apart; "
                    f"kvxferd expects byte {at}, {layer.stride[0] * layer.itemsize} B apart")
            at += math.prod(state.shape) * state.itemsize


def _tensors(cache: Any) -> list[Any]:
    if isinstance(cache, (list, tuple)):
        return [t for c in cache for t in _tensors(c)]
    return [] if cache is None else [cache]


def total_kv_heads(spec: Any, layer_names: list[str], model_config: Any, tp_size: int) -> int:
    """KV heads of a group across all TP ranks. vLLM's spec gives this rank's count; ranks past
    `max_tp_shards` (or past the model's heads) hold replicas."""
    if spec.max_tp_shards is not None:
        return int(spec.num_kv_heads * min(tp_size, spec.max_tp_shards))
    total = _layer_kv_heads(model_config, layer_names[0]) or model_config.get_total_num_kv_heads()
    if spec.num_kv_heads == max(1, total // tp_size):
        return int(total)
    return int(spec.num_kv_heads * tp_size)


def _layer_kv_heads(model_config: Any, layer_name: str) -> int:
    """A per-layer KV head count in the model's config (Gemma4's full-attention layers), or 0."""
    per_layer = getattr(model_config.hf_text_config, "per_layer_config", None)
    index = re.search(r"\.(\d+)\.", layer_name)
    if per_layer is None or index is None:
        return 0
    try:  # transformers' per-layer view is indexed by layer; a plain dict may be keyed by str
        entry = per_layer[int(index.group(1))]
    except (KeyError, IndexError, TypeError):
        entry = per_layer.get(index.group(1)) if isinstance(per_layer, dict) else None
    heads = entry.get("num_key_value_heads") if isinstance(entry, dict) else getattr(entry, "num_key_value_heads",
                                                                                      None)
    return int(heads or 0)


def _mamba_type(kind: Any) -> str:
    name = getattr(kind, "name", str(kind)).upper()
    return {"MAMBA2": "mamba2", "GDN_ATTN": "gdn", "MAMBA1": "mamba1"}.get(name, name.lower())


def _conv_layout() -> str:
    from vllm.model_executor.layers.mamba import mamba_utils

    return str(mamba_utils.get_conv_state_layout())


def kv_dtype(kv_cache_config: Any, model_config: Any) -> str:
    """The attention cache's dtype (state groups carry their own per state)."""
    for group in kv_cache_config.kv_cache_groups:
        dtype = getattr(group.kv_cache_spec, "dtype", None)
        if dtype is not None:
            return str(dtype)
    return str(model_config.dtype)


def _bound_caches(vllm_config: Any) -> list[Any]:
    """The caches vLLM bound to its attention and state layers (other views of the same memory)."""
    return [t for layer in vllm_config.compilation_config.static_forward_context.values()
            for t in _tensors(getattr(layer, "kv_cache", None))]


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

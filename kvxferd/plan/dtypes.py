"""KV cache element types: kvxferd's short names and the names engines use for them.

vLLM says `bfloat16`, `float16`, `float32`, `fp8_e4m3`...; torch says `torch.bfloat16`. Every
place that takes a dtype accepts any of them and keeps the canonical short name, so two
engines that spell the same type differently still agree at handshake.
"""

from __future__ import annotations

from .geometry import GeometryError

ITEMSIZE = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "fp16": 2, "fp32": 4}

ALIASES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
    "fp8_inc": "fp8_e4m3", "fp8_ds_mla": "fp8",
}


def canonical(name: str) -> str:
    """The short name of a dtype given in any accepted spelling; GeometryError names the choices."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in ITEMSIZE:
        raise GeometryError(f"unknown dtype {name!r}; one of {sorted(ITEMSIZE)} "
                            f"or {sorted(ALIASES)}")
    return key


def itemsize(name: str) -> int:
    return ITEMSIZE[canonical(name)]

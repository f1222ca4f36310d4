"""kvxferd's vLLM connector. vLLM loads it with

    "kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.vllm"

The class is imported on first access, so the pure parts of this package (layout,
hand-off, scheduler logic) load without vLLM; the daemon never imports any of it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferdConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvxferdConnector":
        from .connector import KvxferdConnector
        return KvxferdConnector
    raise AttributeError(name)

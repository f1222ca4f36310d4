"""kvxferd: a KV-cache transfer sidecar daemon for disaggregated LLM serving."""

__version__ = "0.1.0"

"""The lab: what builds tiny models, launches vLLM servers and daemons, demos and benches.

Nothing here runs inside vLLM or the daemon; the product is `kvxferd.vllm` (the connector)
and the daemon's modules.
"""

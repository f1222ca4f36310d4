"""The vLLM versions this connector is built and tested against.

vLLM marks the connector API experimental: it changes between minor versions. Any other
version is refused at start rather than misbehaving at the first request.
"""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))  # (major, minor): the CPU build 0.32, the CUDA build 0.33
SUPPORTED_TEXT = ">=0.32,<0.34"


def parse(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"unreadable vLLM version {version!r}") from None


def check(version: str) -> None:
    if parse(version) not in SUPPORTED:
        raise RuntimeError(f"kvxferd's vLLM connector supports vLLM {SUPPORTED_TEXT}; this is vLLM {version}. "
                           "Install a supported vLLM or a kvxferd release built for this one.")


def check_vllm_version() -> None:
    import vllm

    check(vllm.__version__)

"""`kvxferd demo --engine vllm`: real vLLM prefill and decode through kvxferd, on this machine.

Makes a tiny random-weight model (no download), starts two daemons, a prefill and a decode
vLLM (CPU build, each on its own core), a single vLLM instance to compare with, and the
router; sends prompts through the router and to the single instance, streamed, and shows
that the outputs match, with the time to first token of each.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .synthetic.demo import DaemonProcess
from .vllm_servers import DEFAULT_VENV, ProxyProcess, VllmServer, make_model, stream

PROMPTS = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software",
    "This program is free software; you can redistribute it and/or modify it under the terms of the GNU",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT",
    "Redistribution and use in source and binary forms, with or without modification, are permitted",
    "Licensed under the Apache License, Version 2.0 (the License); you may not use this file except in",
    "The above copyright notice and this permission notice shall be included in all copies or substantial",
    "Neither the name of the copyright holder nor the names of its contributors may be used to endorse",
    "You should have received a copy of the GNU General Public License along with this program; if not",
]


@dataclass
class Row:
    prompt: str
    pd_text: str
    single_text: str
    pd_ttft_s: float
    single_ttft_s: float

    @property
    def match(self) -> bool:
        return self.pd_text == self.single_text


@dataclass
class VllmDemoResult:
    rows: list[Row] = field(default_factory=list)
    bytes_read: int = 0

    def summary(self) -> dict[str, Any]:
        pd = [r.pd_ttft_s for r in self.rows]
        single = [r.single_ttft_s for r in self.rows]
        return {"prompts": len(self.rows), "matching": sum(r.match for r in self.rows),
                "ttft_ms_pd_p50": 1e3 * statistics.median(pd), "ttft_ms_single_p50": 1e3 * statistics.median(single),
                "rows": [{"prompt": r.prompt, "match": r.match, "pd_text": r.pd_text, "single_text": r.single_text,
                          "pd_ttft_ms": 1e3 * r.pd_ttft_s, "single_ttft_ms": 1e3 * r.single_ttft_s}
                         for r in self.rows]}


def run(requests: int, max_tokens: int, repeat: int, workdir: str | None = None,
        say: Callable[[str], None] = print) -> VllmDemoResult:
    with ExitStack() as stack:
        wd = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvxferd-vllm-demo-")))
        say(f"making a tiny random-weight model (cached in {DEFAULT_VENV.parent / 'models'})")
        model = make_model(DEFAULT_VENV.parent / "models" / "tiny-llama-seed0", 0)
        p_daemon = DaemonProcess(wd, "prefill-daemon")
        stack.callback(p_daemon.stop)
        d_daemon = DaemonProcess(wd, "decode-daemon")
        stack.callback(d_daemon.stop)
        say("starting vLLM: prefill (core 0), decode (core 1), single instance (core 0); about a minute")
        servers = [VllmServer(wd, "prefill", model, "kv_producer", "kvxferd", p_daemon.socket, cores="0"),
                   VllmServer(wd, "decode", model, "kv_consumer", "kvxferd", d_daemon.socket, cores="1"),
                   VllmServer(wd, "single", model, cores="0")]
        for s in servers:
            stack.callback(s.stop)
        for s in servers:
            s.wait_ready()
        prefill, decode, single = servers
        proxy = ProxyProcess(wd, [prefill.url], [decode.url])
        stack.callback(proxy.stop)
        say(f"router at {proxy.url}; logs in {wd}")
        result = VllmDemoResult()
        texts = [" ".join([PROMPTS[i % len(PROMPTS)]] * repeat) + (f" ({i})" if i >= len(PROMPTS) else "")
                 for i in range(requests)]
        # The single instance shares core 0 with the prefill: run it first and let its OpenMP
        # threads go idle, so neither side's timing carries the other's load.
        singles = [stream(single.url, prompt, max_tokens) for prompt in texts]
        time.sleep(1.0)
        for prompt, one in zip(texts, singles):
            pd = stream(proxy.url, prompt, max_tokens)
            result.rows.append(Row(prompt, pd.text, one.text, pd.ttft_s, one.ttft_s))
            say(f"  {'=' if pd.text == one.text else 'DIFFERENT'}  P/D TTFT {pd.ttft_s * 1e3:6.1f} ms, "
                f"single {one.ttft_s * 1e3:6.1f} ms  {prompt[:48]!r}... -> {pd.text[:40]!r}")
        return result

"""A tiny random-weight Llama and its tokenizer, made locally (no download).

Enough to prove the transfer end to end: greedy decoding depends on every KV byte, and
weights scaled so that output is not degenerate. Different seeds give different weights
with the same geometry (the negative control). Run inside vLLM's environment:

    python -m kvxferd.vllm.tiny_model DIR [--seed N]
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

VOCAB = 1024


def corpus() -> list[str]:
    """Local English text to train the tokenizer on: the system's licence files."""
    texts = []
    for path in sorted(glob.glob("/usr/share/doc/*/copyright"))[:400]:
        try:
            texts.append(Path(path).read_text(errors="ignore"))
        except OSError:
            continue
    return texts or ["the quick brown fox jumps over the lazy dog " * 100]


def make(directory: str | Path, seed: int = 0, layers: int = 4, hidden: int = 256, heads: int = 4,
         kv_heads: int = 2, max_positions: int = 4096) -> Path:
    """Write config, weights and tokenizer to `directory`; skip if it already holds this model."""
    import torch
    from tokenizers import (  # type: ignore[import-not-found]  # installed only in vLLM's environment
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    stamp = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "max_positions": max_positions, "vocab": VOCAB}
    if (out / "kvxferd-tiny.json").exists() and json.loads((out / "kvxferd-tiny.json").read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(out)

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=max_positions, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)  # large enough that greedy output is not one repeated token
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvxferd-tiny.json").write_text(json.dumps(stamp))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make(args.directory, args.seed))


if __name__ == "__main__":
    main()

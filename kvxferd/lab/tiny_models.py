"""Tiny random-weight models of every family vLLM's CPU build serves, and their tokenizer,
made locally (no download).

Enough to prove a transfer end to end: greedy decoding depends on every KV byte (and every
state byte), and weights are scaled so that output is not degenerate. Other seeds give other
weights with the same geometry (the negative control). Run inside vLLM's environment:

    python -m kvxferd.lab.tiny_models DIR [--family dense|gemma3|gemma4|mamba2|gdn|mla] [--seed N]

    family   architecture            KV cache vLLM makes of it
    dense    LlamaForCausalLM        one full-attention group (4 layers, 2 KV heads x 64)
    gemma3   Gemma3ForCausalLM       3 sliding-window layers (window 64) + 1 full, overlaid groups
    gemma4   Gemma4ForCausalLM       sliding layers 2 KV heads x 64, the full layer 1 KV head x 128
    mamba2   NemotronHForCausalLM    Mamba2 state group (conv + SSM) + full attention over one buffer
    gdn      Qwen3NextForCausalLM    gated-delta-net state groups + full attention (small MoE)
    mla      DeepseekV2ForCausalLM   one MLA latent group (512 + 64 wide), one unit held by every rank
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import Any

VOCAB = 1024
HIDDEN = 256
FAMILIES = ("dense", "gemma3", "gemma4", "mamba2", "gdn", "mla")


def corpus() -> list[str]:
    """Local English text to train the tokenizer on: the system's licence files."""
    texts = []
    for path in sorted(glob.glob("/usr/share/doc/*/copyright"))[:400]:
        try:
            texts.append(Path(path).read_text(errors="ignore"))
        except OSError:
            continue
    return texts or ["the quick brown fox jumps over the lazy dog " * 100]


def config(family: str, max_positions: int = 4096) -> Any:
    """The transformers config of a family's tiny model (TP 2 divides every head count)."""
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=max_positions,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "dense":
        return tf.LlamaConfig(**common, intermediate_size=2 * HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, architectures=["LlamaForCausalLM"])
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   query_pre_attn_scalar=64, sliding_window=64,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   architectures=["Gemma3ForCausalLM"])
    if family == "gemma4":
        return tf.Gemma4TextConfig(**common, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=64,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   attention_k_eq_v=True, global_head_dim=128, num_global_key_value_heads=1,
                                   hidden_size_per_layer_input=0, architectures=["Gemma4ForCausalLM"])
    if family == "mamba2":
        return tf.NemotronHConfig(**common, intermediate_size=2 * HIDDEN, layers_block_type=[
                                      "mamba", "attention", "mlp", "mamba", "attention", "mlp"],
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=8,
                                  mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=1,
                                  chunk_size=64, architectures=["NemotronHForCausalLM"])
    if family == "gdn":
        return tf.Qwen3NextConfig(**common, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  layer_types=["linear_attention", "full_attention"] * 2,
                                  linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                  linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=64, decoder_sparse_step=1,
                                  architectures=["Qwen3NextForCausalLM"])
    if family == "mla":
        return tf.DeepseekV2Config(**common, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                                   q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                                   first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=64,
                                   architectures=["DeepseekV2ForCausalLM"])
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def make(directory: str | Path, seed: int = 0, family: str = "dense") -> Path:
    """Write config, weights and tokenizer to `directory`; skip if it already holds this model."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(directory)
    stamp = {"seed": seed, "family": family, "vocab": VOCAB, "hidden": HIDDEN, "version": 2}
    if (out / "kvxferd-tiny.json").exists() and json.loads((out / "kvxferd-tiny.json").read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer().save_pretrained(out)
    cfg = config(family)
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)  # large enough that greedy output is not one repeated token
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvxferd-tiny.json").write_text(json.dumps(stamp))
    return out


def _tokenizer() -> Any:
    from tokenizers import (  # type: ignore[import-not-found]  # installed only in vLLM's environment
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="dense", choices=FAMILIES)
    args = ap.parse_args()
    print(make(args.directory, args.seed, args.family))


if __name__ == "__main__":
    main()

"""A 2-layer random Llama that vLLM's CPU attention runs and two tensor-parallel ranks split: 4
attention heads and 2 KV heads (the embedded model's 9 and 3 do not divide by 2) of 32 dimensions
(the smallest vLLM's CPU attention runs: ``v1/attention/backends/cpu_attn.py:69-70``; the shared
tiny model's are 16), with the embedded tokenizer."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(folder: Path, tokenizer_dir) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

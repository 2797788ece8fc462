"""Tiny, randomly initialised BGE-M3 / bge-reranker look-alikes built offline for tests.

Same architecture as the real checkpoints (XLM-RoBERTa encoder, ``colbert_linear`` /
``sparse_linear`` heads, XLM-RoBERTa sequence classifier) and the same on-disk layout, so the
tests load them through the public code path a user takes with a real local directory. The
tokenizer is a word-level ``tokenizers`` model with XLM-R's special tokens and pair template
(``<s> A </s></s> B </s>``), built from the words the test texts use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # noqa: E402
from transformers import (  # noqa: E402
    PreTrainedTokenizerFast,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R ids 0..3


def words_of(texts: Iterable[str]) -> list[str]:
    return [w.lower() for t in texts for w in re.findall(r"\w+|[^\w\s]", t)]


def build_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for word in sorted(set(words)):
        vocab.setdefault(word, len(vocab))
    vocab["<mask>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
        pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", model_max_length=128)


def tiny_config(vocab_size: int, **overrides) -> XLMRobertaConfig:
    # initializer_range well above the default 0.02 so random texts get clearly different
    # embeddings (with 0.02 every CLS vector has cosine ~0.9999 to every other).
    settings = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=130,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                    initializer_range=0.5)
    settings.update(overrides)
    return XLMRobertaConfig(**settings)


def build_tiny_bge_m3(path: Path, texts: Iterable[str], seed: int = 0,
                      head_format: str = "pt") -> Path:
    """Save a tiny BGE-M3 checkpoint (model, tokenizer, heads) to ``path``.

    The sparse head has near-zero weights and bias 1, so every token weight is about 1 and
    the lexical score is about the number of shared distinct tokens: a predictable signal.
    """
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(words_of(texts))
    model = XLMRobertaModel(tiny_config(len(tokenizer))).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hidden = model.config.hidden_size
    colbert, sparse = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        sparse.weight.mul_(0.01)
        sparse.bias.fill_(1.0)
    for stem, head in (("colbert_linear", colbert), ("sparse_linear", sparse)):
        if head_format == "pt":
            torch.save(head.state_dict(), path / f"{stem}.pt")
        else:
            from safetensors.torch import save_file

            save_file(head.state_dict(), str(path / f"{stem}.safetensors"))
    return path


def build_tiny_reranker(path: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """Save a tiny single-logit XLM-R sequence classifier (bge-reranker-v2-m3's architecture)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(words_of(texts))
    model = XLMRobertaForSequenceClassification(tiny_config(len(tokenizer), num_labels=1)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

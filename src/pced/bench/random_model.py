"""Random-weight models of real architectures, for speed measurements (``pced bench --random-model``).

Speed does not depend on the weights' values, so a Llama-3.1-8B-shaped model with random
weights times exactly like the real one, and anyone can build it in seconds without downloading
16 GB. Named shapes are below; a JSON file of ``LlamaConfig`` fields gives any other. The
tokenizer is the embedded model's (or ``tokenizer``: a local Hugging Face folder); the vocabulary
follows it, so the output layer is the tokenizer's size, not the original model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError

SHAPES = {  # LlamaConfig fields of each architecture (vocabulary excepted)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
}


def shape_of(spec: str) -> tuple[str, dict]:
    """(name, LlamaConfig fields) of a named shape or a JSON file; ValueError with the choices otherwise."""
    if spec in SHAPES:
        return spec, dict(SHAPES[spec])
    path = Path(spec).expanduser()
    if path.suffix == ".json" and path.is_file():
        try:
            fields = json.loads(path.read_text())
        except ValueError as exc:
            raise UserError(f"--random-model {path}: not valid JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise UserError(f"--random-model {path}: expected a JSON object of LlamaConfig fields")
        return path.stem, fields
    raise UserError(f"--random-model: {spec!r} is neither a known shape ({', '.join(SHAPES)}) nor a .json file")


@torch.no_grad()
def random_model(spec: str, device: str | torch.device | None = None, dtype: str | torch.dtype | None = "auto",
                 tokenizer: str | None = None, seed: int = 0):
    """A ``LoadedModel`` of random weights (normal, std 0.02) in the shape ``spec``, built on ``device``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ..llm import LoadedModel, default_device, embedded_model_dir, resolve_dtype

    name, fields = shape_of(spec)
    folder = Path(tokenizer).expanduser() if tokenizer else embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    try:
        config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **fields)
    except TypeError as exc:
        raise UserError(f"--random-model {spec}: {exc}") from None
    config._attn_implementation = "sdpa"
    # Built on the meta device in the target dtype, then given storage once, in that dtype: an fp32
    # build then a cast held 32 GB of fp32 weights (plus the copy) for an 8B model.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied weights separate storage
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        param.normal_(0.0, 0.02, generator=generator)
    for parent in list(model.modules()):  # rotary frequencies: built for real (float32, as loading keeps them)
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, child_name, type(child)(config).to(device))
    model.eval()
    fingerprint = f"random-{name}-{seed}"
    return LoadedModel(model=model, tokenizer=tok, name=f"random {name}", path=fingerprint, fingerprint=fingerprint,
                       tokenizer_hash=fingerprint)

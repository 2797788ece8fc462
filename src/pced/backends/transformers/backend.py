"""``TransformersBackend``: the default backend, declared for the registry (``pced.backend``).

Its rows are ``pced.backends.rows.ExpertRows`` over one preallocated batch buffer; its document
caches are KV tensors in ``STORE/kv/`` (``pced.kv.store.KVStore``), which a backend without caches
of its own (``Capabilities.own_caches``) reads too. Nothing heavy is imported at module level: the registry imports this module to read the
backend's capabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...backend import Backend, Capabilities

KV_DIR = "kv"  # a store's transformers caches (and the name every backend's document cache file shares)


class TransformersBackend(Backend):
    name = "transformers"
    summary = "a Hugging Face model folder in torch, CPU or GPU; every method (the default)"
    capabilities = Capabilities()

    def load_model(self, model: str | None, settings: Any, device: str | None = None, dtype: str = "auto") -> Any:
        from ...llm import load_model

        return load_model(model, device=device, dtype=dtype)

    def model_key(self, settings: Any) -> tuple:
        """Models that load the same way share one load in a store (a subclass that loads alike inherits it)."""
        return ("torch",)

    # -- document caches ------------------------------------------------------------------
    def cache_name(self, settings: Any) -> str:
        return KV_DIR

    def cache_dirs(self, root: Path) -> list[Path]:
        kv = Path(root) / KV_DIR
        return [kv] if kv.is_dir() else []

    def request_cache_dir(self, cache_dir, model: Any, template: Any, settings: Any, storage_dtype: str = "float16") -> Path:
        """The request cache directory itself (its KV store's root), or a folder per model, template
        and storage dtype under the cache root."""
        if cache_dir is not None:
            return Path(cache_dir)
        from ...llm import cache_root

        return cache_root() / KV_DIR / f"{model.name}-{model.fingerprint[:8]}-{template.name}-{storage_dtype}"

    def open_caches(self, model: Any, builder: Any, directory: Path, settings: Any, **policy: Any) -> Any:
        """The caches of ``directory``, for rows this backend runs with ``model``'s weights: a model
        another backend loaded without them (vLLM's, in a store both serve) gets them now."""
        from ...kv.store import KVStore

        return KVStore(directory, model.with_weights(f"for the {self.name} backend"), builder, **policy)

    def cache_files(self, directory: Path) -> Path:
        return Path(directory) / KV_DIR

    def verify_caches(self, directory: Path, remove: bool = False, referenced: set[str] | None = None) -> dict:
        from ...kv.format import verify_cache_dir

        return verify_cache_dir(Path(directory), remove=remove, referenced=referenced)

    def check_cache(self, directory: Path, path: Path, digest: str) -> dict:
        from ...kv.file_check import check_cache_bytes, read_identity

        return check_cache_bytes(path, read_identity(Path(directory), "kvstore.json", recorded=("model",)), digest)

    def cache_estimate(self, model: Any, storage_dtype: str, token_counts: list[int]) -> dict | None:
        """Keys and values of every layer and key-value head per token (int8 adds a float32 scale per
        token and head)."""
        config = model.model.config
        layers = int(config.num_hidden_layers)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        width = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[storage_dtype]
        per_token = 2 * layers * heads * head_dim * width + (layers * heads * 4 if storage_dtype == "int8" else 0)
        tokens = sum(token_counts)
        return {"bytes_per_token": per_token, "tokens": tokens, "bytes": per_token * tokens}

    # -- a question -----------------------------------------------------------------------
    def expert_rows(self, generator: Any, candidates: list, question: str, sampling: Any, rule: Any,
                    max_joins: int = 0) -> Any:
        from ..rows import ExpertRows

        caches, builder = generator.caches, generator.builder
        digests = caches.add([c.document.render() for c in candidates], progress=False)
        return ExpertRows(generator.llm, caches.prefix(), [lambda d=d: caches.load(d) for d in digests],
                          builder.suffix_ids(question, with_context=True),
                          builder.suffix_ids(question, with_context=False), sampling.max_new_tokens)

    # -- bench hooks ----------------------------------------------------------------------
    def work_shape(self, generator: Any) -> Any:
        from .bench import torch_work_shape

        return torch_work_shape(generator.llm.model)

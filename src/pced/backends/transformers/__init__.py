"""The transformers backend: a Hugging Face model in torch, pced's own rows over one preallocated KV
buffer (``pced.backends.rows``), document caches as KV tensors (``pced.kv``). The default backend:
it runs every method."""

from .backend import TransformersBackend

__all__ = ["TransformersBackend"]

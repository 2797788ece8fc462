"""PCED on llama.cpp (optional: ``pip install 'pced[llamacpp]'``, llama-cpp-python): a GGUF model as
it ships, sequences as rows, document caches as stored sequence states.

``model`` loads the GGUF and wraps a llama.cpp context; ``states`` stores and restores document
caches (``verify`` checks them without a model); ``rows`` is the backend of the one decoding loop;
``backend`` declares all of it to the registry (``pced.backend``); ``settings`` holds its options.
"""

from .backend import LlamaCppBackend

__all__ = ["LlamaCppBackend"]

"""PCED on llama.cpp (optional: ``pip install 'pced[llamacpp]'``, llama-cpp-python): a GGUF model as
it ships, sequences as rows, document caches as stored sequence states.

``model`` loads the GGUF and wraps a llama.cpp context; ``states`` stores and restores document
caches; ``rows`` is the backend of the one decoding loop; ``generator`` ties them for a question.
"""

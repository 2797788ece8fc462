"""Backends: what runs the model rows under the one decoding loop (``pced.decoding.Rows``).

``rows`` is the transformers backend (one preallocated KV buffer, explicit masks and positions);
``ape_attention`` adds APE's merged attention to it. A second engine (vLLM, llama.cpp) drives the
same rule (``pced.rule``) and produces the same ``pced.answers`` types.
"""

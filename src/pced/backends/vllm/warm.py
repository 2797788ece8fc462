"""The engine's first question, asked before a server says it is ready.

The first PCED question after an engine starts pays once what no later question pays: measured on
the CPU build (vLLM 0.32, the embedded model, 2 cores), the group's first step, the first one that
asks for logprobs (the carriers: ``channel.py``), spends 2.1 s in vLLM's sampler, which compiles
``batched_count_greater_than`` with ``torch.compile`` on its first call
(``v1/sample/ops/logprobs.py:10-27``, called from ``Sampler.gather_logprobs``:
``v1/sample/sampler.py:312-356``; its batch dimension is marked unbacked, ``:344-350``, so one
compilation serves every batch size), and 10.5 s where Inductor's cache on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default under /tmp) is empty and the kernel is built with the
C++ compiler. The prefill pass asks for no logprobs, so prefilling documents at start
(``--warm-up``) does not pay it.

``warm_start`` pays it with a question of the server's own shape: the amateur and one expert over
a made-up document no store holds, through the same rows, processor, connector (the store's prefix
read through it; the document prefilled by vLLM, since the store has no file for it) and decoding
loop as a client's question, two tokens long. It reads the store and writes nothing to it; it is
counted apart from the engine's questions (``warm_start_tokens``).
"""

from __future__ import annotations

import time
from typing import Any

from ...decoding.loop import Generation
from ...decoding.sampling import SamplingConfig
from ...documents import Candidate, Document
from ...options import resolve_rule

DOCUMENT = Document(id="pced-warm-start", title="Warm start",
                    text="This note exists only to start the engine: the lamp by the north window was lit at dusk.")
QUESTION = "When was the lamp lit?"
TOKENS = 2  # the first token, and one decode step


def warm_start(engine: Any, generator: Any) -> float:
    """Answer the made-up question on ``engine`` (a ``VLLMEngine``) with ``generator``'s prompt
    builder and store (a ``pced.generator.Generator`` of the vLLM backend); the seconds it took."""
    from .engine import EngineRows, TapeScoring

    started = time.perf_counter()
    candidates = [Candidate(DOCUMENT, 0.5)]
    rule = resolve_rule(generator.llm)
    sampling = SamplingConfig(max_new_tokens=TOKENS, ignore_eos=True)
    rows = EngineRows(engine, generator.builder, candidates, QUESTION, rule, sampling, store=generator.caches,
                      counted=False)
    Generation(rows, TapeScoring(rows.betas, candidates, rule), generator.llm, sampling).answer()
    engine.count(warm_start_tokens=len(rows.tokens))
    return time.perf_counter() - started

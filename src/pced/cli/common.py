"""What the subcommands share: the one-line error type, model options, and the ask / decoding
options whose defaults come from ``AskOptions`` and ``SamplingConfig`` (never restated here)."""

from __future__ import annotations

import argparse

from ..errors import UserError
from ..sampling import SamplingConfig
from ..kv.tiers import CacheTiers
from ..options import (BACKENDS, LLAMA_CACHE_TYPES, METHODS, PAPER_RULE, RETRIEVERS, AskOptions, LlamaSettings,
                       VLLMSettings, family_defaults)
from ..rule import AGGREGATIONS, BETA_MODES, PRIORS, SCORE_SPACES, RuleConfig

SAMPLING = SamplingConfig()
TIERS = CacheTiers()
VLLM = VLLMSettings()
LLAMA = LlamaSettings()


class InputError(UserError):
    """Bad user input: reported as one line on stderr, exit code 2."""


def parse_beta(value: str) -> str | float:
    if value in BETA_MODES:
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"beta must be a number or one of {', '.join(BETA_MODES)}") from None


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    group.add_argument("--gpu-cache-gb", type=float, default=TIERS.gpu_cache_gb,
                       help="keep this many GiB of document caches on the model's device between questions (LRU; "
                            f"default: {TIERS.cuda_free_share:g} of the free GPU memory on CUDA, none on a CPU; "
                            "0: none; on a CPU model the copies are kept in RAM)")


def tiers_from(args: argparse.Namespace) -> CacheTiers:
    """The cache tiers of --gpu-cache-gb, checked (the defaults where a subcommand has no such option)."""
    try:
        return CacheTiers(gpu_cache_gb=getattr(args, "gpu_cache_gb", TIERS.gpu_cache_gb))
    except UserError as exc:
        raise InputError(f"--gpu-cache-gb: {exc}") from None


def add_retrieval_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("retrieval")
    group.add_argument("--method", default=AskOptions.method, help=f"{', '.join(METHODS)} (default {AskOptions.method})")
    group.add_argument("--top-k", dest="top_k", type=int, default=AskOptions.top_k,
                       help=f"documents used as experts (default {AskOptions.top_k})")
    group.add_argument("--top-n", type=int, default=AskOptions.top_n,
                       help=f"candidates retrieved before reranking (default {AskOptions.top_n})")
    group.add_argument("--retriever", default=AskOptions.retriever,
                       help=f"{', '.join(RETRIEVERS)} (default {AskOptions.retriever}); colbert needs a BGE-M3 store")
    group.add_argument("--reranker", default=AskOptions.reranker, help="override the store's reranker path")
    group.add_argument("--no-rerank", action="store_true", help="skip the store's reranker")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding (unset rule settings: the model family's rule)")
    group.add_argument("--beta", type=parse_beta, default=AskOptions.beta,
                       help="dynamic (AdaCAD, the paper's), elementwise (the authors' library: per-token JSD terms, frozen at the first step), or a number")
    group.add_argument("--gamma", type=float, default=AskOptions.gamma,
                       help="weight of the retrieval prior gamma*log r (default: the model family's measured value, "
                            f"{family_defaults('gamma')} or with --paper-defaults)")
    group.add_argument("--paper-defaults", action="store_true",
                       help=f"unset settings from the paper's rule (gamma {PAPER_RULE.gamma:g})")
    group.add_argument("--aggregation", choices=AGGREGATIONS, default=AskOptions.aggregation, help="max (the paper's), moe, poe")
    group.add_argument("--score-space", choices=SCORE_SPACES, default=AskOptions.score_space, help="logits (the paper's) or logprobs")
    group.add_argument("--prior", choices=PRIORS, default=AskOptions.prior,
                       help=f"the retrieval prior: log (gamma*log r, the paper's; default {RuleConfig.prior}) or standardized "
                            "(gamma*(log r - best log r)/spread of the question's log r: one gamma for every retriever)")
    group.add_argument("--max-new-tokens", type=int, default=SAMPLING.max_new_tokens,
                       help=f"tokens per answer (default {SAMPLING.max_new_tokens}; the API's max_tokens)")
    group.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0 = greedy (default)")
    group.add_argument("--sample-top-k", dest="sample_top_k", type=int, default=SAMPLING.top_k,
                       help="sampling: keep the k best tokens")
    group.add_argument("--sample-top-p", dest="top_p", type=float, default=SAMPLING.top_p, help="sampling: nucleus mass")
    group.add_argument("--seed", type=int, default=SAMPLING.seed)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--no-repeat-ngram", dest="no_repeat_ngram", type=int, default=SAMPLING.no_repeat_ngram, metavar="N",
                       help="never generate an n-gram of N tokens the answer already holds, after the rule, for every "
                            f"method (default {SAMPLING.no_repeat_ngram}: off)")
    group.add_argument("--loop-span", dest="loop_span", type=int, default=SAMPLING.loop_span, metavar="N",
                       help="end the answer where it starts to loop: a span of N tokens or more twice in a row, or of "
                            f"2 or more three times; one copy stays (default {SAMPLING.loop_span}; 0: off)")
    group.add_argument("--max-experts", type=int, default=AskOptions.max_experts,
                       help="PCED: keep at most this many experts (by relevance)")
    group.add_argument("--prune-margin", type=float, default=AskOptions.prune_margin,
                       help="PCED: drop experts whose prior gamma*log r is this many logits below the best one")
    group.add_argument("--rescore", action="store_true", default=AskOptions.rescore,
                       help="PCED: at each word boundary rank the documents again with the question plus the answer "
                            "so far; an expert's r becomes the higher of the two")
    group.add_argument("--max-joins", type=int, default=AskOptions.max_joins,
                       help="PCED: documents that may join as experts mid-answer when the answer so far ranks them "
                            f"in the top-k (default {AskOptions.max_joins}: off)")


def add_backend_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backend")
    group.add_argument("--backend", choices=BACKENDS, default=AskOptions.backend,
                       help="transformers (default), vllm (pced only, greedy; needs pip install 'pced[vllm]') or "
                            "llamacpp (pced only; a GGUF model: --model file.gguf; needs pip install 'pced[llamacpp]')")
    add_llamacpp_options(group)
    cpu, cuda = VLLMSettings.PLATFORM["cpu"], VLLMSettings.PLATFORM["cuda"]
    group.add_argument("--gpu-memory-utilization", type=float, default=VLLM.gpu_memory_utilization,
                       help="vllm: memory share for weights and KV cache (CPU build: RAM for the KV; default "
                            f"{cpu['gpu_memory_utilization']} on a CPU, {cuda['gpu_memory_utilization']} on CUDA)")
    group.add_argument("--vllm-dtype", default=VLLM.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                       help=f"vllm: the engine's dtype (default {cpu['dtype']} on a CPU, {cuda['dtype']}: the model's own, on CUDA)")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=VLLM.enforce_eager,
                       help=f"vllm: no CUDA graphs or compilation (default {cpu['enforce_eager']} on a CPU, "
                            f"{cuda['enforce_eager']} on CUDA)")
    group.add_argument("--max-model-len", type=int, default=VLLM.max_model_len,
                       help=f"vllm: the longest sequence (default: the model's window; on CUDA at most {cuda['max_model_len']})")
    group.add_argument("--max-num-batched-tokens", type=int, default=VLLM.max_num_batched_tokens,
                       help="vllm: tokens one engine step may prefill (default: max-model-len on CUDA, vLLM's own on a CPU)")
    group.add_argument("--max-num-seqs", type=int, default=VLLM.max_num_seqs,
                       help=f"vllm: requests scheduled at once (a question is N+1; default {VLLM.max_num_seqs})")
    group.add_argument("--tensor-parallel-size", type=int, default=VLLM.tensor_parallel_size,
                       help="vllm: GPUs one model is split over (only 1: the trace cannot come back from other processes)")
    group.add_argument("--kv-transfer-config", default=VLLM.kv_transfer_config, metavar="FILE",
                       help="vllm: a JSON file with vLLM's KVTransferConfig (LMCache, native KV offloading), "
                            "to keep document KV beyond GPU memory and restarts")


def add_llamacpp_options(group) -> None:
    group.add_argument("--cache-type", choices=LLAMA_CACHE_TYPES, default=LLAMA.cache_type,
                       help=f"llamacpp: the KV cache type, also of stored sequence states (default {LLAMA.cache_type})")
    group.add_argument("--gpu-layers", type=int, default=LLAMA.gpu_layers, metavar="N",
                       help="llamacpp: layers on the GPU when llama-cpp-python was built with one (Metal, CUDA); "
                            "default: all there, none on a CPU build; 0 keeps the CPU")


def llamacpp_settings_from(args: argparse.Namespace) -> LlamaSettings:
    """The llama.cpp settings of --cache-type and --gpu-layers (threads: --threads, through torch's setting)."""
    gpu_layers = getattr(args, "gpu_layers", LLAMA.gpu_layers)
    if gpu_layers is not None and gpu_layers < 0:
        raise InputError(f"--gpu-layers must be 0 or more (got {gpu_layers})")
    return LlamaSettings(cache_type=getattr(args, "cache_type", LLAMA.cache_type), gpu_layers=gpu_layers)


def vllm_settings_from(args: argparse.Namespace) -> VLLMSettings:
    """The engine settings of --backend vllm's options (the defaults where a subcommand has none)."""
    if not hasattr(args, "backend"):
        return VLLM
    try:
        return VLLMSettings(gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                            tensor_parallel_size=args.tensor_parallel_size, kv_transfer_config=args.kv_transfer_config,
                            dtype=args.vllm_dtype, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def ask_options_from(args: argparse.Namespace) -> AskOptions:
    """AskOptions from parsed options; a subcommand without retrieval options keeps those defaults.
    Every value is checked here, before any model or store loads."""
    fields = {name: getattr(args, name) for name in ("method", "top_k", "top_n", "retriever", "reranker", "beta", "gamma",
                                                     "aggregation", "score_space", "prior", "paper_defaults", "max_experts",
                                                     "prune_margin", "rescore", "max_joins") if hasattr(args, name)}
    if getattr(args, "no_rerank", False):
        fields["rerank"] = False
    if hasattr(args, "backend"):
        fields["backend"] = args.backend
    try:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.sample_top_k,
                                  top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), no_repeat_ngram=args.no_repeat_ngram,
                                  loop_span=args.loop_span)
        return AskOptions(**fields, sampling=sampling, vllm=vllm_settings_from(args), llamacpp=llamacpp_settings_from(args))
    except UserError as exc:
        raise InputError(str(exc)) from None


def open_store(args: argparse.Namespace):
    """The store of ``args.store``, with the model given by --model / --device / --dtype if any."""
    from ..llm import load_model
    from ..store import DocumentStore

    tiers = tiers_from(args)
    store = DocumentStore.open(args.store, tiers=tiers)
    if getattr(args, "backend", None) == "llamacpp":  # the GGUF on llama.cpp; the transformers model is never loaded
        store.llamacpp_generator(llamacpp_settings_from(args), args.model)
        return store
    if args.model is not None or args.device is not None or args.dtype != "auto":
        llm = load_model(args.model or store.settings.model_path, device=args.device, dtype=args.dtype)
        store = DocumentStore.open(args.store, llm, tiers=tiers)
    return store


__all__ = ["InputError", "add_backend_options", "add_llamacpp_options", "llamacpp_settings_from", "vllm_settings_from", "add_decoding_options", "add_model_options", "add_retrieval_options",
           "ask_options_from", "open_store", "parse_beta", "tiers_from"]

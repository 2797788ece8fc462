"""What the subcommands share: the one-line error type, model options, and the ask / decoding
options whose defaults come from ``AskOptions`` and ``SamplingConfig`` (never restated here)."""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from ..decoding.sampling import SamplingConfig
from ..kv.tier_settings import CacheTiers
from ..backend import get_backend
from ..options import METHODS, PAPER_RULE, RETRIEVERS, AskOptions, family_defaults
from ..decoding.rule_config import AGGREGATIONS, BETA_MODES, PRIORS, SCORE_SPACES, RuleConfig

SAMPLING = SamplingConfig()
TIERS = CacheTiers()


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


def backends_help(backends) -> str:
    """Each backend's name and summary, for a help text (a plug-in's ``%`` kept literal)."""
    return "; ".join(f"{b.name}: {b.summary}" for b in backends).replace("%", "%%")


def add_backend_options(parser: argparse.ArgumentParser, command: str = "ask", choices=None,
                        help: str | None = None) -> None:
    """--backend (every registered backend, or ``choices``) and each built-in backend's own flags; a
    plug-in's wait for ``add_plugin_options``. A plug-in that cannot be used is left out of the help
    (with a warning) but stays a choice, so that naming it gives its one-line error, not argparse's usage."""
    from ..backend import REGISTRY, all_backends, backend_names

    backends = [b for b in all_backends() if choices is None or b.name in choices]
    group = parser.add_argument_group("backend")
    default = get_backend(AskOptions.backend)
    group.add_argument("--backend", choices=[n for n in backend_names() if choices is None or n in choices],
                       default=default.name, metavar="{" + ",".join(b.name for b in backends) + "}",
                       help=help or backends_help(backends))
    for backend in backends:
        if backend.name in REGISTRY:
            backend.add_options(group, command)
    parser.pced_plugin_flags = (group, command, [b for b in backends if b.name not in REGISTRY])


def _usable(backend) -> bool:
    try:
        return get_backend(backend.name) is backend  # not set aside since
    except UserError:
        return False


def add_plugin_options(commands: list[argparse.ArgumentParser]) -> None:
    """The plug-ins' own flags, once every command has all of its own: each plug-in's tried on a copy
    of every command first, so that flags that raise or take a name a command already has set that
    plug-in aside with a warning (``pced.backend.set_aside``) instead of stopping every command."""
    from ..backend import set_aside

    pending = [getattr(parser, "pced_plugin_flags", None) + (parser,) for parser in commands
               if hasattr(parser, "pced_plugin_flags")]
    for _, command, plugins, parser in pending:
        for backend in filter(_usable, plugins):
            trial = argparse.ArgumentParser(add_help=False, parents=[parser])
            try:
                backend.add_options(trial.add_argument_group("backend"), command)
            except Exception as exc:  # the plug-in's own code
                set_aside(backend.name, f"its flags for pced {command}: {type(exc).__name__}: {exc}")
    for group, command, plugins, _ in pending:
        for backend in filter(_usable, plugins):
            backend.add_options(group, command)


def backend_settings_from(args: argparse.Namespace):
    """The chosen backend's settings from its flags (the defaults where a subcommand has none);
    every value checked here, before any model loads."""
    backend = get_backend(getattr(args, "backend", AskOptions.backend))
    try:
        return backend.settings_from_args(args)
    except (UserError, ValueError) as exc:
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
    settings = backend_settings_from(args)
    try:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.sample_top_k,
                                  top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), no_repeat_ngram=args.no_repeat_ngram,
                                  loop_span=args.loop_span)
        return AskOptions(**fields, sampling=sampling, backend_settings=settings)
    except UserError as exc:
        raise InputError(str(exc)) from None


def open_store(args: argparse.Namespace):
    """The store of ``args.store``, its model on the chosen backend loaded now: --model (another
    folder or file of the store's model, e.g. a GGUF with its tokenizer), --device and --dtype
    where given. A backend that runs only some methods loads no other model until one is asked."""
    from ..store import DocumentStore

    store = DocumentStore.open(args.store, tiers=tiers_from(args))
    backend = get_backend(getattr(args, "backend", AskOptions.backend))
    load = {"device": args.device, "dtype": args.dtype} if hasattr(args, "device") else {}
    say(f"loading the model ({args.model or store.settings.model}, on {backend.name}) and the store's retrievers ...")
    settings = backend_settings_from(args)
    backend.prepare(store.model_for(backend, settings, args.model, **load), settings)  # an engine starts first
    store.retriever(getattr(args, "retriever", AskOptions.retriever))  # loaded now: a question's retrieval_s is retrieval
    if not getattr(args, "no_rerank", True):
        store.reranker(getattr(args, "reranker", None))
    return store


def say(text: str) -> None:
    """A phase named on stderr for a person at a terminal (a script's stderr stays for errors)."""
    if sys.stderr.isatty():
        print(f"pced: {text}", file=sys.stderr, flush=True)


__all__ = ["InputError", "add_backend_options", "add_decoding_options", "add_model_options", "add_plugin_options",
           "add_retrieval_options", "ask_options_from", "backend_settings_from", "backends_help", "open_store", "parse_beta",
           "tiers_from"]

"""``pced eval``: score methods and the paper's ablation sweeps on a dataset (resumable).

Every option is read as text and checked here and in ``pced.evaluation.runner.validate``, so a
bad value is one ``pced: error: ...`` line (exit 2) before any model or store is touched.
"""

from __future__ import annotations

import argparse
import logging
import math

from ..decoding.sampling import SamplingConfig
from ..evaluation.config import EvalConfig
from ..options import METHODS, RETRIEVERS, STORAGE_DTYPES

EVAL = EvalConfig(dataset="")  # the defaults of an evaluation run
from ..backend import all_backends
from .common import InputError, add_backend_options, add_model_options, backend_settings_from

SWEEP_HELP = "comma list; a list of several values is a sweep"


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate methods (and sweeps) on a dataset; resumable",
                       description="Evaluate methods on a dataset. Comma lists sweep a setting: PCED runs the "
                                   "product of all lists, baselines vary with --top-k only. Results are appended "
                                   "to OUT/results.jsonl as they finish; a rerun skips what is there.")
    p.add_argument("--dataset", required=True,
                   help="hotpotqa, musique, nq, bbh-date, bbh-web-of-lies, bbh-tracking7, secret-code, "
                        "a LOFT directory (corpus.jsonl + *_queries.jsonl) or a LongBench .jsonl")
    p.add_argument("--methods", default=",".join(EVAL.methods),
                   help=f"comma list of {', '.join(METHODS)} (default {','.join(EVAL.methods)})")
    p.add_argument("--limit", default=None, help="first N examples (default: all)")
    p.add_argument("--setting", default=None, help="distractor or corpus (default: the dataset's own)")
    p.add_argument("--retriever", default=EVAL.retriever,
                   help=f"{', '.join(RETRIEVERS)} (default {EVAL.retriever}); colbert needs --bge-m3")
    p.add_argument("--relevance", default=None,
                   help="PCED only: take r_k from these retrievers for the same candidates (the paper's "
                        f"PCED-Sparse/-Dense/-ColBERT; default: --retriever's); {SWEEP_HELP}")
    p.add_argument("--follow", default=None,
                   help="PCED decode-time relevance: off, rescore, join, rescore+join (the answer so far ranks "
                        f"the documents again; see docs/rule.md); {SWEEP_HELP}")
    p.add_argument("--max-joins", type=int, default=EVAL.max_joins,
                   help=f"experts that may join per answer with --follow join (default {EVAL.max_joins})")
    top_k = ",".join(map(str, EVAL.top_k))
    p.add_argument("--top-k", dest="top_k", default=top_k, help=f"experts / documents per question (default {top_k}); {SWEEP_HELP}")
    p.add_argument("--top-n", dest="top_n", default=str(EVAL.top_n),
                   help=f"corpus setting: candidates retrieved before the cut (default {EVAL.top_n})")
    p.add_argument("--beta", default=None, help=f"dynamic, elementwise or numbers; {SWEEP_HELP}")
    p.add_argument("--gamma", default=None, help=f"retrieval prior weight(s); {SWEEP_HELP}")
    p.add_argument("--aggregation", default=None, help=f"max, moe, poe; {SWEEP_HELP}")
    p.add_argument("--score-space", dest="score_space", default=None, help=f"logits, logprobs; {SWEEP_HELP}")
    p.add_argument("--prior", default=None,
                   help=f"log (gamma*log r, the paper's) or standardized (log r standardized within the question); {SWEEP_HELP}")
    p.add_argument("--no-repeat-ngram", dest="no_repeat_ngram", default=None, metavar="N",
                   help="every method: never repeat an n-gram of N tokens of the answer (0 = off; default "
                        f"{SamplingConfig.no_repeat_ngram}); {SWEEP_HELP}")
    p.add_argument("--loop-span", dest="loop_span", default=None, metavar="N",
                   help="every method: end an answer where a span of N tokens or more repeats back to back (0 = off; "
                        f"default {SamplingConfig.loop_span}); {SWEEP_HELP}")
    p.add_argument("--paper-defaults", action="store_true",
                   help="unset PCED settings from the paper's rule (default: the per-model-family defaults)")
    p.add_argument("--max-new-tokens", default=str(EVAL.max_new_tokens),
                   help=f"tokens per answer (default {EVAL.max_new_tokens})")
    p.add_argument("--seed", default=str(EVAL.seed), help=f"default {EVAL.seed}")
    p.add_argument("--data-dir", default=None, help="shared data folder (default: $PCED_DATA_DIR or ../shared/data)")
    p.add_argument("--out", default=None, help="output folder (default runs/eval/<dataset>)")
    p.add_argument("--work-dir", default=None,
                   help="document store folder (default runs/stores/<dataset>-<setting>-<model>-<template>)")
    p.add_argument("--bge-m3", default=None, help="local BGE-M3: sparse/dense/ColBERT relevance (the paper's variants)")
    p.add_argument("--reranker", default=None, help="local cross-encoder / bge-reranker: rerank and fuse relevance")
    p.add_argument("--storage-dtype", default=EVAL.storage_dtype,
                   help=f"KV cache dtype on disk: {', '.join(STORAGE_DTYPES)} (default {EVAL.storage_dtype})")
    p.add_argument("--max-doc-tokens", default=str(EVAL.max_doc_tokens),
                   help=f"longer documents are split into chunks (default {EVAL.max_doc_tokens})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_backend_options(p, "eval", help="the methods a backend runs run on it, the others on the default one: "
                                        + "; ".join(f"{b.name}: {b.summary}" for b in all_backends()))
    add_model_options(p)
    p.set_defaults(func=cmd_eval)


def _items(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise InputError(f"{option}: empty value in {text!r} (expected a comma list)")
    return items


def _number(item: str, option: str, integer: bool = False):
    try:
        value = int(item) if integer else float(item)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise InputError(f"{option}: {item!r} is not {kind}") from None
    if not integer and not math.isfinite(value):
        raise InputError(f"{option}: {item!r} is not a finite number")
    return value


def _int_option(text: str | None, option: str, minimum: int) -> int | None:
    if text is None:
        return None
    value = _number(text.strip(), option, integer=True)
    if value < minimum:
        raise InputError(f"{option} must be at least {minimum}, got {value}")
    return value


def _choices(text: str | None, option: str, allowed) -> list[str] | None:
    if text is None:
        return None
    items = _items(text, option)
    for item in items:
        if item not in allowed:
            raise InputError(f"{option}: {item!r} is not one of {', '.join(allowed)}")
    return items


def config_from(args: argparse.Namespace):
    """EvalConfig from the command line; every value checked, nothing loaded."""
    from ..evaluation.config import EvalConfig
    from ..options import METHODS
    from ..decoding.rule_config import AGGREGATIONS, BETA_MODES, PRIORS, SCORE_SPACES

    if args.setting not in (None, "distractor", "corpus"):
        raise InputError(f"--setting: {args.setting!r} is not one of distractor, corpus")
    if args.storage_dtype not in STORAGE_DTYPES:
        raise InputError(f"--storage-dtype: {args.storage_dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    betas = None
    if args.beta is not None:
        betas = [b if b in BETA_MODES else _number(b, "--beta") for b in _items(args.beta, "--beta")]
    gammas = None if args.gamma is None else [_number(g, "--gamma") for g in _items(args.gamma, "--gamma")]
    if gammas and min(gammas) < 0:
        raise InputError(f"--gamma: values must be >= 0, got {min(gammas):g}")
    nrngs = None
    if args.no_repeat_ngram is not None:
        nrngs = [_number(n, "--no-repeat-ngram", integer=True) for n in _items(args.no_repeat_ngram, "--no-repeat-ngram")]
        if min(nrngs) < 0:
            raise InputError(f"--no-repeat-ngram: values must be >= 0 (0 = off), got {min(nrngs)}")
    loops = None
    if args.loop_span is not None:
        loops = [_number(n, "--loop-span", integer=True) for n in _items(args.loop_span, "--loop-span")]
        if any(n != 0 and n < 2 for n in loops):
            raise InputError(f"--loop-span: values must be 0 (off) or at least 2, got {min(loops)}")
    backend_settings = backend_settings_from(args)
    return EvalConfig(
        dataset=args.dataset,
        methods=_choices(args.methods, "--methods", METHODS),
        limit=_int_option(args.limit, "--limit", 1),
        setting=args.setting,
        model=args.model, device=args.device, dtype=args.dtype, gpu_cache_gb=args.gpu_cache_gb,
        retriever=args.retriever,
        relevance=None if args.relevance is None else _items(args.relevance, "--relevance"),
        top_k=[_number(k, "--top-k", integer=True) for k in _items(args.top_k, "--top-k")],
        beta=betas, gamma=gammas,
        aggregation=_choices(args.aggregation, "--aggregation", AGGREGATIONS),
        score_space=_choices(args.score_space, "--score-space", SCORE_SPACES),
        prior=_choices(args.prior, "--prior", PRIORS),
        no_repeat_ngram=nrngs,
        loop_span=loops,
        paper_defaults=args.paper_defaults,
        max_new_tokens=_int_option(args.max_new_tokens, "--max-new-tokens", 1),
        seed=_int_option(args.seed, "--seed", 0),
        top_n=_int_option(args.top_n, "--top-n", 1),
        data_dir=args.data_dir, out=args.out, work_dir=args.work_dir,
        bge_m3=args.bge_m3, reranker=args.reranker, storage_dtype=args.storage_dtype,
        max_doc_tokens=_int_option(args.max_doc_tokens, "--max-doc-tokens", 16),
        progress=not args.no_progress,
        backend=args.backend,
        backend_settings=backend_settings,
        follow=None if args.follow is None else _items(args.follow, "--follow"),
        max_joins=args.max_joins,
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from ..evaluation.runner import run_eval, validate

    logging.basicConfig(level=logging.WARNING, format="pced: %(message)s")
    run_eval(validate(config_from(args)))
    return 0

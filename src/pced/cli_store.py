"""``pced index``, ``pced ask`` and ``pced demo``: the DocumentStore from the command line."""

from __future__ import annotations

import argparse
import json
import logging
from importlib import resources
from pathlib import Path

from .cli import InputError, add_decoding_options, add_model_options, rule_from, sampling_from

DEMO_QUESTIONS = "demo_questions.json"
DEMO_CORPUS = "demo_corpus.jsonl"


def add_index_parser(sub) -> None:
    p = sub.add_parser("index", help="build or extend a document store (retrieval indexes + KV caches)")
    p.add_argument("corpus", help='JSONL: {"id", "text", "title"?} or LOFT {"pid", "title_text", "passage_text"} per line')
    p.add_argument("--out", required=True, help="store directory (created, or extended if it exists)")
    p.add_argument("--model", default=None, help="local Hugging Face causal LM (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dense-model", default=None, help="local sentence-transformers model (default: packaged all-MiniLM-L6-v2)")
    p.add_argument("--bge-m3", default=None, help="local BGE-M3 directory: sparse/dense/ColBERT from BGE-M3 instead of BM25/MiniLM")
    p.add_argument("--reranker", default=None, help="local cross-encoder or bge-reranker-v2-m3 directory, used by pced ask")
    p.add_argument("--template", choices=["rag", "icl"], default="rag")
    p.add_argument("--storage-dtype", choices=["float16", "float32", "bfloat16"], default="float16")
    p.add_argument("--max-doc-tokens", type=int, default=1024, help="longer documents are split into chunks (logged)")
    p.add_argument("--lazy-kv", action="store_true",
                   help="build the retrieval indexes only; encode a document's KV cache the first time it is retrieved")
    p.set_defaults(func=cmd_index)


def add_ask_parser(sub) -> None:
    p = sub.add_parser("ask", help="answer a question from a store")
    p.add_argument("store", help="store directory built by pced index")
    p.add_argument("question")
    p.add_argument("--method", default="pced", help="pced (default), all, single, ape or mapreduce")
    p.add_argument("--top-k", dest="top_k", type=int, default=8, help="documents used as experts (default 8)")
    p.add_argument("--top-n", type=int, default=90, help="candidates retrieved before reranking (default 90)")
    p.add_argument("--retriever", default="hybrid", help="hybrid (default), sparse, dense or colbert (BGE-M3 stores)")
    p.add_argument("--reranker", default=None, help="override the store's reranker path")
    p.add_argument("--no-rerank", action="store_true", help="skip the store's reranker")
    p.add_argument("--json", action="store_true", help="print one JSON object (the DESIGN.md contract)")
    p.add_argument("--trace-png", default=None, help="save the expert-trace picture to this PNG")
    add_model_options(p)
    add_decoding_options(p)
    p.set_defaults(func=cmd_ask)


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="index a small built-in corpus once and answer three questions")
    p.add_argument("--rebuild", action="store_true", help="rebuild the demo store")
    p.set_defaults(func=cmd_demo)


def cmd_index(args: argparse.Namespace) -> int:
    from .corpus import read_corpus
    from .store import DocumentStore, IndexSettings

    logging.basicConfig(level=logging.WARNING, format="pced: %(message)s")
    if args.max_doc_tokens < 16:
        raise InputError("--max-doc-tokens must be at least 16")
    corpus = read_corpus(args.corpus)  # validated before anything is written
    settings = IndexSettings(
        model=args.model or "embedded", dense_model=args.dense_model, bge_m3=args.bge_m3, reranker=args.reranker,
        template=args.template, storage_dtype=args.storage_dtype, max_doc_tokens=args.max_doc_tokens,
    )
    _, report = DocumentStore.index(corpus, args.out, settings, encode_kv=not args.lazy_kv)
    print(
        f"pced: store {args.out}: {report['documents']} documents ({report['added']} added, {report['updated']} updated, "
        f"{len(report['chunked'])} chunked); {report['kv_encoded']} KV caches encoded in {report['kv_s']:.1f} s"
        f"{' (--lazy-kv: the others on first use)' if args.lazy_kv else ''}; "
        f"retrieval indexes built in {report['retrieval_index_s']:.1f} s"
    )
    return 0


def _validate_ask(args: argparse.Namespace) -> None:
    from .methods import check_method

    check_method(args.method)
    if not args.question.strip():
        raise InputError("the question is empty")
    if args.top_k < 1:
        raise InputError("--top-k must be at least 1")


def run_question(store, question: str, args: argparse.Namespace):
    """Retrieve, then stream the chosen method; returns (generation, candidates, retrieval seconds)."""
    import time

    from .methods import make_generation

    started = time.perf_counter()
    candidates = store.retrieve(question, args.retriever, top_k=args.top_k, top_n=args.top_n,
                                rerank=not args.no_rerank, reranker_path=args.reranker)
    retrieval_s = time.perf_counter() - started
    rule = rule_from(args, getattr(args, "model", None) or store.settings.model)
    if args.method == "pced":
        from .engine import prune_candidates

        candidates = prune_candidates(candidates, rule.gamma, args.max_experts, args.prune_margin)
    generation = make_generation(store.engine, args.method, candidates, question, rule, sampling_from(args))
    return generation, candidates, retrieval_s


def cmd_ask(args: argparse.Namespace) -> int:
    from .llm import load_model
    from .store import DocumentStore

    _validate_ask(args)
    rule_from(args), sampling_from(args)  # bad settings fail before any model loads
    store = DocumentStore.open(args.store)
    if args.model is not None or args.device is not None or args.dtype != "auto":
        store = DocumentStore.open(args.store, load_model(args.model or (None if store.settings.model == "embedded" else store.settings.model),
                                                          device=args.device, dtype=args.dtype))
    generation, candidates, retrieval_s = run_question(store, args.question, args)
    if args.json:
        from .engine import answer_json

        answer = generation.answer()
        print(json.dumps(answer_json(answer, candidates, retrieval_s), ensure_ascii=False))
    else:
        from .render import stream_answer

        answer = stream_answer(generation, candidates, args.question)
    if args.trace_png:
        from .trace_plot import save_trace_png

        save_trace_png(answer, candidates, args.trace_png, title=args.question)
    return 0


def demo_ask_args() -> argparse.Namespace:
    """What ``pced demo`` asks with: ``pced ask``'s defaults for the embedded model, top-4, 48 tokens."""
    return argparse.Namespace(retriever="hybrid", top_k=4, top_n=30, no_rerank=True, reranker=None, method="pced",
                              beta="dynamic", gamma=None, paper_defaults=False, model=None, aggregation="max",
                              score_space="logits", max_new_tokens=48, temperature=0.0, sample_top_k=0, top_p=1.0,
                              seed=None, stop=[], max_experts=None, prune_margin=None)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .corpus import read_corpus
    from .llm import cache_root
    from .render import stream_answer
    from .store import DocumentStore, IndexSettings, StoreError
    from .trace_plot import save_trace_png
    from . import __version__

    console = Console(highlight=False)
    root = cache_root() / f"demo-store-{__version__}"
    data = resources.files("pced") / "data"
    store = None
    if not args.rebuild:
        try:
            store = DocumentStore.open(root)
        except StoreError:
            store = None
    if store is None:
        console.print(f"[bold]Building the demo store[/bold] (once) in {root} ...")
        with resources.as_file(data / DEMO_CORPUS) as corpus_path:
            store, report = DocumentStore.index(read_corpus(corpus_path), root, IndexSettings())
        console.print(f"  {report['documents']} documents indexed, KV caches in {report['kv_s']:.1f} s")
    questions = json.loads((data / DEMO_QUESTIONS).read_text())
    ask_args = demo_ask_args()
    traces = root.parent / "demo-traces"
    for number, item in enumerate(questions, start=1):
        console.rule(f"[bold]Question {number}[/bold] ({item['note']})")
        generation, candidates, _ = run_question(store, item["question"], ask_args)
        answer = stream_answer(generation, candidates, item["question"], console)
        found = item["answer"].lower() in answer.text.lower()
        console.print(f"expected: {item['answer']}  {'[green]found in the answer[/green]' if found else '[red]not in the answer[/red]'}")
        png = save_trace_png(answer, candidates, traces / f"question{number}.png", title=item["question"])
        console.print(f"[dim]trace picture: {png}[/dim]")
    return 0

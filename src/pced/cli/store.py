"""``pced index``, ``pced ask`` and ``pced demo``: the DocumentStore from the command line."""

from __future__ import annotations

import argparse
import json
import math
import logging
import sys
from importlib import resources

from ..backend import all_backends
from ..decoding.sampling import SamplingConfig
from ..options import DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES, AskOptions, check_question
from .common import (InputError, add_backend_options, add_decoding_options, add_model_options, add_retrieval_options,
                     ask_options_from, backend_settings_from, open_store, say)

DEMO_QUESTIONS = "demo_questions.json"
DEMO_CORPUS = "demo_corpus.jsonl"
# What ``pced demo`` asks with: the defaults for the embedded model, top-4 of 30, no reranker, 48 tokens.
DEMO_OPTIONS = AskOptions(top_k=4, top_n=30, rerank=False, sampling=SamplingConfig(max_new_tokens=48))


def add_index_parser(sub) -> None:
    from ..store import IndexSettings

    defaults = IndexSettings()
    p = sub.add_parser("index", help="build or extend a document store (retrieval indexes + KV caches)")
    p.add_argument("corpus", help='JSON Lines or a JSON document (.gz too), chosen by content: {"id", "text", "title"?}, '
                   'LOFT {"pid", "passage_text", "title_text"?}, {"title", "text"}, or HotpotQA / MuSiQue / NQ '
                   'question or corpus files (every paragraph once)')
    p.add_argument("--out", required=True, help="store directory (created, or extended if it exists)")
    p.add_argument("--model", default=None, help="the model the backend loads: a local Hugging Face causal LM, or what "
                                                 "--backend's help names (default: the store's, else embedded "
                                                 "SmolLM2-135M-Instruct)")
    add_backend_options(p, "index", help="whose document caches to encode, each backend's in its own folder of the "
                                         "store (one store may hold several): " + "; ".join(
                                             f"{b.name}: {b.summary}" for b in all_backends()))
    # left unset: an existing store's own (a run that extends a store builds it as it was built), else the defaults
    p.add_argument("--dense-model", default=None, help="local sentence-transformers model (default: the store's, else "
                                                       "packaged all-MiniLM-L6-v2)")
    p.add_argument("--bge-m3", default=None, help="local BGE-M3 directory: sparse/dense/ColBERT from BGE-M3 instead of "
                                                  "BM25/MiniLM (default: the store's)")
    p.add_argument("--reranker", default=None, help="local cross-encoder or bge-reranker-v2-m3 directory, used by pced "
                                                    "ask (default: the store's)")
    p.add_argument("--template", choices=["rag", "icl"], default=None,
                   help=f"prompt template (default: the store's, else {defaults.template})")
    p.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default=None,
                   help=f"the KV caches' dtype on disk (default: the store's, else {DEFAULT_STORAGE_DTYPE})")
    p.add_argument("--max-doc-tokens", type=int, default=defaults.max_doc_tokens,
                   help=f"longer documents are split into chunks (logged; default {defaults.max_doc_tokens})")
    p.add_argument("--lazy-kv", action="store_true",
                   help="build the retrieval indexes only; encode a document's KV cache the first time it is retrieved")
    p.add_argument("--kv-budget-gb", type=float, default=defaults.kv_budget_gb,
                   help="keep the KV caches within this many GiB (2^30 bytes): encoded when first retrieved, least recently used "
                        "evicted (kept in the manifest; later runs keep it unless given again)")
    p.add_argument("--rebuild", action="store_true",
                   help="replace what the store holds with CORPUS, whatever its manifest and documents.jsonl held or "
                        "however they are damaged (the caches that still match are kept)")
    p.set_defaults(func=cmd_index)


def add_ask_parser(sub) -> None:
    p = sub.add_parser("ask", help="answer a question from a store")
    p.add_argument("store", help="store directory built by pced index")
    p.add_argument("question", nargs="?", help="the question (or --questions FILE)")
    p.add_argument("--json", action="store_true", help="print one JSON object (docs/reference.md, \"The JSON answer\")")
    p.add_argument("--questions", metavar="FILE", default=None,
                   help='answer every question of FILE (one a line, or JSON Lines {"id", "question"}) with the model '
                        "loaded once; writes JSON Lines: id, question and the --json object")
    p.add_argument("--out", default=None, help="with --questions: write the JSON Lines here (default: stdout)")
    p.add_argument("--trace-png", default=None, help="save the expert-trace picture to this PNG")
    add_retrieval_options(p)
    add_model_options(p)
    add_decoding_options(p)
    add_backend_options(p)
    p.set_defaults(func=cmd_ask)


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="index a small built-in corpus once and answer three questions")
    p.add_argument("--rebuild", action="store_true", help="rebuild the demo store")
    p.set_defaults(func=cmd_demo)


def add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="check every stored cache of a store, of every backend (checksums, shapes, "
                                      "finiteness), and its retrieval index files")
    add_verify_arguments(p)
    p.set_defaults(func=cmd_verify, metadata_only=True)


def add_verify_arguments(p) -> None:
    p.add_argument("store", help="store directory built by pced index")
    p.add_argument("--remove", action="store_true",
                   help="delete damaged cache files, so that the next pced index (or a lazy store's answer) re-encodes them")


def cmd_verify(args: argparse.Namespace) -> int:
    from ..retrieval.storage import verify_index_files
    from ..store import DocumentStore
    from ..store.inventory import Inventory
    from ..store.layout import RETRIEVERS_DIR
    from .terminal import count, printable

    store = DocumentStore.open(args.store)  # the manifest's schema, documents.jsonl against the retriever indexes
    index_damage = verify_index_files(store.state / RETRIEVERS_DIR)
    inventory = Inventory.open(store)
    referenced = inventory.referenced()  # a cache no document names is an orphan, not the store's data
    report = {"checked": 0, "damaged": [], "without_checksum": 0, "removed": 0, "orphans": 0, "orphans_removed": 0}
    for backend, directory in inventory.directories:  # every backend's caches
        for key, value in backend.verify_caches(directory, remove=args.remove, referenced=referenced).items():
            report[key] += value
    for line in index_damage + report["damaged"]:
        print(f"pced: damaged: {printable(line, newlines=False)}", file=sys.stderr)
    old = f"; {report['without_checksum']} written before checksums (checked for shape and finiteness only)" \
        if report["without_checksum"] else ""
    removed = f"; {report['removed']} removed" if report["removed"] else ""
    indexes = f"; {len(index_damage)} retrieval index files damaged (re-run pced index)" if index_damage else ""
    orphans = f"; {count(report['orphans'], 'orphan cache file')}" + (
        " removed" if report["orphans_removed"] else " (no document names them; --remove deletes them)") \
        if report["orphans"] else ""
    print(f"pced: {store.root}: {len(store.documents)} documents, {report['checked']} cache files checked, "
          f"{len(report['damaged'])} damaged{removed}{old}{indexes}{orphans}")
    return 1 if index_damage or (report["damaged"] and not args.remove) else 0


# What a run that extends a store takes from it when left unset: the settings it was built with.
INHERITED = ("model", "dense_model", "bge_m3", "reranker", "template", "storage_dtype")


def cmd_index(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..corpus.reader import read_corpus
    from ..store import IndexSettings, index_store
    from ..store.manifest import recorded_settings

    logging.basicConfig(level=logging.WARNING, format="pced: %(message)s")
    if args.max_doc_tokens < 16:
        raise InputError("--max-doc-tokens must be at least 16")
    if args.kv_budget_gb is not None and not (math.isfinite(args.kv_budget_gb) and args.kv_budget_gb > 0):
        raise InputError(f"--kv-budget-gb must be a number > 0, got {args.kv_budget_gb}")
    corpus = read_corpus(args.corpus)  # validated before anything is written
    recorded, defaults = recorded_settings(Path(args.out)), IndexSettings()
    inherited = {name: getattr(args, name) if getattr(args, name) is not None else recorded.get(name, getattr(defaults, name))
                 for name in INHERITED}
    settings = IndexSettings(**inherited, max_doc_tokens=args.max_doc_tokens, kv_budget_gb=args.kv_budget_gb,
                             lazy_kv=args.lazy_kv)
    say(f"loading the model ({settings.model}, on {args.backend}) ...")
    _, report = index_store(corpus, args.out, settings, backend=args.backend, backend_settings=backend_settings_from(args),
                            rebuild=args.rebuild)
    print(
        f"pced: store {args.out}: {report['documents']} documents ({report['added']} added, {report['updated']} updated, "
        f"{len(report['chunked'])} chunked); {report['kv_encoded']} KV caches encoded in {report['kv_s']:.1f} s"
        f"{' (the others when first retrieved)' if report['on_demand'] else ''}; "
        f"retrieval indexes built in {report['retrieval_index_s']:.1f} s"
        + (f"; {report['chunks_replaced']} old chunks replaced" if report["chunks_replaced"] else "")
        + (f"; {report['kv_orphans_removed']} caches of documents no longer in the store removed"
           if report["kv_orphans_removed"] else "")
        + (f"; {report['kv_evicted']} caches evicted to stay within --kv-budget-gb" if report["kv_evicted"] else "")
    )
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from ..pipeline import ask

    if args.questions is not None:
        from .batch import cmd_ask_many

        return cmd_ask_many(args)
    if args.question is None:
        raise InputError("give a question, or --questions FILE")
    if args.out:
        raise InputError("--out goes with --questions (one answer prints to stdout)")
    check_question(args.question)
    options = ask_options_from(args)  # bad settings fail before any model loads
    asked = ask(open_store(args), args.question, options)
    if args.json:
        answer = asked.answer()
        print(json.dumps(asked.json(), ensure_ascii=False))
    else:
        from .render import stream_answer

        answer = stream_answer(asked.generation, asked.candidates, args.question)
    if args.trace_png:
        from .trace_plot import save_trace_png

        png = save_trace_png(answer, asked.candidates, args.trace_png, title=args.question)
        print(f"pced: trace picture saved to {png}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from .. import __version__
    from ..corpus.reader import read_corpus
    from ..llm import cache_root
    from ..pipeline import ask
    from .render import stream_answer
    from ..store import DocumentStore, IndexSettings, StoreError, index_store
    from .trace_plot import save_trace_png

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
        console.print(f"[bold]Building the demo store[/bold] (once) in {escape(str(root))} ...")
        with resources.as_file(data / DEMO_CORPUS) as corpus_path:
            store, report = index_store(read_corpus(corpus_path), root, IndexSettings())
        console.print(f"  {report['documents']} documents indexed, KV caches in {report['kv_s']:.1f} s")
    questions = json.loads((data / DEMO_QUESTIONS).read_text())
    traces = root.parent / "demo-traces"
    for number, item in enumerate(questions, start=1):
        console.rule(f"[bold]Question {number}[/bold] ({item['note']})")
        asked = ask(store, item["question"], DEMO_OPTIONS)
        answer = stream_answer(asked.generation, asked.candidates, item["question"], console)
        found = item["answer"].lower() in answer.text.lower()
        console.print(f"expected: {item['answer']}  {'[green]found in the answer[/green]' if found else '[red]not in the answer[/red]'}")
        png = save_trace_png(answer, asked.candidates, traces / f"question{number}.png", title=item["question"])
        console.print(f"[dim]trace picture: {escape(str(png))}[/dim]")
    return 0

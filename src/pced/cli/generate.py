"""``pced generate``: answer a question over given documents with relevance scores (no store)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import math

from ..options import DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES, GivenDocuments, QuestionError
from ..options import check_question
from .common import (InputError, add_backend_options, add_decoding_options, add_model_options, ask_options_from,
                     tiers_from)


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="answer a question over given documents with relevance scores")
    gen.add_argument("--docs", required=True, help='JSONL, one {"id", "text", "score"} per line (score = relevance in [0,1])')
    gen.add_argument("--question", required=True)
    gen.add_argument("--json", action="store_true", help="print the pced ask --json contract")
    gen.add_argument("--template", choices=["rag", "icl"], default="rag")
    given = GivenDocuments()
    gen.add_argument("--kv-dir", default=given.cache_dir,
                     help="the request cache: where document caches are kept (a backend with caches of its own "
                          "keeps them in its folder there, as in a store; default: user cache, per model)")
    gen.add_argument("--request-cache-gb", type=float, default=given.cache_gb,
                     help=f"disk for those caches, least recently used evicted (default {given.cache_gb:g})")
    gen.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default=DEFAULT_STORAGE_DTYPE)
    add_model_options(gen)
    add_decoding_options(gen)
    add_backend_options(gen, "generate")
    gen.set_defaults(func=cmd_generate)


def read_scored_documents(path: Path):
    """DOCS.jsonl for ``pced generate``: one {"id", "text", "score"?, "title"?} per line."""
    from ..corpus.reader import jsonl_records
    from ..documents import Candidate, Document

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    candidates, seen = [], set()
    for number, _, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"].strip():
            raise InputError(f"{path}:{number}: each line needs a non-empty string field 'text'")
        doc_id = str(record.get("id", f"doc{number}"))
        if doc_id in seen:
            raise InputError(f"{path}:{number}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        score = record.get("score", 1.0)
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:  # no float(): 10**400
            raise InputError(f"{path}:{number}: 'score' must be a number in [0, 1], got {score!r:.40}")
        document = Document(id=doc_id, text=record["text"], title=str(record.get("title") or ""))
        candidates.append(Candidate(document, float(score), {"given": float(score)}))
    return candidates


def cmd_generate(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.request_cache_gb) and args.request_cache_gb > 0):
        raise InputError(f"--request-cache-gb must be a number > 0, got {args.request_cache_gb}")
    given = GivenDocuments(cache_gb=args.request_cache_gb, cache_dir=args.kv_dir)
    candidates = read_scored_documents(Path(args.docs))
    check_question(args.question)
    try:
        given.check(candidates)  # the server's limits, before any model loads
    except QuestionError as exc:
        raise InputError(str(exc)) from None
    options = ask_options_from(args)
    tiers = tiers_from(args)
    from ..backend import get_backend
    from ..generator import Generator
    from ..kv.budget import gb_to_bytes
    from ..pipeline import ask_candidates
    from ..text.prompts import TEMPLATES
    from ..store import IndexSettings

    backend, settings = get_backend(options.backend), options.backend_settings
    llm = backend.load_model(args.model, settings, device=args.device, dtype=args.dtype)
    limit = IndexSettings().document_token_limit(llm.max_context)  # what the server takes per document
    for c in candidates:
        n = len(llm.tokenizer.encode(c.document.render(), add_special_tokens=False))
        if n > limit:
            raise InputError(f"document {c.document.id!r} has {n} tokens; at most {limit} per document (split it)")
    template = TEMPLATES[args.template]
    root = backend.request_cache_dir(given.cache_dir, llm, template, settings, args.storage_dtype)  # under --kv-dir
    generator = Generator(llm, template, root, args.storage_dtype, tiers, budget_bytes=gb_to_bytes(given.cache_gb),
                          backend=backend, settings=settings)
    asked = ask_candidates(generator, candidates, args.question, options)
    if args.json:
        print(json.dumps(asked.json(), ensure_ascii=False))
        return 0
    from .render import stream_answer

    stream_answer(asked.generation, asked.candidates, args.question)
    return 0

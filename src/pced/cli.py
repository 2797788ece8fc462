"""The ``pced`` command line. Every subcommand sits on the same Engine / Generation loop."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .rule import AGGREGATIONS, BETA_MODES, SCORE_SPACES, RuleConfig


class InputError(ValueError):
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


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding (paper defaults)")
    group.add_argument("--beta", type=parse_beta, default="dynamic", help="dynamic (AdaCAD, default), elementwise, or a number")
    group.add_argument("--gamma", type=float, default=None,
                       help="weight of the retrieval prior gamma*log r (default: the model family's measured value, "
                            "32 for the embedded SmolLM2; the paper's 2.5 otherwise or with --paper-defaults)")
    group.add_argument("--paper-defaults", action="store_true", help="unset settings from the paper's rule (gamma 2.5)")
    group.add_argument("--aggregation", choices=AGGREGATIONS, default="max")
    group.add_argument("--score-space", choices=SCORE_SPACES, default="logits")
    group.add_argument("--max-new-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--sample-top-k", dest="sample_top_k", type=int, default=0, help="sampling: keep the k best tokens")
    group.add_argument("--sample-top-p", dest="top_p", type=float, default=1.0, help="sampling: nucleus mass")
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--max-experts", type=int, default=None, help="PCED: keep at most this many experts (by relevance)")
    group.add_argument("--prune-margin", type=float, default=None,
                       help="PCED: drop experts whose prior gamma*log r is this many logits below the best one")


def rule_from(args: argparse.Namespace, model: str | None = None) -> RuleConfig:
    """The rule of the decoding options; an unset gamma is ``model``'s family default."""
    from .defaults import default_gamma

    gamma = args.gamma if args.gamma is not None else default_gamma(model, paper=getattr(args, "paper_defaults", False))
    return RuleConfig(beta=args.beta, gamma=gamma, aggregation=args.aggregation, score_space=args.score_space)


def sampling_from(args: argparse.Namespace):
    from .decoding import SamplingConfig

    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.sample_top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def read_scored_documents(path: Path):
    """DOCS.jsonl for ``pced generate``: one {"id", "text", "score"?, "title"?} per line."""
    from .documents import Document
    from .engine import Candidate

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    candidates, seen = [], set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"].strip():
            raise InputError(f"{path}:{number}: each line needs a non-empty string field 'text'")
        doc_id = str(record.get("id", f"doc{number}"))
        if doc_id in seen:
            raise InputError(f"{path}:{number}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        score = record.get("score", 1.0)
        if not isinstance(score, (int, float)) or not 0.0 <= float(score) <= 1.0:
            raise InputError(f"{path}:{number}: 'score' must be a number in [0, 1], got {score!r}")
        document = Document(id=doc_id, text=record["text"], title=str(record.get("title") or ""))
        candidates.append(Candidate(document=document, relevance=float(score), scores={"given": float(score)}))
    return candidates


def cmd_generate(args: argparse.Namespace) -> int:
    candidates = read_scored_documents(Path(args.docs))
    if not args.question.strip():
        raise InputError("--question is empty")
    rule, sampling = rule_from(args, args.model), sampling_from(args)
    from .engine import Engine, answer_json
    from .llm import load_model

    engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype), args.template, args.kv_dir, args.storage_dtype)
    from .engine import prune_candidates

    candidates = prune_candidates(candidates, rule.gamma, args.max_experts, args.prune_margin)
    generation = engine.stream(candidates, args.question, rule, sampling)
    if args.json:
        answer = generation.answer()
        print(json.dumps(answer_json(answer, candidates), ensure_ascii=False))
        return 0
    from .render import stream_answer

    stream_answer(generation, candidates, args.question)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pced", description="Parallel Context-of-Experts Decoding for RAG")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a question over given documents with relevance scores")
    gen.add_argument("--docs", required=True, help='JSONL, one {"id", "text", "score"} per line (score = relevance in [0,1])')
    gen.add_argument("--question", required=True)
    gen.add_argument("--json", action="store_true", help="print the pced ask --json contract")
    gen.add_argument("--template", choices=["rag", "icl"], default="rag")
    gen.add_argument("--kv-dir", default=None, help="where document caches are stored (default: user cache)")
    gen.add_argument("--storage-dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    add_model_options(gen)
    add_decoding_options(gen)
    gen.set_defaults(func=cmd_generate)

    from .cli_eval import add_eval_parser
    from .cli_serve import add_serve_parser
    from .cli_store import add_ask_parser, add_demo_parser, add_index_parser

    add_index_parser(sub)
    add_ask_parser(sub)
    add_demo_parser(sub)
    add_serve_parser(sub)
    add_eval_parser(sub)

    from .cli_bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .corpus import CorpusError
    from .kvstore import CacheError
    from .llm import ModelLoadError
    from .prompts import PromptError
    from .store import StoreError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (InputError, ModelLoadError, CacheError, PromptError, CorpusError, StoreError, ValueError) as exc:
        print(f"pced: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pced: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

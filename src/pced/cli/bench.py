"""``pced bench``: the latency / storage / memory benchmark (a script users run, not a test)."""

from __future__ import annotations

import argparse

from ..bench.config import BenchConfig
from ..backend import all_backends, backend_names
from ..errors import UserError
from ..options import STORAGE_DTYPES
from .common import add_backend_options

DEFAULTS = BenchConfig()


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="time to first token, decode cost, storage and memory: PCED vs all vs APE")
    joined = ",".join
    p.add_argument("--ks", type=_ints, default=DEFAULTS.ks, help=f"numbers of documents (default {joined(map(str, DEFAULTS.ks))})")
    p.add_argument("--doc-tokens", type=_ints, default=DEFAULTS.doc_tokens,
                   help=f"tokens per document (default {joined(map(str, DEFAULTS.doc_tokens))}; with a --backend other than "
                        "the default: the first)")
    p.add_argument("--methods", default=joined(DEFAULTS.methods), help="subset of pced,all,ape")
    p.add_argument("--repeats", type=int, default=DEFAULTS.repeats)
    p.add_argument("--new-tokens", type=int, default=DEFAULTS.new_tokens, help="tokens generated per run (decode timing)")
    p.add_argument("--long-new-tokens", type=int, default=DEFAULTS.long_new_tokens,
                   help="tokens for the end-to-end run (0: skip it)")
    p.add_argument("--storage-dtypes", default=joined(DEFAULTS.storage_dtypes), help="dtypes for the storage table ('' to skip)")
    p.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default=DEFAULTS.storage_dtype,
                   help=f"how the timed runs' caches are stored (default {DEFAULTS.storage_dtype})")
    p.add_argument("--concurrency", type=_ints, default=DEFAULTS.concurrency,
                   help="with a --backend whose engine batches questions: questions answered at once (default "
                        f"{joined(map(str, DEFAULTS.concurrency))})")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache runs")
    p.add_argument("--no-resident", action="store_true", help="skip the runs with caches resident on the device")
    p.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory runs")
    p.add_argument("--remeasure", action="store_true",
                   help="measure this machine's limits (bandwidth, page cache, GEMM rates) again instead of reading "
                        "them from the cache (they are measured once per machine, threads and torch version)")
    p.add_argument("--out", default=DEFAULTS.out)
    p.add_argument("--model", default=None, help="local Hugging Face model (default: embedded); with a --backend that "
                   "loads another kind of file (a GGUF), that file, timed on that backend alone (with --beside '')")
    p.add_argument("--random-model", default=None, metavar="SHAPE",
                   help="time a random-weight model of this architecture instead: llama-3.1-8b, llama-3.2-1b, "
                        "smollm2-135m, tiny, or a JSON file of LlamaConfig fields (built on the device in seconds; "
                        "speed does not depend on the weights; no memory runs)")
    p.add_argument("--tokenizer", default=None, help="with --random-model: a local tokenizer folder (default: embedded)")
    p.add_argument("--device", default=None, help="with --random-model: cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="with --random-model: float32, bfloat16, float16 (default: auto)")
    p.add_argument("--beside", default=None,
                   help="with a --backend other than the default: the backends timed beside it in the same run, "
                        "comma-separated (default: every backend, one that is not installed skipped; for a backend "
                        "whose engine batches questions, none: its own bench sets it beside the default one; '' for "
                        "that backend alone)")
    add_backend_options(p, "bench")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """The default backend: the methods bench (PCED, all, APE). Another backend: it beside those of
    --beside (each on the same documents, one question at a time), and, for one whose engine batches
    questions, PCED at several questions at once beside the default backend."""
    from ..backend import DEFAULT_BACKEND, get_backend
    from ..bench.run import run_bench
    from ..llm import load_model
    from .common import InputError, backend_settings_from

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods or not set(methods) <= {"pced", "all", "ape"}:
        raise InputError("--methods must be a subset of pced,all,ape")
    if args.repeats < 1 or args.new_tokens < 2 or args.long_new_tokens < 0:
        raise InputError("--repeats must be >= 1 and --new-tokens >= 2")
    dtypes = tuple(d for d in args.storage_dtypes.split(",") if d)
    if not set(dtypes) <= set(STORAGE_DTYPES):
        raise InputError(f"--storage-dtypes must be a subset of {','.join(STORAGE_DTYPES)}")
    config = BenchConfig(ks=args.ks, storage_dtypes=dtypes, doc_tokens=args.doc_tokens, methods=methods, repeats=args.repeats,
                         new_tokens=args.new_tokens, long_new_tokens=args.long_new_tokens,
                         storage_dtype=args.storage_dtype, cold=not args.no_cold, resident=not args.no_resident, memory=not args.no_memory, out=args.out,
                         concurrency=args.concurrency, remeasure=args.remeasure)
    backend, default = get_backend(args.backend), get_backend(DEFAULT_BACKEND)
    settings = backend_settings_from(args)
    if args.beside is None:
        args.beside = "" if backend.capabilities.concurrent_questions else ",".join(b.name for b in all_backends())
    beside = tuple(dict.fromkeys(b.strip() for b in args.beside.split(",") if b.strip() and b.strip() != backend.name))
    unknown = [b for b in beside if b not in backend_names()]
    if unknown:
        raise InputError(f"--beside: unknown backend {unknown[0]!r}; choose from {', '.join(backend_names())}")
    own_model = args.model is not None and backend.model_key(settings) != default.model_key(default.settings())
    if args.random_model is not None:
        from dataclasses import replace

        from ..bench.random_model import random_model

        if args.model is not None:
            raise InputError("--model and --random-model are alternatives: give one")
        if backend is not default:
            raise InputError(f"--random-model is built in memory; {backend.name} loads a model file: use --model with "
                             f"--backend {backend.name}")
        try:
            llm = random_model(args.random_model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                               seed=config.seed)
        except UserError as exc:
            raise InputError(str(exc)) from None
        config = replace(config, memory=False)  # the memory runs load the embedded model in a fresh process
    elif own_model and beside:
        raise InputError(f"pced bench --backend {backend.name} --model {args.model} times that model on {backend.name} "
                         "alone (the other backends time the embedded model): add --beside ''")
    else:  # the embedded model in float32 on the CPU unless --model says otherwise
        llm = load_model(None if own_model else args.model, device="cpu" if args.model is None or own_model else None,
                         dtype="float32" if args.model is None or own_model else "auto")
    if backend is default:
        run_bench(llm, config)
        print(open(f"{args.out}/bench.md").read())
        print(f"pced: wrote {args.out}/bench.json, bench.md and bench.png")
        return 0
    entries = [(get_backend(name), None) for name in beside] + [(backend, settings)]
    for other, other_settings in entries:  # an engine starts before anything imports the retrieval libraries
        try:
            other.prepare(llm, other.settings(other_settings))
        except UserError as exc:  # a backend beside that is not installed: the others still run
            if other is backend:
                raise InputError(str(exc)) from None
            print(f"pced: bench: {other.name} skipped ({exc})")
            entries.remove((other, other_settings))
    if backend.capabilities.concurrent_questions:
        from ..bench.concurrency import run_concurrency_bench

        run_concurrency_bench(llm, config, backend, settings)
        print(open(f"{args.out}/bench_{backend.name}.md").read())
        print(f"pced: wrote {args.out}/bench_{backend.name}.json, .md and .png")
        if not beside:
            return 0
    from ..bench.backends import run_backends_bench

    run_backends_bench(llm, config, entries, args.model if own_model else None)
    print(open(f"{args.out}/bench_backends.md").read())
    print(f"pced: wrote {args.out}/bench_backends.json, .md and .png")
    return 0

"""``pced serve DIR``: load the store and the model once, then serve them over HTTP (FastAPI + uvicorn)
until SIGTERM drains it or its engine dies (``server.lifecycle``: exit 0, or ``ENGINE_DEAD_EXIT``)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys

from .common import InputError, add_backend_options, add_model_options, backend_settings_from, open_store


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a store over HTTP: OpenAI-compatible chat completions and a page at /")
    p.add_argument("store", help="store directory built by pced index")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but the page's own files (default: "
                        "$PCED_API_KEY if set; without a key only requests naming this server's address are answered)")
    add_model_options(p)
    add_backend_options(p, "serve")
    from ..server.limits import Limits

    defaults = Limits()
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help=f"largest request body (default {defaults.max_body_bytes} bytes)")
    limits.add_argument("--max-tokens-limit", "--max-tokens", dest="max_tokens", type=int, default=defaults.max_tokens,
                        help=f"largest max_tokens a request may ask (default {defaults.max_tokens}); a limit, not the "
                             f"default length ({defaults.default_max_tokens}, SamplingConfig.max_new_tokens)")
    limits.add_argument("--max-queue", type=int, default=defaults.max_queue,
                        help=f"requests queued or running before 503 (default {defaults.max_queue})")
    limits.add_argument("--max-concurrent", type=int, default=defaults.max_concurrent,
                        help="questions decoding at once on a backend whose engine batches them (default "
                             f"{defaults.max_concurrent}; the others answer one at a time)")
    limits.add_argument("--max-documents", type=int, default=defaults.max_documents,
                        help=f"documents a request may carry (default {defaults.max_documents})")
    limits.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, metavar="SECONDS",
                        help="stop a request that has run this long (retrieval and generation, not its time in the "
                             f"queue) with a 504 (default {defaults.request_timeout_s:g})")
    limits.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s, metavar="SECONDS",
                        help="on SIGTERM or Ctrl+C, how long the requests already accepted may still run while new "
                             f"ones get 503; then they end and the server exits (default {defaults.drain_timeout_s:g})")
    limits.add_argument("--request-cache-gb", type=float, default=defaults.request_cache_gb,
                        help="disk for the KV caches of documents sent with requests, least recently used evicted "
                             f"(default {defaults.request_cache_gb:g}; never written into the store)")
    limits.add_argument("--request-cache-dir", default=None,
                        help="where those caches live (default: under $PCED_CACHE_DIR/kv, one folder per model)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be between 0 and 65535, got {args.port}")
    for name in ("max_body_bytes", "max_tokens", "max_queue", "max_documents", "max_concurrent"):
        if getattr(args, name) < 1:
            flag = "max-tokens-limit" if name == "max_tokens" else name.replace("_", "-")
            raise InputError(f"--{flag} must be at least 1")
    if not (math.isfinite(args.request_cache_gb) and args.request_cache_gb > 0):
        raise InputError(f"--request-cache-gb must be a number > 0, got {args.request_cache_gb}")
    try:
        from ..server import Limits, create_app
        from ..server.lifecycle import exit_now, serve
    except ImportError as exc:
        raise InputError(f"pced serve needs fastapi and uvicorn ({exc.name} is missing): pip install fastapi uvicorn") from None

    if not (math.isfinite(args.request_timeout) and args.request_timeout > 0):
        raise InputError(f"--request-timeout must be a finite number of seconds > 0, got {args.request_timeout}")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise InputError(f"--drain-timeout must be a finite number of seconds >= 0, got {args.drain_timeout}")
    api_key = args.api_key or os.environ.get("PCED_API_KEY") or None
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, max_queue=args.max_queue,
                    max_documents=args.max_documents, max_concurrent=args.max_concurrent,
                    request_cache_gb=args.request_cache_gb,
                    default_max_tokens=min(Limits.default_max_tokens, args.max_tokens),
                    request_timeout_s=args.request_timeout, drain_timeout_s=args.drain_timeout)
    settings = backend_settings_from(args)
    store = open_store(args)
    print(f"pced: loading {store.settings.model} and the retrievers of {args.store} ...", file=sys.stderr)
    app = create_app(store, limits, api_key=api_key, backend=args.backend, settings=settings, hosts=(args.host,),
                     request_cache_dir=args.request_cache_dir)
    report = app.state.worker.warm_up()
    if report.get("message"):
        print(f"pced: {report['message']}", file=sys.stderr)
    if not _is_loopback(args.host) and not api_key:
        print(f"pced: warning: serving on {args.host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"pced: {len(store.documents)} documents; open http://{shown}:{args.port}/ "
          f"(OpenAI base_url http://{shown}:{args.port}/v1){'; API key required' if api_key else ''}", file=sys.stderr)
    exit_now(serve(app, args.host, args.port, args.log_level, limits.drain_timeout_s))

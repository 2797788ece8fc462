"""``pced store list | show | remove | stats | sync | verify``: see, change and copy what a store holds.

list / show / stats read the store with its tokenizer only (no model weights, no torch); show checks
each cache file it reports as ``pced verify`` checks its bytes (``pced.store.inventory``); remove goes through
the indexing writer (its lock, its atomic swap of the retrieval indexes); sync copies a store's current
generation to another directory in the order that keeps its readers consistent (``pced.store.sync``). ``pced store verify`` is
``pced verify`` under the store verbs (both stay: scripts call the short one). User text (ids,
titles, document text) is printed as it is, never interpreted as markup.
"""

from __future__ import annotations

import argparse
import json

from .common import InputError
from .terminal import count, printable


def add_store_parser(sub) -> None:
    from .store import add_verify_arguments, cmd_verify

    p = sub.add_parser("store", help="list, show, remove documents of a store; its size by part; copy it to another "
                                     "directory; verify its caches")
    verbs = p.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="one line per document: id, chunks, tokens, cache bytes, title")
    listing.add_argument("store", help="store directory built by pced index")
    listing.add_argument("--json", action="store_true", help="print a JSON array of {id, title, chunks, tokens, cache_bytes, encoded}")
    listing.set_defaults(func=cmd_list, metadata_only=True)
    show = verbs.add_parser("show", help="a document's text, chunks and cache state")
    show.add_argument("store", help="store directory built by pced index")
    show.add_argument("id", help="a document id (or one chunk's id)")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=cmd_show, metadata_only=True)
    remove = verbs.add_parser("remove", help="remove documents with their chunks, every backend's caches and their "
                                             "retrieval index entries (a chunk's own id is refused: name its document)")
    remove.add_argument("store", help="store directory built by pced index")
    remove.add_argument("ids", nargs="+", metavar="ID")
    remove.set_defaults(func=cmd_remove, metadata_only=True)
    stats = verbs.add_parser("stats", help="documents, tokens, bytes by part (text, retrieval, caches)")
    stats.add_argument("store", help="store directory built by pced index")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=cmd_stats, metadata_only=True)
    sync = verbs.add_parser("sync", help="copy a store's current generation to another directory (a server's own "
                                         "disk), caches first and manifest.json last, each file checked; DST keeps "
                                         "the generation it served before, as pced index does")
    sync.add_argument("src", metavar="SRC", help="the store to copy (built by pced index; may be read-only)")
    sync.add_argument("dst", metavar="DST", help="the copy (created, or one pced store sync made before)")
    sync.set_defaults(func=cmd_sync, metadata_only=True)
    verify = verbs.add_parser("verify", help="the same as pced verify: check every stored KV cache")
    add_verify_arguments(verify)
    verify.set_defaults(func=cmd_verify, metadata_only=True)


def _inventory(path: str):
    from ..store import DocumentStore
    from ..store.inventory import Inventory

    return Inventory.open(DocumentStore.open(path))


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def cmd_list(args: argparse.Namespace) -> int:
    rows = _inventory(args.store).rows()
    if args.json:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    ids = {r["id"]: printable(r["id"], newlines=False) for r in rows}
    width = max([len("id")] + [len(shown) for shown in ids.values()])
    print(f"{'id':<{width}}  chunks  tokens  cache       title")
    for r in rows:
        cache = human_bytes(r["cache_bytes"]) if r["encoded"] else "-"
        print(f"{ids[r['id']]:<{width}}  {r['chunks']:>6}  {r['tokens']:>6}  {cache:<10}  {printable(r['title'] or '', newlines=False)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        info = _inventory(args.store).show(args.id)
    except KeyError:
        raise InputError(f"no document {args.id!r} in {args.store} (pced store list shows the ids)") from None
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
        return 0
    print(f"id: {printable(info['id'], newlines=False)}\ntitle: {printable(info['title'] or '', newlines=False)}\nchunks: {info['chunks']}, tokens: {info['tokens']}, "
          f"caches encoded: {info['encoded']}/{info['chunks']} ({human_bytes(info['cache_bytes'])})")
    for part in info["parts"]:
        print(f"\n[{printable(part['id'], newlines=False)}] {part['tokens']} tokens; cache {part['cache']}"
              + (f", {human_bytes(part['cache_bytes'])}" if part["cache_bytes"] else "")
              + "".join(f"; {printable(name, newlines=False)}" for name in part["cache_files"]))
        for line in part["cache_damage"]:
            print(f"  {printable(line, newlines=False)}")
        print(printable(part["text"]))
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from ..store import StoreError, remove_documents

    try:
        store, report = remove_documents(args.store, args.ids)
    except StoreError as exc:
        if "no document" in str(exc) or "is a chunk of" in str(exc):
            raise InputError(str(exc)) from None
        raise
    print(f"pced: store {args.store}: removed {count(len(args.ids), 'document')} ({count(len(report['removed']), 'stored id')}), "
          f"{count(report['kv_orphans_removed'], 'cache file')} deleted; {report['documents']} remain")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    from ..store.sync import sync_store

    report = sync_store(args.src, args.dst)
    published = (f"DST now serves generation {report['generation']}" if report["published"]
                 else f"DST already served generation {report['generation']}")
    swept = [count(report["generations_swept"], "old generation"), count(report["caches_removed"], "unreferenced cache")]
    swept = f"; removed {' and '.join(swept)}" if report["generations_swept"] or report["caches_removed"] else ""
    print(f"pced: synced {args.src} to {args.dst}: {count(report['copied'], 'file')} copied "
          f"({human_bytes(report['bytes'])}), {report['skipped']} skipped (already there); {published} "
          f"({count(report['documents'], 'document')}){swept}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _inventory(args.store).stats()
    if args.json:
        print(json.dumps(stats, ensure_ascii=False))
        return 0
    b = stats["bytes"]
    print(f"documents: {stats['documents']} ({stats['stored_chunks']} stored, chunks counted), tokens: {stats['tokens']}, "
          f"caches encoded: {stats['caches_encoded']}")
    print(f"bytes: text {human_bytes(b['text'])}, retrieval {human_bytes(b['retrieval'])}, caches {human_bytes(b['caches'])}, "
          f"total {human_bytes(b['total'])}")
    if stats["orphans"]["files"]:
        print(f"orphans: {count(stats['orphans']['files'], 'cache file')}, {human_bytes(stats['orphans']['bytes'])} "
              "(no document of the store names them; pced verify --remove or the next pced index deletes them)")
    for key, budget in stats.items():
        if key.endswith("_budget"):  # each backend's cache directory has a budget of its own
            print(f"{key.removesuffix('_budget').replace('_', ' ')} budget: " + ", ".join(f"{k} {v}" for k, v in budget.items()))
    return 0


__all__ = ["add_store_parser"]

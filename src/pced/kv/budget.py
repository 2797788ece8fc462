"""A byte budget over a directory of cache files: the least recently used go first.

One mechanism for both bounded caches pced keeps: a store indexed with ``--kv-budget-gb`` (its
documents' caches encoded when first retrieved) and the request cache (documents sent with a
question, never written into a store). Recency is each file's modification time, set when it is
written and again on every use, so several processes sharing a directory (a server, ``pced ask``,
``pced generate``) agree on it without a shared ledger. Counters (hits, misses, evictions) live in
``budget.json`` beside the files, updated under an exclusive ``flock`` so that no process loses
another's counts.

Evicting a file another process on this host has memory-mapped is safe (the mapping keeps the old
inode); a process that finds a file it was about to read evicted encodes it again
(``CacheUse.read_or_encode``). On NFS a file another host evicts is gone for a reader that had it
open (docs/deploy.md): a budgeted store is shared by the processes of one host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ContextManager

from ..fs import atomic_write_json, read_regular, vanished

COUNTERS = "budget.json"
LOCK = ".budget.lock"
GB = 1 << 30


def gb_to_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * GB)


class ByteBudget:
    """LRU of the ``*/*.safetensors`` files under ``files_dir`` within ``max_bytes`` (None: no limit,
    counters only). ``root`` holds the counters and the lock."""

    def __init__(self, root: Path, files_dir: Path, max_bytes: int | None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"a cache budget must be >= 0 bytes, got {max_bytes}")
        self.root, self.files_dir, self.max_bytes = Path(root), Path(files_dir), max_bytes
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with self._thread_lock:
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _counters(self) -> dict:
        try:
            stored = json.loads(read_regular(self.root / COUNTERS))
        except (OSError, ValueError):
            stored = {}
        stored = stored if isinstance(stored, dict) else {}
        return {k: int(stored.get(k, 0)) if isinstance(stored.get(k, 0), int) else 0
                for k in ("hits", "misses", "evictions")}

    def files(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every cache file, least recently used first."""
        found = []
        for path in self.files_dir.glob("*/*.safetensors"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    @staticmethod
    def touch(paths: Iterable[Path]) -> None:
        """Mark files as used now (their place in the LRU order)."""
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)

    def record(self, hits: int = 0, misses: int = 0, protect: Iterable[str] = ()) -> int:
        """Count a use (``hits`` files found, ``misses`` encoded), then evict the least recently used
        files past the budget, never those named in ``protect`` (stems: the caches in use now).
        Returns how many were evicted. Only a use that added files (or a bare call: the index run)
        scans the directory, so a question whose caches were all there costs one small write."""
        with self._locked():
            counters = self._counters()
            grew = misses > 0 or not (hits or misses)
            evicted = self._evict(set(protect)) if self.max_bytes is not None and grew else 0
            counters["hits"] += hits
            counters["misses"] += misses
            counters["evictions"] += evicted
            atomic_write_json(self.root / COUNTERS, counters)
        return evicted

    def _evict(self, protect: set[str]) -> int:
        files = self.files()
        total = sum(size for _, size, _ in files)
        evicted = 0
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            if path.stem in protect:
                continue
            path.unlink(missing_ok=True)
            total -= size
            evicted += 1
        return evicted

    def stats(self) -> dict:
        """Budget, bytes and files held, and the persisted counters (hits, misses, evictions)."""
        files = self.files()
        return {"budget_bytes": self.max_bytes, "bytes": sum(size for _, size, _ in files), "files": len(files),
                **self._counters()}


class CacheUse:
    """How a directory of content-addressed caches is used, shared by ``KVStore`` and every other
    backend's cache store (``pced.backend``): which documents to encode, the budget's hits, misses and
    evictions when the directory is on demand, and the recent documents' texts, so that a cache
    evicted between ``add`` and its load is encoded again instead of failing.

    ``write_guard`` (set by the store that owns the directory: ``DocumentStore``) decides whether an
    encoded cache may be written: ``write_guard(digest)`` is a context manager yielding a bool, held
    while the file is written. A cache it refuses (its document is no longer in the store) is held
    in memory for its load instead (``hold`` / ``take``), never written."""

    RECENT = 4 * 64  # texts remembered: a few questions' documents
    HELD = 64  # caches kept in memory for their load, at most (one question's experts)

    def __init__(self, root: Path, files_dir: Path, budget_bytes: int | None, on_demand: bool,
                 write_guard: Callable[[str], ContextManager[bool]] | None = None):
        self.on_demand = on_demand or budget_bytes is not None
        self.budget = ByteBudget(root, files_dir, budget_bytes)
        self.write_guard = write_guard
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._held: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, digests: list[str], texts: list[str], has: Callable[[str], bool], path_for: Callable[[str], Path],
            encode: Callable[[dict[str, str]], None]) -> int:
        """Encode (``encode({digest: text})``) the documents not stored; on demand, count the use and
        keep the directory within its budget, never evicting these. Returns how many were encoded."""
        with self._lock:
            for digest, text in zip(digests, texts):
                self._texts[digest] = text
                self._texts.move_to_end(digest)
            while len(self._texts) > self.RECENT:
                self._texts.popitem(last=False)
            held = set(self._held)
        todo = {digest: text for digest, text in zip(digests, texts) if digest not in held and not has(digest)}
        if self.on_demand:
            self.budget.touch(path_for(d) for d in set(digests) - set(todo))
        encode(todo)
        if self.on_demand:
            unique = set(digests)
            self.budget.record(hits=len(unique) - len(todo), misses=len(todo), protect=unique)
        return len(todo)

    def keep(self, digest: str, cache: Any, write: Callable[[], None]) -> None:
        """A cache just encoded: ``write()`` it into the directory if the guard lets it, else hold
        ``cache`` in memory until its load."""
        if self.write_guard is None:
            write()
            return
        with self.write_guard(digest) as allowed:
            if allowed:
                write()
                return
        with self._lock:
            self._held[digest] = cache
            self._held.move_to_end(digest)
            while len(self._held) > self.HELD:  # a dropped one is encoded again at its load
                self._held.popitem(last=False)

    def take(self, digest: str) -> Any:
        """The cache held in memory for ``digest`` (once), or None."""
        with self._lock:
            return self._held.pop(digest, None)

    def read_or_encode(self, digest: str, path: Path, read: Callable[[], Any],
                       encode: Callable[[dict[str, str]], None]) -> Any | None:
        """A cache for its load: the one held in memory, else the file at ``path`` read, else
        (the file is gone before or while it is read: evicted, swept by an index run, or removed or
        replaced by another host, ENOENT or ESTALE on NFS) encoded again from its remembered text.
        None: gone, and its text not remembered."""
        held = self.take(digest)
        if held is not None:
            return held
        if os.path.isfile(path):  # False on any error from stat, ESTALE included
            try:
                return read()
            except OSError as exc:
                if not vanished(exc):
                    raise
        if not self.encode_again(digest, encode):
            return None
        held = self.take(digest)  # encoded again, and not the store's to keep
        return held if held is not None else read()

    def encode_again(self, digest: str, encode: Callable[[dict[str, str]], None]) -> bool:
        """A cache ``add`` saw, gone before its load (evicted by another process, or swept by an index
        run): encode it again from its remembered text. False if its text is not remembered."""
        with self._lock:
            text = self._texts.get(digest)
        if text is None:
            return False
        encode({digest: text})
        if self.on_demand:
            self.budget.record(misses=1, protect={digest})
        return True

    def stats(self) -> dict:
        return {"on_demand": self.on_demand, **self.budget.stats()}

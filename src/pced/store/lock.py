"""One writer per store: ``pced index`` holds an exclusive lock on ``STORE/.writer.lock`` for its
whole run. A second indexer waits (saying so) and then indexes on top of what the first wrote, so
both corpora end up in the store; readers never take the lock and never see a half-written state
(every file they read is replaced atomically).

A second, short lock (``STORE/.caches.lock``) orders cache writes against the writer's sweep of
caches: a reader that encodes a document's cache checks the current generation and writes the file
under it, and the writer removes caches under it after publishing, so no cache of a document the
new generation dropped is written after the sweep (``retention``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".writer.lock"
CACHES_LOCK = ".caches.lock"


@contextlib.contextmanager
def writer_lock(root: Path, wait: bool = True) -> Iterator[None]:
    """Hold the store's writer lock (released by the OS if the process dies, even on kill -9)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise
            print(f"pced: {root} is being indexed by another process; waiting for it to finish ...", file=sys.stderr,
                  flush=True)
            started = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            print(f"pced: the other index run finished after {time.perf_counter() - started:.0f} s; continuing",
                  file=sys.stderr, flush=True)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def caches_lock(root: Path) -> Iterator[None]:
    """Hold the store's cache lock (exclusive, for a check and a file write, or the writer's sweep).
    A store this process may not write has nothing to order: no lock, and its writes fail anyway."""
    try:
        fd = os.open(Path(root) / CACHES_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except FileNotFoundError:
        raise
    except OSError:  # read-only: EACCES, EROFS
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

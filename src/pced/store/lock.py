"""One writer per store: ``pced index`` holds an exclusive lock on ``STORE/.writer.lock`` for its
whole run. A second indexer waits (saying so) and then indexes on top of what the first wrote, so
both corpora end up in the store; readers never take the lock and never see a half-written state
(every file they read is replaced atomically)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".writer.lock"


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

"""Which document caches a store keeps: those of the documents its current generation holds.

Caches live beside the generations, shared by all of them, and a reader may encode one while it
answers (an on-demand store, a cache evicted or swept meanwhile). A reader still answering from an
older generation must not write back the cache of a document the current generation no longer
holds (``pced store remove``, a document replaced): the writer has swept it, and nothing would
remove it again until the next index run. ``CurrentDocuments`` is the guard a store's generators
write through (``Generator.guard_writes``): under the store's cache lock, the one the writer's sweep
takes after it publishes, a cache is written only if the current generation records its content
hash; else the reader uses it from memory for that answer.

The sweep every writer of a store runs after it publishes (``pced index``, ``pced store remove``,
``pced store sync``): generations other than the new one and the one it replaced are removed
(``sweep_generations``), and caches neither of them names (``remove_unreferenced``), so that no
reader of either ever finds a file gone."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from .layout import DOCUMENTS, GENERATIONS_DIR, RETRIEVERS_DIR, StoreError, generation
from .lock import caches_lock
from .manifest import read_manifest
from .records import read_documents


class CurrentDocuments:
    """``guard(digest)``: a context manager yielding whether the store at ``root`` may keep that
    cache now, holding the cache lock while the caller writes. ``known``: the content hashes of a
    generation already read (None where some document has no recorded hash: a store written before
    the records, whose own generation may then write every cache)."""

    def __init__(self, root: Path, number: int, known: set[str] | None):
        self.root = Path(root)
        self._known: dict[int, set[str] | None] = {number: known}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, digest: str) -> Iterator[bool]:
        with caches_lock(self.root):
            yield self._holds(digest)

    def _holds(self, digest: str) -> bool:
        try:
            manifest = read_manifest(self.root)
            number = generation(manifest)
            with self._lock:
                digests = self._known.get(number, ())
            if digests == ():
                records: dict = {}
                documents = read_documents(self.root, manifest, records)
                digests = {d for d, _ in records.values()} if len(records) == len(documents) else None
                with self._lock:
                    self._known = {**dict(list(self._known.items())[-1:]), number: digests}
        except (StoreError, OSError):  # damaged or being replaced: keep the cache in memory, write nothing
            return False
        return digests is None or digest in digests


def remove_unreferenced(root: Path, keep: set[str]) -> int:
    """Delete, in every backend's cache directory of the store, the document caches not named in
    ``keep`` (content hashes, the same name in every backend's directory); the store's writer only."""
    from .inventory import cache_directories

    removed = 0
    with caches_lock(root):  # after the manifest is published: a reader's cache write sees the new generation
        for backend, directory in cache_directories(root):
            for path in backend.cache_files(directory).glob("*/*.safetensors"):
                if path.stem not in keep:
                    path.unlink(missing_ok=True)
                    removed += 1
    return removed


def sweep_generations(root: Path, keep: set[int]) -> int:
    """Remove generations no reader can be using: all but the current and the previous one (and
    the top-level state of a store written before generations, once it is neither)."""
    removed = 0
    for folder in (root / GENERATIONS_DIR).iterdir() if (root / GENERATIONS_DIR).is_dir() else []:
        if folder.name.isdigit() and int(folder.name) not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if 0 not in keep and (root / DOCUMENTS).exists():
        (root / DOCUMENTS).unlink(missing_ok=True)
        shutil.rmtree(root / RETRIEVERS_DIR, ignore_errors=True)
        removed += 1
    return removed

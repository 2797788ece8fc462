"""Copying a store's current generation to another directory (``pced store sync SRC DST``): a copy
on a server's own disk of a store built elsewhere (a shared mount, a mounted bucket).

DST changes in the order that keeps a reader of it consistent at every moment, the order
``pced index`` writes in: the cache directories first (identity, prefix, then each document's
cache, each under a temporary name renamed into place; a cache's name is its content, so a reader
of DST's current generation reads none it does not name), then the generation folder (staged, renamed), then
``manifest.json`` last, replaced atomically; then the sweep ``pced index`` runs
(``retention``: DST keeps the generation it served before and the caches that one names).

Everything is copied and checked before the first rename: a cache must pass the byte check
``pced verify`` runs (``Backend.check_cache``: header, identity, content hash, checksum) as it
landed in DST, and the generation's retrieval files open. A damaged SRC is one line, and DST is
left as it was (temporary files removed). A cache DST already holds with the same header and
size, and bytes that match the checksum that header records, is not copied again. DST's writer
lock is held throughout; SRC is only read (it may be a read-only mount)."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from ..fs import TEMP_PREFIX, atomic_write_json, open_regular, read_regular, sweep_temporaries, temp_path, vanished
from ..kv.budget import COUNTERS
from ..kv.file_check import read_header
from .inventory import cache_directories
from .layout import GENERATIONS_DIR, MANIFEST, RETRIEVERS_DIR, StoreError, generation
from .lock import CACHES_LOCK, LOCK_FILE, writer_lock
from .manifest import read_manifest
from .records import read_documents
from .retention import remove_unreferenced, sweep_generations

CHUNK = 1 << 20
LARGE_COPY_BYTES = 64 << 20  # a progress bar from this many bytes to copy on


@dataclass
class Copy:
    """One file to put at ``target`` in DST (``check``: the cache check of what landed, or None)."""

    source: Path
    target: Path
    check: Callable[[Path], dict] | None = None
    staged: Path | None = None
    size: int = 0


@dataclass
class Plan:
    """What a sync copies (in publishing order) and what it found already in DST."""

    copies: list[Copy] = field(default_factory=list)
    skipped: int = 0
    generation_files: list[str] = field(default_factory=list)  # SRC's generation folder, when DST lacks it
    staged_dirs: list[Path] = field(default_factory=list)
    made_dirs: list[Path] = field(default_factory=list)
    published: bool = False


def sync_store(src: str | os.PathLike, dst: str | os.PathLike, progress: bool = True) -> dict:
    """Copy the current generation of the store at ``src`` to ``dst`` (created, or a copy made
    before); returns ``{"generation", "documents", "copied", "bytes", "skipped", "published",
    "generations_swept", "caches_removed"}`` (files; ``published``: DST's manifest was replaced).
    A ``StoreError`` (one line) before DST changes when SRC is not a whole store, or DST holds
    something else."""
    src, dst = Path(src), Path(dst)
    if os.path.lexists(dst) and not dst.is_dir():
        raise StoreError(f"{dst} is not a directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise StoreError(f"{src} and {dst} are the same directory")
    source = read_source(src)  # SRC's damage and a DST holding something else, before DST's lock is made
    if os.path.lexists(dst):
        _check_destination(dst)
    created = not os.path.lexists(dst)
    done = False
    try:
        with writer_lock(dst):
            report = _sync_locked(source, dst, progress)
            done = True
            return report
    finally:
        if created and not done:  # DST did not exist: a refused sync leaves nothing of it behind
            for name in (LOCK_FILE, CACHES_LOCK):
                (dst / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                dst.rmdir()


def _sync_locked(source: tuple, dst: Path, progress: bool) -> dict:
    src, manifest, documents, digests, state = source
    number = generation(manifest)
    before = _destination_state(dst)
    target_state = dst / GENERATIONS_DIR / str(number)
    plan = Plan()
    try:
        if _generation_missing(state, target_state, src, dst, number):
            plan.generation_files = sorted(_relative_files(state))
        else:
            plan.skipped += len(_relative_files(state))
        for backend, directory in cache_directories(src):
            _plan_caches(plan, backend, directory, dst / directory.relative_to(src), digests, src, dst)
        # checked and planned: from here on DST is written, first under temporary names only
        _sweep_stale(dst)
        _stage(plan, progress)
        staged = _stage_generation(state, target_state, plan) if plan.generation_files else None
        for copy in plan.copies:  # identities and prefixes first, then documents' caches
            os.replace(copy.staged, copy.target)
            copy.staged = None
        plan.published = True
        if staged is not None:
            os.replace(staged, target_state)
    finally:
        _discard(plan)
    changed = before["manifest"] != manifest
    swept = removed = 0
    if changed:
        atomic_write_json(dst / MANIFEST, manifest)  # readers of DST switch to the new generation here
        previous = before["generation"]
        swept = sweep_generations(dst, keep={number} | ({previous} if previous is not None else set()))
        if before["digests"] is not None:  # caches neither generation names (none if the previous is unreadable)
            removed = remove_unreferenced(dst, digests | before["digests"])
    copied_bytes = sum(c.size for c in plan.copies) + sum((state / n).stat().st_size for n in plan.generation_files)
    return {"generation": number, "documents": len(documents),
            "copied": len(plan.copies) + len(plan.generation_files) + changed, "bytes": copied_bytes,
            "skipped": plan.skipped + (not changed), "published": changed, "generations_swept": swept,
            "caches_removed": removed}


def read_source(src: Path) -> tuple[Path, dict, list, set[str], Path]:
    """SRC, its manifest, documents, the content hashes of their caches and its generation folder,
    every one checked (``read_manifest``, ``read_documents``, the retrieval files) before DST changes."""
    from ..retrieval.storage import verify_index_files
    from .reader import DocumentStore

    manifest = read_manifest(src)
    if not generation(manifest):
        raise StoreError(f"{src} keeps its documents at the top level (written before generations); "
                         f"index it once with this version (pced index CORPUS --out {src}), then sync")
    store = DocumentStore.open(src)  # documents.jsonl and the retrievers' id lists checked against each other
    if len(store.cache_records) != len(store.documents):
        raise StoreError(f"{store.state / 'documents.jsonl'} does not record every document's cache (written by an "
                         f"older pced); index it once with this version (pced index CORPUS --out {src}), then sync")
    damage = verify_index_files(store.state / RETRIEVERS_DIR)
    if damage:
        raise StoreError(damage[0])
    return src, store.manifest, store.documents, {digest for digest, _ in store.cache_records.values()}, store.state


def _check_destination(dst: Path) -> None:
    if os.path.lexists(dst / MANIFEST):
        return
    ours = {GENERATIONS_DIR, LOCK_FILE, CACHES_LOCK} | {d.name for _, d in cache_directories(dst)}
    strangers = sorted(p.name for p in dst.iterdir() if p.name not in ours and not p.name.startswith(TEMP_PREFIX))
    if strangers:
        raise StoreError(f"{dst} exists and is not a pced store (it holds {strangers[0]!r}); "
                         "sync into an empty or new directory, or a copy made by pced store sync")


def _destination_state(dst: Path) -> dict:
    """What DST serves now: its manifest, generation and the content hashes that generation names
    (None: unknown, so no cache is swept). A damaged or missing manifest serves no reader."""
    try:
        manifest = read_manifest(dst)
    except (StoreError, OSError):
        return {"manifest": None, "generation": None, "digests": None}
    try:
        records: dict = {}
        documents = read_documents(dst, manifest, records)
        digests = {d for d, _ in records.values()} if len(records) == len(documents) else None
    except (StoreError, OSError):
        digests = None
    return {"manifest": manifest, "generation": generation(manifest), "digests": digests}


def _sweep_stale(dst: Path) -> None:
    """What killed runs left (this process is DST's one writer); a reader's cache write in flight is kept."""
    sweep_temporaries(dst)
    sweep_temporaries(dst / GENERATIONS_DIR)
    for backend, directory in cache_directories(dst):
        sweep_temporaries(directory, keep_live=True)
        sweep_temporaries(backend.cache_files(directory), "*/", keep_live=True)


def _generation_missing(state: Path, target: Path, src: Path, dst: Path, number: int) -> bool:
    """Whether SRC's generation folder must be copied: not if DST holds the same files byte for
    byte; a DST folder of that number holding anything else is refused (a reader may use it)."""
    if not os.path.lexists(target):
        return True
    ours, theirs = _relative_files(state), _relative_files(target)
    if ours == theirs and all(filecmp.cmp(state / name, target / name, shallow=False) for name in ours):
        return False
    raise StoreError(f"{target} is not {src}'s generation {number} ({dst} is a copy of another store); "
                     "sync into an empty or new directory")


def _plan_caches(plan: Plan, backend, directory: Path, target: Path, digests: set[str], src: Path, dst: Path) -> None:
    """The files of one backend's cache directory to copy: its identity and other metadata, the
    prefix, and the caches of the generation's documents that SRC holds (an on-demand store's
    others are encoded when first retrieved, as in SRC)."""
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.name == COUNTERS or not path.is_file() or path.is_symlink():
            continue  # locks, temporaries, a budget's counters (DST's own), folders of caches
        if path.suffix == ".json":
            _plan_identity(plan, path, target / path.name, src, dst)
        elif path.suffix == ".safetensors":  # the prefix, checked as a cache of its own name
            _plan_cache(plan, backend, directory, path, target / path.name, path.stem)
    files = backend.cache_files(directory)
    for digest in sorted(digests):
        path = files / digest[:2] / f"{digest}.safetensors"
        if os.path.lexists(path):
            _plan_cache(plan, backend, directory, path, backend.cache_files(target) / digest[:2] / path.name, digest)


def _plan_identity(plan: Plan, path: Path, target: Path, src: Path, dst: Path) -> None:
    """What a cache directory was built for: copied where DST has none; DST's kept where it says the
    same (the model's recorded folder aside); refused where it says something else."""
    def identity(p: Path) -> dict:
        try:
            value = json.loads(read_regular(p))
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise StoreError(f"{p}: not readable ({exc}); not a cache directory pced wrote") from None
        return {k: v for k, v in value.items() if k != "model"}

    ours = identity(path)
    if not os.path.lexists(target):
        plan.copies.insert(0, Copy(path, target))
        return
    if identity(target) != ours:
        raise StoreError(f"{target} says its caches were built for another model, template or dtype than {src}'s; "
                         f"{dst} is a copy of another store: sync into an empty or new directory")
    plan.skipped += 1


def _plan_cache(plan: Plan, backend, directory: Path, path: Path, target: Path, digest: str) -> None:
    def check(p: Path) -> dict:
        try:
            return backend.check_cache(directory, p, digest)
        except NotImplementedError:  # a plug-in backend without the check: its files are copied as they are
            return {}

    if _same_cache(path, target, check):
        plan.skipped += 1
    else:
        plan.copies.append(Copy(path, target, check))


def _same_cache(path: Path, target: Path, check) -> bool:
    """Whether DST's file is SRC's: the same size and header, and bytes matching the checksum the
    header records (a damaged copy in DST is copied again)."""
    try:
        with open_regular(path) as ours, open_regular(target) as theirs:
            size = os.fstat(ours.fileno()).st_size
            if os.fstat(theirs.fileno()).st_size != size or read_header(ours, size) != read_header(theirs, size):
                return False
        check(target)
        return True
    except (OSError, ValueError, DataError):  # absent, foreign or damaged: copied
        return False


def _stage(plan: Plan, progress: bool) -> None:
    """Copy every planned file to a temporary name beside its target and check what landed."""
    from tqdm.auto import tqdm

    for copy in plan.copies:
        copy.size = copy.source.stat().st_size
    total = sum(c.size for c in plan.copies)
    with tqdm(total=total, desc="copying", unit="B", unit_scale=True, mininterval=1.0, file=sys.stderr,
              disable=not progress or total < LARGE_COPY_BYTES) as bar:
        for copy in plan.copies:
            _make_dirs(copy.target.parent, plan)
            copy.staged = temp_path(copy.target)
            try:
                _copy_file(copy.source, copy.staged, bar.update)
            except OSError as exc:
                if vanished(exc):
                    raise StoreError(f"{copy.source} was removed while it was copied (an index run of the source "
                                     "published meanwhile); run pced store sync again") from None
                if copy.check is not None:
                    copy.check(copy.source)  # a FIFO, a link: the cache check's line names it
                raise
            if copy.check is not None:
                try:
                    copy.check(copy.staged)
                except DataError:
                    copy.check(copy.source)  # SRC's own file names the damage
                    raise StoreError(f"{copy.source} changed while it was copied; run pced store sync again") from None


def _stage_generation(state: Path, target: Path, plan: Plan) -> Path:
    from ..retrieval.storage import verify_index_files

    _make_dirs(target.parent, plan)
    staging = temp_path(target)
    plan.staged_dirs.append(staging)
    staging.mkdir()
    for name in plan.generation_files:
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            _copy_file(state / name, staging / name, lambda n: None)
        except OSError as exc:
            if vanished(exc):
                raise StoreError(f"{state} was swept while it was copied (two index runs of the source published "
                                 "meanwhile); run pced store sync again") from None
            raise
    damage = verify_index_files(staging / RETRIEVERS_DIR)
    if damage:
        raise StoreError(damage[0])
    return staging


def _copy_file(source: Path, target: Path, advance) -> None:
    with open_regular(source) as reading, open(target, "xb") as writing:
        expected = os.fstat(reading.fileno()).st_size
        written = 0
        while chunk := reading.read(CHUNK):
            writing.write(chunk)
            written += len(chunk)
            advance(len(chunk))
    if written != expected:
        raise StoreError(f"{source} changed size while it was copied; run pced store sync again")


def _make_dirs(folder: Path, plan: Plan) -> None:
    """Create ``folder`` and its missing parents, remembering them so a refused sync removes them."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
        plan.made_dirs.append(path)


def _discard(plan: Plan) -> None:
    """Remove what a sync that stopped staged: temporary files and folders, and, before anything
    was published, the folders it created."""
    for copy in plan.copies:
        if copy.staged is not None:
            copy.staged.unlink(missing_ok=True)
    for staging in plan.staged_dirs:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if not plan.published:
        for folder in reversed(plan.made_dirs):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _relative_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink()}



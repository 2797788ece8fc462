"""Atomic writes and directory swaps: the one place in pced that creates temporary names.

Every file is written under a temporary name in its target's directory (same file system), then
``os.replace``-d into place, so a crash leaves the old file or the new one, never half of one,
and a reader that has the old file memory-mapped keeps reading the old inode. Temporary names
are ``.tmp-<target name>.<pid>.<random>``; ``sweep_temporaries`` (called by the single indexing
writer, never by readers) removes those a killed run left behind.

Files are created with a plain ``open`` (mode 0666 minus the umask), so a store or result folder
shared between users stays readable; nothing here reads or changes the process umask. What pced
reads back of its own (``open_regular``) must be a regular file: a FIFO, a device or a symbolic
link put in its place is refused instead of blocking a reader or reading outside the folder.

A file may be deleted or replaced by another host while it is read (a store on NFS): a read of the
open file then fails with ESTALE, where a local file's inode lives on. ``vanished`` names those
errors; ``read_regular`` reads a replaced file again by its name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

TEMP_PREFIX = ".tmp-"
# a file gone from under its name: removed here (ENOENT), or removed or replaced by another NFS client (ESTALE)
VANISHED = frozenset({errno.ENOENT, errno.ESTALE})
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """Something other than a regular file where pced keeps one of its files."""

    def __init__(self, path: str | os.PathLike, mode: int):
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file; ``NotRegularFile`` otherwise.
    Never follows a symbolic link in its last component and never blocks (a FIFO's open waits for
    a writer that may never come)."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the two looks
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def vanished(exc: BaseException) -> bool:
    """Whether ``exc`` says the file was removed or replaced while it was opened or read (``VANISHED``)."""
    return isinstance(exc, OSError) and not isinstance(exc, NotRegularFile) and exc.errno in VANISHED


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of a regular file (``open_regular``). A file another NFS client replaced while it
    was read (ESTALE: ``manifest.json`` renamed over by a writer on another host) is read once more
    by its name, which now names the file that replaced it."""
    try:
        with open_regular(path) as handle:
            return handle.read()
    except OSError as exc:
        if exc.errno != errno.ESTALE:
            raise
    with open_regular(path) as handle:
        return handle.read()


def temp_path(target: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``target`` (same directory, so a rename is atomic)."""
    target = Path(target)
    return target.parent / f"{TEMP_PREFIX}{target.name}.{os.getpid()}.{secrets.token_hex(4)}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it over ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "xb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "x", encoding="utf-8") as handle:
        handle.write(text)


def atomic_write_lines(path: str | os.PathLike, lines: Iterator[str]) -> None:
    """Stream lines (each ending in a newline) into ``path`` without holding them all."""
    with atomic_path(path) as tmp, open(tmp, "x", encoding="utf-8") as handle:
        handle.writelines(lines)


def atomic_write_json(path: str | os.PathLike, data: Any, *, indent: int = 2, sort_keys: bool = True,
                      ensure_ascii: bool = True, newline: bool = False) -> None:
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    atomic_write_text(path, text + ("\n" if newline else ""))


def atomic_save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str]) -> None:
    """A safetensors file, written atomically (serialized here: safetensors' own writer creates 0600 files)."""
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


@contextlib.contextmanager
def staging_dir(target: str | os.PathLike) -> Iterator[Path]:
    """A new empty directory beside ``target`` to build its replacement in; removed on exit
    unless ``swap_directory`` moved it into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_path(target)
    staging.mkdir()
    try:
        yield staging
    finally:
        _remove(staging)


def _displaced(target: Path) -> Path:
    return temp_path(target.parent / f"{target.name}.old")


def swap_directory(staging: Path, target: Path) -> None:
    """Put the finished directory ``staging`` at ``target``: the old one is renamed aside first,
    then removed. A crash between the two renames leaves the old one aside, where
    ``recover_directory`` finds it."""
    old = _displaced(target) if target.exists() else None
    if old is not None:
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        _remove(old)


def recover_directory(target: Path) -> None:
    """Undo a ``swap_directory`` interrupted between its renames (safe for readers to call)."""
    if target.exists():
        return
    for old in sorted(target.parent.glob(f"{TEMP_PREFIX}{target.name}.old.*")):
        os.replace(old, target)
        return


def _writer_alive(stale: Path) -> bool:
    """Whether the process named in a temporary name (``.tmp-<name>.<pid>.<random>``) still runs here."""
    try:
        pid = int(stale.name.rsplit(".", 2)[-2])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_temporaries(directory: str | os.PathLike, pattern: str = "", keep_live: bool = False) -> int:
    """Remove what killed writers left in ``directory`` (``pattern`` narrows it, e.g. ``"*/"`` for one
    level down). Only a single writer may call this with ``keep_live`` off: it would delete another
    writer's file in flight; with it, files of processes still running are left alone."""
    removed = 0
    for stale in Path(directory).glob(f"{pattern}{TEMP_PREFIX}*"):
        if keep_live and _writer_alive(stale):
            continue
        _remove(stale)
        removed += 1
    return removed

"""A store's files as vLLM's workers read them: memory-mapped, checked, and checksummed once per
file per node.

A worker reads the manifest's identity and the prefix once per directory (again when a file
changes) and maps a document's cache each time it is loaded. Mapping is what makes a
tensor-parallel rank read only its own KV heads: a cache is ``[layers, kv_heads, tokens, head_dim]``,
so one layer's heads of one rank are contiguous runs of the file, and the pages of the other
ranks' heads are never touched (``safetensors``' ``get_slice`` reads the same ranges, into a
fresh tensor that would then be copied again into the pinned staging buffer).

The CRC-32 of a file's bytes reads the whole file, every head. It is checked at most once per file
per node, not once per worker process: a rank that verified a file leaves an empty marker named
after the file's identity (path, device, inode, size, modification and change times) in a directory
of this user's own under the node's temporary directory; the other ranks (and later engines on the
node) find it and skip the check. A file rewritten in place gets a new
identity, so it is checked again. Where the directory cannot be made safely (another owner, group
or world writable) only the process's own record (``kv.format.VERIFIED``) is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

from ...kv.format import VERIFIED, check_cache_file
from ...kv.segment import DocKV
from .store_kv import StoreSpec


def node_key(path: Path) -> str:
    """A file's identity on this node: a rewrite, a rename over it or a change of its size gives another."""
    info = os.stat(path)
    fields = (str(Path(path).resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return hashlib.sha256("\0".join(map(str, fields)).encode()).hexdigest()[:40]


class NodeVerified:
    """Markers of files whose checksum some process of this user on this node matched."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else Path(tempfile.gettempdir()) / f"pced-verified-{os.getuid()}"
        self._usable: bool | None = None

    def _ready(self) -> bool:
        if self._usable is None:
            try:
                self.root.mkdir(mode=0o700, exist_ok=True)
                info = os.lstat(self.root)
                self._usable = (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                                and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
            except OSError:
                self._usable = False
        return self._usable

    def __contains__(self, key: str) -> bool:
        return self._ready() and (self.root / key).exists()

    def add(self, key: str) -> None:
        if not self._ready():
            return
        try:  # an empty file made in one system call: there is no half-written marker to read
            os.close(os.open(self.root / key, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError:
            pass  # the process's own record still holds it


NODE_VERIFIED = NodeVerified()


class StoreFiles:
    """The files one worker reads: a manifest's identity and a prefix once per directory, a document's
    cache each time it is loaded; every file's checksum once per node (``NodeVerified``)."""

    def __init__(self, verified: NodeVerified = NODE_VERIFIED) -> None:
        self._identity: dict[tuple, dict] = {}
        self._prefix: dict[tuple, DocKV] = {}
        self.verified = verified
        self.checksums = 0  # files whose whole bytes this worker checked

    @staticmethod
    def _key(path: Path) -> tuple:
        info = os.stat(path)
        return (str(path), info.st_ino, info.st_size, info.st_mtime_ns)

    def identity(self, kv_dir: str) -> dict:
        manifest = Path(kv_dir) / "kvstore.json"
        key = self._key(manifest)
        if key not in self._identity:
            identity = json.loads(manifest.read_text())
            self._identity[key] = {k: v for k, v in identity.items() if k != "model"}  # recorded, not checked
        return self._identity[key]

    def _open(self, path: Path, identity: dict, digest: str, tokens: int) -> DocKV:
        """The cache, checked; its bytes against their checksum unless this process or this node did."""
        key = node_key(path)
        if path in VERIFIED or key in self.verified:
            return check_cache_file(path, identity, digest, tokens, verify=False)[0]
        kv, meta = check_cache_file(path, identity, digest, tokens, verify=True)
        if "checksum" in meta:  # files written before checksums existed have none to match
            self.checksums += 1
            self.verified.add(key)
        return kv

    def segments(self, spec: StoreSpec) -> list[DocKV]:
        identity = self.identity(spec.kv_dir)
        key = self._key(spec.prefix_path)
        if key not in self._prefix:
            self._prefix[key] = self._open(spec.prefix_path, identity, "prefix", spec.prefix_tokens)
        if spec.document_path is None:
            return [self._prefix[key]]
        document = self._open(spec.document_path, identity, spec.digest, spec.tokens - spec.prefix_tokens)
        return [self._prefix[key], document]

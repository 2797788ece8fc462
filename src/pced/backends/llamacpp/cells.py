"""llama.cpp's sequence-state bytes, read as far as pced needs to move cells between cache layouts.

A context with one KV stream per sequence (``kv_unified = false``) lets each row attend only to its
own cells, but it writes and reads sequence states with its stream count in them, and it cannot
share cells across streams. This module turns states from one layout into the other, and joins the
shared prefix and a document into one state, without calling llama.cpp. What
``llama_state_seq_get_data`` writes (vendor/llama.cpp, llama-cpp-python 0.3.36)::

    magic u32, seq_id i32                                   src/llama-context.cpp:3213-3214
    per KV cache (an iSWA model has two: base, then SWA)    src/llama-kv-cache-iswa.cpp:259-264
        n_stream u32                                        src/llama-kv-cache.cpp:2073
        per stream: cell_count u32, then if it is not 0:    :2075-2132
            per cell: pos i32, n_seq_id u32 (1 for one sequence), [ext, 12 bytes], seq_id i32   :2211-2242
            v_trans u32, n_layer u32                        :2250-2251
            per layer: key type i32, key row bytes u64, cell_count key rows        :2255-2276
            per layer with values: value type i32, row bytes u64, cell_count rows  :2278-2303

Reading it back (``set_data``) refuses another stream count ("n_stream mismatch", :2163-2166: the
exception makes ``llama_state_seq_set_data`` return 0 bytes read, src/llama-context.cpp:3245-3260),
restores every non-empty stream block into the stream of the sequence it is given (:2187), and first
removes that sequence's cells for each block (:2354): so a sequence takes one block, and a prefix and
a document restored one after the other would leave only the document. Hence one block holding both.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok (src/llama-kv-cells.h:13-20), written for M-RoPE and PLE models
LAYER_HEADER = 12  # type i32 + row bytes u64


class StateLayoutError(ValueError):
    """Bytes that are not a one-sequence llama.cpp state pced can read (e.g. transposed values)."""


@dataclass
class Cells:
    """One KV cache's cells of one sequence: a row of metadata per cell, then per layer a header
    and one row of bytes per cell (keys for every layer, then values)."""

    meta: np.ndarray  # [n, meta bytes]
    body_header: np.ndarray  # v_trans u32, n_layer u32
    layers: list[tuple[np.ndarray, np.ndarray]]  # (12-byte header, [n, row bytes])

    @property
    def n(self) -> int:
        return int(self.meta.shape[0])

    @property
    def positions(self) -> np.ndarray:
        return np.ascontiguousarray(self.meta[:, :4]).view("<i4").ravel()

    def nbytes(self) -> int:
        return self.meta.size + 8 + sum(LAYER_HEADER + rows.size for _, rows in self.layers)


@dataclass
class SeqCells:
    """A parsed sequence state: its 8-byte header and, per KV cache, the sequence's cells (None: none)."""

    header: np.ndarray
    caches: list[Cells | None]


def _u32(data: np.ndarray, offset: int) -> int:
    if offset + 4 > data.size:
        raise StateLayoutError("truncated")
    return struct.unpack_from("<I", data, offset)[0]


def _parse_block(data: np.ndarray, offset: int, n: int, ext: int, values: bool) -> tuple[Cells, int]:
    meta_bytes = 12 + ext
    end = offset + n * meta_bytes
    if end + 8 > data.size:
        raise StateLayoutError("truncated cell metadata")
    meta = data[offset:end].reshape(n, meta_bytes)
    if not np.all(np.ascontiguousarray(meta[:, 4:8]).view("<u4") == 1):
        raise StateLayoutError("a cell shared by several sequences (not a one-sequence state)")
    offset = end
    body_header = data[offset : offset + 8]
    v_trans, n_layer = _u32(data, offset), _u32(data, offset + 4)
    if v_trans != 0:
        raise StateLayoutError("transposed values (a context without flash attention)")
    if not 0 < n_layer < 4096:
        raise StateLayoutError("implausible layer count")
    offset += 8
    layers = []
    for _ in range(n_layer * (2 if values else 1)):
        if offset + LAYER_HEADER > data.size:
            raise StateLayoutError("truncated layer header")
        type_id, row = struct.unpack_from("<iQ", data, offset)
        end = offset + LAYER_HEADER + n * row
        if not 0 <= type_id < 64 or row == 0 or end > data.size:
            raise StateLayoutError("implausible layer header")
        layers.append((data[offset : offset + LAYER_HEADER], data[offset + LAYER_HEADER : end].reshape(n, row)))
        offset = end
    return Cells(meta, body_header, layers), offset


def _parse_with(data: np.ndarray, ext: int, values: bool) -> SeqCells:
    caches: list[Cells | None] = []
    offset = 8
    while offset < data.size:
        n_stream = _u32(data, offset)
        if not 0 < n_stream <= 4096:
            raise StateLayoutError("implausible stream count")
        offset += 4
        found = None
        for _ in range(n_stream):
            n = _u32(data, offset)
            offset += 4
            if n:
                if found is not None:
                    raise StateLayoutError("cells in two streams (not a one-sequence state)")
                found, offset = _parse_block(data, offset, n, ext, values)
        caches.append(found)
    if offset != data.size or not caches:
        raise StateLayoutError("the sizes do not add up")
    return SeqCells(data[:8], caches)


def parse(data: np.ndarray) -> SeqCells:
    """A sequence state's cells. Whether cells carry the 12-byte extension and layers their values is
    not written in the bytes (src/llama-kv-cache.cpp:1843-1846, :2285-2287): the one reading whose
    sizes add up to the whole state, with every cell of one sequence, is the state."""
    data = np.ascontiguousarray(data, dtype=np.uint8).ravel()
    if data.size < 12:
        raise StateLayoutError("too short for a sequence state")
    for ext in (0, EXT_BYTES):
        for values in (True, False):
            try:
                return _parse_with(data, ext, values)
            except StateLayoutError:
                continue
    raise StateLayoutError("not a one-sequence llama.cpp state in a layout pced reads")


def write(state: SeqCells, n_stream: int) -> np.ndarray:
    """The bytes ``set_data`` reads into a context of ``n_stream`` streams (the cells in the first stream
    block: a one-sequence restore puts every block into the sequence's own stream, src/llama-kv-cache.cpp:2187)."""
    size = 8 + sum(4 + 4 * n_stream + (c.nbytes() if c is not None else 0) for c in state.caches)
    out = np.empty(size, dtype=np.uint8)
    out[:8] = state.header
    offset = 8

    def put(chunk: np.ndarray | bytes) -> None:
        nonlocal offset
        chunk = np.frombuffer(chunk, dtype=np.uint8) if isinstance(chunk, bytes) else chunk.reshape(-1)
        out[offset : offset + chunk.size] = chunk
        offset += chunk.size

    for cells in state.caches:
        put(struct.pack("<I", n_stream))
        put(struct.pack("<I", cells.n if cells is not None else 0))
        if cells is not None:
            put(cells.meta)
            put(cells.body_header)
            for header, rows in cells.layers:
                put(header)
                put(rows)
        put(bytes(4 * (n_stream - 1)))
    assert offset == size
    return out


def restream(data: np.ndarray, n_stream: int) -> np.ndarray:
    """A state's bytes for a context of ``n_stream`` streams (its cells unchanged)."""
    return write(parse(data), n_stream)


def _merge(a: Cells | None, b: Cells | None) -> Cells | None:
    if a is None or b is None:
        return a if b is None else b
    if a.meta.shape[1] != b.meta.shape[1] or len(a.layers) != len(b.layers) or any(
            not np.array_equal(ha, hb) for (ha, _), (hb, _) in zip(a.layers, b.layers)):
        raise StateLayoutError("states of different models or cache types")
    positions = np.concatenate([a.positions, b.positions])
    order = None if np.all(positions[1:] > positions[:-1]) else np.argsort(positions, kind="stable")
    if order is not None and np.any(np.diff(positions[order]) == 0):
        raise StateLayoutError("two cells at the same position")

    def cat(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        joined = np.concatenate([x, y])
        return joined if order is None else joined[order]

    return Cells(cat(a.meta, b.meta), a.body_header,
                 [(ha, cat(ra, rb)) for (ha, ra), (_, rb) in zip(a.layers, b.layers)])


def join(first: np.ndarray | SeqCells, second: np.ndarray | SeqCells, n_stream: int = 1) -> np.ndarray:
    """One state holding both states' cells, in position order (the prefix's, then a document's:
    the order in which a fresh decode of prefix + document fills a stream, so that attention sums
    the same cells in the same order)."""
    a = first if isinstance(first, SeqCells) else parse(first)
    b = second if isinstance(second, SeqCells) else parse(second)
    if len(a.caches) != len(b.caches):
        raise StateLayoutError("states of different models")
    return write(SeqCells(a.header, [_merge(x, y) for x, y in zip(a.caches, b.caches)]), n_stream)


def between(data: np.ndarray, start: int, end: int) -> SeqCells:
    """A state's cells at positions ``start <= pos < end`` (a negative bound: open)."""
    state = parse(data)
    caches: list[Cells | None] = []
    for cells in state.caches:
        if cells is None:
            caches.append(None)
            continue
        pos = cells.positions
        keep = np.ones(pos.size, dtype=bool)
        if start >= 0:
            keep &= pos >= start
        if end >= 0:
            keep &= pos < end
        caches.append(Cells(cells.meta[keep], cells.body_header, [(h, rows[keep]) for h, rows in cells.layers])
                      if keep.any() else None)
    return SeqCells(state.header, caches)

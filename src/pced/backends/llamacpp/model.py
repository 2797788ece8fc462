"""A GGUF model on llama.cpp (through llama-cpp-python's C bindings), as the loop needs it.

``LlamaModel`` is what the rest of pced calls a model: ``tokenizer`` (a transformers tokenizer
read from the GGUF's own vocabulary and chat template, so that prompts are the same token ids
on every backend; a GGUF without a template, a base model, gets a plain-text one),
``eos_token_ids()``, ``name``, ``fingerprint``, ``tokenizer_hash`` and ``max_context``. The weights stay as the file ships them (Q4_1 for the embedded model): llama.cpp
computes on them directly.

``LlamaContext`` is one llama.cpp context whose sequences are rows (sequence 0 the amateur, one per
expert), each in a KV stream of its own (or, with ``LlamaModel.split_streams`` off, all in one
unified cache); ``decode`` runs one ``llama_batch`` of (token, position, sequence) entries and
returns the logits of those that asked for them, and a sequence's cells can be copied (``seq_cp``),
removed, saved and restored (``state_seq_get_data`` / ``set_data``, in one byte layout whatever the
context's).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from ...fingerprint import files_fingerprint
from ...fingerprint import tokenizer_hash
from ...llm import ModelLoadError, cache_root
from . import cells as state_cells
from .native import Native, free_context, free_model
from .settings import LlamaSettings

GGUF_MAGIC = b"GGUF"
GGML_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type of the KV cache


# ggml-cpu's tiled K-quant matrix product (Q2_K-Q6_K, IQ* weights) takes a step over from the per-row
# dot products when the step has 8 rows or more (vendor/llama.cpp ggml/src/ggml-cpu/tiled/tiled.cpp:1202-1205,
# called first by ggml-cpu.c:1268-1271), and the two round differently: a row's numbers then depend on how
# many rows share its step (Gemma 3's Q4_K_M: logits up to 1.06 apart on a random-token prompt split in
# two). Its master switch (tiled.cpp:572-581, read once, at the first product) off, every row is computed
# by the same dot products, as a one-sequence llama.cpp decode computes it; measured cost on Gemma 3 270M
# within the noise (docs/llamacpp.md). A value set beforehand wins.
TILED_SWITCH = "GGML_CPU_TILED_MM"


def require_llama_cpp():
    """The low-level bindings, or a one-line error saying how to install them. Turns ggml-cpu's tiled
    K-quant products off for this process (unless ``GGML_CPU_TILED_MM`` is set already): the backend,
    like the vLLM engine with its own variables, owns its library's process-wide switch."""
    os.environ.setdefault(TILED_SWITCH, "0")
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError("the llamacpp backend needs llama-cpp-python: pip install 'pced[llamacpp]' "
                             f"(importing it failed: {exc})") from None
    return llama_cpp


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_gguf(model: str | os.PathLike | None) -> Path:
    """The GGUF file of a ``--model`` setting (None / "embedded": the embedded model's, as it ships)."""
    from ...options import is_embedded
    from ...llm import _embedded_gguf

    if is_embedded(model if model is None else str(model)):
        return _embedded_gguf()
    path = Path(model).expanduser()
    if not path.is_file() or not is_gguf(path):
        raise ModelLoadError(f"the llamacpp backend needs a GGUF file (--model file.gguf); {path} is not one")
    return path


_BACKEND_READY = threading.Lock()
_BACKEND_STARTED = False
_LOG_CALLBACK = None  # kept alive: llama.cpp calls it for every log line


def _start_backend(lib) -> None:
    global _BACKEND_STARTED, _LOG_CALLBACK
    with _BACKEND_READY:
        if _BACKEND_STARTED:
            return
        if not os.environ.get("PCED_LLAMA_LOG"):  # llama.cpp logs every load to stderr; pced's output stays clean
            _LOG_CALLBACK = lib.llama_log_callback(lambda level, text, data: None)
            lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        lib.llama_backend_init()
        _BACKEND_STARTED = True


# A GGUF without a chat template is a base (pretrained) model: pced prompts it as plain text, the
# documents then the question then "Answer:", so that the answer is the text's continuation.
PLAIN_TEMPLATE = ("{bos}{{% for message in messages %}}{{{{ message['content'] }}}}\n\n{{% endfor %}}"
                  "{{% if add_generation_prompt %}}Answer:{{% endif %}}")


def plain_template(add_bos: bool) -> str:
    """The plain-text chat template of a base model; it starts with BOS where the GGUF asks for it
    (``tokenizer.ggml.add_bos_token``), as llama.cpp's own tokenization would."""
    return PLAIN_TEMPLATE.format(bos="{{ bos_token }}" if add_bos else "")


def gguf_tokenizer(path: Path, fingerprint: str):
    """The GGUF's tokenizer as a transformers tokenizer. transformers converts a GGUF vocabulary in
    tens of seconds, so the first load saves it (tokenizer files only, no weights) under the cache."""
    from transformers import AutoTokenizer

    from ...fs import staging_dir, swap_directory

    target = cache_root() / "tokenizers" / f"{path.stem}-{fingerprint[:12]}"
    if (target / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with staging_dir(target) as staging:
        tokenizer.save_pretrained(staging)
        swap_directory(staging, target)
    return tokenizer


class LlamaModel:
    """A GGUF model loaded by llama.cpp, with the tokenizer and identity pced records."""

    backend = "llamacpp"
    # ggml-cpu's repacked weight layouts (use_extra_bufts): off. Its repacked Q4_K kernels compute a step's
    # rows in groups of 4 and the rest by another kernel (vendor/llama.cpp ggml/src/ggml-cpu/repack.cpp:4637),
    # so a row's logits depended on how many rows shared its step (Gemma 3's Q4_K_M: up to 1.18 apart;
    # experiments/llamacpp_state_sizes.py); the plain layout computes every row alike. A class
    # attribute, not an option: the exact contracts (restore, greedy, joins) need it off.
    repack_weights = False
    # One KV stream per sequence (kv_unified = false). In one unified cache every row's attention walks
    # every cell in use, skipping the other rows' masked ones (ggml-cpu/ops.cpp:8967-8971; the cells
    # walked: all in use, padded to 256, src/llama-kv-cache.cpp:1260-1274), so a step's attention grows
    # with k x all rows' cells; in its own stream a row walks only its own cells. Also a class
    # attribute: off, contexts are unified as before (experiments/llamacpp_streams.py compares the two).
    split_streams = True

    def __init__(self, model: str | os.PathLike | None = None, settings: LlamaSettings = LlamaSettings()):
        from ...options import EMBEDDED_NAME, is_embedded

        self.lib = require_llama_cpp()
        self.gguf = resolve_gguf(model)
        self.settings = settings
        self.path = str(self.gguf)
        self.name = EMBEDDED_NAME if is_embedded(model if model is None else str(model)) else self.gguf.stem
        self.fingerprint = files_fingerprint(self.gguf.parent, [self.gguf], b"gguf")[:16]
        self.tokenizer = gguf_tokenizer(self.gguf, self.fingerprint)
        _start_backend(self.lib)
        params = self.lib.llama_model_default_params()
        self.gpu_layers = settings.gpu_layers if settings.gpu_layers is not None else (
            -1 if self.lib.llama_supports_gpu_offload() else 0)  # -1: every layer
        params.n_gpu_layers = self.gpu_layers
        params.use_extra_bufts = self.repack_weights
        self._native = Native(self.lib.llama_model_load_from_file(self.path.encode(), params))
        if not self.handle:
            raise ModelLoadError(f"llama.cpp could not load {self.path}")
        # llama.cpp's memory is not Python's: the weights and every context are freed when the model is
        # collected (or closed), contexts first; the finalizer holds the handles, never the objects
        self._context_natives: list[Native] = []
        self._finalizer = weakref.finalize(self, free_model, self.lib, self._native, self._context_natives)
        self.vocab = self.lib.llama_model_get_vocab(self.handle)
        self.plain_prompt = not getattr(self.tokenizer, "chat_template", None)
        if self.plain_prompt:  # a base model: no chat template in its GGUF
            self.tokenizer.chat_template = plain_template(bool(self.lib.llama_vocab_get_add_bos(self.vocab)))
        self.tokenizer_hash = tokenizer_hash(self.tokenizer)
        self.n_swa = int(self.lib.llama_model_n_swa(self.handle))  # sliding-window attention span (0: none)
        self.n_vocab = int(self.lib.llama_vocab_n_tokens(self.vocab))
        self.max_context = int(self.lib.llama_model_n_ctx_train(self.handle))
        self.version = getattr(self.lib, "__version__", "") or _package_version()
        self._contexts: dict[str, LlamaContext] = {}
        self.lock = threading.RLock()  # one question at a time owns the context

    @property
    def handle(self):
        return self._native.handle

    def close(self) -> None:
        """Free the model's contexts and weights in llama.cpp now (also done when it is collected)."""
        self._contexts.clear()
        self._finalizer()

    def model_record(self) -> dict:
        """What a store's manifest records about the GGUF that built it."""
        return {"name": self.name, "path": self.path, "fingerprint": self.fingerprint,
                "tokenizer_hash": self.tokenizer_hash, "backend": self.backend}

    def model_difference(self, stored: dict) -> str | None:
        """None when a manifest's ``model`` record names this GGUF; else what differs."""
        if stored.get("tokenizer_hash") != self.tokenizer_hash:
            return "its tokenizer differs"
        return None if stored.get("fingerprint") == self.fingerprint else "its GGUF weights differ"

    def eos_token_ids(self) -> set[int]:
        ids = {int(self.lib.llama_vocab_eos(self.vocab)), int(self.lib.llama_vocab_eot(self.vocab))}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return {i for i in ids if i >= 0}

    @property
    def threads(self) -> int:
        return self.settings.threads or torch.get_num_threads()

    def context(self, cells: int, sequences: int, role: str = "decode", seq_cells: int | None = None) -> "LlamaContext":
        """The model's context for ``role`` ("decode": the question's rows; "encode": documents
        being stored, so that a document encoded mid-answer leaves the rows alone), with room for
        ``cells`` KV cells in all, ``sequences`` sequences and ``seq_cells`` cells in the longest
        sequence (default ``cells``: a stream of its own holds one sequence's cells only). Made again,
        larger, when a question needs more; emptied either way. Callers hold ``lock``."""
        ctx = self._contexts.get(role)
        split = self.split_streams
        longest = min(cells, seq_cells) if seq_cells else cells
        fits = ctx is not None and ctx.split == split and ctx.n_seq >= sequences and ctx.threads == self.threads \
            and (ctx.seq_cells >= longest if split else ctx.n_ctx >= cells)
        if not fits:
            if ctx is not None:
                ctx.free()
                del self._contexts[role]
            if split:  # streams in eights and cells in 512s: a question a little larger reuses the context
                n_seq = -(-max(sequences, 1) // 8) * 8
                n_ctx = n_seq * (-(-max(longest, 1) // 512) * 512)
            else:
                n_seq, n_ctx = max(sequences, 32), max(4096, 1 << (max(cells, 1) - 1).bit_length())
            self._contexts[role] = ctx = LlamaContext(self, n_ctx, n_seq, self.threads, split)
            # the finalizer's list (a freed context's handle is None: freeing it again does nothing)
            self._context_natives[:] = [c._native for c in self._contexts.values()]
        ctx.clear()
        return ctx

    def identity(self) -> dict:
        return {"backend": self.backend, "model": self.name, "model_fingerprint": self.fingerprint,
                "tokenizer_hash": self.tokenizer_hash, "llama_cpp": self.version,
                "cache_type": self.settings.cache_type}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return ""


class LlamaContext:
    """One llama.cpp context of ``n_seq`` sequences: each in a KV stream of ``seq_cells`` cells
    (``split``), or all in one unified cache of ``n_ctx`` cells."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_seq: int, threads: int, split: bool = False):
        lib = self.lib = model.lib
        self.model, self.n_ctx, self.n_seq, self.threads, self.split = model, n_ctx, n_seq, threads, split
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        # A compute step holds at most ubatch_tokens tokens of each sequence (``decode`` cuts the calls so).
        # In a split context each stream attends its own queries (src/llama-graph.cpp:36-41), so a step may
        # hold that many tokens of every row at once and each row still stays below flash attention's
        # 64-query tile: the question suffix of k + 1 rows runs in ceil(suffix / ubatch_tokens) steps.
        step_tokens = model.settings.ubatch_tokens * (n_seq if split else 1)
        params.n_batch, params.n_ubatch = max(model.settings.batch_tokens, step_tokens), step_tokens
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = GGML_TYPES[model.settings.cache_type]
        # flash attention always: a q8_0 V cache needs it, and a state's layout depends on it (V transposed without)
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.kv_unified = not split
        params.no_perf = True
        self._native = Native(lib.llama_init_from_model(model.handle, params))
        if not self.handle:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} cells and {n_seq} sequences")
        weakref.finalize(self, free_context, lib, self._native)
        # a split context has n_seq streams of n_ctx / n_seq cells each (src/llama-context.cpp:292-304;
        # one stream per sequence: src/llama-kv-cache.cpp:84), which its state bytes count (:2073)
        self.n_stream = n_seq if split else 1
        self.seq_cells = int(lib.llama_n_ctx_seq(self.handle))
        self.memory = lib.llama_get_memory(self.handle)
        self.n_vocab = model.n_vocab
        self._batch_size = 0

    @property
    def handle(self):
        return self._native.handle

    def free(self) -> None:
        free_context(self.lib, self._native)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def seq_cp(self, source: int, target: int, start: int = -1, end: int = -1) -> None:
        """Give ``target`` the cells of ``source`` at positions [start, end). In one unified cache the
        cells are shared (no memory copied). Across streams llama.cpp copies whole stream buffers, for
        full ranges only (it asserts otherwise: src/llama-kv-cache.cpp:494-512), and overwrites the
        target's cells: here the range's cells are copied through their state bytes and join the
        target's, in position order."""
        if not self.split or source == target:
            self.lib.llama_memory_seq_cp(self.memory, source, target, start, end)
            return
        moved = state_cells.between(self.get_state(source), start, end)
        self._set(target, state_cells.join(self.get_state(target), moved, self.n_stream))

    def seq_rm(self, seq: int, start: int = -1, end: int = -1) -> None:
        if not self.lib.llama_memory_seq_rm(self.memory, seq, start, end):
            raise RuntimeError(f"llama.cpp could not remove cells [{start}, {end}) of sequence {seq}")

    def get_state(self, seq: int) -> np.ndarray:
        """Sequence ``seq``'s KV cells (positions, keys, values) as llama.cpp serializes them for a
        one-stream context, whatever this context's streams: the bytes of a state do not depend on the
        layout that computed it."""
        size = int(self.lib.llama_state_seq_get_size(self.handle, seq))
        data = np.empty(size, dtype=np.uint8)
        written = int(self.lib.llama_state_seq_get_data(self.handle, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                        size, seq))
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} bytes of sequence {seq}'s state")
        return state_cells.restream(data, 1) if self.n_stream > 1 else data

    def set_state(self, seq: int, data: np.ndarray) -> None:
        """Restore a state into sequence ``seq`` (whatever it held is removed first)."""
        self._set(seq, state_cells.restream(data, self.n_stream) if self.n_stream > 1 else data)

    def set_states(self, seq: int, first: np.ndarray | state_cells.SeqCells, second: np.ndarray) -> None:
        """Restore two states' cells (a prefix's and a document's) into sequence ``seq`` in one restore:
        each restore first removes the sequence's cells (src/llama-kv-cache.cpp:2354)."""
        self._set(seq, state_cells.join(first, second, self.n_stream))

    def _set(self, seq: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        read = int(self.lib.llama_state_seq_set_data(self.handle, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                     data.size, seq))
        if read != data.size:
            raise RuntimeError(f"llama.cpp could not restore a sequence state of {data.size} bytes (read {read}): "
                               "built by another llama.cpp version or model, or the context is full")

    def _batch_for(self, size: int):
        native = self._native
        if size > self._batch_size:
            if native.batch is not None:
                self.lib.llama_batch_free(native.batch)
                native.batch = None
            native.batch = self.lib.llama_batch_init(size, 0, 1)
            self._batch_size = size
        return native.batch

    def decode(self, tokens, positions, seqs, outputs) -> torch.Tensor:
        """Run entries (token, position, sequence, wants logits) through the model; returns the logits
        of the entries that want them, in order, as [R, V] float32."""
        calls = self._calls(seqs)
        order = [j for call in calls for j in call if outputs[j]]  # the wanted entries, in the calls' order
        rows = []
        for call in calls:
            batch = self._batch_for(len(call))
            for i, j in enumerate(call):
                batch.token[i] = tokens[j]
                batch.pos[i] = positions[j]
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seqs[j]
                batch.logits[i] = 1 if outputs[j] else 0
            batch.n_tokens = len(call)
            status = int(self.lib.llama_decode(self.handle, batch))
            if status != 0:
                raise RuntimeError(f"llama_decode failed ({status}): "
                                   + ("the KV cache is full" if status == 1 else "see PCED_LLAMA_LOG=1"))
            wanted = sum(1 for j in call if outputs[j])
            if wanted:
                pointer = self.lib.llama_get_logits(self.handle)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(wanted, self.n_vocab)).copy()))
        if not rows:
            return torch.empty(0, self.n_vocab)
        logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        if order != sorted(order):
            logits = logits[torch.tensor(order).argsort()]
        return logits

    def _calls(self, seqs) -> list[list[int]]:
        """The entries of each ``llama_decode`` call. One unified cache: ``batch_tokens`` entries at a
        time, which llama.cpp cuts into compute steps of ``ubatch_tokens``. Split streams: call r takes
        entries r·s to (r + 1)·s − 1 of every sequence (s = ``ubatch_tokens``), in the given order, so a
        step never holds more than s tokens of a stream however many rows it holds."""
        settings = self.model.settings
        if not self.split:
            step = settings.batch_tokens
            return [list(range(start, min(len(seqs), start + step))) for start in range(0, len(seqs), step)]
        fed: dict[int, int] = {}
        calls: list[list[int]] = []
        for j, seq in enumerate(seqs):
            call = fed.get(seq, 0) // settings.ubatch_tokens
            fed[seq] = fed.get(seq, 0) + 1
            if call == len(calls):
                calls.append([])
            calls[call].append(j)
        return calls

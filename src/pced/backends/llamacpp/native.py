"""llama.cpp's memory is not Python's: a model's weights and a context's KV cells live in llama.cpp's
allocations, which Python's collector never sees. ``Native`` holds a model's or context's handle,
and ``weakref.finalize`` frees it when its owner is collected (or closed), once; a model frees its
contexts first, since a context must not outlive its model. The finalizers hold these handles,
never the objects, so they keep nothing alive."""

from __future__ import annotations


class Native:
    """A llama.cpp model's or context's handle (and a context's batch), freed once."""

    __slots__ = ("handle", "batch")

    def __init__(self, handle) -> None:
        self.handle, self.batch = handle, None


def free_context(lib, native: Native) -> None:
    if native.batch is not None:
        lib.llama_batch_free(native.batch)
        native.batch = None
    if native.handle:
        lib.llama_free(native.handle)
        native.handle = None


def free_model(lib, native: Native, contexts: list[Native]) -> None:
    """A model's contexts, then its weights (a context must not outlive its model)."""
    for context in contexts:
        free_context(lib, context)
    if native.handle:
        lib.llama_model_free(native.handle)
        native.handle = None

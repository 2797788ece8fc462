"""llama.cpp rows in KV streams of their own (``LlamaModel.split_streams``) on the embedded GGUF:
the same bytes stored, the same numbers computed, as in one unified cache; the prefix restored into
every stream; a join into a new stream, and one that outgrows the streams.

Skipped where llama-cpp-python is not installed, except the byte-layout refusals, which need no model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_llamacpp import DOC, OTHER, QUESTION, _llama, _store

from pced.backends.llamacpp import cells
from pced.backends.llamacpp.settings import LlamaSettings


@pytest.fixture(scope="module")
def models():
    """The same GGUF loaded twice: one with a stream per sequence (the default), one unified."""
    _llama()
    from pced.backends.llamacpp.model import LlamaModel

    split, unified = LlamaModel(None, LlamaSettings(threads=1)), LlamaModel(None, LlamaSettings(threads=1))
    unified.split_streams = False
    assert split.split_streams
    return split, unified


def _answer_logits(model, store, documents, answer_ids):
    """The prefill's logits and each step's, of the rows amateur + one per document."""
    from pced.backends.llamacpp.rows import LlamaExpertRows

    builder = store.builder
    states = [store.load(d) for d in store.add(documents)]
    rows = LlamaExpertRows(model, store.prefix(), [lambda s=s: s for s in states], builder.suffix_ids(QUESTION),
                           builder.suffix_ids(QUESTION, with_context=False), len(answer_ids) + 1)
    try:
        out = [rows.prefill()] + [rows.advance(token) for token in answer_ids]
        assert rows.ctx.split == model.split_streams
    finally:
        rows.close()
    return out


@pytest.mark.slow
def test_a_state_is_the_same_bytes_whichever_layout_encoded_it(tmp_path, models):
    """Stored states do not depend on the context's streams: states stored before pced gave each row
    a stream load unchanged, and the format version stays."""
    from pced.backends.llamacpp.states import encode_states

    split, unified = models
    store = _store(split, tmp_path / "states")
    builder, prefix = store.builder, store.prefix()
    documents = [builder.encode(builder.context_text([d])) for d in (DOC, OTHER, " ".join([DOC] * 3))]
    with split.lock, unified.lock:
        got = encode_states(split, prefix, documents)
        assert split._contexts["encode"].n_stream > 1
        expected = encode_states(unified, prefix, documents)
        assert unified._contexts["encode"].n_stream == 1
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert [cells.parse(s).caches[0].n for s in got] == [len(d) for d in documents]


@pytest.mark.slow
def test_a_split_context_refuses_one_stream_bytes_until_their_stream_count_is_rewritten(tmp_path, models):
    """Why a stored state restored into a split context read 0 bytes: the bytes count the streams of the
    cache that wrote them, and llama.cpp refuses another count. ``set_state`` rewrites it."""
    import ctypes

    split, _ = models
    store = _store(split, tmp_path / "states")
    state = store.load(store.add([DOC])[0])
    data = np.ascontiguousarray(state.data)
    with split.lock:
        ctx = split.context(512, 2)
        assert ctx.n_stream > 1
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        assert split.lib.llama_state_seq_set_data(ctx.handle, pointer, data.size, 1) == 0
        ctx.set_state(1, state.data)
        restored, stored = cells.parse(ctx.get_state(1)).caches[0], state.cells.caches[0]
    assert np.array_equal(restored.positions, stored.positions)
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(restored.layers, stored.layers))


@pytest.mark.slow
def test_rows_in_streams_of_their_own_compute_what_one_unified_cache_computes(tmp_path, models):
    """Exact, at every step: a row attends to the same cells in the same order, its own; in one
    unified cache it also walks past every other row's (masked) cells."""
    split, unified = models
    store = _store(split, tmp_path / "states")
    answer = store.builder.encode(" The code is 4417")
    got = _answer_logits(split, store, [DOC, OTHER, " ".join([OTHER] * 4)], answer)
    expected = _answer_logits(unified, store, [DOC, OTHER, " ".join([OTHER] * 4)], answer)
    assert got[0].shape == (4, split.n_vocab)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_row_restored_into_its_stream_is_its_prompt_decoded_as_one_sequence(tmp_path, models):
    """Every row of a prefill (prefix restored into each stream, joined to the document's stored cells)
    gives exactly the logits of its whole prompt decoded from tokens as the only sequence of a context."""
    split, _ = models
    store = _store(split, tmp_path / "states")
    builder = store.builder
    rows = _answer_logits(split, store, [OTHER, DOC], [])[0]
    prompts = [builder.prefix_ids + builder.suffix_ids(QUESTION, with_context=False)] + [
        builder.prefix_ids + builder.encode(builder.context_text([d])) + builder.suffix_ids(QUESTION) for d in (OTHER, DOC)]
    for row, prompt in enumerate(prompts):
        with split.lock:
            ctx = split.context(len(prompt), 1)
            alone = ctx.decode(prompt, range(len(prompt)), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])[0]
        assert torch.equal(rows[row], alone)


@pytest.mark.slow
def test_every_expert_stream_holds_the_prefix_then_its_document(tmp_path, models):
    from pced.backends.llamacpp.states import restore_expert, restore_prefix

    split, _ = models
    store = _store(split, tmp_path / "states")
    prefix = store.prefix()
    states = [store.load(d) for d in store.add([DOC, OTHER])]
    with split.lock:
        ctx = split.context(prefix.n_tokens + 200, 3, seq_cells=prefix.n_tokens + 100)
        assert ctx.split and ctx.n_seq >= 3 and ctx.seq_cells >= prefix.n_tokens + 100
        restore_prefix(ctx, prefix)
        for seq, state in enumerate(states, start=1):
            restore_expert(ctx, seq, prefix, state)
        held = [cells.parse(ctx.get_state(seq)).caches[0] for seq in range(3)]
        assert np.array_equal(ctx.get_state(0), prefix.data)  # the amateur: the prefix alone
        for state, row in zip(states, held[1:]):
            assert row.positions.tolist() == list(range(prefix.n_tokens + state.n_tokens))
            prefix_cells, doc_cells = prefix.cells.caches[0], state.cells.caches[0]
            for (_, rows), (_, p_rows), (_, d_rows) in zip(row.layers, prefix_cells.layers, doc_cells.layers):
                assert np.array_equal(rows, np.concatenate([p_rows, d_rows]))
        # a copy across streams takes the range's cells and keeps the target's: here, the prefix back
        ctx.seq_rm(2, 0, prefix.n_tokens)
        assert cells.parse(ctx.get_state(2)).caches[0].positions[0] == prefix.n_tokens
        ctx.seq_cp(1, 2, 0, prefix.n_tokens)
        assert cells.parse(ctx.get_state(2)).caches[0].positions.tolist() == held[2].positions.tolist()
        again = cells.parse(ctx.get_state(2)).caches[0]
        for (_, rows), (_, before) in zip(again.layers, held[2].layers):
            assert np.array_equal(rows, before)


def _join(model, store, joining: str, reserve: int):
    """The next logits of rows (amateur, OTHER, ``joining``) where ``joining`` joined after the answer's
    first tokens, and of the same rows with it present from the start."""
    from pced.backends.llamacpp.rows import LlamaExpertRows

    a, b = (store.load(d) for d in store.add([OTHER, joining]))
    builder = store.builder
    suffix, amateur = builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, with_context=False)
    answer = builder.encode(" The code is")
    joined = LlamaExpertRows(model, store.prefix(), [lambda: a], suffix, amateur, 16)
    joined.reserve(reserve)
    joined.prefill()
    streams = (joined.ctx.n_seq, joined.ctx.seq_cells)
    for token in answer[:-1]:
        joined.advance(token)
    joined.join(b, answer)
    grown = (joined.ctx.n_seq, joined.ctx.seq_cells) != streams
    got = joined.advance(answer[-1])
    joined.close()
    both = LlamaExpertRows(model, store.prefix(), [lambda: a, lambda: b], suffix, amateur, 16)
    both.prefill()
    for token in answer:
        expected = both.advance(token)
    both.close()
    assert got.shape == expected.shape == (3, model.n_vocab)
    return got, expected, grown


@pytest.mark.slow
def test_a_join_into_a_free_stream_is_exact(tmp_path, models):
    split, _ = models
    got, expected, grown = _join(split, _store(split, tmp_path / "states"), DOC, 256)
    assert not grown and torch.equal(got, expected)


@pytest.mark.slow
def test_a_join_longer_than_the_streams_grows_the_context_and_stays_exact(tmp_path, models):
    """The rows' streams hold the longest row (OTHER: about 500 cells); a document of 800 tokens
    joining needs longer ones: every row's cells move into a larger context, the same bytes in the
    same order, so no row's numbers move."""
    from pced.backends.llamacpp.model import LlamaModel

    split = LlamaModel(None, LlamaSettings(threads=1))  # its own contexts: none larger from another test
    store = _store(split, tmp_path / "states")
    long_doc = " ".join([DOC] * 14)
    assert len(store.builder.encode(store.builder.context_text([long_doc]))) > 700
    got, expected, grown = _join(split, store, long_doc, 0)
    assert grown and torch.equal(got, expected)


def test_bytes_that_are_not_a_sequence_state_are_refused():
    with pytest.raises(cells.StateLayoutError):
        cells.parse(np.zeros(4, dtype=np.uint8))
    rng = np.random.default_rng(0)
    with pytest.raises(cells.StateLayoutError):
        cells.parse(rng.integers(0, 256, 4096, dtype=np.uint8))


def _calls(split: bool, seqs: list[int], step: int = 32, batch: int = 512) -> list[list[int]]:
    from types import SimpleNamespace

    from pced.backends.llamacpp.model import LlamaContext

    ctx = LlamaContext.__new__(LlamaContext)  # no model: the cutting of calls is arithmetic
    ctx.split = split
    ctx.model = SimpleNamespace(settings=LlamaSettings(batch_tokens=batch, ubatch_tokens=step))
    return ctx._calls(seqs)


def test_split_streams_take_every_rows_next_tokens_in_one_call():
    """The question suffix of 17 rows (the amateur's 43 tokens, 45 for each expert): two calls, each
    holding at most 32 tokens of a row, every entry once, each row's entries in their order."""
    seqs = [0] * 43 + [seq for seq in range(1, 17) for _ in range(45)]
    calls = _calls(True, seqs)
    assert [len(call) for call in calls] == [17 * 32, 11 + 16 * 13]
    assert sorted(j for call in calls for j in call) == list(range(len(seqs)))
    for call in calls:
        assert call == sorted(call)
        assert max(sum(1 for j in call if seqs[j] == seq) for seq in range(17)) <= 32
    # a decode step: one token of every row, one call; one sequence: 32 tokens a call
    assert _calls(True, list(range(17))) == [list(range(17))]
    assert [len(c) for c in _calls(True, [3] * 70)] == [32, 32, 6]


def test_one_unified_cache_takes_batch_tokens_a_call():
    seqs = [seq for seq in range(17) for _ in range(45)]
    assert [len(c) for c in _calls(False, seqs)] == [512, 17 * 45 - 512]

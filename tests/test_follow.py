"""Decode-time relevance (``methods.follow``): experts that join mid-answer see exactly what a
fresh run of them would; re-scoring that changes nothing changes no token; a bridge word raises
the second document's relevance."""

import pytest
import torch

from pced.decoding.sampling import SamplingConfig
from pced.backends.rows import ExpertRows
from pced.documents import Candidate, Document
from pced.methods.follow import Follow
from pced.methods.pced import Expert, PCEDGeneration
from pced.decoding.rule import RuleConfig

from helpers.server import QUESTION as BRIDGE_QUESTION, tiny_store
from helpers.experts import encode_setup

QUESTION = "Which town was the founder born in?"
DOCS = [
    "Mira Quell founded the Zorblax company.",
    "Mira Quell was born in the town of Oskvale, which lies on the northern shore of Lake Tarnow. " * 6,
    "Oskvale is a fishing town with a copper-roofed harbour.",
]


@pytest.fixture(scope="module")
def setup(tiny_llm):
    return encode_setup(tiny_llm, DOCS)


def alone(llm, ids):
    with torch.inference_mode():
        return llm.model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("first, joining", [(0, 1), (1, 2)], ids=["longer document (widened)", "shorter document"])
def test_a_joined_expert_sees_exactly_what_a_fresh_run_of_it_sees(setup, first, joining):
    llm, builder, prefix, caches = setup
    rows = ExpertRows(llm, prefix, [lambda: caches[first]], builder.suffix_ids(QUESTION),
                      builder.suffix_ids(QUESTION, with_context=False), max_new_tokens=8)
    logits = rows.prefill()
    generated = []
    for _ in range(3):
        generated.append(int(torch.argmax(logits[1])))
        logits = rows.advance(generated[-1])
    generated.append(int(torch.argmax(logits[1])))  # chosen, not fed yet: the join happens here
    rows.join(caches[joining], generated)
    logits = rows.advance(generated[-1])
    assert logits.shape[0] == 3 and rows.stats["joined"] == 1
    sequences = [builder.prompt_ids([], QUESTION), builder.prompt_ids([DOCS[first]], QUESTION),
                 builder.prompt_ids([DOCS[joining]], QUESTION)]
    for row, ids in enumerate(sequences):  # the joined row, and the rows that were there (after widening)
        diff = (logits[row] - alone(llm, ids + generated)).abs().max().item()
        assert diff <= 1e-4, (row, diff)
    generated.append(int(torch.argmax(logits[2])))
    logits = rows.advance(generated[-1])  # and it keeps decoding with the others
    diff = (logits[2] - alone(llm, sequences[2] + generated)).abs().max().item()
    assert diff <= 1e-4, diff


def pced(setup, follow=None, n_docs=2, max_new_tokens=10):
    llm, builder, prefix, caches = setup
    experts = [Expert(f"d{i}", r, lambda kv=kv: kv) for i, (kv, r) in enumerate(zip(caches[:n_docs], [0.9, 0.6]))]
    return PCEDGeneration(llm, prefix, experts, builder.suffix_ids(QUESTION), builder.suffix_ids(QUESTION, False),
                          RuleConfig(gamma=2.5), SamplingConfig(max_new_tokens=max_new_tokens, ignore_eos=True), follow)


def candidates(relevance):
    return [Candidate(Document(f"d{i}", DOCS[i]), r) for i, r in enumerate(relevance)]


def test_looking_again_without_a_change_gives_todays_tokens_exactly(setup):
    today = pced(setup).answer()
    looks = []

    def retrieve(query):  # the same two documents, with lower relevance than the question gave them
        looks.append(query)
        return candidates([0.5, 0.3])

    follow = Follow(QUESTION, retrieve, lambda c: None, top_k=2, rescore=True, max_joins=3)
    again = pced(setup, follow).answer()
    assert again.token_ids == today.token_ids and [s.winner for s in again.trace] == [s.winner for s in today.trace]
    assert again.betas == today.betas
    assert looks and all(q.startswith(QUESTION) for q in looks)  # it did look, at word boundaries
    assert all(s.relevance == pytest.approx([0.9, 0.6]) for s in again.trace)
    assert today.trace[0].relevance is None  # off: the trace does not carry it


def test_a_document_found_with_the_answer_joins_and_its_relevance_is_recorded(setup):
    llm, builder, prefix, caches = setup
    follow = Follow(QUESTION, lambda query: candidates([0.9, 0.6, 0.95]), lambda c: caches[int(c.document.id[1:])],
                    top_k=3, rescore=True, max_joins=1)
    generation = pced(setup, follow, max_new_tokens=16)
    answer = generation.answer()
    assert [c.document.id for c in generation.joined] == ["d2"] and answer.stats["joined"] == 1
    joined_at = next(i for i, s in enumerate(answer.trace) if len(s.relevance) == 3)
    assert joined_at > 0 and answer.trace[joined_at].relevance == pytest.approx([0.9, 0.6, 0.95])
    assert len(answer.betas) == 3 and all(b == b for b in answer.betas)  # the joined expert got its own beta


def test_the_bridge_word_raises_the_second_documents_relevance(tmp_path_factory, tiny_llm):
    store = tiny_store(tmp_path_factory, tiny_llm)
    for retriever in ("sparse", "hybrid"):
        def retrieve(query):
            return store.retrieve(query, retriever, top_k=5, top_n=5, rerank=False)

        base = {c.document.id: c.relevance for c in retrieve(BRIDGE_QUESTION)}
        follow = Follow(BRIDGE_QUESTION, retrieve, lambda c: None, top_k=1, rescore=True)
        experts = ["zorblax", "quell"]
        before, _ = follow.look("The company was founded by ", experts, [base[e] for e in experts], [0, 0])
        after, _ = follow.look("The company was founded by Mira Quell, who ", experts, [base[e] for e in experts], before)
        assert after[1] > before[1] >= base["quell"], (retriever, base, before, after)  # "Mira Quell" names the second hop
        assert after[0] >= base["zorblax"]  # an expert never loses what the question gave it

"""Citations from the trace: sentences, shares, the JSON contract, the server and the CLI."""

import io

import pytest

from pced.text.answers import Answer, Step, answer_json
from pced.text.citations import CitationRule, cite, cite_answer, split_sentences
from pced.documents import Candidate, Document

A = Document("quell", "Mira Quell was born in the town of Oskvale.", "Mira Quell")
B = Document("zorblax", "The Zorblax Company makes tidal clocks.", "Zorblax")
CANDIDATES = [Candidate(A, 0.8), Candidate(B, 0.6)]
# (token, winner): sentence 1 from A (one stray word won by B, one by the amateur), sentence 2 from B
PIECES = [("Mira", "quell"), (" Quell", "quell"), (" was", None), (" born", "quell"), (" in", "zorblax"),
          (" Oskvale", "quell"), (".", "quell"), (" Her", "zorblax"), (" company", "zorblax"), (" makes", "zorblax"),
          (" tidal", "zorblax"), (" clocks", "zorblax"), (".", "quell")]


def two_document_answer() -> Answer:
    trace = [Step(i, i, text, -1 if doc is None else ["quell", "zorblax"].index(doc), doc) for i, (text, doc) in enumerate(PIECES)]
    return Answer("".join(t for t, _ in PIECES), list(range(len(PIECES))), trace, [0.1, 0.2], {})


def test_each_sentence_cites_the_documents_it_is_made_of():
    answer = two_document_answer()
    citations = cite_answer(answer)
    assert [(c.text, c.doc_ids) for c in citations] == [
        ("Mira Quell was born in Oskvale.", ["quell"]),  # B's " in" is 2 of 27 characters: below 0.2
        ("Her company makes tidal clocks.", ["zorblax"]),
    ]
    assert all(answer.text[c.start:c.end] == c.text for c in citations)
    # a lower threshold cites the stray word's document too, most characters first
    assert cite_answer(answer, CitationRule(min_share=0.05))[0].doc_ids == ["quell", "zorblax"]


def test_the_amateur_is_never_cited_and_counts_against_documents():
    text = "It is so. Mira Quell."
    pieces = [("It is so.", None), (" Mira", "quell"), (" Quell.", None)]
    citations = cite(text, pieces)
    assert [c.doc_ids for c in citations] == [[], ["quell"]]  # 4 of 10 characters: 0.4
    assert cite(text, pieces, CitationRule(min_share=0.5))[1].doc_ids == []
    with pytest.raises(ValueError, match="min_share"):
        CitationRule(min_share=0)


@pytest.mark.parametrize("text,sentences", [
    ("He met Dr. Smith in the U.S. in 1990. Then e.g. he left!", ["He met Dr. Smith in the U.S. in 1990.", "Then e.g. he left!"]),
    ("J. R. R. Tolkien wrote it. It cost 3.5 dollars.", ["J. R. R. Tolkien wrote it.", "It cost 3.5 dollars."]),
    ('She said "Yes." Then approx. five left?', ['She said "Yes."', "Then approx. five left?"]),
    ("First line\nsecond line", ["First line", "second line"]),
    ("no end punctuation", ["no end punctuation"]),
    ("   ", []),
])
def test_sentences_split_on_ends_not_on_abbreviations_initials_or_decimals(text, sentences):
    assert [text[a:b] for a, b in split_sentences(text)] == sentences


def test_the_json_contract_carries_citations():
    out = answer_json(two_document_answer(), CANDIDATES)
    assert out["citations"] == [
        {"start": 0, "end": 31, "text": "Mira Quell was born in Oskvale.", "doc_ids": ["quell"]},
        {"start": 32, "end": 63, "text": "Her company makes tidal clocks.", "doc_ids": ["zorblax"]},
    ]


def test_the_cli_prints_markers_and_sources_literally():
    from rich.console import Console

    from pced.cli.render import stream_answer

    class Done(list):
        def answer(self):
            return two_document_answer()

    answer = two_document_answer()
    odd = [Candidate(Document("quell", A.text, "[bold]Mira[/bold]"), 0.8), CANDIDATES[1]]
    out = io.StringIO()
    stream_answer(Done(answer.trace), odd, "Who is [red]she[/red]?", Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "Q: Who is [red]she[/red]?" in text  # user text printed as it is, never as markup
    assert "Cited: Mira Quell was born in Oskvale.[1] Her company makes tidal clocks.[2]" in text
    assert "[1] quell  [bold]Mira[/bold]" in text and "[2] zorblax  Zorblax" in text


def covers(answer: str, citations: list[dict]) -> bool:
    """Every non-space character of the answer lies in exactly one citation span."""
    marks = [0] * len(answer)
    for c in citations:
        assert answer[c["start"]:c["end"]] == c["text"]
        for i in range(c["start"], c["end"]):
            marks[i] += 1
    return all(m == 1 for ch, m in zip(answer, marks) if not ch.isspace())


def test_a_real_tiny_model_answer_cites_its_experts(tmp_path, tiny_llm):
    from pced.generator import Generator
    from pced.pipeline import ask_candidates
    from pced.options import AskOptions
    from pced.decoding.sampling import SamplingConfig

    generator = Generator(tiny_llm, "rag", tmp_path / "kv", "float32")
    options = AskOptions(gamma=1.0, sampling=SamplingConfig(max_new_tokens=24))
    out = ask_candidates(generator, CANDIDATES, "Where was the founder of Zorblax born?", options).json()
    experts = {e["doc_id"] for e in out["experts"]}
    assert out["answer"].strip() and out["citations"] and covers(out["answer"], out["citations"])
    for c in out["citations"]:
        assert set(c["doc_ids"]) <= experts
        # recount from the trace: the characters each document won inside the span
        counts, position = {}, 0
        for t in out["trace"]:
            for ch in t["token"]:
                if c["start"] <= position < c["end"] and not ch.isspace():
                    counts[t["doc_id"]] = counts.get(t["doc_id"], 0) + 1
                position += 1
        total = sum(counts.values())
        assert set(c["doc_ids"]) == {d for d, n in counts.items() if d is not None and n / total >= CitationRule().min_share}
    assert any(c["doc_ids"] for c in out["citations"])  # max aggregation: documents win tokens


def test_the_server_returns_citations_in_the_message_and_the_last_stream_chunk(tmp_path_factory, tiny_llm):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from helpers.server import QUESTION, sse_chunks, tiny_store
    from pced.server import create_app

    store = tiny_store(tmp_path_factory, tiny_llm)
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "pced": {"top_k": 3}}
    with TestClient(create_app(store)) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = sse_chunks(response.iter_lines())
    citations = message["pced"]["citations"]
    assert citations and covers(message["content"], citations)
    experts = {e["doc_id"] for e in message["pced"]["experts"]}
    assert all(set(c["doc_ids"]) <= experts for c in citations)
    assert chunks[-1]["pced"]["citations"] == citations
    assert all("citations" not in c.get("pced", {}) for c in chunks[:-1])

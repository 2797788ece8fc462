"""The loop guard: its definition on plain sequences, the loop's stream and trace under it, and
the tiny random model's answers with it on and off."""

import random

import pytest
import torch

from pced.decoding.loop import Decision, Generation, PlainScoring, Rows
from pced.decoding.repetition import LoopGuard
from pced.decoding.sampling import SamplingConfig


def first_loop(keys: list[str], min_span: int):
    """(tokens pushed, tokens kept) at the first loop by the definition, or None: a span S of p
    tokens with a letter and two distinct tokens, followed by itself (p >= min_span) or twice more
    (2 <= p < min_span)."""
    for n in range(1, len(keys) + 1):
        for p in range(2, n + 1):
            copies = 2 if p >= min_span else 3
            if copies * p > n:
                continue
            span = keys[n - p : n]
            if keys[n - copies * p : n] == span * copies and len(set(span)) > 1 and any(k.isalpha() for k in span):
                return n, n - (copies - 1) * p
    return None


def push_all(keys: list[str], min_span: int):
    guard = LoopGuard(min_span, max(1, len(keys)))
    for n, key in enumerate(keys, start=1):
        if guard.push(key):
            return n, guard.keep
    return None


@pytest.mark.parametrize("keys, expected", [
    ("a b c d e f a b c d e f".split(), (12, 6)),  # six tokens twice
    ("x a b c a b c a b c".split(), (10, 4)),  # a short span three times: one copy stays
    ("a b c a b c".split(), None),  # a short span twice is not a loop ("Bora Bora")
    ("a a a a a a a a".split(), None),  # one token repeated
    ("1 , 0 0 0 , 0 0 0 , 0 0 0 , 0 0 0".split(), None),  # a number: no letter
])
def test_the_guard_finds_loops_by_their_definition(keys, expected):
    assert push_all(keys, 6) == expected == first_loop(keys, 6)


def test_the_guard_agrees_with_the_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        vocabulary = ["a", "b", "c", "1", ","][: rng.randrange(2, 6)]
        keys = [rng.choice(vocabulary) for _ in range(rng.randrange(1, 40))]
        min_span = rng.randrange(2, 7)
        assert push_all(keys, min_span) == first_loop(keys, min_span), (keys, min_span)


def test_held_is_the_longest_repeat_in_progress():
    guard = LoopGuard(6, 32)
    held = []
    for key in "the city of Paris and the city of Lyon".split():
        guard.push(key)
        held.append(guard.held)
    assert held == [0, 0, 0, 0, 0, 1, 2, 3, 0]  # "the city of" repeats, then "Lyon" breaks it


class ScriptedRows(Rows):
    """One row whose next token is the script's next one: a stand-in model for the loop's stop
    rules (what the guard does depends only on the chosen tokens)."""

    def __init__(self, script: list[int], vocab: int):
        self.script, self.vocab, self.taken, self.timings, self.stats = script, vocab, [], {}, {}

    def logits(self) -> torch.Tensor:
        logits = torch.zeros(1, self.vocab)
        logits[0, self.script[len(self.taken) % len(self.script)]] = 1.0
        return logits

    def prefill(self) -> torch.Tensor:
        return self.logits()

    def advance(self, token: int) -> torch.Tensor:
        self.taken.append(token)
        return self.logits()


def scripted(tiny_llm, text: str, loop_span: int, max_new_tokens: int = 40, eos: bool = False, ignore_eos: bool = False):
    """The answer of a row that writes ``text`` (over and over, or once then EOS), and the steps
    it streamed."""
    tokenizer = tiny_llm.tokenizer
    script = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    rows = ScriptedRows(script, len(tokenizer))
    generation = Generation(rows, PlainScoring(), tiny_llm, SamplingConfig(max_new_tokens=max_new_tokens,
                                                                           loop_span=loop_span, ignore_eos=ignore_eos),
                            method="single")
    streamed = list(generation)
    return generation.answer(), streamed, rows


def test_a_loop_ends_with_one_copy_and_nothing_of_the_repeat_is_streamed(tiny_llm):
    answer, streamed, rows = scripted(tiny_llm, " a suburb of Ashwood City,", loop_span=6)
    assert answer.text == " a suburb of Ashwood City,"
    assert streamed == answer.trace and "".join(s.text for s in streamed) == answer.text
    copy = len(tiny_llm.tokenizer.encode(" a suburb of Ashwood City,", add_special_tokens=False))
    assert answer.token_ids == rows.script[:copy] and len(rows.taken) == 2 * copy - 1  # stopped at the second copy
    off, _, _ = scripted(tiny_llm, " a suburb of Ashwood City,", loop_span=0)
    assert len(off.token_ids) == 40 and off.token_ids[: len(answer.token_ids)] == answer.token_ids
    bench, _, _ = scripted(tiny_llm, " a suburb of Ashwood City,", loop_span=6, ignore_eos=True)
    assert bench.token_ids == off.token_ids  # a benchmark's exact length: ignore_eos turns the guard off too


def test_a_loop_that_starts_the_answer_is_cut_between_words(tiny_llm):
    """The first copy has no leading space: compared by key, the cut falls after a whole copy."""
    answer, streamed, _ = scripted(tiny_llm, "Kenji Fujimori Kenji Fujimori Kenji Fujimori Kenji Fujimori", loop_span=6,
                                   eos=True)
    assert answer.text == "Kenji Fujimori" and streamed == answer.trace


@pytest.mark.parametrize("text", [
    "The Little Couple: The Little Couple: September 19, 2017",  # a short phrase twice, then the answer
    "It cost 1,000,000,000,000 elums.",  # a number
    "Bora Bora and Walla Walla",
])
def test_what_is_not_a_loop_is_streamed_whole(tiny_llm, text):
    answer, streamed, _ = scripted(tiny_llm, text, loop_span=6, eos=True)
    assert answer.text == text and streamed == answer.trace
    assert "".join(s.text for s in streamed) == text


def test_rows_that_decide_themselves_stop_at_the_loop(tiny_llm):
    """vLLM's rows choose tokens inside the engine: the guard acts on the tokens they hand the
    loop, which then asks for no further token and closes the rows (vLLM aborts the requests)."""
    tokens = tiny_llm.tokenizer.encode(" the grey heron of Elumia," * 4, add_special_tokens=False)
    copy = len(tokens) // 4

    class DecidedRows(Rows):
        timings, stats = {}, {}

        def __init__(self):
            self.taken, self.closed = [], False

        def prefill(self):
            return Decision(tokens[0], 0)

        def advance(self, token):
            self.taken.append(token)
            return Decision(tokens[len(self.taken)], 0)

        def close(self):
            self.closed = True

    rows = DecidedRows()
    answer = Generation(rows, PlainScoring(), tiny_llm, SamplingConfig(max_new_tokens=64)).answer()
    assert answer.token_ids == tokens[:copy] and len(rows.taken) == 2 * copy - 1 and rows.closed


def guarded_and_unguarded(llm, run, key):
    """``run(loop_span)`` -> Answer. The guard only stops: the answer with it is the answer without
    it, cut exactly where the unguarded tokens first loop. Returns that first loop (or None)."""
    on, off = run(6), run(0)
    loop = push_all([key(t) for t in off.token_ids], 6)
    if loop is None:
        assert on.token_ids == off.token_ids and on.text == off.text
    else:
        assert on.token_ids == off.token_ids[: loop[1]] and on.text == llm.tokenizer.decode(on.token_ids)
        assert push_all([key(t) for t in on.token_ids], 6) is None
    return loop


def test_on_the_tiny_model_the_guard_changes_no_answer_that_does_not_loop(tiny_llm):
    """The random model does not loop (its answers run to the limit without a repeat): holding
    tokens back and releasing them leaves every token and the text as they were."""
    from pced.methods.concat import PlainGeneration
    from pced.text.prompts import PromptBuilder
    from pced.decoding.repetition import key_of

    builder = PromptBuilder(tiny_llm.tokenizer)
    for question in ("Where was Mira Quell born?", "What is the capital of Elumia?", "Name three fishing towns."):
        ids = builder.prompt_ids(["Mira Quell founded Zorblax. She was born in Oskvale."], question)
        run = lambda span: PlainGeneration(tiny_llm, ids, SamplingConfig(max_new_tokens=48, loop_span=span)).answer()
        guarded_and_unguarded(tiny_llm, run, lambda t: key_of(tiny_llm.tokenizer, t))


@pytest.mark.slow
def test_the_demo_answer_that_looped_ends_after_one_copy(tmp_path_factory, embedded_llm):
    """The demo's third question, with the demo's settings: without the guard the embedded model
    repeats "a suburb of Ashwood City" to the token limit; with it the answer is the same tokens up
    to the second copy, and ends there."""
    import json
    from dataclasses import replace
    from importlib import resources

    from pced.cli.store import DEMO_OPTIONS
    from pced.corpus.reader import read_corpus
    from pced.pipeline import ask
    from pced.decoding.repetition import key_of
    from pced.store import DocumentStore, IndexSettings, index_store

    root = tmp_path_factory.mktemp("demo") / "store"
    data = resources.files("pced") / "data"
    with resources.as_file(data / "demo_corpus.jsonl") as corpus:
        index_store(read_corpus(corpus), root, IndexSettings(), llm=embedded_llm, progress=False)
    store = DocumentStore.open(root, llm=embedded_llm)
    question = json.loads((data / "demo_questions.json").read_text())[2]["question"]
    options = lambda span: replace(DEMO_OPTIONS, sampling=replace(DEMO_OPTIONS.sampling, loop_span=span))
    run = lambda span: ask(store, question, options(span)).answer()
    loop = guarded_and_unguarded(embedded_llm, run, lambda t: key_of(embedded_llm.tokenizer, t))
    assert loop is not None and loop[1] < DEMO_OPTIONS.sampling.max_new_tokens

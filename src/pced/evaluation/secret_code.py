"""The paper's synthetic latency set: N documents of exactly L tokens, one holding a secret code.

Latency (TTFT, end-to-end) must be measured under a controlled context length, so every
document is padded/truncated to exactly ``doc_tokens`` tokens of the model's own tokenizer,
measured as ``len(tokenizer(doc.render(), add_special_tokens=False)["input_ids"])``.
Tokenizers are not additive over concatenation, so lengths are fixed by re-tokenizing: the
longest whole-word prefix that fits, then single short pieces appended until the count is
exact, each step checked by a fresh tokenization.
"""

from __future__ import annotations

import random
import string
from typing import Any

from pced.errors import UserError
from pced.documents import Document
from pced.evaluation.kinds import INTEGER, Kind, check, record
from pced.evaluation.records import Dataset, Example, example_rng

__all__ = ["make_secret_code", "token_count"]

QUESTION = "What is the secret code? Answer with the code exactly as it is written."

# Plain words; none of them is "secret" or "code", so only the gold document mentions one.
_FILLER_WORDS = (
    "river mountain village morning evening garden window market letter journey teacher "
    "student harbor island forest meadow bridge castle kitchen library museum painter "
    "farmer soldier sailor winter summer autumn spring weather cloud stone silver golden "
    "quiet gentle ancient modern bright narrow wide early late small large happy busy "
    "walked carried opened closed watched found built painted wrote read visited crossed "
    "followed remembered noticed gathered shared planted repaired described measured "
    "table chair lamp road field orchard valley coast tower station engine wheel basket "
    "candle blanket mirror ladder fence path hill lake pond shore sand wave wind rain "
    "snow sun moon star night day week year story song music dance picture map book"
).split()
_LINKS = ("the", "a", "and", "of", "to", "in", "near", "with", "after", "before")
_COUNT = Kind("an integer >= 1", lambda v: INTEGER.mismatch(v, "") is None and v >= 1)
SETTINGS = record({"n_docs": _COUNT, "doc_tokens": _COUNT, "seed": INTEGER, "n_examples": _COUNT})
# Short pieces appended one at a time to close the last gap to exactly L tokens.
_PADDING = (" and", " the", " of", " a", ".", ",", " x", " -")


def token_count(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` without special tokens: the length the paper fixes."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _filler_sentence(rng: random.Random) -> list[str]:
    words = [rng.choice(_FILLER_WORDS if k % 3 else _LINKS) for k in range(rng.randint(8, 16))]
    words[0] = words[0].capitalize()
    words[-1] += "."
    return words


def _secret(rng: random.Random) -> str:
    letters = string.ascii_uppercase
    return (f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(1000, 9999)}-"
            f"{rng.choice(letters)}{rng.choice(letters)}")


def _exact_length_text(tokenizer: Any, rng: random.Random, n_tokens: int,
                       head: list[str]) -> str:
    """Text of exactly ``n_tokens`` tokens that starts with the words ``head``: filler words
    are added until the text is too long, the longest fitting word prefix is searched, and the
    remaining gap is closed with single padding pieces."""
    words = list(head)
    if head and token_count(tokenizer, " ".join(head)) > n_tokens:
        raise UserError(f"doc_tokens={n_tokens} is too small for {' '.join(head)!r}")
    total = 0
    while total <= n_tokens:
        target = len(words) + n_tokens + 8
        while len(words) < target:
            words.extend(_filler_sentence(rng))
        total = token_count(tokenizer, " ".join(words))

    def fits(n_words: int) -> bool:
        return token_count(tokenizer, " ".join(words[:n_words])) <= n_tokens

    # Longest fitting word prefix: gallop from the proportional guess, then bisect.
    # Invariants: the prefix of `low` words fits; that of `high + 1` words does not.
    low, high = len(head), len(words) - 1
    guess = min(max(low, len(words) * n_tokens // total), high)
    step = 4
    if fits(guess):
        low = guess
        while low + step <= high and fits(low + step):
            low, step = low + step, step * 2
        high = min(high, low + step - 1)
    else:
        high = guess - 1
        while high - step >= low and not fits(high - step + 1):
            high, step = high - step, step * 2
        low = max(low, high - step + 1)
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    count = token_count(tokenizer, text)
    while count < n_tokens:
        for piece in _PADDING:
            trial = (text + piece).strip()
            trial_count = token_count(tokenizer, trial)
            if count < trial_count <= n_tokens:
                text, count = trial, trial_count
                break
        else:
            raise RuntimeError(f"cannot pad to exactly {n_tokens} tokens with this tokenizer")
    return text


def make_secret_code(tokenizer: Any, n_docs: int = 64, doc_tokens: int = 2048, seed: int = 42,
                     n_examples: int = 1) -> Dataset:
    """Build ``n_examples`` instances of ``n_docs`` documents of exactly ``doc_tokens`` tokens.

    One document per instance (at a seeded random position) contains "The secret code is
    XX-NNNN-XX." at a random early word offset; the rest are filler distractors. The question
    asks for the code verbatim; answers = [code], scored with subspan_em. A caller measuring
    latency treats the first instance as the warm-up (the paper discards one).
    """
    check("secret-code", {"n_docs": n_docs, "doc_tokens": doc_tokens, "seed": seed, "n_examples": n_examples},
          SETTINGS, noun="setting")
    examples = []
    for e in range(n_examples):
        rng = example_rng(seed, e)
        code = _secret(rng)
        gold_position = rng.randrange(n_docs)
        documents = []
        for d in range(n_docs):
            head: list[str] = []
            if d == gold_position:
                lead: list[str] = []
                lead_words = rng.randint(0, 40)
                while len(lead) < lead_words:
                    lead.extend(_filler_sentence(rng))
                head = lead + f"The secret code is {code}.".split()
                if token_count(tokenizer, " ".join(head)) > doc_tokens:
                    head = f"The secret code is {code}.".split()
            text = _exact_length_text(tokenizer, rng, doc_tokens, head)
            documents.append(Document(id=f"secret-{e}-{d}", text=text))
        for doc in documents:  # the contract: exact length of what the model will read
            length = token_count(tokenizer, doc.render())
            if length != doc_tokens:
                raise RuntimeError(f"document {doc.id} has {length} tokens, not {doc_tokens}")
        examples.append(Example(
            id=f"secret-code-{e}", question=QUESTION, answers=[code], documents=documents,
            gold_doc_ids=[documents[gold_position].id],
            metadata={"gold_position": gold_position, "n_docs": n_docs,
                      "doc_tokens": doc_tokens},
        ))
    return Dataset(name="secret-code", task="rag", metric="subspan_em", examples=examples,
                   corpus=None, setting="distractor")

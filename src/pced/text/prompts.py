"""The paper's prompt templates (Appendix A), rendered through a model's chat template into token segments.

Every prompt pced builds is ``prefix + context + suffix``:

- ``prefix``: the chat template up to the start of the user turn's content (system prompt included);
  identical for every expert, encoded once per store.
- ``context``: the template's context block around one document (an expert) or several (the
  concatenation baselines); empty for the amateur.
- ``suffix``: the question template, the end of the user turn and the generation prompt.

Each segment is tokenized on its own and the ids are concatenated. That concatenation *is* the
plain path: the `all`/`single` baselines and the reference ``model.generate`` in the tests use
exactly these ids, so an expert's tokens equal the plain path's tokens for the same text by
construction. To make those ids also equal tokenizing the whole rendered chat at once, the
blank line between context and question goes where the tokenizer's pre-tokenizer puts it:
GPT-2-style tokenizers split ``"text.\n\nBased"`` as ``. | \n | \n | Based`` (so the separator must
lead the suffix), Llama-3-style ones as ``.\n\n | Based`` (so it must end the context). The
builder probes the tokenizer once and picks the placement that reproduces full tokenization.
Without a document there is no separator (the amateur's user turn is just the question).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

from ..errors import UserError

CONTEXT_SEPARATOR = "\n\n"
_DOC_SENTINEL = "\u2063PCED-CONTEXT\u2063"
_QUESTION_SENTINEL = "\u2063PCED-QUESTION\u2063"


@dataclass(frozen=True)
class Template:
    """Four fields the paper fixes per task; only the context mechanism varies across methods."""

    name: str
    system_prompt: str
    context_template: str
    question_template: str

    def context_block(self, documents: list[str]) -> str:
        """The context block for one or more documents ('' when there are none: the amateur)."""
        if not documents:
            return ""
        return self.context_template.format(context=CONTEXT_SEPARATOR.join(doc.strip() for doc in documents))

    def question_text(self, question: str) -> str:
        return self.question_template.format(question=question.strip())

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


RAG_TEMPLATE = Template(
    name="rag",
    system_prompt=(
        "You will be given a list of documents. You need to read carefully and understand all of them. "
        "Then you will be given a query, and your goal is to answer the query based on the documents you have read."
    ),
    context_template="{context}",
    question_template=(
        "Based on the documents above, can you answer the following query? Write a concise answer.\n"
        "query: {question}"
    ),
)

ICL_TEMPLATE = Template(
    name="icl",
    system_prompt=(
        "Please answer the following questions and ensure you follow a consistent format. In particular, "
        "ensure your final answer always looks like `Output: ['your_answer_here']` After Output write ONLY "
        "the best option following the example(s). Do NOT write anything else."
    ),
    context_template="Example(s):\n{context}",
    question_template="Now begin!\n{question}",
)

TEMPLATES = {"rag": RAG_TEMPLATE, "icl": ICL_TEMPLATE}


class PromptError(UserError):
    """A chat template pced cannot split into prefix / context / suffix."""


def render_chat(tokenizer: object, system: str, user: str) -> str:
    """One system and one user turn through the chat template, up to the generation prompt. Some
    templates (Gemma, ...) refuse a system role with the template's own error (``raise_exception``):
    then the system text is folded into the user turn. Any other failure is not caught here."""
    from jinja2 import TemplateError

    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        merged = [{"role": "user", "content": system + "\n\n" + user}]
        return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)


class PromptBuilder:
    """Turns (documents, question) into the token segments of one model's chat template."""

    def __init__(self, tokenizer: object, template: Template = RAG_TEMPLATE):
        self.tokenizer = tokenizer
        self.template = template
        self._prefix_text, self._suffix_tail = self._split_chat_template()
        self.separator_leads_suffix = True
        self.separator_leads_suffix = self._probe_separator()

    def _render(self, user_content: str) -> str:
        return render_chat(self.tokenizer, self.template.system_prompt, user_content)

    def _split_chat_template(self) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("the tokenizer has no chat template; pced needs an instruction-tuned chat model")
        rendered = self._render(_DOC_SENTINEL + _QUESTION_SENTINEL)
        doc_at, question_at = rendered.find(_DOC_SENTINEL), rendered.find(_QUESTION_SENTINEL)
        if doc_at < 0 or question_at != doc_at + len(_DOC_SENTINEL):
            raise PromptError("the chat template rewrites the user message; cannot split it into segments")
        return rendered[:doc_at], rendered[question_at + len(_QUESTION_SENTINEL) :]

    def _probe_separator(self) -> bool:
        probes = ["Alpha beta.", "Gamma 1987", "Delta (epsilon)", "zeta: eta!", "Theta\nIota"]
        question = "What is it?"

        def agrees() -> bool:
            return all(self.prompt_ids([doc], question) == self.encode(self.render([doc], question)) for doc in probes)

        for leads in (True, False):
            self.separator_leads_suffix = leads
            if agrees():
                return leads
        return True

    def render(self, documents: list[str], question: str) -> str:
        """The whole prompt as text, exactly as the chat template renders it."""
        block = self.template.context_block(documents)
        content = block + CONTEXT_SEPARATOR if block else ""
        return self._render(content + self.template.question_text(question))

    def context_text(self, documents: list[str]) -> str:
        """The context segment: the block, plus the separator unless the suffix carries it."""
        block = self.template.context_block(documents)
        return block if (self.separator_leads_suffix or not block) else block + CONTEXT_SEPARATOR

    def suffix_text(self, question: str, with_context: bool = True) -> str:
        lead = CONTEXT_SEPARATOR if (with_context and self.separator_leads_suffix) else ""
        return lead + self.template.question_text(question) + self._suffix_tail

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    @cached_property
    def prefix_ids(self) -> list[int]:
        return self.encode(self._prefix_text)

    def context_ids(self, documents: list[str]) -> list[int]:
        return self.encode(self.context_text(documents))

    def suffix_ids(self, question: str, with_context: bool = True) -> list[int]:
        """The question segment after a document (experts) or right after the prefix (amateur)."""
        return self.encode(self.suffix_text(question, with_context))

    def prompt_ids(self, documents: list[str], question: str) -> list[int]:
        """The plain path: prefix + context(documents) + suffix, the ids a concatenation baseline feeds."""
        return self.prefix_ids + self.context_ids(documents) + self.suffix_ids(question, bool(documents))

    def digest(self) -> str:
        """Identity of everything that shapes a stored cache: template fields and rendered prefix."""
        digest = hashlib.sha256(self.template.digest().encode())
        digest.update(self._prefix_text.encode())
        digest.update(self._suffix_tail.encode())
        digest.update(str(self.separator_leads_suffix).encode())
        return digest.hexdigest()[:16]

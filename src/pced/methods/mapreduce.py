"""MapReduce (agentic aggregation): summarize every document, then answer from the summaries.

Map (paper, Appendix A): one call per document with the fixed instruction, rendered through the
model's chat template as

    system: "Summarize the given documents concisely, focusing on the key points and main ideas."
    user:   the document text (stripped)
    assistant: <generation prompt>

decoded greedily, at most ``summary_tokens`` (``AskOptions.summary_tokens``) new tokens, stop
strings of the answer's sampling not applied. Chat templates that reject a system turn get the
instruction and the document in one user turn, separated by a blank line (as ``PromptBuilder`` does).

Reduce: the standard prompt of every other method, ``PromptBuilder.prompt_ids(summaries,
question)``, i.e. the dataset's system prompt, context template and question template with the
summaries (ranked order, joined like documents) in the ``{context}`` slot; empty summaries are
left out of the context. It is decoded with the caller's sampling by the one loop, like the
``all`` baseline. The map phase runs inside ``prefill``, so time to first token includes it.

``stats``: ``llm_calls`` (N map calls + 1 reduce), ``prompt_tokens`` (all prompts),
``generated_tokens`` (all outputs, end-of-sequence tokens not counted), ``summaries`` and
``map_s`` (seconds spent in the map phase).
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch

from ..errors import UserError
from ..decoding.sampling import SamplingConfig
from ..text.answers import Step
from ..backends.rows import PlainRows
from ..decoding.loop import Generation, PlainScoring, Rows
from ..llm import LoadedModel
from ..options import AskOptions
from ..text.prompts import PromptBuilder, render_chat
from .concat import PlainGeneration

MAP_INSTRUCTION = "Summarize the given documents concisely, focusing on the key points and main ideas."


def map_prompt_ids(tokenizer: object, document: str, instruction: str = MAP_INSTRUCTION) -> list[int]:
    """The map call's prompt: system = instruction, user = document, then the generation prompt."""
    text = render_chat(tokenizer, instruction, document.strip())
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class MapReduceRows(Rows):
    """Rows whose prefill runs the N map calls, then prefills the reduce prompt in one plain row."""

    def __init__(self, llm: LoadedModel, builder: PromptBuilder, documents: Sequence[str], question: str,
                 max_new_tokens: int, summary_tokens: int):
        if summary_tokens < 1:
            raise UserError(f"summary_tokens must be >= 1, got {summary_tokens}")
        self.llm, self.builder, self.question = llm, builder, question
        self.documents, self.max_new_tokens, self.summary_tokens = list(documents), max_new_tokens, summary_tokens
        self.prompt_ids: list[int] = []  # the reduce prompt, known once the map phase has run
        self.summaries: list[str] = []
        self.map_generated = 0
        self.timings: dict[str, float] = {}
        self.stats: dict = {}
        self.reduce: PlainRows | None = None
        self.deadline = None  # the generation's Deadline: the map calls stop at it too

    def prefill(self) -> torch.Tensor:
        started = time.perf_counter()
        greedy = SamplingConfig(max_new_tokens=self.summary_tokens)
        prompt_tokens = 0
        for document in self.documents:
            ids = map_prompt_ids(self.llm.tokenizer, document)
            call = PlainGeneration(self.llm, ids, greedy, method="mapreduce (map)")
            call.deadline = self.deadline
            summary = call.answer()
            self.summaries.append(summary.text.strip())
            prompt_tokens += len(ids)
            self.map_generated += len(summary.token_ids)
        self.prompt_ids = self.builder.prompt_ids([s for s in self.summaries if s], self.question)
        self.reduce = PlainRows(self.llm, self.prompt_ids, self.max_new_tokens, "mapreduce")  # checks the window
        self.stats.update(
            llm_calls=len(self.documents) + 1,
            prompt_tokens=prompt_tokens + len(self.prompt_ids),
            generated_tokens=self.map_generated,
            summaries=list(self.summaries),
            map_s=time.perf_counter() - started,
        )
        logits = self.reduce.prefill()
        self.timings.update(self.reduce.timings)
        self.stats.update(self.reduce.stats)
        return logits

    def advance(self, token: int) -> torch.Tensor:
        return self.reduce.advance(token)


class MapReduceGeneration(Generation):
    """N greedy summary calls, then one answer call over the summaries; doc_id is null."""

    def __init__(self, llm: LoadedModel, builder: PromptBuilder, documents: Sequence[str], question: str,
                 sampling: SamplingConfig = SamplingConfig(), summary_tokens: int = AskOptions.summary_tokens):
        self.map_rows = MapReduceRows(llm, builder, documents, question, sampling.max_new_tokens, summary_tokens)
        super().__init__(self.map_rows, PlainScoring(), llm, sampling, method="mapreduce")

    @property
    def prompt_ids(self) -> list[int]:
        return self.map_rows.prompt_ids

    @property
    def summaries(self) -> list[str]:
        return self.map_rows.summaries

    def __iter__(self) -> Iterator[Step]:
        self.map_rows.deadline = self.deadline
        for step in super().__iter__():
            self.stats["generated_tokens"] = self.map_rows.map_generated + len(self.tracker.ids)
            yield step
        self.stats["generated_tokens"] = self.map_rows.map_generated + len(self.tracker.ids)

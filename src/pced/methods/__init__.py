"""The methods: pced and the baselines (all, single, ape, mapreduce), each a ``Generation`` built
from rows of the backend and a scoring, so that the CLI, server, eval and bench treat them alike.

All methods share the same candidates (ranked order), templates and sampling settings.
"""

from __future__ import annotations

from typing import Sequence

from ..sampling import SamplingConfig
from ..decoding import Generation
from ..documents import Candidate
from ..options import AskOptions, check_method
from ..rule import RuleConfig

__all__ = ["make_generation", "check_method"]


def make_generation(
    generator,
    method: str,
    candidates: Sequence[Candidate],
    question: str,
    rule: RuleConfig | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    ape_temperature: float = AskOptions.ape_temperature,
    ape_scale: float = AskOptions.ape_scale,
    summary_tokens: int = AskOptions.summary_tokens,
    follow=None,
) -> Generation:
    """``method`` over ``candidates`` with ``generator`` (a ``pced.generator.Generator``); ``rule`` None is the
    model family's rule (``pced.options.resolve_rule``); ``follow`` (PCED only) is decode-time
    relevance (``methods.follow``)."""
    check_method(method)
    texts = [c.document.render() for c in candidates]
    if method == "pced":
        return generator.stream(candidates, question, rule, sampling, follow)
    if method in ("all", "single"):
        from .concat import PlainGeneration

        chosen = texts if method == "all" else texts[:1]
        return PlainGeneration(generator.llm, generator.builder.prompt_ids(chosen, question), sampling, method=method)
    if method == "ape":
        from .ape import ape_from_store

        return ape_from_store(generator.llm, generator.caches, texts, question, sampling, ape_temperature, ape_scale)
    from .mapreduce import MapReduceGeneration

    return MapReduceGeneration(generator.llm, generator.builder, texts, question, sampling, summary_tokens)

"""The methods: pced and the baselines (all, single, ape, mapreduce), each a ``Generation`` built
from rows of a backend and a scoring, so that the CLI, server, eval and bench treat them alike.

``start`` is the one place where a question's method is chosen; the backend is the generator's
(PCED asks it for its rows: ``pced.backend.Backend.expert_rows``). All methods share the same
candidates (ranked order), templates and sampling settings.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..decoding.loop import Generation
from ..documents import Candidate
from ..options import AskOptions, check_method
from ..decoding.rule import RuleConfig
from ..decoding.sampling import SamplingConfig

__all__ = ["BUILDERS", "check_method", "make_generation", "start"]


def _pced(generator, candidates, question, rule, options, follow) -> Generation:
    from .pced import pced_generation

    return pced_generation(generator, candidates, question, rule, options.sampling, follow)


def _concatenated(generator, candidates, question, rule, options, follow) -> Generation:
    from .concat import PlainGeneration

    texts = [c.document.render() for c in candidates]
    chosen = texts if options.method == "all" else texts[:1]
    return PlainGeneration(generator.llm, generator.builder.prompt_ids(chosen, question), options.sampling, method=options.method)


def _ape(generator, candidates, question, rule, options, follow) -> Generation:
    from .ape import ape_from_store

    return ape_from_store(generator.llm, generator.caches, [c.document.render() for c in candidates], question,
                          options.sampling, options.ape_temperature, options.ape_scale)


def _mapreduce(generator, candidates, question, rule, options, follow) -> Generation:
    from .mapreduce import MapReduceGeneration

    return MapReduceGeneration(generator.llm, generator.builder, [c.document.render() for c in candidates], question,
                               options.sampling, options.summary_tokens)


# method -> how it is built from a Generator: PCED on the generator's backend (its rows, pced.backend);
# the baselines from the default backend's model, prompt builder and KV store (the only one that runs them)
BUILDERS: dict[str, Callable[..., Generation]] = {"pced": _pced, "all": _concatenated, "single": _concatenated,
                                                  "ape": _ape, "mapreduce": _mapreduce}


def start(generator, candidates: Sequence[Candidate], question: str, options: AskOptions, rule: RuleConfig | None = None,
          follow=None) -> Generation:
    """``options.method`` over ``candidates`` with ``generator`` (a ``pced.generator.Generator`` of
    ``options.backend``: its backend, model, prompt builder and caches); ``rule`` None is the model
    family's rule; ``follow`` (PCED only) is decode-time relevance (``methods.follow``)."""
    return BUILDERS[check_method(options.method)](generator, list(candidates), question, rule, options, follow)


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
    """``start`` on the transformers backend with these settings, the rest ``AskOptions``'."""
    options = replace(AskOptions(), method=check_method(method), sampling=sampling, ape_temperature=ape_temperature,
                      ape_scale=ape_scale, summary_tokens=summary_tokens)
    return start(generator, candidates, question, options, rule, follow)

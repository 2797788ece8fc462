"""One entry point for every way of using the candidates: pced, all, single, ape, mapreduce.

All methods share the same candidates (ranked order), templates and sampling settings, and all
return a ``Generation`` (the one decoding loop), so the CLI, server and evaluation treat them alike.
"""

from __future__ import annotations

from typing import Sequence

from .decoding import Generation, SamplingConfig
from .engine import Candidate, Engine
from .rule import RuleConfig

METHODS = ("pced", "all", "single", "ape", "mapreduce")


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def make_generation(
    engine: Engine,
    method: str,
    candidates: Sequence[Candidate],
    question: str,
    rule: RuleConfig = RuleConfig(),
    sampling: SamplingConfig = SamplingConfig(),
    ape_temperature: float = 0.9,
    ape_scale: float = 0.9,
) -> Generation:
    check_method(method)
    texts = [c.document.render() for c in candidates]
    if method == "pced":
        return engine.stream(candidates, question, rule, sampling)
    if method in ("all", "single"):
        from .baselines.concat import PlainGeneration

        chosen = texts if method == "all" else texts[:1]
        return PlainGeneration(engine.llm, engine.builder.prompt_ids(chosen, question), sampling, method=method)
    if method == "ape":
        from .baselines.ape import ape_from_store

        return ape_from_store(engine.llm, engine.store, texts, question, sampling, temperature=ape_temperature, scale=ape_scale)
    from .baselines.mapreduce import MapReduceGeneration

    return MapReduceGeneration(engine.llm, engine.builder, texts, question, sampling)

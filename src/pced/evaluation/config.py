"""What one ``pced eval`` run asks for (``EvalConfig``), its checks, and the grid of method
configurations it evaluates. Defaults come from ``AskOptions`` and ``IndexSettings``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Sequence

from pced.errors import UserError
from pced.decoding.sampling import SamplingConfig
from pced.kv.tier_settings import CacheTiers
from pced.backend import DEFAULT_BACKEND, get_backend
from pced.options import DEFAULT_STORAGE_DTYPE, RETRIEVERS, AskOptions
from pced.decoding.rule_config import Beta, RuleConfig
from pced.store.layout import IndexSettings

class EvalError(UserError):
    """Bad evaluation settings or an output folder of another run; one line for the CLI."""


@dataclass
class EvalConfig:
    """One ``pced eval`` run. A sweep field left None takes its value from the default rule."""

    dataset: str
    methods: Sequence[str] = ("pced",)
    limit: int | None = None  # None = every example
    setting: str | None = None  # None = the dataset's natural one
    model: str | None = None  # None = the embedded default
    device: str | None = None
    dtype: str = "auto"
    retriever: str = AskOptions.retriever
    relevance: Sequence[str] | None = None  # PCED r_k from these retrievers (None: the retriever's)
    top_k: Sequence[int] = (AskOptions.top_k,)
    beta: Sequence[Beta] | None = None
    gamma: Sequence[float] | None = None
    aggregation: Sequence[str] | None = None
    score_space: Sequence[str] | None = None
    prior: Sequence[str] | None = None
    no_repeat_ngram: Sequence[int] | None = None  # every method's runs (None: SamplingConfig's, off)
    loop_span: Sequence[int] | None = None  # every method's runs: the loop guard (None: SamplingConfig's)
    paper_defaults: bool = False
    max_new_tokens: int = SamplingConfig.max_new_tokens
    seed: int = 42  # dataset shuffles and sampled baselines
    top_n: int = AskOptions.top_n
    data_dir: str | None = None
    out: str | None = None
    work_dir: str | None = None
    bge_m3: str | None = None
    reranker: str | None = None
    storage_dtype: str = DEFAULT_STORAGE_DTYPE
    gpu_cache_gb: float | None = CacheTiers.gpu_cache_gb  # document caches kept on the device between questions (None: by device)
    max_doc_tokens: int = IndexSettings.max_doc_tokens
    progress: bool = True
    backend: str = AskOptions.backend  # the methods it runs run on it; the others on the default backend
    backend_settings: object = None  # that backend's settings dataclass (None: its defaults)
    follow: Sequence[str] | None = None  # PCED decode-time relevance modes to sweep (None: off only)
    max_joins: int = 2  # experts that may join per answer, in the modes with "join"


def _fmt(value) -> str:
    return value if isinstance(value, str) else f"{float(value):g}"


@dataclass(frozen=True)
class RunConfig:
    """One cell of the grid: a method, its rule (PCED only), top-k, retriever and n-gram ban."""

    method: str
    top_k: int
    retriever: str
    rule: RuleConfig | None = None
    relevance: str | None = None  # PCED only: the retriever r_k comes from, when not ``retriever``
    follow: str | None = None  # PCED only: "rescore", "join" or "rescore+join" (None: off)
    max_joins: int = 0
    no_repeat_ngram: int = SamplingConfig.no_repeat_ngram  # every method
    loop_span: int = SamplingConfig.loop_span  # every method; 0 (off) is what earlier records were decoded with

    def ask_fields(self) -> dict:
        """The AskOptions fields of the decode-time relevance mode."""
        mode = self.follow or ""
        return {"rescore": "rescore" in mode, "max_joins": self.max_joins if "join" in mode else 0}

    @property
    def key(self) -> str:
        """Settings at their earlier-only values (log prior, no n-gram ban) are left out, so the keys
        of runs made before those options existed still name the same runs."""
        parts = [self.method]
        if self.rule is not None:
            r = self.rule
            parts += [f"beta={_fmt(r.beta)}", f"gamma={_fmt(r.gamma)}", f"agg={r.aggregation}",
                      f"space={r.score_space}"]
            parts += [f"prior={r.prior}"] if r.prior != "log" else []
        parts += [f"k={self.top_k}", f"ret={self.retriever}"]
        parts += [f"rel={self.relevance}"] if self.relevance else []
        parts += [f"follow={self.follow}" + (f",joins={self.max_joins}" if "join" in self.follow else "")] if self.follow else []
        parts += [f"nrng={self.no_repeat_ngram}"] if self.no_repeat_ngram else []
        parts += [f"loop={self.loop_span}"] if self.loop_span else []
        return "|".join(parts)

    def settings(self) -> dict:
        """What the run sets; like ``key``, the log prior and an n-gram ban of 0 (what every earlier
        record was decoded with) are left out, so old and new records of one run read alike."""
        out: dict = {}
        if self.rule is not None:
            out.update(beta=self.rule.beta, gamma=self.rule.gamma,
                       aggregation=self.rule.aggregation, score_space=self.rule.score_space)
            out.update({"prior": self.rule.prior} if self.rule.prior != "log" else {})
        out.update(top_k=self.top_k, retriever=self.retriever)
        out.update({"relevance": self.relevance} if self.relevance else {})
        out.update({"no_repeat_ngram": self.no_repeat_ngram} if self.no_repeat_ngram else {})
        out.update({"loop_span": self.loop_span} if self.loop_span else {})
        return {**out, **self.ask_fields()} if self.follow else out


# --------------------------------------------------------------------------- validation


def validate(config: EvalConfig) -> EvalConfig:
    """Check every setting that needs no model or data; returns a normalized copy."""
    from pced.options import check_method

    methods = list(dict.fromkeys(config.methods))
    if not methods:
        raise EvalError("--methods is empty")
    for method in methods:
        check_method(method)
    try:
        backend = get_backend(config.backend)
        backend_settings = backend.settings(config.backend_settings)
    except UserError as exc:
        raise EvalError(f"--backend: {exc}") from None
    runs_pced = "pced" in methods and (backend.capabilities.methods is None or "pced" in backend.capabilities.methods)
    if config.limit is not None and config.limit < 1:
        raise EvalError(f"--limit must be at least 1, got {config.limit}")
    relevance = None if config.relevance is None else list(dict.fromkeys(config.relevance))
    for name, option in [(config.retriever, "--retriever")] + [(r, "--relevance") for r in relevance or []]:
        if name not in RETRIEVERS:
            raise EvalError(f"{option}: unknown retriever {name!r}; choose one of {', '.join(RETRIEVERS)}")
        if name == "colbert" and not config.bge_m3:
            raise EvalError(f"{option}: colbert needs --bge-m3 PATH (a local BGE-M3 model)")
    if relevance == []:
        raise EvalError("--relevance is empty")
    top_k = list(dict.fromkeys(config.top_k))
    if not top_k or any(int(k) != k or k < 1 for k in top_k):
        raise EvalError(f"--top-k values must be integers >= 1, got {config.top_k!r}")
    for name, minimum in (("max_new_tokens", 1), ("top_n", 1), ("max_doc_tokens", 16)):
        if getattr(config, name) < minimum:
            raise EvalError(f"--{name.replace('_', '-')} must be at least {minimum}")
    sweeps = {}
    for name in ("beta", "gamma", "aggregation", "score_space", "prior"):
        values, option = getattr(config, name), "--" + name.replace("_", "-")
        if values is None:
            continue
        if not values:
            raise EvalError(f"{option} is empty")
        values = [v if isinstance(v, str) or name not in ("beta", "gamma") else float(v) for v in dict.fromkeys(values)]
        for value in values:
            try:
                RuleConfig(**{name: value})
            except (ValueError, TypeError) as exc:
                raise EvalError(f"{option}: {exc}") from None
        sweeps[name] = values
    nrng = None if config.no_repeat_ngram is None else list(dict.fromkeys(config.no_repeat_ngram))
    if nrng == []:
        raise EvalError("--no-repeat-ngram is empty")
    if any(isinstance(n, bool) or int(n) != n or n < 0 for n in nrng or []):
        raise EvalError(f"--no-repeat-ngram values must be integers >= 0 (0 = off), got {config.no_repeat_ngram!r}")
    if nrng and any(nrng) and runs_pced and not backend.capabilities.no_repeat_ngram:
        raise EvalError(f"--no-repeat-ngram: the {backend.name} backend decodes inside its engine's sampler; use "
                        f"--backend {DEFAULT_BACKEND}")
    loops = None if config.loop_span is None else list(dict.fromkeys(config.loop_span))
    if loops == []:
        raise EvalError("--loop-span is empty")
    for n in loops or []:
        if isinstance(n, bool) or int(n) != n or not (n == 0 or n >= 2):
            raise EvalError(f"--loop-span values must be 0 (off) or integers >= 2, got {config.loop_span!r}")
    from pced.methods.follow import MODES

    follow = None if config.follow is None else list(dict.fromkeys(config.follow))
    for mode in follow or []:
        if mode not in MODES:
            raise EvalError(f"--follow: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if follow == []:
        raise EvalError("--follow is empty")
    if follow and set(follow) != {"off"} and runs_pced and not backend.capabilities.decode_time_relevance:
        raise EvalError(f"--follow: decode-time relevance does not run on the {backend.name} backend")
    try:
        CacheTiers(gpu_cache_gb=config.gpu_cache_gb)
    except ValueError as exc:
        raise EvalError(f"--gpu-cache-gb: {exc}") from None
    if not 1 <= config.max_joins <= 64:
        raise EvalError(f"--max-joins must be between 1 and 64, got {config.max_joins}")
    return replace(config, methods=methods, top_k=[int(k) for k in top_k], relevance=relevance, follow=follow,
                   backend_settings=backend_settings,
                   no_repeat_ngram=None if nrng is None else [int(n) for n in nrng],
                   loop_span=None if loops is None else [int(n) for n in loops], **sweeps)


def build_grid(config: EvalConfig, base: RuleConfig) -> list[RunConfig]:
    """PCED: the product of the sweep lists (unset ones from ``base``); baselines: top-k and the
    n-gram ban only (it applies after the rule, in the loop every method shares)."""
    grid: list[RunConfig] = []
    lists = [config.beta or [base.beta], config.gamma or [base.gamma], config.aggregation or [base.aggregation],
             config.score_space or [base.score_space], config.prior or [base.prior]]
    nrngs = config.no_repeat_ngram or [SamplingConfig.no_repeat_ngram]
    loops = config.loop_span or [SamplingConfig.loop_span]
    for method in config.methods:
        for k in config.top_k:
            if method != "pced":
                grid += [RunConfig(method, k, config.retriever, no_repeat_ngram=n, loop_span=loop)
                         for n, loop in product(nrngs, loops)]
                continue
            follows = [None if f == "off" else f for f in (config.follow or ["off"])]
            for beta, gamma, aggregation, space, prior, relevance, follow, n, loop in product(
                    *lists, config.relevance or [None], follows, nrngs, loops):
                rule = RuleConfig(beta=beta, gamma=gamma, aggregation=aggregation, score_space=space, prior=prior)
                grid.append(RunConfig(method, k, config.retriever, rule, relevance, follow,
                                      config.max_joins if follow else 0, n, loop))
    return grid



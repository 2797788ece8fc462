"""``pced eval``: every method over one dataset, with the paper's ablation sweeps, resumable.

For all methods the LLM, prompts and candidates are fixed (paper §4): each example gets one
candidate list per top-k, ranked best first, shared by every method and setting. Only how the
candidates enter the model differs.

- Corpus setting (NQ, LOFT, HotpotQA/MuSiQue ``--setting corpus``): a DocumentStore of the
  dataset's corpus, built once under the work dir, then retrieve-(rerank) from the top-N.
- Stores are built with lazy KV: the retrieval indexes at once, a document's KV cache the first
  time it is a candidate, before any method's clock starts (offline, as in the paper).
- Own documents (distractor paragraphs, ICL exemplars, LongBench contexts): one store over the
  union of the loaded examples' documents; an example's candidates are its own documents,
  scored against the question by the chosen retriever and ranked.
- ``relevance`` (the paper's PCED-Sparse/-Dense/-ColBERT): the same candidates, with r_k
  recomputed by another retriever's scores (fused with the reranker's when there is one).

Every finished (example, config) pair is appended to ``results.jsonl`` at once, so a rerun
skips what is there; ``summary.json``, ``table.md`` and the plots are rebuilt from the file.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Sequence

import numpy as np

from pced.engine import Candidate
from pced.evaluation.datasets import Dataset, Example, load_dataset, score_example
from pced.evaluation.report import completed_pairs, format_table, write_reports
from pced.rule import Beta, RuleConfig

__all__ = ["EvalConfig", "EvalError", "RunConfig", "build_grid", "run_eval", "validate"]

RETRIEVERS = ("hybrid", "sparse", "dense", "colbert")
EMBEDDED = "embedded"
# Cheap extra metrics recorded beside the primary one (dataset metric -> extra METRICS keys).
SECONDARY = {"subspan_em": ("em", "f1"), "icl_em": ("icl_lenient",)}
HOTPOT_SECONDARY = ("hotpot_em", "hotpot_f1")
RUN_IDENTITY = ("dataset", "setting", "model", "max_new_tokens", "seed", "bge_m3", "reranker",
                "storage_dtype", "max_doc_tokens", "top_n")


class EvalError(ValueError):
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
    retriever: str = "hybrid"
    relevance: Sequence[str] | None = None  # PCED r_k from these retrievers (None: the retriever's)
    top_k: Sequence[int] = (8,)
    beta: Sequence[Beta] | None = None
    gamma: Sequence[float] | None = None
    aggregation: Sequence[str] | None = None
    score_space: Sequence[str] | None = None
    paper_defaults: bool = False
    max_new_tokens: int = 32
    seed: int = 42
    top_n: int = 90
    data_dir: str | None = None
    out: str | None = None
    work_dir: str | None = None
    bge_m3: str | None = None
    reranker: str | None = None
    storage_dtype: str = "float16"
    max_doc_tokens: int = 1024
    progress: bool = True


def _fmt(value) -> str:
    return value if isinstance(value, str) else f"{float(value):g}"


@dataclass(frozen=True)
class RunConfig:
    """One cell of the grid: a method, its rule (PCED only), top-k and retriever."""

    method: str
    top_k: int
    retriever: str
    rule: RuleConfig | None = None
    relevance: str | None = None  # PCED only: the retriever r_k comes from, when not ``retriever``

    @property
    def key(self) -> str:
        parts = [self.method]
        if self.rule is not None:
            r = self.rule
            parts += [f"beta={_fmt(r.beta)}", f"gamma={_fmt(r.gamma)}", f"agg={r.aggregation}",
                      f"space={r.score_space}"]
        parts += [f"k={self.top_k}", f"ret={self.retriever}"]
        return "|".join(parts + ([f"rel={self.relevance}"] if self.relevance else []))

    def settings(self) -> dict:
        out: dict = {}
        if self.rule is not None:
            out.update(beta=self.rule.beta, gamma=self.rule.gamma,
                       aggregation=self.rule.aggregation, score_space=self.rule.score_space)
        out.update(top_k=self.top_k, retriever=self.retriever)
        return {**out, "relevance": self.relevance} if self.relevance else out


# --------------------------------------------------------------------------- validation


def validate(config: EvalConfig) -> EvalConfig:
    """Check every setting that needs no model or data; returns a normalized copy."""
    from pced.methods import check_method

    methods = list(dict.fromkeys(config.methods))
    if not methods:
        raise EvalError("--methods is empty")
    for method in methods:
        check_method(method)
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
    for name in ("beta", "gamma", "aggregation", "score_space"):
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
    return replace(config, methods=methods, top_k=[int(k) for k in top_k], relevance=relevance, **sweeps)


def build_grid(config: EvalConfig, base: RuleConfig) -> list[RunConfig]:
    """PCED: the product of the sweep lists (unset ones from ``base``); baselines: top-k only."""
    grid: list[RunConfig] = []
    lists = [config.beta or [base.beta], config.gamma or [base.gamma],
             config.aggregation or [base.aggregation], config.score_space or [base.score_space]]
    for method in config.methods:
        for k in config.top_k:
            if method != "pced":
                grid.append(RunConfig(method, k, config.retriever))
                continue
            for beta, gamma, aggregation, space, relevance in product(*lists, config.relevance or [None]):
                rule = RuleConfig(beta=beta, gamma=gamma, aggregation=aggregation, score_space=space)
                grid.append(RunConfig(method, k, config.retriever, rule, relevance))
    return grid


# --------------------------------------------------------------------------- candidates


class CandidateSource:
    """Per example, one ranked candidate list per top-k, the same for every method."""

    def __init__(self, dataset: Dataset, store, config: EvalConfig):
        self.store, self.config = store, config
        self.corpus_mode = dataset.corpus is not None
        self.retriever = store.retriever(config.retriever)
        self.reranker = store.reranker(config.reranker) if config.reranker else None
        self.retriever.scores("warm-up")  # load lazy encoders now, not inside the first retrieval_s
        self.position = {doc.id: row for row, doc in enumerate(store.documents)}
        chunked = set(store.manifest.get("chunked", []))
        self.rows: dict[str, list[int]] = {}  # example doc id -> store rows (a long one's chunks "id#n")
        for row, doc in enumerate(store.documents):
            base, _, number = doc.id.rpartition("#")
            self.rows.setdefault(base if base in chunked and number.isdigit() else doc.id, []).append(row)

    def candidates(self, example: Example, ks: Sequence[int],
                   relevances: Sequence[str | None] = (None,)) -> dict[tuple, list[Candidate]]:
        """{(k, relevance): candidates}: the same documents for every relevance source."""
        lists = self._lists(example, ks)
        out = {(k, None): found for k, found in lists.items()}
        for name in set(relevances) - {None}:
            raw = np.asarray(self.store.retriever(name).scores(example.question), dtype=np.float64)
            out.update({(k, name): self._rescore(found, name, raw) for k, found in lists.items()})
        return out

    def _rescore(self, found: list[Candidate], name: str, raw: np.ndarray) -> list[Candidate]:
        from pced.retrieval.scores import fuse

        rows = [self.position[c.document.id] for c in found]
        r_ret = np.asarray(self.store.retriever(name).normalize(raw[rows]), dtype=np.float64)
        rescored = []
        for c, s, r in zip(found, raw[rows], r_ret):
            r_rer = c.scores.get("r_rer")
            relevance = float(r if r_rer is None else fuse(r, r_rer))
            rescored.append(Candidate(c.document, relevance, {**c.scores, name: float(s), "r_ret": float(r)}))
        return rescored

    def _lists(self, example: Example, ks: Sequence[int]) -> dict[int, list[Candidate]]:
        if not self.corpus_mode:
            ranked = self._rank_own(example)
            return {k: ranked[:k] for k in ks}
        lists: dict[int, list[Candidate]] = {}
        by_pool: dict[int, list[int]] = {}
        for k in ks:  # one retrieval per candidate pool size; smaller k are its prefixes
            by_pool.setdefault(max(self.config.top_n, k), []).append(k)
        for top_n, group in by_pool.items():
            found = self.store.retrieve(example.question, self.config.retriever, top_k=max(group),
                                        top_n=top_n, rerank=self.reranker is not None,
                                        reranker_path=self.config.reranker)
            lists.update({k: found[:k] for k in group})
        return lists

    def _rank_own(self, example: Example) -> list[Candidate]:
        from pced.retrieval.scores import fuse, normalize_reranker

        rows = list(dict.fromkeys(r for d in example.documents for r in self.rows.get(d.id, [])))
        if not rows:
            return []
        raw = np.asarray(self.retriever.scores(example.question), dtype=np.float64)[rows]
        r_ret = np.asarray(self.retriever.normalize(raw), dtype=np.float64)
        scores = [{"retrieval": float(s), "r_ret": float(r)} for s, r in zip(raw, r_ret)]
        relevance, order_by = r_ret, r_ret
        if self.reranker is not None:
            logits = np.asarray(self.reranker.score(
                example.question, [self.store.documents[r].render() for r in rows]), dtype=np.float64)
            r_rer = normalize_reranker(logits)
            relevance, order_by = fuse(r_ret, r_rer), logits
            for entry, z, r in zip(scores, logits, r_rer):
                entry.update(rerank=float(z), r_rer=float(r))
        order = np.argsort(-order_by, kind="stable")  # ties keep the example's document order
        return [Candidate(self.store.documents[rows[j]], float(relevance[j]), scores[j]) for j in order]


# --------------------------------------------------------------------------- store


def _model_setting(config: EvalConfig, llm) -> str:
    if config.model:
        return str(Path(config.model).expanduser().resolve())
    from pced.llm import EMBEDDED_NAME

    return EMBEDDED if llm is None or llm.name == EMBEDDED_NAME else llm.path


def _model_name(model_setting: str) -> str:
    from pced.llm import EMBEDDED_NAME

    return EMBEDDED_NAME if model_setting == EMBEDDED else Path(model_setting).name


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "dataset"


def prepare_store(config: EvalConfig, dataset: Dataset, llm, model_setting: str):
    """Open the dataset's store under the work dir, building or extending it when it lacks documents."""
    from pced.store import DocumentStore, IndexSettings

    template = "icl" if dataset.task == "icl" else "rag"
    settings = IndexSettings(model=model_setting, bge_m3=config.bge_m3, reranker=config.reranker,
                             template=template, storage_dtype=config.storage_dtype,
                             max_doc_tokens=config.max_doc_tokens)
    root = Path(config.work_dir) if config.work_dir else Path("runs") / "stores" / "-".join(
        [_safe(dataset.name), dataset.setting or "default", _model_name(model_setting), template]
        + (["m3"] if config.bge_m3 else []) + ([config.storage_dtype] if config.storage_dtype != "float16" else []))
    documents = dataset.corpus if dataset.corpus is not None else list(
        {d.id: d for e in dataset.examples for d in e.documents}.values())
    if not documents:
        raise EvalError(f"{dataset.name}: the loaded examples have no documents to use as experts")
    if (root / "manifest.json").is_file():
        store = DocumentStore.open(root, llm)
        stored = {d.id for d in store.documents}
        chunked = set(store.manifest.get("chunked", []))
        if store.settings.identity() == settings.identity() and all(
                d.id in stored or d.id in chunked for d in documents):
            return store
    print(f"pced: indexing {len(documents)} documents into {root} (once; reused by later runs; a document's "
          f"KV cache is encoded the first time it is a candidate)", flush=True)
    store, report = DocumentStore.index(documents, root, settings, llm, progress=config.progress, encode_kv=False)
    print(f"pced: store {root}: {report['documents']} documents, retrieval indexes built in "
          f"{report['retrieval_index_s']:.1f} s", flush=True)
    return store


# --------------------------------------------------------------------------- one answer


def evaluate_one(engine, dataset: Dataset, example: Example, run: RunConfig,
                 candidates: list[Candidate], sampling, retrieval_s: float) -> dict:
    """Generate, score and describe one (example, config) pair as a results.jsonl record."""
    import torch

    from pced.methods import make_generation

    record = {"example_id": example.id, "method": run.method, "config": run.key,
              "settings": run.settings(), "prediction": "", "gold": example.answers,
              "metric": dataset.metric, "score": 0.0, "metrics": {},
              "experts": [{"doc_id": c.document.id, "relevance": float(f"{c.relevance:.6g}")} for c in candidates],
              "gold_doc_ids": example.gold_doc_ids, "trace": [], "beta": [],
              "timings": {"retrieval_s": round(retrieval_s, 6)}, "stats": {}}
    try:
        answer = make_generation(engine, run.method, candidates, example.question,
                                 run.rule or RuleConfig(), sampling).answer()
    except (ValueError, torch.cuda.OutOfMemoryError) as exc:  # e.g. "all" past the context window
        record["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return record
    prediction = answer.text
    extra = SECONDARY.get(dataset.metric, ()) + (HOTPOT_SECONDARY if "hotpot" in dataset.name else ())
    record.update(
        prediction=prediction, score=score_example(dataset.metric, prediction, example),
        metrics={name: score_example(name, prediction, example) for name in extra},
        trace=[[step.text, step.doc_id] for step in answer.trace],
        beta=[round(b, 6) for b in answer.betas],
        stats=answer.stats)
    record["timings"].update({k: round(v, 6) for k, v in answer.timings.items()})
    return record


# --------------------------------------------------------------------------- the run


def _check_run_identity(out: Path, identity: dict) -> None:
    path = out / "run.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        differ = [k for k in RUN_IDENTITY if previous.get(k) != identity.get(k)]
        if differ:
            k = differ[0]
            raise EvalError(f"{out} holds results of another run ({k}: {previous.get(k)!r} there, "
                            f"{identity.get(k)!r} now); use another --out")
    else:
        from pced.kvstore import atomic_write_json

        atomic_write_json(identity, path)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_eval(config: EvalConfig, llm=None) -> dict:
    """Run (or resume) an evaluation; returns the summary written to ``<out>/summary.json``."""
    from pced.defaults import PAPER_RULE, default_rule
    from pced.llm import ModelLoadError, load_model

    config = validate(config)

    def model():
        nonlocal llm
        if llm is None:
            llm = load_model(config.model, device=config.device, dtype=config.dtype)
        return llm

    seed_everything(config.seed)
    tokenizer = model().tokenizer if config.dataset == "secret-code" else None
    dataset = load_dataset(config.dataset, setting=config.setting, data_dir=config.data_dir,
                           limit=config.limit, seed=config.seed, tokenizer=tokenizer)
    if llm is None and config.model and not (Path(config.model).expanduser() / "config.json").is_file():
        raise ModelLoadError(f"model path {config.model} is not a Hugging Face model directory (no config.json)")
    model_setting = _model_setting(config, llm)
    out = Path(config.out) if config.out else Path("runs") / "eval" / _safe(dataset.name)
    meta = {"dataset": dataset.name, "setting": dataset.setting, "model": _model_name(model_setting),
            "metric": dataset.metric}
    identity = {**meta, "model": model_setting, "max_new_tokens": config.max_new_tokens, "seed": config.seed,
                "bge_m3": config.bge_m3, "reranker": config.reranker, "storage_dtype": config.storage_dtype,
                "max_doc_tokens": config.max_doc_tokens, "top_n": config.top_n}
    out.mkdir(parents=True, exist_ok=True)
    _check_run_identity(out, identity)
    results = out / "results.jsonl"
    done = completed_pairs(results)
    fixed = config.paper_defaults or None not in (config.beta, config.gamma, config.aggregation, config.score_space)
    grid = build_grid(config, PAPER_RULE if fixed else default_rule(model(), paper=False))
    todo = [(e, [run for run in grid if (e.id, run.key) not in done]) for e in dataset.examples]
    todo = [(e, runs) for e, runs in todo if runs]
    if not todo:
        print(f"pced: nothing to do: all {len(dataset.examples) * len(grid)} results are in {results}", flush=True)
    else:
        _compute(config, dataset, todo, results, model(), model_setting, len(done))
    summary = write_reports(out, meta)
    print(format_table(summary), flush=True)
    return summary


def _compute(config: EvalConfig, dataset: Dataset, todo: list, results: Path, llm, model_setting: str,
             n_done: int) -> None:
    """Answer every (example, config) pair of ``todo``, appending each record as it finishes."""
    from tqdm.auto import tqdm

    from pced.decoding import SamplingConfig

    total = sum(len(runs) for _, runs in todo)
    print(f"pced: {total} answers to compute ({len(todo)} examples; {n_done} already in {results})", flush=True)
    store = prepare_store(config, dataset, llm, model_setting)
    source = CandidateSource(dataset, store, config)
    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, seed=config.seed)
    errors = 0
    with open(results, "a", encoding="utf-8") as handle, \
            tqdm(total=total, desc=f"eval {dataset.name}", unit="answer", disable=not config.progress) as bar:
        for example, runs in todo:
            started = time.perf_counter()
            lists = source.candidates(example, sorted({run.top_k for run in runs}), {run.relevance for run in runs})
            retrieval_s = time.perf_counter() - started
            # KV caches are built offline in the paper: encode this example's new ones before any clock starts
            store.engine.store.add(list(dict.fromkeys(c.document.render() for found in lists.values() for c in found)), progress=False)
            for run in runs:
                record = evaluate_one(store.engine, dataset, example, run, lists[run.top_k, run.relevance],
                                      sampling, retrieval_s)
                if "error" in record and not errors:
                    bar.write(f"pced: warning: {run.key} on {example.id}: {record['error']} (recorded, scored 0)")
                errors += "error" in record
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                bar.update(1)
    print(f"pced: {total} new answers ({errors} errors) in {results}; summary.json and table.md rebuilt", flush=True)

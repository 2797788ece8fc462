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
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pced.documents import Candidate
from pced.evaluation.config import EvalConfig, EvalError, RunConfig, build_grid, validate
from pced.backend import DEFAULT_BACKEND, get_backend
from pced.evaluation.datasets import Dataset, Example, load_dataset, score_example
from pced.evaluation.report import completed_pairs, format_table, write_reports
from pced.evaluation.sources import CandidateSource, model_name, model_setting_of, prepare_store, safe_name

__all__ = ["EvalConfig", "EvalError", "RunConfig", "build_grid", "run_eval", "validate"]

# Cheap extra metrics recorded beside the primary one (dataset metric -> extra METRICS keys).
SECONDARY = {"subspan_em": ("em", "f1"), "icl_em": ("icl_lenient", "icl_em_pced")}
HOTPOT_SECONDARY = ("hotpot_em", "hotpot_f1")
RUN_IDENTITY = ("dataset", "setting", "model", "max_new_tokens", "seed", "bge_m3", "reranker",
                "storage_dtype", "max_doc_tokens", "top_n", "backend")


# --------------------------------------------------------------------------- one answer


def evaluate_one(generator, dataset: Dataset, example: Example, run: RunConfig,
                 candidates: list[Candidate], sampling, retrieval_s: float, retrieve=None) -> dict:
    """Generate, score and describe one (example, config) pair as a results.jsonl record, on
    ``generator``'s backend (with its settings)."""
    import torch

    from pced.options import AskOptions
    from pced.pipeline import ask_candidates

    record = {"example_id": example.id, "method": run.method, "config": run.key,
              "settings": run.settings(), "prediction": "", "gold": example.answers,
              "metric": dataset.metric, "score": 0.0, "metrics": {},
              "experts": [{"doc_id": c.document.id, "relevance": float(f"{c.relevance:.6g}")} for c in candidates],
              "gold_doc_ids": example.gold_doc_ids, "trace": [], "beta": [],
              "timings": {"retrieval_s": round(retrieval_s, 6)}, "stats": {}}
    try:
        rule = {} if run.rule is None else {k: getattr(run.rule, k)
                                            for k in ("beta", "gamma", "aggregation", "score_space", "prior")}
        sampling = replace(sampling, no_repeat_ngram=run.no_repeat_ngram, loop_span=run.loop_span)
        options = AskOptions(method=run.method, sampling=sampling, backend=generator.backend.name,
                             backend_settings=generator.settings, **rule, **run.ask_fields())
        asked = ask_candidates(generator, candidates, example.question, options, retrieve=retrieve if run.follow else None)
        answer = asked.answer()
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
    joined = getattr(asked.generation, "joined", [])
    if run.follow:
        record["joined"] = [{"doc_id": c.document.id, "relevance": float(f"{c.relevance:.6g}")} for c in joined]
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
        from pced.fs import atomic_write_json

        atomic_write_json(path, identity)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_eval(config: EvalConfig, llm=None) -> dict:
    """Run (or resume) an evaluation; returns the summary written to ``<out>/summary.json``."""
    from pced.options import resolve_rule
    from pced.llm import ModelLoadError, load_model

    config = validate(config)

    def model():
        nonlocal llm
        if llm is None:
            llm = load_model(config.model, device=config.device, dtype=config.dtype)
        return llm

    def read(tokenizer=None) -> Dataset:
        return load_dataset(config.dataset, setting=config.setting, data_dir=config.data_dir,
                            limit=config.limit, seed=config.seed, tokenizer=tokenizer)

    seed_everything(config.seed)
    # every record is read and checked before any model loads: a bad file costs no model load
    dataset = None if config.dataset == "secret-code" else read()
    if llm is None and config.model and not (Path(config.model).expanduser() / "config.json").is_file():
        raise ModelLoadError(f"model path {config.model} is not a Hugging Face model directory (no config.json)")
    if dataset is None:  # its documents are exactly N tokens of the model's own tokenizer
        dataset = read(model().tokenizer)
    model_setting = model_setting_of(config, llm)
    out = Path(config.out) if config.out else Path("runs") / "eval" / safe_name(dataset.name)
    meta = {"dataset": dataset.name, "setting": dataset.setting, "model": model_name(model_setting),
            "metric": dataset.metric}
    identity = {**meta, "model": model_setting, "max_new_tokens": config.max_new_tokens, "seed": config.seed,
                "bge_m3": config.bge_m3, "reranker": config.reranker, "storage_dtype": config.storage_dtype,
                "max_doc_tokens": config.max_doc_tokens, "top_n": config.top_n,
                "backend": None if config.backend == DEFAULT_BACKEND else
                get_backend(config.backend).run_label(config.backend_settings)}
    out.mkdir(parents=True, exist_ok=True)
    _check_run_identity(out, identity)
    results = out / "results.jsonl"
    done = completed_pairs(results)
    fixed = config.paper_defaults or None not in (config.beta, config.gamma, config.aggregation, config.score_space,
                                                  config.prior)
    grid = build_grid(config, resolve_rule(paper=True) if fixed else resolve_rule(model()))
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

    from pced.decoding.sampling import SamplingConfig

    total = sum(len(runs) for _, runs in todo)
    print(f"pced: {total} answers to compute ({len(todo)} examples; {n_done} already in {results})", flush=True)
    backend = get_backend(config.backend)
    backend.prepare(llm, config.backend_settings)  # an engine starts before the retrieval libraries load
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
            pced_generator = store.generator_for(backend, config.backend_settings)
            pced_generator.caches.add(list(dict.fromkeys(c.document.render() for found in lists.values() for c in found)),
                                      progress=False)
            for run in runs:
                generator = pced_generator if backend.capabilities.methods is None or run.method in \
                    backend.capabilities.methods else store.generator  # the default backend runs the rest
                record = evaluate_one(generator, dataset, example, run, lists[run.top_k, run.relevance],
                                      sampling, retrieval_s, source.again(example))
                if "error" in record and not errors:
                    bar.write(f"pced: warning: {run.key} on {example.id}: {record['error']} (recorded, scored 0)")
                errors += "error" in record
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                bar.update(1)
    print(f"pced: {total} new answers ({errors} errors) in {results}; summary.json and table.md rebuilt", flush=True)

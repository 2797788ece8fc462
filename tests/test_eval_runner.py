"""pced eval: the config grid, shared candidates, output contract, resuming, and bad input."""

import json
import shutil
import time
from pathlib import Path

import pytest

from pced.cli import main
from pced.evaluation import DatasetError, resolve_data_dir
from pced.evaluation.runner import EvalConfig, EvalError, RunConfig, build_grid, run_eval, validate
from pced.evaluation.report import format_table
from pced.decoding.rule import RuleConfig

from helpers.cli import run_pced

LOFT_TINY = Path(__file__).parent / "fixtures" / "loft_tiny"
RESULT_KEYS = {"example_id", "method", "config", "settings", "prediction", "gold", "metric", "score",
               "experts", "gold_doc_ids", "trace", "timings", "stats"}
ROW_KEYS = {"method", "config", "metric", "score", "n", "ttft_s_median", "total_s_median", "top_k", "retriever"}


def pced(*args, timeout=300):
    started = time.perf_counter()
    result = run_pced(*args, timeout=timeout)
    return result, time.perf_counter() - started


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def has_shared_data() -> bool:
    try:
        return (resolve_data_dir() / "hotpotqa").is_dir()
    except DatasetError:
        return False


def test_grid_sweeps_pced_and_varies_baselines_only_with_top_k():
    config = validate(EvalConfig(dataset="x", methods=["pced", "all", "pced"], top_k=[8, 16],
                                 beta=["dynamic", 0.5], gamma=[2.5, 1], aggregation=["max"]))
    grid = build_grid(config, RuleConfig(score_space="logprobs"))
    pced_runs = [r for r in grid if r.method == "pced"]
    assert len(pced_runs) == 2 * 2 * 2 and len(grid) == 8 + 2
    assert {r.key for r in grid if r.method == "all"} == {"all|k=8|ret=hybrid|loop=6", "all|k=16|ret=hybrid|loop=6"}
    assert pced_runs[0].key == "pced|beta=dynamic|gamma=2.5|agg=max|space=logprobs|k=8|ret=hybrid|loop=6"
    assert "pced|beta=0.5|gamma=1|agg=max|space=logprobs|k=16|ret=hybrid|loop=6" in {r.key for r in grid}
    assert len({r.key for r in grid}) == len(grid)
    assert pced_runs[0].settings() == {"beta": "dynamic", "gamma": 2.5, "aggregation": "max",
                                       "score_space": "logprobs", "top_k": 8, "retriever": "hybrid", "loop_span": 6}
    with pytest.raises(EvalError, match="--aggregation"):
        validate(EvalConfig(dataset="x", aggregation=["sum"]))


@pytest.fixture(scope="module")
def loft_run(tmp_path_factory, tiny_model_dir):
    """One pced eval of the LOFT fixture: 3 examples x (pced 2 gammas + all + single) x 2 top-k."""
    root = tmp_path_factory.mktemp("eval")
    args = ["eval", "--dataset", str(LOFT_TINY), "--methods", "pced,all,single", "--gamma", "1,2.5",
            "--top-k", "2,3", "--max-new-tokens", "3", "--model", str(tiny_model_dir),
            "--out", str(root / "out"), "--work-dir", str(root / "store")]
    result, seconds = pced(*args)
    assert result.returncode == 0, result.stderr
    return root, args, result, seconds


@pytest.mark.slow
def test_eval_end_to_end_outputs(loft_run):
    root, _, result, _ = loft_run
    out = root / "out"
    for name in ("results.jsonl", "summary.json", "table.md", "paired.md", "topk.png", "gamma.png"):
        assert (out / name).stat().st_size > 0, name
    lines = records(out)
    assert len(lines) == 3 * (2 * 2 + 2 + 2)
    assert len({(r["example_id"], r["config"]) for r in lines}) == len(lines)
    corpus_ids = {json.loads(line)["pid"] for line in (LOFT_TINY / "corpus.jsonl").read_text().splitlines()}
    lists: dict[tuple, list] = {}
    for r in lines:
        assert RESULT_KEYS <= set(r) and "error" not in r
        assert r["metric"] == "subspan_em" and r["score"] in (0.0, 1.0) and isinstance(r["prediction"], str)
        experts = r["experts"]
        assert len(experts) == r["settings"]["top_k"] and {e["doc_id"] for e in experts} <= corpus_ids
        assert [e["relevance"] for e in experts] == sorted((e["relevance"] for e in experts), reverse=True)
        assert all(isinstance(tok, str) and (doc is None or doc in corpus_ids) for tok, doc in r["trace"])
        assert {"retrieval_s", "ttft_s", "total_s"} <= set(r["timings"])
        # one shared candidate list per example and top-k, whatever the method or setting
        assert lists.setdefault((r["example_id"], r["settings"]["top_k"]), experts) == experts
    for (example, k), experts in lists.items():
        if k == 2:
            assert lists[(example, 3)][:2] == experts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "loft:loft_tiny" and summary["setting"] == "corpus"
    assert summary["model"] == Path(loft_run[1][loft_run[1].index("--model") + 1]).name
    assert summary["n_examples"] == 3 and len(summary["results"]) == 8
    for row in summary["results"]:
        assert ROW_KEYS <= set(row) and row["n"] == 3 and 0.0 <= row["score"] <= 100.0
        assert row["ttft_s_median"] > 0 and row["total_s_median"] >= row["ttft_s_median"]
        assert ("gamma" in row) == (row["method"] == "pced")
    table = (out / "table.md").read_text()
    assert table.count("| PCED |") == 4 and table.count("Corpus in Ctx (All)") == 2
    assert "nothing to do" not in result.stdout


@pytest.mark.slow
def test_rerun_resumes_without_generating(loft_run):
    root, args, _, first_seconds = loft_run
    before = (root / "out" / "results.jsonl").read_bytes()
    result, seconds = pced(*args)
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stdout
    assert "answer" not in result.stderr  # no progress bar: nothing was generated
    assert (root / "out" / "results.jsonl").read_bytes() == before
    assert json.loads((root / "out" / "summary.json").read_text())["n_examples"] == 3


@pytest.mark.slow
def test_interrupted_run_completes_only_missing_pairs(loft_run, tmp_path, tiny_model_dir, tiny_llm, capsys):
    root, _, _, _ = loft_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    full = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(full[:5]) + "\n" + full[5][:40])  # killed mid-line
    config = EvalConfig(dataset=str(LOFT_TINY), methods=["pced", "all", "single"], gamma=[1, 2.5], top_k=[2, 3],
                        max_new_tokens=3, model=str(tiny_model_dir), out=str(out), work_dir=str(root / "store"),
                        progress=False)
    summary = run_eval(config, llm=tiny_llm)
    lines = records(out)
    assert len(lines) == 24 and lines[:5] == [json.loads(x) for x in full[:5]]
    assert {(r["example_id"], r["config"]) for r in lines} == {(json.loads(x)["example_id"], json.loads(x)["config"]) for x in full}
    assert summary == json.loads((out / "summary.json").read_text())
    assert "19 answers to compute" in capsys.readouterr().out


@pytest.mark.slow
def test_relevance_variants_rescore_the_same_candidates(loft_run, tmp_path, tiny_model_dir, tiny_llm):
    root = loft_run[0]
    config = EvalConfig(dataset=str(LOFT_TINY), methods=["pced", "single"], relevance=["sparse", "dense"],
                        top_k=[3], max_new_tokens=2, model=str(tiny_model_dir), out=str(tmp_path / "out"),
                        work_dir=str(root / "store"), progress=False)
    summary = run_eval(config, llm=tiny_llm)
    lines = records(tmp_path / "out")
    assert len(lines) == 3 * 3 and {r["settings"].get("relevance") for r in lines} == {"sparse", "dense", None}
    for example in {r["example_id"] for r in lines}:
        mine = [r for r in lines if r["example_id"] == example]
        assert len({tuple(e["doc_id"] for e in r["experts"]) for r in mine}) == 1
        by_source = {r["settings"].get("relevance"): [e["relevance"] for e in r["experts"]] for r in mine}
        assert by_source["sparse"] != by_source["dense"]
    assert "rel=sparse" in summary["results"][0]["config"]
    assert "| Relevance |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "relevance.png").is_file()


@pytest.mark.skipif(not has_shared_data(), reason="shared data dir with hotpotqa is absent")
def test_distractor_candidates_are_the_examples_own_paragraphs(tmp_path, tiny_model_dir, tiny_llm):
    config = EvalConfig(dataset="hotpotqa", limit=2, methods=["pced", "single"], top_k=[3, 20],
                        beta=["dynamic", 0.5], max_new_tokens=2, model=str(tiny_model_dir),
                        out=str(tmp_path / "out"), work_dir=str(tmp_path / "store"), progress=False)
    summary = run_eval(config, llm=tiny_llm)
    from pced.evaluation import load_dataset

    own = {e.id: [d.id for d in e.documents] for e in load_dataset("hotpotqa", limit=2).examples}
    lines = records(tmp_path / "out")
    assert len(lines) == 2 * (2 * 2 + 2)
    for r in lines:
        ids = [e["doc_id"] for e in r["experts"]]
        assert set(ids) <= set(own[r["example_id"]])
        assert len(ids) == min(r["settings"]["top_k"], len(own[r["example_id"]]))
        relevances = [e["relevance"] for e in r["experts"]]
        assert relevances == sorted(relevances, reverse=True) and all(0 < x < 1 for x in relevances)
        assert {"em", "f1", "hotpot_em", "hotpot_f1"} <= set(r["metrics"])
    assert summary["setting"] == "distractor" and {"gold_recall", "hotpot_f1"} <= set(summary["results"][0])
    assert (tmp_path / "out" / "beta.png").is_file() and (tmp_path / "out" / "topk.png").is_file()


BAD_INPUTS = [
    (["--dataset", "no-such-dataset"], "unknown dataset 'no-such-dataset'"),
    (["--dataset", "{empty}"], "neither a LOFT dir"),
    (["--dataset", str(LOFT_TINY), "--methods", "pced,magic"], "--methods: 'magic' is not one of"),
    (["--dataset", str(LOFT_TINY), "--limit", "0"], "--limit must be at least 1"),
    (["--dataset", str(LOFT_TINY), "--limit", "-2"], "--limit must be at least 1"),
    (["--dataset", str(LOFT_TINY), "--gamma", "1,,2"], "--gamma: empty value"),
    (["--dataset", str(LOFT_TINY), "--beta", "dynamic,strong"], "--beta: 'strong' is not a number"),
    (["--dataset", str(LOFT_TINY), "--top-k", "8,x"], "--top-k: 'x' is not an integer"),
    (["--dataset", str(LOFT_TINY), "--aggregation", "max,sum"], "--aggregation: 'sum' is not one of"),
    (["--dataset", str(LOFT_TINY), "--score-space", "probs"], "--score-space: 'probs' is not one of"),
    (["--dataset", str(LOFT_TINY), "--setting", "distractor"], "supports only the 'corpus' setting"),
    (["--dataset", str(LOFT_TINY), "--retriever", "colbert"], "--retriever: colbert needs --bge-m3"),
    (["--dataset", str(LOFT_TINY), "--relevance", "dense,bm42"], "--relevance: unknown retriever 'bm42'"),
    (["--dataset", str(LOFT_TINY)], "model path"),  # everything else is fine: the model dir is missing
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_before_any_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    import pced.llm

    def no_model(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(pced.llm, "load_model", no_model)
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{empty}", str(tmp_path / "empty")) for a in argv]
    started = time.perf_counter()
    code = main(["eval", *argv, "--model", str(tmp_path / "missing-model"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and time.perf_counter() - started < 5.0
    assert err.startswith("pced: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_input_from_the_shell(tmp_path):
    result, seconds = pced("eval", "--dataset", str(LOFT_TINY), "--methods", "pced,nope",
                           "--model", str(tmp_path / "missing"))
    assert result.returncode == 2 and seconds < 60
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("pced: error: --methods: 'nope'")


def test_out_dir_of_another_run_is_refused_before_loading(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import pced.llm

    monkeypatch.setattr(pced.llm, "load_model", lambda *_, **__: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"dataset": "loft:loft_tiny", "model": "/elsewhere/model"}))
    code = main(["eval", "--dataset", str(LOFT_TINY), "--model", str(tiny_model_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "holds results of another run" in err and err.count("\n") == 1


@pytest.mark.slow
def test_follow_sweeps_decode_time_relevance_and_off_is_todays_run(tmp_path, tiny_model_dir):
    """--follow off,rescore+join: the off run is the plain run's records; the other carries its
    settings, the experts that joined, and the relevance it ranked with."""
    common = ["eval", "--dataset", str(LOFT_TINY), "--methods", "pced", "--top-k", "1", "--max-new-tokens", "6",
              "--model", str(tiny_model_dir), "--work-dir", str(tmp_path / "store")]
    plain, _ = pced(*common, "--out", str(tmp_path / "plain"))
    follow, _ = pced(*common, "--follow", "off,rescore+join", "--max-joins", "2", "--out", str(tmp_path / "follow"))
    assert plain.returncode == 0 and follow.returncode == 0, plain.stderr + follow.stderr
    by_config: dict[str, list] = {}
    for r in records(tmp_path / "follow"):
        by_config.setdefault(r["config"], []).append(r)
    off = by_config.pop(next(k for k in by_config if "follow" not in k))
    assert [(r["prediction"], r["trace"]) for r in off] == [(r["prediction"], r["trace"]) for r in records(tmp_path / "plain")]
    (key, followed), = by_config.items()
    assert key.endswith("|follow=rescore+join,joins=2|loop=6")
    for r in followed:
        assert r["settings"]["rescore"] is True and r["settings"]["max_joins"] == 2
        assert len(r["joined"]) <= 2 and len(r["experts"]) == 1
    assert "rescore+join<=2" in (tmp_path / "follow" / "table.md").read_text()
    bad = run_pced(*common, "--follow", "sideways", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "--follow: unknown mode 'sideways'" in bad.stderr


@pytest.mark.parametrize("argv, message", [
    (["--prior", "nope"], "--prior: 'nope' is not one of log, standardized"),
    (["--prior", "log,"], "--prior: empty value"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram: values must be >= 0"),
    (["--no-repeat-ngram", "3,x"], "--no-repeat-ngram: 'x' is not an integer"),
    (["--no-repeat-ngram", "0,3", "--backend", "vllm"], "--no-repeat-ngram: the vllm backend"),
    (["--loop-span", "0,1"], "--loop-span: values must be 0 (off) or at least 2"),
    (["--loop-span", "6,"], "--loop-span: empty value"),
])
def test_eval_refuses_bad_prior_and_ngram_before_any_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    import pced.llm

    monkeypatch.setattr(pced.llm, "load_model", lambda *_, **__: pytest.fail("a model was loaded"))
    code = main(["eval", "--dataset", str(LOFT_TINY), *argv, "--model", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pced: error: ") and err.count("\n") == 1 and message in err, err


def test_grid_sweeps_prior_for_pced_and_the_ban_for_every_method():
    config = validate(EvalConfig(dataset="x", methods=["pced", "single"], prior=["log", "standardized"],
                                 no_repeat_ngram=[0, 3], loop_span=[0]))
    grid = build_grid(config, RuleConfig(gamma=32.0))
    today = "pced|beta=dynamic|gamma=32|agg=max|space=logits|k=8|ret=hybrid"
    assert [r.key for r in grid] == [
        today, today + "|nrng=3",
        "pced|beta=dynamic|gamma=32|agg=max|space=logits|prior=standardized|k=8|ret=hybrid",
        "pced|beta=dynamic|gamma=32|agg=max|space=logits|prior=standardized|k=8|ret=hybrid|nrng=3",
        "single|k=8|ret=hybrid", "single|k=8|ret=hybrid|nrng=3"]
    assert [(r.rule.prior if r.rule else None, r.no_repeat_ngram) for r in grid] == [
        ("log", 0), ("log", 3), ("standardized", 0), ("standardized", 3), (None, 0), (None, 3)]
    # a run without the new settings has exactly the keys and settings it had before they existed
    plain = build_grid(validate(EvalConfig(dataset="x", methods=["pced", "single"], loop_span=[0])), RuleConfig(gamma=32.0))
    assert [r.key for r in plain] == [today, "single|k=8|ret=hybrid"]
    assert plain[0] == grid[0] and plain[0].settings() == {"beta": "dynamic", "gamma": 32.0, "aggregation": "max",
                                                          "score_space": "logits", "top_k": 8, "retriever": "hybrid"}
    assert grid[3].settings()["prior"] == "standardized" and grid[3].settings()["no_repeat_ngram"] == 3
    with pytest.raises(EvalError, match="--prior"):
        validate(EvalConfig(dataset="x", prior=["nope"]))
    with pytest.raises(EvalError, match="--no-repeat-ngram"):
        validate(EvalConfig(dataset="x", no_repeat_ngram=[]))


def test_the_loop_guard_is_on_by_default_and_a_key_says_so():
    """Records decoded before the guard existed had it off: their key (no loop part) is the key of
    --loop-span 0, so a run extended with the guard computes only the new answers."""
    today = "pced|beta=dynamic|gamma=32|agg=max|space=logits|k=8|ret=hybrid"
    default = build_grid(validate(EvalConfig(dataset="x", methods=["pced", "single"])), RuleConfig(gamma=32.0))
    assert [r.key for r in default] == [today + "|loop=6", "single|k=8|ret=hybrid|loop=6"]
    assert default[0].settings()["loop_span"] == 6 and "loop_span" not in RunConfig("single", 8, "hybrid", loop_span=0).settings()
    swept = build_grid(validate(EvalConfig(dataset="x", loop_span=[0, 6])), RuleConfig(gamma=32.0))
    assert [(r.key, r.loop_span) for r in swept] == [(today, 0), (today + "|loop=6", 6)]
    for bad in ([], [1], [2.5]):
        with pytest.raises(EvalError, match="--loop-span"):
            validate(EvalConfig(dataset="x", loop_span=bad))


def test_table_shows_prior_and_ngram_columns_only_when_swept():
    base = {"method": "pced", "config": "c", "score": 10.0, "n": 2, "beta": "dynamic", "gamma": 2.5,
            "aggregation": "max", "score_space": "logits", "top_k": 8, "retriever": "hybrid"}
    plain = format_table({"metric": "em", "results": [base]})
    assert "Prior" not in plain and "n-gram" not in plain
    swept = format_table({"metric": "em", "results": [
        base, {**base, "config": "d", "prior": "standardized", "no_repeat_ngram": 3},
        {"method": "single", "config": "e", "score": 5.0, "n": 2, "top_k": 8, "retriever": "hybrid"}]})
    lines = swept.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| Method")).split("|")]
    cells = [[c.strip() for c in line.split("|")] for line in lines if line.startswith("| PCED") or "Single" in line]
    prior, ngram = header.index("Prior"), header.index("No-repeat n-gram")
    assert [(row[prior], row[ngram]) for row in cells] == [("log", "0"), ("standardized", "3"), ("–", "0")]

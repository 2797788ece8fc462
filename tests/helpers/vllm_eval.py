"""``pced eval`` with the vLLM backend on an engine of given settings (``pced eval`` starts its
engine with the default ``VLLMSettings``; this starts the engine of SETTINGS first, as that one).

    python tests/helpers/vllm_eval.py SETTINGS.json -- EVAL ARGUMENTS...
    python tests/helpers/vllm_eval.py --compare OUT_A OUT_B

The second form compares two eval outputs as the agreement experiment does: the predictions and
the traces of every (example, method) record, and prints one JSON line.
"""

import json
import os
import sys
from pathlib import Path


def records(out: str) -> dict:
    rows = [json.loads(line) for line in (Path(out) / "results.jsonl").read_text().splitlines() if line.strip()]
    return {(row["id"] if "id" in row else row.get("example_id"), row.get("method")): row for row in rows}


def compare(a: str, b: str) -> dict:
    left, right = records(a), records(b)
    shared = sorted(set(left) & set(right), key=str)
    same_text = sum(left[k]["prediction"] == right[k]["prediction"] for k in shared)
    same_trace = sum(left[k]["trace"] == right[k]["trace"] for k in shared)
    return {"records": len(shared), "only_a": len(set(left) - set(right)), "only_b": len(set(right) - set(left)),
            "same_prediction": same_text, "same_trace": same_trace,
            "differ": [str(k) for k in shared if left[k]["trace"] != right[k]["trace"]]}


def main() -> None:
    if sys.argv[1] == "--compare":
        print(json.dumps(compare(sys.argv[2], sys.argv[3])))
        return
    # 1 GiB of KV per rank (VLLM_CPU_KVCACHE_SPACE, vllm/platforms/cpu.py:323-327), not a share of the RAM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    settings_json, separator, *eval_args = sys.argv[1:]
    assert separator == "--", "usage: vllm_eval.py SETTINGS.json -- EVAL ARGUMENTS..."
    from pced.backends.vllm import engine as vllm_engine
    from pced.cli import main as pced_main
    from pced.llm import embedded_model_dir
    from pced.backends.vllm.settings import VLLMSettings

    model = str(embedded_model_dir())
    started = vllm_engine.shared_engine(model, VLLMSettings(**json.loads(settings_json)))
    vllm_engine._ENGINES[(model, VLLMSettings())] = started  # what pced eval asks for
    try:
        code = pced_main(["eval", *eval_args, "--backend", "vllm"])
    finally:
        vllm_engine.close_engines()
    print(json.dumps({"engine_counters": started.counters}), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()

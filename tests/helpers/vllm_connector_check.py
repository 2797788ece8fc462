"""Run in a fresh process by tests/test_vllm_connector.py: one vLLM engine with pced's store
connector over a small random Llama, the same prompts answered from the store's caches and computed
by vLLM itself. Prints one JSON line per round.

argv: model_dir store_dir storage_dtype tensor_parallel_size documents_json [--damage]
"""

import json
import os
import sys

QUESTION = "Who painted the harbor, and when?"


def main() -> None:
    model_dir, store_dir, dtype, tp, documents = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    documents = json.loads(documents)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if tp > 1 else "0"  # tensor parallel needs worker processes
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON lines
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pced.backends.vllm.engine import group_prompts
    from pced.backends.vllm.store_kv import SUPPLIED_KEY, StoreSpec, connector_config, group_params
    from pced.documents import Candidate, Document
    from pced.kv.store import KVStore
    from pced.llm import load_model
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    llm = load_model(model_dir, device="cpu", dtype="float32")
    store = KVStore(store_dir, llm, PromptBuilder(llm.tokenizer, RAG_TEMPLATE), storage_dtype=dtype)
    store.add(documents, progress=False)
    prompts = group_prompts(store.builder, [Candidate(Document(str(i), d), 0.5) for i, d in enumerate(documents)],
                            QUESTION)
    params = group_params(store, prompts, [None] + documents)
    engine = LLM(model=model_dir, dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=True,
                 kv_cache_memory_bytes=128 << 20, tensor_parallel_size=tp, max_model_len=1024,
                 kv_transfer_config=connector_config())

    def answer(from_store: bool) -> list[dict]:
        sampling = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                   extra_args={"kv_transfer_params": p} if from_store else None) for p in params]
        outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                 "supplied": (o.kv_transfer_params or {}).get(SUPPLIED_KEY)} for o in outputs]

    print(json.dumps({"round": "store", "specs": [StoreSpec.from_params(p).tokens for p in params],
                      "prompts": [len(p) for p in prompts], "rows": answer(True)}), flush=True)
    engine.reset_prefix_cache()
    print(json.dumps({"round": "computed", "rows": answer(False)}), flush=True)
    engine.reset_prefix_cache()
    if "--damage" in sys.argv[6:]:  # bytes no longer matching their checksum: the worker refuses them, vLLM recomputes
        path = store.path_for(store.digests(documents[:1])[0])
        data = bytearray(path.read_bytes())
        data[-64:] = bytes(64)
        path.write_bytes(bytes(data))
        print(json.dumps({"round": "damaged", "rows": answer(True)}), flush=True)


if __name__ == "__main__":  # tensor parallel workers are spawned processes, which import this file
    main()

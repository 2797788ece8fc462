"""Run in a fresh process by tests/test_vllm_connector.py: one vLLM engine whose KV connector is the
MultiConnector pced builds from a user's own kv_transfer_config (a front tier) with ``store_kv``
on: the front tier first, pced's store last. The front tier is vLLM's ExampleConnector (a disk tier
keyed by the prompt), the one in-tree tier vLLM's CPU build runs (OffloadingConnector needs a GPU:
vllm/v1/kv_offload/cpu/spec.py:199-203). Prints one JSON line per round.

argv: model_dir store_dir front_dir documents_json
"""

import json
import os
import shutil
import sys

QUESTION = "Who painted the harbor, and when?"


def main() -> None:
    model_dir, store_dir, front_dir, documents = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON lines
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pced.backends.vllm.engine import group_prompts
    from pced.backends.vllm.settings import VLLMSettings
    from pced.backends.vllm.store_kv import SUPPLIED_KEY, StoreSpec, group_params, reads_store
    from pced.documents import Candidate, Document
    from pced.kv.store import KVStore
    from pced.llm import load_model
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    llm = load_model(model_dir, device="cpu", dtype="float32")
    store = KVStore(store_dir, llm, PromptBuilder(llm.tokenizer, RAG_TEMPLATE), storage_dtype="float16")
    store.add(documents, progress=False)
    prompts = group_prompts(store.builder, [Candidate(Document(str(i), d), 0.5) for i, d in enumerate(documents)],
                            QUESTION)
    params = group_params(store, prompts, [None] + documents)
    front = os.path.join(front_dir, "front.json")
    tiers = os.path.join(front_dir, "tiers")
    with open(front, "w") as out:
        json.dump({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": tiers}}, out)
    config = VLLMSettings(kv_transfer_config=front, store_kv=True).engine_args()["kv_transfer_config"]
    engine = LLM(model=model_dir, dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=True,
                 kv_cache_memory_bytes=128 << 20, max_model_len=1024, kv_transfer_config=config)

    def answer(from_store: bool) -> list[dict]:
        engine.reset_prefix_cache()  # every round starts from the tiers, not from vLLM's GPU/CPU prefix cache
        sampling = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                   extra_args={"kv_transfer_params": p} if from_store else None) for p in params]
        outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                 "supplied": (o.kv_transfer_params or {}).get(SUPPLIED_KEY)} for o in outputs]

    def forget_front() -> None:
        shutil.rmtree(tiers, ignore_errors=True)

    print(json.dumps({"round": "config", "reads_store": reads_store(config), "config": config}), flush=True)
    # the front tier is empty: the store supplies prefix + document; the front tier keeps each prompt
    print(json.dumps({"round": "store", "specs": [StoreSpec.from_params(p).tokens for p in params],
                      "prompts": [len(p) for p in prompts], "rows": answer(True)}), flush=True)
    # the front tier holds every prompt now: it loads them, the store is not asked to
    print(json.dumps({"round": "front", "rows": answer(True)}), flush=True)
    forget_front()
    print(json.dumps({"round": "computed", "rows": answer(False)}), flush=True)
    forget_front()
    path = store.path_for(store.digests(documents[:1])[0])  # bytes no longer matching their checksum
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    path.write_bytes(bytes(data))
    print(json.dumps({"round": "damaged", "rows": answer(True)}), flush=True)


if __name__ == "__main__":
    main()

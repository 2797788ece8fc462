"""Run in a fresh process by tests/test_vllm_backend.py: ask the same questions of stores with the
vLLM backend and with the transformers backend; print one JSON line per question with both answers.

argv: a JSON file holding a list of jobs, each ``{"name", "store", "questions": [...], "settings":
{...}, "warm_up": bool}``. Every job's engine is started first (vLLM 0.32 must start its engines
before the retrieval libraries are imported; jobs with the same model and settings share one
engine, whose prefix cache is emptied between them, so each job's documents come from its own
store or prefill). Then every job's questions are asked of vLLM, and only then of transformers: the
line after the vLLM answers counts the causal LMs with weights in this process (the vLLM backend
holds none; the transformers answers after it load them). Without ``warm_up`` the documents' KV
comes from the store's caches through pced's connector (or, with store_kv off, vLLM prefills them)."""

import gc
import json
import sys
import time
from dataclasses import replace


def only_the_question(builder, asked, block: int) -> int:
    """The prompt tokens vLLM computes for a question when the store supplies every row's prefix and
    document: each row's question suffix in the first pass, and in the second (the group, admitted
    from the prefix cache) the last partial block, less any part the store supplies again."""
    from pced.backends.vllm.engine import group_prompts

    prompts = group_prompts(builder, asked.candidates, asked.question)
    stored = [len(builder.prefix_ids)] + [len(builder.prefix_ids) + len(builder.context_ids([c.document.render()]))
                                          for c in asked.candidates]
    return sum(len(p) - s for p, s in zip(prompts, stored)) + sum(
        len(p) - max((len(p) - 1) // block * block, s) for p, s in zip(prompts, stored))


def causal_lms_with_weights() -> int:
    """Causal LMs in this process with any parameter off the meta device (the retrievers' encoders are not
    causal LMs)."""
    from transformers import GenerationMixin

    return sum(1 for o in gc.get_objects()
               if isinstance(o, GenerationMixin) and any(not p.is_meta for p in o.parameters()))


def forget(engine) -> None:
    """Empty the engine's prefix cache (refused while a request still holds blocks: retried)."""
    deadline = time.monotonic() + 60
    while not engine.loop.llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM refused to empty its prefix cache for a minute")
        time.sleep(0.1)


def main() -> None:
    from pced.backend import get_backend
    from pced.backends.vllm.engine import close_engines, shared_engine
    from pced.backends.vllm.settings import VLLMSettings
    from pced.decoding.sampling import SamplingConfig
    from pced.options import AskOptions
    from pced.pipeline import ask
    from pced.store import DocumentStore

    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs:  # every engine first: before retrieval imports its libraries
        store = DocumentStore.open(job["store"])
        # the engine computes in the transformers model's dtype (float32 here), so the two backends are the same
        # arithmetic and the betas agree to float32 rounding (the test's 1e-4)
        model = store.model_for("vllm")  # its config, tokenizer and chat template: the engine loads the weights
        settings = VLLMSettings(**{"dtype": str(model.dtype).removeprefix("torch."), **job["settings"]})
        # the engine ask() uses: the settings as the backend resolves them (store_kv None -> on or off)
        engine = shared_engine(model.path, get_backend("vllm").engine_settings(model, settings))
        job.update(open_store=store, vllm_settings=settings, engine=engine)
    base = AskOptions(top_k=4, top_n=30, rerank=False, sampling=SamplingConfig(max_new_tokens=32))
    used = set()
    for job in jobs:  # every vLLM answer before the first transformers one
        store, settings, engine = job["open_store"], job["vllm_settings"], job["engine"]
        if id(engine) in used:
            forget(engine)
        used.add(id(engine))
        builder = store.generator_for("vllm", settings).builder
        job["warm_up_tokens"] = (engine.warm_up(builder, [d.render() for d in store.documents]) if job.get("warm_up")
                                 else 0)
        job["served"] = []
        for question in job["questions"]:
            asked = ask(store, question, replace(base, backend="vllm", backend_settings=settings))
            job["served"].append((question, asked.json(), asked.answer().stats,
                                  only_the_question(builder, asked, settings.block_size)))
        job["engine_core"] = type(engine.loop.llm.llm_engine.engine_core).__name__  # SyncMPClient: its own process
    print(json.dumps({"weights_here": causal_lms_with_weights(),  # and no engine but the jobs' own was started
                      "engines": len(shared_engine.__globals__["_ENGINES"])}), flush=True)
    for job in jobs:
        print(json.dumps({"job": job["name"], "warm_up_tokens": job["warm_up_tokens"], "engine_core": job["engine_core"],
                          "reads_store": job["engine"].reads_store}), flush=True)
        for question, answer_json, stats, own_tokens in job["served"]:
            reference = ask(job["open_store"], question, base)
            print(json.dumps({"job": job["name"], "question": question, "transformers": reference.json(),
                              "vllm": answer_json, "vllm_stats": stats, "only_the_question": own_tokens}), flush=True)
    engines = {id(job["engine"]): job["engine"] for job in jobs}.values()
    close_engines()  # every engine's thread ends and it leaves the shared table
    print(json.dumps({"closed": all(not e.loop._thread.is_alive() and e.loop.llm is None for e in engines)
                      and shared_engine.__globals__["_ENGINES"] == {}}), flush=True)


if __name__ == "__main__":
    main()

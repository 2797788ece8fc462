"""Run in a fresh process by tests/test_vllm_backend.py (vLLM 0.32 must start its engine before the
retrieval libraries are imported): ask the same questions of the same store with the transformers
backend and the vLLM backend; print one JSON line per question with both answers.

argv: store_dir questions_file settings_json [--warm-up]. Without --warm-up the documents' KV comes
from the store's caches through pced's connector (or, with store_kv off, vLLM prefills them)."""

import json
import os
import sys
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


def main() -> None:
    # the KV memory of the CPU build: 1 GiB per rank, not the default share of the machine's RAM
    # (``vllm/platforms/cpu.py:323-327``), beside the other tests
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from pced.backends.vllm.engine import shared_engine
    from pced.backends.vllm.settings import VLLMSettings
    from pced.options import AskOptions
    from pced.pipeline import ask
    from pced.decoding.sampling import SamplingConfig
    from pced.store import DocumentStore

    store_dir, questions_file, settings_json = sys.argv[1:4]
    store = DocumentStore.open(store_dir)
    # the engine computes in the transformers model's dtype (float32 here), so the two backends are the same
    # arithmetic and the betas agree to float32 rounding (the test's 1e-4)
    settings = VLLMSettings(**{"dtype": str(store.llm.dtype).removeprefix("torch."), **json.loads(settings_json)})
    engine = shared_engine(store.llm.path, settings)  # first: before retrieval imports its libraries
    warm = (engine.warm_up(store.generator.builder, [d.render() for d in store.documents])
            if "--warm-up" in sys.argv[4:] else 0)
    core = type(engine.loop.llm.llm_engine.engine_core).__name__  # SyncMPClient: the engine in its own process
    print(json.dumps({"warm_up_tokens": warm, "engine_core": core, "reads_store": engine.reads_store}), flush=True)
    for question in json.loads(open(questions_file).read()):
        base = AskOptions(top_k=4, top_n=30, rerank=False, sampling=SamplingConfig(max_new_tokens=32))
        reference = ask(store, question, base)
        served = ask(store, question, replace(base, backend="vllm", backend_settings=settings))
        answer = served.answer()
        print(json.dumps({"question": question, "transformers": reference.json(), "vllm": served.json(),
                          "vllm_stats": answer.stats,
                          "only_the_question": only_the_question(store.generator.builder, served, settings.block_size)}),
              flush=True)
    engine.close()  # the engine's thread ends and it leaves the shared table
    print(json.dumps({"closed": not engine.loop._thread.is_alive() and engine.loop.llm is None
                      and shared_engine.__globals__["_ENGINES"] == {}}), flush=True)


if __name__ == "__main__":
    main()

"""Run in a fresh process by tests/test_vllm_backend.py (vLLM 0.32 must start its engine before the
retrieval libraries are imported): ask the same questions of the same store with the transformers
backend and the vLLM backend; print one JSON line per question with both answers.

argv: store_dir questions_file settings_json [--warm-up]. Without --warm-up the documents' KV comes
from the store's caches through pced's connector (or, with store_kv off, vLLM prefills them). Every
question is asked of vLLM first: the first line counts the causal LMs with weights in this process
then (the vLLM backend holds none; the transformers answers after it load one)."""

import gc
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


def causal_lms_with_weights() -> int:
    """Causal LMs in this process with any parameter off the meta device (the retrievers' encoders are not
    causal LMs)."""
    from transformers import GenerationMixin

    return sum(1 for o in gc.get_objects()
               if isinstance(o, GenerationMixin) and any(not p.is_meta for p in o.parameters()))


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
    model = store.model_for("vllm")  # its config, tokenizer and chat template: the engine loads the weights
    settings = VLLMSettings(**{"dtype": str(model.dtype).removeprefix("torch."), **json.loads(settings_json)})
    engine = shared_engine(model.path, settings)  # first: before retrieval imports its libraries
    builder = store.generator_for("vllm", settings).builder
    warm = engine.warm_up(builder, [d.render() for d in store.documents]) if "--warm-up" in sys.argv[4:] else 0
    base = AskOptions(top_k=4, top_n=30, rerank=False, sampling=SamplingConfig(max_new_tokens=32))
    served = {}
    for question in json.loads(open(questions_file).read()):  # every vLLM answer before the first transformers one
        asked = ask(store, question, replace(base, backend="vllm", backend_settings=settings))
        served[question] = (asked, asked.json(), asked.answer())
    core = type(engine.loop.llm.llm_engine.engine_core).__name__  # SyncMPClient: the engine in its own process
    print(json.dumps({"warm_up_tokens": warm, "engine_core": core, "reads_store": engine.reads_store,
                      "weights_here": causal_lms_with_weights()}), flush=True)
    for question, (asked, answer_json, answer) in served.items():
        reference = ask(store, question, base)
        print(json.dumps({"question": question, "transformers": reference.json(), "vllm": answer_json,
                          "vllm_stats": answer.stats,
                          "only_the_question": only_the_question(builder, asked, settings.block_size)}), flush=True)
    engine.close()  # the engine's thread ends and it leaves the shared table
    print(json.dumps({"closed": not engine.loop._thread.is_alive() and engine.loop.llm is None
                      and shared_engine.__globals__["_ENGINES"] == {}}), flush=True)


if __name__ == "__main__":
    main()

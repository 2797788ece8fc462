"""A GGUF on pced's llama.cpp backend: stored state bytes per token, and whether a row's logits
depend on how a prompt is split into steps (with and without ggml-cpu's repacked weights).

For each KV cache type and document length (random tokens), the bytes of a stored sequence state
per token (a model with sliding-window layers keeps only the window's cells in those layers). Then
one prompt's next-token logits decoded in one call against the same prompt in two calls split
at each of ``--splits`` (default: every point): max |difference| with the weights repacked
(llama.cpp's default) and in the plain layout (pced's). ggml-cpu's tiled K-quant products are off
as pced runs them; ``GGML_CPU_TILED_MM=1`` in the environment turns them back on for a comparison
(the value is recorded). Prints and saves JSON + Markdown.

    python experiments/llamacpp_state_sizes.py --model PATH.gguf --out runs/llamacpp-state-sizes
    GGML_CPU_TILED_MM=1 python experiments/llamacpp_state_sizes.py --model PATH.gguf --out runs/llamacpp-state-sizes-tiled
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--doc-tokens", default="64,256,512,2048")
    parser.add_argument("--prompt-tokens", type=int, default=141)
    parser.add_argument("--splits", default="all", help="points to split the prompt at (default: every one)")
    parser.add_argument("--out", default="runs/llamacpp-state-sizes")
    args = parser.parse_args()
    from pced.backends.llamacpp.model import LlamaModel
    from pced.backends.llamacpp.states import StateStore
    from pced.backends.llamacpp.settings import LlamaSettings
    from pced.text.prompts import RAG_TEMPLATE, PromptBuilder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    sizes = []
    for cache_type in ("f16", "q8_0"):
        llm = LlamaModel(args.model, LlamaSettings(cache_type=cache_type, threads=1))
        store = StateStore(tempfile.mkdtemp(), llm, PromptBuilder(llm.tokenizer, RAG_TEMPLATE))
        prefix = store.prefix()
        for n in map(int, args.doc_tokens.split(",")):
            from pced.backends.llamacpp.states import encode_states

            ids = torch.randint(1000, llm.n_vocab - 1000, (n,), generator=generator).tolist()
            with llm.lock:
                data = encode_states(llm, prefix, [ids])[0]
            sizes.append({"cache_type": cache_type, "tokens": n, "bytes": int(data.size),
                          "bytes_per_token": data.size / n})
            print(f"{cache_type} {n} tokens: {data.size / n:,.0f} bytes per token")

    class Repacked(LlamaModel):
        repack_weights = True

    prompt = torch.randint(1000, llm.n_vocab - 1000, (args.prompt_tokens,), generator=generator).tolist()
    prompt[0] = int(llm.lib.llama_vocab_bos(llm.vocab))
    splits = {}
    for name, cls in (("repacked", Repacked), ("plain", LlamaModel)):
        model = cls(args.model, LlamaSettings(threads=1))

        def logits(points):
            with model.lock:
                ctx, bounds, last = model.context(len(prompt) + 8, 1), [0, *points, len(prompt)], None
                for start, end in zip(bounds, bounds[1:]):
                    part = prompt[start:end]
                    last = ctx.decode(part, range(start, end), [0] * len(part), [False] * (len(part) - 1) + [True])[0]
                return last

        whole = logits([])
        points = range(1, len(prompt)) if args.splits == "all" else map(int, args.splits.split(","))
        splits[name] = {p: float((logits([p]) - whole).abs().max()) for p in points}
        print(name, {p: d for p, d in splits[name].items() if d})
        model = None
    tiled = os.environ.get("GGML_CPU_TILED_MM")
    result = {"model": llm.name, "gguf": llm.path, "n_swa": llm.n_swa, "ubatch": llm.settings.ubatch_tokens,
              "GGML_CPU_TILED_MM": tiled,
              "state_sizes": sizes, "split_max_abs_logit_difference": splits}
    (out / "state_sizes.json").write_text(json.dumps(result, indent=1))
    lines = [f"# {llm.name} on llama.cpp: state bytes per token, and split prompts", "",
             f"Sliding window: {llm.n_swa or 'none'}; compute steps of {llm.settings.ubatch_tokens} tokens.", "",
             "| cache type | document tokens | bytes per token |", "|---|---|---|"]
    lines += [f"| {s['cache_type']} | {s['tokens']} | {s['bytes_per_token']:,.0f} |" for s in sizes]
    lines += ["", f"A {len(prompt)}-token random prompt decoded whole against split in two at each of "
              f"{len(splits['plain'])} points (ggml-cpu's tiled K-quant products "
              f"{'on' if tiled not in (None, '0') else 'off'}, GGML_CPU_TILED_MM={tiled}):", "",
              "| weights | splits with a difference | max abs logit difference | where |", "|---|---|---|---|"]
    for name, values in splits.items():
        moved = {p: d for p, d in values.items() if d}
        where = ", ".join(map(str, moved)) if len(moved) <= 12 else ", ".join(map(str, list(moved)[:12])) + ", ..."
        lines.append(f"| {name} | {len(moved)} | {max(values.values(), default=0):.4g} | {where or '-'} |")
    (out / "state_sizes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

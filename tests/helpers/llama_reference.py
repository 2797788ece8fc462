"""llama.cpp's own greedy continuation, the reference for a one-expert, no-contrast PCED answer."""

from __future__ import annotations


def llama_cpp_greedy(model, prompt: list[int], max_new_tokens: int, monkeypatch) -> list[int]:
    """Greedy tokens from llama-cpp-python's high-level ``Llama`` on ``model``'s GGUF, loaded as pced's
    backend loads it: the same compute steps (ubatch), flash attention, and weights not repacked
    (see ``LlamaModel``), so the two differ only in who drives the decode."""
    import llama_cpp
    import llama_cpp.llama as high_level

    def plain_layout():
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(high_level.llama_cpp, "llama_model_default_params", plain_layout)
    settings = model.settings
    reference = llama_cpp.Llama(model_path=model.path, n_ctx=1024, n_threads=1, n_batch=settings.batch_tokens,
                                n_ubatch=settings.ubatch_tokens, flash_attn=True, verbose=False)
    expected: list[int] = []
    for token in reference.generate(prompt, top_k=1, temp=0.0):
        if token in model.eos_token_ids() or len(expected) == max_new_tokens:
            break
        expected.append(token)
    return expected

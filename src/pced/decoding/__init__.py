"""Decoding: the one loop every method and front end runs (``loop``), the contrastive rule it
applies to the experts' logits (``rule``, with its settings and the paper's defaults in
``rule_config``), how a token is chosen and when an answer stops (``sampling``), and the guard that
ends an answer repeating itself (``repetition``). The rule takes plain tensors and knows nothing of
where logits come from, so every backend drives the same loop and rule."""

"""Text in and out: the paper's prompt templates rendered through a model's chat template into token
segments (``prompts``), incremental detokenization and stop strings (``detokenize``), the answer
every backend produces and every front end reads, with its JSON contract (``answers``), and the
citations drawn from an answer's trace (``citations``)."""

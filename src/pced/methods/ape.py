"""APE (Yang et al., ICLR 2025: "Adaptive Parallel Encoding"): the stored per-document caches
merged in one row, attended with APE's tempered, scaled attention (``pced.backends.ape_attention``)."""

from __future__ import annotations

from typing import Sequence

from ..errors import DataError
from ..decoding.sampling import SamplingConfig
from ..backends.ape_attention import APERows, DocumentCache
from ..decoding.loop import Generation, PlainScoring
from ..kv.segment import DocKV
from ..kv.store import KVStore
from ..llm import LoadedModel
from ..options import AskOptions


class APEGeneration(Generation):
    """One row: prefix | doc_1 | ... | doc_N | suffix | generated. No attribution: doc_id is null."""

    def __init__(
        self,
        llm: LoadedModel,
        prefix: DocKV,
        documents: Sequence[DocumentCache],
        suffix_ids: Sequence[int],
        sampling: SamplingConfig = SamplingConfig(),
        temperature: float = AskOptions.ape_temperature,
        scale: float = AskOptions.ape_scale,
    ):
        rows = APERows(llm, prefix, documents, suffix_ids, sampling.max_new_tokens, temperature, scale)
        super().__init__(rows, PlainScoring(), llm, sampling, method="ape")


def ape_from_store(
    llm: LoadedModel,
    store: KVStore,
    documents: Sequence[str],
    question: str,
    sampling: SamplingConfig = SamplingConfig(),
    temperature: float = AskOptions.ape_temperature,
    scale: float = AskOptions.ape_scale,
) -> APEGeneration:
    """An APEGeneration over document texts (ranked order), encoding any not yet in ``store``."""
    if store.llm.fingerprint != llm.fingerprint:
        raise DataError(f"the KV store {store.root} was built for model {store.llm.name!r}, not {llm.name!r}")
    digests = store.add(list(documents), progress=False)
    return APEGeneration(
        llm,
        store.prefix(),
        [lambda d=digest: store.load(d) for digest in digests],
        store.builder.suffix_ids(question, with_context=bool(documents)),
        sampling,
        temperature,
        scale,
    )

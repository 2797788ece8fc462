"""The one switch that keeps Hugging Face libraries off the network and quiet (DESIGN: no network
at run time; pced draws its own progress, a bar per model load is noise)."""

from __future__ import annotations

import os


def force_offline() -> None:
    """Tell huggingface_hub / transformers not to touch the network (before they load a model), and
    keep their per-load progress bars ("Loading weights") out of pced's output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

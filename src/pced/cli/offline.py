"""The switch that keeps Hugging Face libraries off the network and quiet for a whole process (no
network at run time; pced draws its own progress, a bar per model load is noise).

Environment variables are process state, so only an entry point sets them: ``pced``'s ``main``
(every subcommand, ``pced serve`` included) and the tools under ``tools/``. The library stays
offline without them: every loader passes ``local_files_only=True`` and a local directory."""

from __future__ import annotations

import os
import sys


def force_offline() -> None:
    """Tell huggingface_hub / transformers not to touch the network (before they load a model), and
    keep their per-load progress bars ("Loading weights") out of pced's output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    if "huggingface_hub" in sys.modules:  # imported before this switch: tell it directly
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

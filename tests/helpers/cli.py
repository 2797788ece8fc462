"""Run the ``pced`` command line in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_pced(*args: str, timeout: float = 600, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pced.cli", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path

"""The README cannot rot: its set-up commands are what CI runs, every command of its reference table
parses with the real command line, and its quick start (shell blocks and the Python snippet) runs
exactly as printed against the embedded model."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _normalized(command: str) -> list[str]:
    """A command's words without quietness flags and pytest's cache switch (CI adds those)."""
    words = shlex.split(command)
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "-p":
            skip = True
            continue
        if word not in ("-q",):
            out.append(word)
    return out


def test_readme_opens_with_exactly_two_setup_commands_and_ci_runs_the_second():
    first = code_blocks(README, "bash")[0].strip().splitlines()
    assert len(first) == 2, first
    assert README.index("```bash") < 1200  # the first lines of the README
    demo, suite = first
    assert demo.endswith("pced demo")
    assert suite.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    ci_line = next(line for line in ci.splitlines() if "pytest" in line and "pip install" in line)
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert suite.startswith(venv)
    assert _normalized(suite[len(venv):]) == _normalized(ci_line)


def _table_commands() -> list[str]:
    return re.findall(r"^\| `(pced [^`]*)` \|", section("Commands"), flags=re.M)


def test_every_reference_command_parses_with_the_real_command_line():
    from pced.cli import build_parser

    commands = _table_commands()
    assert len(commands) >= 8
    placeholders = {"STORE": "mystore", "CORPUS": "corpus.jsonl", '"QUESTION"': '"a question"', "DOCS.jsonl": "docs.jsonl"}
    parser = build_parser()
    for command in commands:
        for name, value in placeholders.items():
            command = command.replace(name, value)
        args = parser.parse_args(shlex.split(command)[1:])  # argparse exits (SystemExit) on a bad line
        assert args.command == shlex.split(command)[1]


def test_readme_links_point_at_files_of_the_repository():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / target).exists(), target
    assert "../" not in README  # nothing outside the repository
    assert len(README.splitlines()) <= 300


def test_every_experiment_has_a_row_in_the_experiments_index():
    """experiments/README.md says what each script reproduces and how to run it: one row per file,
    and no row for a file that is gone."""
    index = (ROOT / "experiments" / "README.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", index, flags=re.M))
    files = {p.name for p in (ROOT / "experiments").iterdir() if p.is_file() and p.name != "README.md"}
    assert files - rows == set(), "experiments without a row"
    assert rows - files == set(), "rows for files that are not there"


@pytest.mark.slow
def test_quick_start_runs_exactly_as_printed(tmp_path):
    quick = section("Quick start")
    shell_blocks = code_blocks(quick, "bash")
    python_blocks = code_blocks(quick, "python")
    assert len(shell_blocks) == 2 and len(python_blocks) == 1
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    index_and_ask, serve = shell_blocks
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", index_and_ask], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"answer"' in done.stdout and '"trace"' in done.stdout

    # the serve block: the server in the background, curl waits for it; stop the server afterwards
    server = subprocess.Popen(["bash", "-c", serve + "\nkill %1\nwait\n"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = server.communicate(timeout=600)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
    assert '"choices"' in out, err[-2000:]

    # the snippet as printed, with every model load counted: it loads the model once
    script = tmp_path / "snippet.py"
    script.write_text(python_blocks[0])
    counted = tmp_path / "count_loads.py"
    counted.write_text("import atexit, runpy, sys\nimport pced.llm\nloads = []\nload = pced.llm.load_model\n"
                       "pced.llm.load_model = lambda *a, **k: loads.append(1) or load(*a, **k)\n"
                       "atexit.register(lambda: print(f'model loads: {len(loads)}', file=sys.stderr))\n"
                       f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, str(counted)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
    assert "model loads: 1" in done.stderr, done.stderr[-2000:]

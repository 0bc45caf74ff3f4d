"""The suite's two local lm-evaluation-harness tasks over the JSON lines beside this file: a multiple-choice task
(loglikelihood requests: echo, logprobs, max_tokens 1) and a generate task (token-id prompts, stop strings)."""

from __future__ import annotations

import runpy
from pathlib import Path

HERE = Path(__file__).resolve().parent
write_task = runpy.run_path(str(HERE.parent.parent / "benchmarks" / "lmeval_tasks.py"))["write_task"]


def write_tasks(folder: Path) -> Path:
    """Both tasks' YAML in `folder` (infinigen_mc, infinigen_gen); returns the folder."""
    write_task(folder, "infinigen_mc", HERE / "mc.jsonl")
    return write_task(folder, "infinigen_gen", HERE / "gen.jsonl", "gen")

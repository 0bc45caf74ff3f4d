"""Two local lm-evaluation-harness tasks over the JSON lines beside this file, written as task YAML into a folder
for `lm-eval run --include_path`: a multiple-choice task (loglikelihood requests: echo, logprobs, max_tokens 1)
and a generate task (token-id prompts, stop strings)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

MC = """task: infinigen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN = """task: infinigen_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, mc: Path = HERE / "mc.jsonl", gen: Path | None = HERE / "gen.jsonl") -> Path:
    """The task YAML in `folder` (made), naming the data files by absolute path; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "infinigen_mc.yaml").write_text(MC.format(data=mc.resolve()))
    if gen is not None:
        (folder / "infinigen_gen.yaml").write_text(GEN.format(data=gen.resolve()))
    return folder

"""lm-evaluation-harness task YAML over local JSON lines, for `lm-eval run --include_path FOLDER`: the tasks of
benchmarks/lmeval_policies.py and of the suite (tests/lmeval/). No imports beyond the standard library."""

from __future__ import annotations

from pathlib import Path

MC_YAML = """task: {name}
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
  - metric: acc_norm
"""

GEN_YAML = """task: {name}
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


def write_task(folder: Path, name: str, data: Path, kind: str = "mc") -> Path:
    """A task YAML for `lm-eval run --include_path folder` over JSON lines `data` (named by absolute path):
    multiple choice (context, choices, label) or generate (question, answer, up to a newline)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text((MC_YAML if kind == "mc" else GEN_YAML).format(name=name, data=data.resolve()))
    return folder

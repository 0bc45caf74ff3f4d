"""lm-evaluation-harness (the field's harness, `lm-eval run --model local-completions`) against a live
`infinigen-rt serve` on a tiny model under the infinigen policy, offline, with the default (auto) tokenizer
backend: it finds the server's /tokenizer_info and /tokenize and sends token-id prompts, several per request.

A local multiple-choice task (loglikelihood requests: echo, logprobs 1, max_tokens 1) and a local generate task
(tests/lmeval/). The log-likelihoods lm-eval reads from the server equal the engine's own (`eval`'s teacher-forced
decode steps under the same policy), and differ from the dense ones: a loglikelihood task measures the policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infinigen_rt.bundle import read_bundle
from infinigen_rt.engine import Engine
from infinigen_rt.measure.perplexity import score
from infinigen_rt.policies import KVOptions, configure
from tests.lmeval.tasks import HERE, write_tasks
from tests.rt.test_serve import ENV, Server

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need it (the lm-eval[api] extra)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (TemplateLM._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def samples(out, task: str) -> list[dict]:
    """lm-eval's logged samples of `task` (--log_samples)."""
    return [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl") for line in f.read_text().splitlines()]


def test_lm_eval_runs_a_multiple_choice_and_a_generate_task_against_the_server(bundles, tmp_path):
    bundle = bundles["llama31_gqa"]
    server = Server(bundle, tmp_path / "serve.log", "--policy", "infinigen", "--budget", "0.3", "--model-name", "tiny")
    try:
        out = tmp_path / "out"
        env = {
            **os.environ, **ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
            "TOKENIZERS_PARALLELISM": "false",
        }  # fmt: skip
        args = f"base_url={server.url}/v1/completions,model=tiny,num_concurrent=1,max_retries=1"
        r = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
             "--tasks", "infinigen_mc,infinigen_gen", "--include_path", str(write_tasks(tmp_path / "tasks")),
             "--output_path", str(out), "--log_samples", "--batch_size", "3"],
            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Using remote tokenizer" in r.stderr, r.stderr[-3000:]
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        assert 0 <= results["infinigen_mc"]["acc,none"] <= 1
        assert 0 <= results["infinigen_gen"]["exact_match,none"] <= 1
        mc, gen = samples(out, "infinigen_mc"), samples(out, "infinigen_gen")
        assert len(mc) == len((HERE / "mc.jsonl").read_text().splitlines()) and len(gen) == 4

        # the generate task's answers are the server's greedy completions of the same token ids
        client = server.client(key="none")
        for s in gen:
            ids = server.post("/tokenize", {"prompt": s["arguments"]["gen_args_0"]["arg_0"], "add_special_tokens": False}).json()["tokens"]  # noqa: E501
            want = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, stop=["\n"])
            assert s["resps"][0][0] == want.choices[0].text

        # the multiple-choice log-likelihoods are the engine's own under the same policy, not the dense ones
        engine = Engine(read_bundle(bundle), device="cpu", dtype="float32")
        policy = configure(engine, "infinigen", KVOptions(budget=0.3))
        full = configure(engine, "full", KVOptions())
        moved = 0
        for s in mc:
            for k, (resp, args) in enumerate(zip(s["resps"], s["arguments"].values(), strict=True)):
                ctx, cont = encode_pair(engine.tokenizer, args["arg_0"], args["arg_1"])
                ids = ctx + cont  # every token after the first is scored by a decode step (--score-tail 128)
                own = score(engine, policy, ids, 1).logprobs[len(ctx) - 1 :].sum().item()
                dense = score(engine, full, ids, 1).logprobs[len(ctx) - 1 :].sum().item()
                got = float(resp[0][0])
                assert abs(got - own) < 1e-3 * max(1, abs(own)), (s["doc_id"], k, got, own)
                moved += abs(own - dense) > 1e-3
        assert moved > 0  # the policy changed some log-likelihoods: the task measured it
    finally:
        server.stop()
    assert "-> 4" not in (tmp_path / "serve.log").read_text()  # no request was refused

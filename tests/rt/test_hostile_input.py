"""Hostile input, third round: a copy of a tiny bundle with one field edited (its `files` hashes fixed where a
file changed), or a command as a hostile user writes it. Each was a traceback, a silent wrong answer, memory without
bound or a misleading message; each is now a one-line error that says what to do, and nothing is half-written.
(The planted and cut-short kernel libraries: tests/rt/test_cpu_kernels.py; chat templates, tokenizers and logprob
bytes: tests/rt/test_serve.py and tests/rt/test_tokenizer.py.)"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinigen_rt.bundle import read_bundle
from infinigen_rt.errors import InfinigenError
from tests.conftest import run_cli
from tests.test_cli import one_line_error

pytestmark = pytest.mark.slow
SHARD = "model-00001-of-00001.safetensors"


def edited(bundle: Path, out: Path, change=None, tensors=None) -> Path:
    """A copy of `bundle` with bundle.json edited by `change(meta)` and the weight shard's tensors by
    `tensors(dict)` (then its size and sha256 in `files` fixed, so that `inspect --verify` passes the hashes)."""
    shutil.copytree(bundle, out)
    meta = json.loads((out / "bundle.json").read_text())
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        state = load_file(out / SHARD)
        tensors(state)
        save_file(state, out / SHARD, metadata={"format": "pt"})
        data = (out / SHARD).read_bytes()
        meta["files"][SHARD] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    if change is not None:
        change(meta)
    (out / "bundle.json").write_text(json.dumps(meta))
    return out


def config(key: str, value):
    def change(meta):
        meta["config"][key] = value

    return change


# --------------------------------------------------------------------------------- the model config's numbers
@pytest.mark.parametrize("key, value, words", [
    ("norm_eps", float("nan"), "norm_eps"),
    ("norm_eps", 0, "norm_eps"),
    ("rope_theta", 0, "rope_theta"),
    ("rope_theta", float("inf"), "rope_theta"),
    ("query_scale", float("nan"), "query_scale"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor"),
    ("sliding_window", -5, "sliding_window"),
    ("head_dim", 63, "head_dim"),
    ("eos_token_ids", [10**9], "eos_token_ids"),
])  # fmt: skip
def test_a_config_number_no_model_runs_with_is_a_one_line_error(bundles, tmp_path, key, value, words):
    """NaN eps, a zero RoPE base, NaN query scale and a zero scaling factor gave garbage at rc 0; a negative window
    a traceback; a scaling without its fields a KeyError."""
    b = edited(bundles["llama31_gqa"], tmp_path / "b", config(key, value))
    with pytest.raises(InfinigenError, match=words.replace(".", r"\.")) as e:
        read_bundle(b)
    assert "re-convert" in str(e.value)


def test_a_config_of_a_billion_layers_is_refused_before_any_model_is_built(bundles, tmp_path):
    """generate ran on (4.5 GB after 120 s) building modules for the config's layers before the weights said no."""
    b = edited(bundles["tied_hd64"], tmp_path / "b", config("num_hidden_layers", 10**9))
    r = run_cli("rt", "generate", b, "hi", "-n", "2", "--device", "cpu", timeout=60)
    one_line_error(r, "num_hidden_layers = 1,000,000,000", "layers 0-3")
    b = edited(bundles["tied_hd64"], tmp_path / "c", config("num_hidden_layers", 5))
    with pytest.raises(InfinigenError, match="hold layers 0-3"):
        read_bundle(b)


# ----------------------------------------------------------------------------------- memory: pool and prompt
def test_the_default_pool_never_takes_more_than_half_the_memory_and_a_pool_asked_for_must_fit(bundles, tmp_path):
    """max_position_embeddings = 10^12: serve's default pool (max batch x context) for `full` on a CPU grew a
    deque of 6e10 blocks until the OOM killer came; --kv-tokens 10^12 was a SystemError under a memory limit."""
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.runner import pool_tokens
    from infinigen_rt.system import host_available

    b = edited(bundles["tied_hd64"], tmp_path / "b", config("max_position_embeddings", 10**12))
    engine = Engine(read_bundle(b), device="cpu")
    for name in ("full", "infinigen", "offload"):
        policy = configure(engine, name)
        device, host, _ = policy.kv_bytes(engine, engine.cfg.num_key_value_heads, engine.dtype.itemsize)
        tokens = pool_tokens(engine, policy, max_batch=8)
        assert 16 <= tokens <= 0.55 * host_available() / (host or device), name  # half, as the memory moves
        with pytest.raises(InfinigenError, match=r"KV pool of 1,000,000,000,000 tokens needs .* ask for at most"):
            pool_tokens(engine, policy, max_batch=8, kv_tokens=10**12)
        with pytest.raises(InfinigenError, match="--kv-memory"):
            pool_tokens(engine, policy, max_batch=8, kv_memory=10**18)


def test_serve_with_a_pool_past_the_memory_is_a_one_line_error_under_a_memory_limit(bundles, tmp_path):
    """Under `ulimit -v` (RLIMIT_AS) the room is the limit's, not the machine's: --kv-tokens 10^12 fails at once."""
    limit = 6 << 30
    code = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
            "sys.argv = ['infinigen-rt'] + sys.argv[1:]; from infinigen_rt.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code, "serve", str(bundles["tied_hd64"]), "--device", "cpu",
                        "--kv-tokens", str(10**12), "--port", "0"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    one_line_error(r, "KV pool of 1,000,000,000,000 tokens", "ask for at most")


def test_a_prompt_past_what_the_context_can_hold_is_refused_before_it_is_read_whole(bundles):
    """A 2 GB prompt on standard input took 8.7 GB in 28 s, then the tokenizer aborted (SIGABRT): now standard
    input is read no further than the most text the model's 256 tokens could hold."""
    big = b"word " * (1 << 20)  # 5 MiB: more than 256 tokens x 256 bytes could ever be
    r = run_cli("rt", "generate", bundles["tied_hd64"], "-", "-n", "2", "--device", "cpu", input=big.decode())
    one_line_error(r, "standard input is over", "context of 256 tokens")


# ---------------------------------------------------------------------------------------- bundle.json itself
def test_a_bundle_json_nested_past_any_bundle_is_a_one_line_error(hub, bundles, tmp_path):
    """bundle.json nested 100,000 deep: a RecursionError traceback in generate, serve, inspect --verify and pull."""
    b = tmp_path / "deep"
    shutil.copytree(bundles["tied_hd64"], b)
    meta = json.loads((b / "bundle.json").read_text())
    text = json.dumps(meta)
    (b / "bundle.json").write_text(text[:-1] + ', "source": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for args in (("rt", "generate", b, "hi", "-n", "2"), ("rt", "serve", b, "--port", "0"),
                 ("prep", "inspect", b, "--verify")):  # fmt: skip
        one_line_error(run_cli(*args, timeout=120), "nests deeper than 32 levels")
    moderate = json.loads(text)
    moderate["source"] = {"x": json.loads("[" * 40 + "]" * 40)}  # parses, and deeper than a bundle nests
    (b / "bundle.json").write_text(json.dumps(moderate))
    with pytest.raises(InfinigenError, match="nests deeper"):
        read_bundle(b)

    from tests.hubserver import hub_env
    from tests.test_hub_paths import folder_files

    files = folder_files(bundles["tied_hd64"])
    files["bundle.json"] = (text[:-1] + ', "source": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    hub.add_repo("test-user/deep-bundle", files)
    out = tmp_path / "pulled"
    one_line_error(run_cli("rt", "pull", "test-user/deep-bundle", "--out", out, env=hub_env(hub, tmp_path)),
                   "nests deeper")  # fmt: skip
    assert not out.exists() and not list(tmp_path.glob(".pulled.partial-*"))


@pytest.fixture(scope="module")
def hub():
    from tests.hubserver import HubServer

    with HubServer() as server:
        yield server


def test_pull_fetches_only_what_bundle_json_lists(hub, bundles, tmp_path):
    """pull --out said "verified" on a folder holding files bundle.json does not list (evil.py, notes/deep.txt),
    with huggingface_hub's .cache/ beside them; a repo file named ../../x was "cannot reach the Hub ... check the
    network". Now only bundle.json's files (and its card) come, and nothing else is left in the folder."""
    from tests.hubserver import hub_env
    from tests.test_hub_paths import folder_files

    files = folder_files(bundles["tied_hd64"])
    hub.add_repo("test-user/extra-files", {**files, "evil.py": b"import os\n", "notes/deep.txt": b"x",
                                           "../../x": b"outside"})  # fmt: skip
    env = hub_env(hub, tmp_path)
    out = tmp_path / "pulled"
    r = run_cli("rt", "pull", "test-user/extra-files", "--out", out, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verified"] is True
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted(files)
    r = run_cli("rt", "pull", "test-user/extra-files", "--json", env=env)  # into the cache
    assert r.returncode == 0, r.stderr
    snapshot = Path(json.loads(r.stdout)["path"])
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(files)
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


# ------------------------------------------------------------------------------------------ NaN in a weight
def test_a_nan_weight_is_an_error_in_generate_and_the_server_and_inspect_verify_finds_it(bundles, tmp_path):
    """Greedy returned empty text at rc 0, sampling a RuntimeError traceback, the server a 500 plain text, and
    `inspect --verify` passed."""
    def poison(state):
        state["layers.1.mlp.down_proj.weight"][0, 0] = float("nan")

    b = edited(bundles["tied_hd64"], tmp_path / "b", tensors=poison)
    for extra in ((), ("--temperature", "0.8", "--seed", "3")):
        r = run_cli("rt", "generate", b, "hi", "-n", "3", "--device", "cpu", *extra)
        one_line_error(r, "logits are not finite", "inspect --verify")
    one_line_error(run_cli("prep", "inspect", b, "--verify"), "layers.1.mlp.down_proj.weight", "1 nan")
    assert run_cli("prep", "inspect", b).returncode == 0  # sizes only: the weights are not read

    from tests.rt.test_serve import app_client

    with app_client(b) as (client, _):
        for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "temperature": 0.9},
                     {"prompt": "hi", "max_tokens": 2, "stream": True}):  # fmt: skip
            r = client.post("/v1/completions", json=body)
            if body.get("stream"):
                assert r.status_code == 200 and '"server_error"' in r.text and "not finite" in r.text, r.text
                continue
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "not finite" in err["message"]
        assert client.get("/health").json()["status"] == "ok"


def test_sampling_tells_a_row_without_usable_logits_apart_and_keeps_the_others():
    from infinigen_rt.sampling import NOT_FINITE, SamplingParams, sample, seeded

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    for p, gen in ((SamplingParams(), None), (SamplingParams(temperature=0.7, top_p=0.9), None),
                   (SamplingParams(temperature=1.0, top_k=5), seeded(4, torch.device("cpu")))):  # fmt: skip
        got = sample(logits, p, gen)
        assert got[1:].tolist() == [NOT_FINITE] * 3 and 0 <= got[0] < 50


# -------------------------------------------------------------------------------------------------- seeds
def test_every_64_bit_seed_draws_its_own_stream_on_a_cpu():
    """Torch's CPU generator keeps 32 bits of its seed: 1 and 2^32 + 1 sampled the same; -1 and 2^64 - 2 did too
    (torch maps a negative seed to 2^64 - 1 + seed) while the API accepted [-2^63, 2^64)."""
    from infinigen_rt.sampling import SamplingParams, sample, seeded

    logits = torch.zeros(1, 1000)  # uniform: any two streams that differ show it at once
    p = SamplingParams(temperature=1.0)

    def draws(seed):
        g = seeded(seed, torch.device("cpu"))
        return [int(sample(logits, p, g)) for _ in range(12)]

    assert draws(1) == draws(1)
    streams = [draws(s) for s in (1, 2**32 + 1, -1, 2**63 - 1, -(2**63), 0)]
    assert len({tuple(s) for s in streams}) == len(streams)
    for bad in (2**63, 2**64 - 2, -(2**63) - 1):
        with pytest.raises(InfinigenError, match="64-bit integer"):
            SamplingParams(temperature=1.0, seed=bad)


def test_the_server_takes_a_signed_64_bit_seed(bundles):
    from tests.rt.test_serve import app_client

    with app_client(bundles["tied_hd64"]) as (client, _):
        def text(seed):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 1.0,
                                                     "seed": seed})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert text(1) == text(1)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**63 - 1})
        assert r.status_code == 200, r.text  # its second choice wraps to -2^63


# -------------------------------------------------------------------------------- requests the server parses
def test_a_deeply_nested_body_is_a_400_and_an_internal_error_an_openai_500(bundles, monkeypatch):
    """An exception no handler knew was Starlette's plain-text 500: now the OpenAI error body; the server goes on."""
    from infinigen_rt.serve import routes
    from tests.rt.test_serve import app_client

    async def broken(self):
        return 1 / 0

    monkeypatch.setattr(routes.Routes, "models", broken)
    with app_client(bundles["tied_hd64"]) as (client, _):
        r = client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                        headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        r = client.get("/v1/models")
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error" and "ZeroDivisionError" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200


# ------------------------------------------------------------------------------------- eval and bench limits
def test_eval_and_bench_refuse_lengths_past_the_context_and_say_which_option(bundles, tmp_path):
    """eval --seq-len past the context reported a perplexity without a word; bench --context past it ran on;
    bench --text too short blamed --seq-len, which bench does not have; eval --text FOLDER said it did not exist."""
    b = bundles["tied_hd64"]
    text = tmp_path / "t.txt"
    text.write_text("the king and the queen " * 40)
    one_line_error(run_cli("rt", "eval", b, "--text", text, "--seq-len", 300, "--score-from", 290, "--device", "cpu"),
                   "--seq-len 300 is past the model's context of 256")  # fmt: skip
    one_line_error(run_cli("rt", "bench", b, "--context", 400, "--gen", 4, "--device", "cpu"),
                   "--context 400 is past", "at most")  # fmt: skip
    short = tmp_path / "short.txt"
    short.write_text("the king")
    r = run_cli("rt", "bench", b, "--context", 64, "--gen", 2, "--batch", 1, "--device", "cpu", "--text", short)
    one_line_error(r, "fewer than the largest --context 64")
    assert "--seq-len" not in r.stderr
    for task in ("perplexity", "needle"):
        one_line_error(run_cli("rt", "eval", b, "--text", tmp_path, "--task", task, "--device", "cpu"), "is a folder")


def test_eval_does_not_write_over_a_file_it_was_not_told_to_resume(bundles, tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}\n')
    text = tmp_path / "t.txt"
    text.write_text("the king and the queen " * 40)
    r = run_cli("rt", "eval", bundles["tied_hd64"], "--text", text, "--seq-len", 64, "--score-from", 32,
                "--policies", "full", "--out", mine, "--device", "cpu")  # fmt: skip
    one_line_error(r, f"--out {mine} exists", "--resume")
    assert mine.read_text() == '{"mine": true}\n'

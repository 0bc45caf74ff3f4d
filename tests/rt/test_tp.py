"""Tensor parallelism on the CPU: two gloo ranks on loopback give the tokens one process gives, for every policy
on the tiny MHA, GQA and OPT models; the bytes moved sum to one process's; a size that would split a KV head is a
one-line error naming the sizes allowed; a rank that dies makes the other fail with a clear error, not hang."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError
from infinigen_rt.tp import TP, allowed_sizes, shard_config
from tests.conftest import run_cli
from tests.rt import tp_worker
from tests.test_cli import one_line_error

WORKER = Path(tp_worker.__file__)
MODELS = ("llama2_mha", "llama31_gqa", "opt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, bundles: dict, *extra: str, size: int = 2, timeout: float = 300):
    """`size` worker processes as torchrun would start them (its environment variables), their exits and stderr."""
    spec = tmp_path / "bundles.json"
    spec.write_text(json.dumps({m: str(bundles[m]) for m in MODELS}))
    out = tmp_path / "out.json"
    port = free_port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "INFINIGEN_TP_TIMEOUT": "30",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}  # this checkout's package  # fmt: skip
        cmd = [sys.executable, str(WORKER), str(out), str(spec), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=WORKER.parents[2]))
    deadline = time.monotonic() + timeout
    codes, errs = [], []
    for p in procs:
        _, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        codes.append(p.returncode)
        errs.append(err)
    return codes, errs, out


@pytest.fixture(scope="module")
def two_ranks(bundles, tmp_path_factory):
    codes, errs, out = launch(tmp_path_factory.mktemp("tp"), bundles)
    assert codes == [0, 0], "\n".join(errs)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank(bundles):
    return tp_worker.run({m: bundles[m] for m in MODELS}, None)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", list(tp_worker.CASES))
def test_two_ranks_generate_what_one_does_and_move_the_same_bytes(model, case, two_ranks, one_rank):
    one, two = one_rank[f"{model}/{case}"], two_ranks[f"{model}/{case}"]
    assert two["tokens"] == one["tokens"] and len(one["tokens"][0]) == 8
    assert two["bytes_h2d"] == one["bytes_h2d"] and two["bytes_d2h"] == one["bytes_d2h"]
    assert two["evictions"] == one["evictions"]
    if case != "infinigen-alpha":  # a share per rank's heads; their mean is the share over all heads
        assert two["kv_fetched_share"] == pytest.approx(one["kv_fetched_share"], abs=1e-6)


def test_a_full_budget_with_two_ranks_equals_full(two_ranks):
    for model in MODELS:
        assert two_ranks[f"{model}/infinigen-all"]["tokens"] == two_ranks[f"{model}/full"]["tokens"]


def test_a_size_that_splits_kv_heads_names_the_sizes_allowed():
    cfg = ModelConfig("llama", 100, 576, 1536, 30, 9, 3, 64, 8192)  # SmolLM2-135M's shape
    assert allowed_sizes(cfg) == [1, 3]
    with pytest.raises(InfinigenError, match=r"does not divide the model's 3 KV heads.*use one of: 1, 3"):
        shard_config(cfg, TP(0, 2))
    assert shard_config(cfg, TP(2, 3)).num_attention_heads == 3


def test_a_rank_that_dies_makes_the_other_fail_with_a_clear_error(bundles, tmp_path):
    t0 = time.monotonic()
    codes, errs, out = launch(tmp_path, bundles, "die-after-first", timeout=120)
    assert codes[1] == 3 and codes[0] not in (0, None), errs
    assert "tensor-parallel rank 0 of 2: a collective failed" in errs[0], errs[0][-2000:]
    assert time.monotonic() - t0 < 90 and not out.exists()


@pytest.mark.parametrize("how", ["torchrun", "--tp"])
def test_generate_under_torchrun_prints_once_what_one_process_prints(how, bundles):
    """Launched by torchrun, or by `--tp 2` (which starts torchrun itself)."""
    args = ["generate", str(bundles["llama31_gqa"]), "the king said", "-n", "6", "--device", "cpu", "--json",
            "--policy", "infinigen", "--budget", "0.3"]  # fmt: skip
    one = run_cli("rt", *args)
    assert one.returncode == 0, one.stderr
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "infinigen_rt.cli", *args] if how == "torchrun" else [
        sys.executable, "-m", "infinigen_rt.cli", *args[:2], "--tp", "2", *args[2:]]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1, r.stdout  # rank 0 only
    solo = json.loads(one.stdout)
    assert printed[0]["token_ids"] == solo["token_ids"] and printed[0]["stats"]["tensor_parallel"] == 2
    assert printed[0]["stats"]["bytes_h2d"] == solo["stats"]["bytes_h2d"] > 0


@pytest.mark.parametrize("how", ["torchrun", "--tp"])
def test_serve_with_two_ranks_answers_what_one_process_generates(how, bundles, tmp_path):
    """torchrun (or `--tp 2`, which starts it) runs two ranks: rank 0 serves over HTTP, rank 1 replays its
    runner's calls; concurrent requests (one streamed) get the text one process generates alone; SIGTERM (to
    torchrun, or to the process that started it) ends every rank."""
    import concurrent.futures

    import httpx

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.generate import generate
    from infinigen_rt.policies import KVOptions
    from tests.conftest import ServerProcess

    bundle = bundles["llama31_gqa"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = ["serve", str(bundle), "--device", "cpu", "--policy", "infinigen", "--budget", "0.3"]
    if how == "--tp":
        launcher, args = [sys.executable], [*args, "--tp", "2"]
    server = ServerProcess(args, tmp_path / "tp.log", env={"OMP_NUM_THREADS": "1"}, launcher=launcher)
    prompts = ["the king said", "a horse, a horse", "to be or not to be, that is", "now is the winter"]
    try:
        def ask(i: int) -> str:
            body = {"model": bundle.name, "prompt": prompts[i], "max_tokens": 8, "temperature": 0}
            if i == 3:  # streamed
                body["stream"] = True
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                return "".join(c["choices"][0]["text"] for c in chunks)
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        text = httpx.get(server.url + "/metrics", timeout=10).text
        moved = float(re.search(r"^infinigen_bytes_h2d_total (\S+)$", text, re.M)[1])
    finally:
        server.stop()
    assert server.proc.returncode is not None
    assert "tensor-parallel over 2 ranks" in server.log.read_text()
    e = Engine(read_bundle(bundle), device="cpu", dtype="float32")
    tok = e.tokenizer
    alone = [generate(e, [tok.encode(p)], 8, policy="infinigen", kv=KVOptions(budget=0.3)) for p in prompts]
    want = [gens[0].text for gens, _ in alone]
    assert got == want and all(want)
    assert moved == sum(stats.extra["bytes_h2d"] for _, stats in alone) > 0  # the ranks' bytes, totalled


def test_bench_under_torchrun_reports_per_rank_and_total_bytes(bundles):
    args = ["bench", str(bundles["llama31_gqa"]), "--device", "cpu", "--batch", "1", "--context", "64", "--gen", "3",
            "--warmup", "1", "--policies", "offload,infinigen", "--json"]  # fmt: skip
    one = run_cli("rt", *args, env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = subprocess.run([*launcher, "-m", "infinigen_rt.cli", *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    printed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and printed[0]["tensor_parallel"] == 2
    for solo, two in zip(json.loads(one.stdout)["points"], printed[0]["points"], strict=True):
        assert two["status"] == solo["status"] == "ok" and two["tensor_parallel"] == 2
        ranks = two["h2d_bytes_per_step_per_rank"]
        assert len(ranks) == 2 and all(x > 0 for x in ranks) and sum(ranks) == two["h2d_bytes_per_step"]
        assert two["h2d_bytes_per_step"] == solo["h2d_bytes_per_step"]
        assert two["allreduce_ms_per_step"] > 0


def test_bad_tp_options_are_one_line_errors(bundles):
    from infinigen_rt.cli.launch import strip_tp

    assert strip_tp(["generate", "b", "--tp", "2", "x", "--tp=3", "-n", "4"]) == ["generate", "b", "x", "-n", "4"]
    b = str(bundles["llama31_gqa"])
    one_line_error(run_cli("rt", "generate", b, "hi", "--tp", "0"), "--tp must be >= 1")
    one_line_error(run_cli("rt", "generate", b, "-", "--tp", "2", input="hi"), "standard input")
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--tp", "2"), "needs a BUNDLE")
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    one_line_error(run_cli("rt", "generate", b, "hi", "--tp", "4", env=env), "--tp 4 under torchrun with WORLD_SIZE 2")


@pytest.mark.parametrize("cmd", [["generate", "hi", "-n", "2"], ["bench", "--context", "64"], ["serve"]])
def test_a_tp_size_the_bundle_cannot_split_fails_before_torchrun_starts(bundles, cmd):
    """Read from the bundle by the launcher (it printed the error once per rank, then torchrun's traceback, and
    exited 0: click returns a typer.Exit's code under standalone_mode=False, and it was dropped)."""
    args = [cmd[0], bundles["llama31_gqa"], *cmd[1:], "--tp", "4", "--device", "cpu"]
    start = time.monotonic()
    r = run_cli("rt", *args, timeout=120)
    one_line_error(r, "tensor-parallel size 4", "2 KV heads", "use one of: 1, 2")
    assert "torch.distributed" not in r.stderr + r.stdout and time.monotonic() - start < 60


def test_a_user_error_in_every_rank_is_one_line_and_the_launchers_exit_code(bundles):
    """Found by the ranks (the prompt is longer than the context): each rank's line, said once; no torchrun
    traceback, banner or log; the exit code of the failed ranks."""
    r = run_cli("rt", "generate", bundles["llama31_gqa"], "king " * 400, "--tp", "2", "--device", "cpu", timeout=300)
    one_line_error(r, "the prompt is 401 tokens", "context is 256")
    assert r.returncode == 1 and "ChildFailedError" not in r.stderr and "OMP_NUM_THREADS" not in r.stderr


@pytest.mark.slow
def test_smollm2_over_two_ranks_is_a_one_line_error_naming_the_sizes(smollm2_bundle):
    """Checked before waiting for the other ranks: one process told it is rank 0 of 2 fails at once."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for cmd in (["generate", smollm2_bundle, "hi", "--no-verify"], ["serve", smollm2_bundle, "--no-verify"],
                ["bench", smollm2_bundle, "--device", "cpu", "--context", "64"]):  # fmt: skip
        r = run_cli("rt", *cmd, env=env, timeout=60)
        one_line_error(r, "tensor-parallel size 2", "3 KV heads", "use one of: 1, 3")


def test_a_rank_binds_to_its_gpus_numa_node_only_where_there_are_several(tmp_path):
    from infinigen_rt.tp import bind_to_node, node_cpus

    nodes = tmp_path / "devices/system/node"
    mine = sorted(os.sched_getaffinity(0))
    for i, cpus in enumerate(([mine[0]], mine[1:] or [mine[0]])):
        (nodes / f"node{i}").mkdir(parents=True)
        (nodes / f"node{i}" / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
    (nodes / "node1" / "cpulist").write_text("0-2,5,7-8\n")
    assert node_cpus(1, tmp_path) == {0, 1, 2, 5, 7, 8} and node_cpus(4, tmp_path) == set()
    before = os.sched_getaffinity(0)
    try:
        assert bind_to_node(0, tmp_path) and os.sched_getaffinity(0) == {mine[0]}
    finally:
        os.sched_setaffinity(0, before)
    assert not bind_to_node(None, tmp_path) and not bind_to_node(3, tmp_path)
    (nodes / "node1" / "cpulist").unlink()
    (nodes / "node1").rmdir()
    assert not bind_to_node(0, tmp_path)  # one node: nothing to choose
    assert os.sched_getaffinity(0) == before

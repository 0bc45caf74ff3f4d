"""`infinigen-rt bench`: a tiny smoke run of every policy (the real runs are benchmarks, not tests), the bytes it
reports against what the policies must move, out-of-memory rows, the overlap arithmetic, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infinigen_rt.measure.bench import Variant, interval_overlap, is_oom, point_label, run_points
from infinigen_rt.measure.synthetic import preset_config, synthetic_engine
from tests.conftest import RESULTS, render80, run_cli, shakespeare
from tests.test_cli import one_line_error

BW = {"device_bytes_per_s": 1e10, "h2d_bytes_per_s": 5e9}


@pytest.fixture(scope="module")
def smol_synthetic():
    return synthetic_engine("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)


def test_bench_cli_smoke_every_policy(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--device", "cpu", "--batch", "1,2", "--context", "48",
                "--gen", "3", "--warmup", "1", "--json", "--out", out, "--plot", png)  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert json.loads(out.read_text()) == res and png.stat().st_size > 10_000
    assert res["bandwidth"]["device_bytes_per_s"] > 0 and res["bandwidth"]["h2d_bytes_per_s"] > 0
    pts = {(p["policy"], p["batch"]): p for p in res["points"]}
    assert len(pts) == 10 and all(p["status"] == "ok" for p in pts.values())
    for p in pts.values():
        assert p["ms_per_step"] > 0 and p["floor_ms"] > 0 and p["over_floor"] == pytest.approx(
            p["ms_per_step"] / p["floor_ms"], rel=0.02
        )
        assert p["tokens_per_s"] == pytest.approx(1000 * p["batch"] / p["ms_per_step"], rel=0.01)
    assert pts[("full", 1)]["h2d_bytes_per_step"] == 0  # nothing moves: KV resident on the device
    # infinigen fetches about the budget; int4 a quarter-ish of every row; offload all of it
    assert pts[("infinigen", 2)]["h2d_bytes_per_step"] < pts[("int4", 2)]["h2d_bytes_per_step"]
    assert pts[("int4", 2)]["h2d_bytes_per_step"] < pts[("offload", 2)]["h2d_bytes_per_step"]
    assert 0 < pts[("infinigen", 1)]["kv_fetched_share"] <= 0.1 + 1e-9


def test_offload_bytes_are_every_held_row(smol_synthetic):
    cfg = preset_config("smollm2-135m")
    ctx, warm, gen, b = 40, 2, 4, 2
    (p,) = run_points(smol_synthetic, "t", ["offload"], b, ctx, gen, BW, warmup=warm, trace=False)
    held = ctx + warm + (gen - 1) / 2 + 1  # mean over the timed steps of the rows held, and one copied for the new
    row = 2 * cfg.head_dim * 4  # K and V of one token, one KV head, one layer, fp32
    assert p.h2d_bytes_per_step == pytest.approx(cfg.num_hidden_layers * cfg.num_key_value_heads * b * held * row)
    assert p.d2h_bytes_per_step == cfg.num_hidden_layers * cfg.num_key_value_heads * b * row  # the new token
    assert p.kv_fetched_share == 1.0


def test_side_by_side_points_move_what_each_policy_moves_alone(smol_synthetic):
    kw = dict(warmup=1, trace=False, budget=0.25)
    together = run_points(smol_synthetic, "t", ["offload", "infinigen", "full"], 2, 64, 4, BW, **kw)
    assert [p.policy for p in together] == ["offload", "infinigen", "full"] and all(p.status == "ok" for p in together)
    for p in together:  # each policy's own cache and counters, as if it had run alone
        (alone,) = run_points(smol_synthetic, "t", [p.policy], 2, 64, 4, BW, **kw)
        assert (p.h2d_bytes_per_step, p.d2h_bytes_per_step) == (alone.h2d_bytes_per_step, alone.d2h_bytes_per_step)
        assert p.kv_fetched_share == alone.kv_fetched_share and p.ms_per_step > 0


def test_key_choices_side_by_side_fetch_the_same_bytes(smol_synthetic):
    """bench --spec-keys partial,int4,int2: one point per key choice, timed together; each records its keys, and
    all fetch the budget's rows (the keys choose which rows, not how many)."""
    kw = dict(warmup=1, trace=False, budget=0.25)
    variants = [Variant("infinigen", k, 0.0) for k in ("partial", "int4", "int2")] + [Variant("infinigen", "int4", 0.5)]
    pts = run_points(smol_synthetic, "t", [*variants, "full"], 1, 96, 3, BW, **kw)
    assert [(p.spec_keys, p.correct) for p in pts] == [("partial", 0.0), ("int4", 0.0), ("int2", 0.0), ("int4", 0.5),
                                                       (None, None)]  # fmt: skip
    assert len({p.h2d_bytes_per_step for p in pts[:4]}) == 1 and pts[0].h2d_bytes_per_step > 0
    labels = [point_label(vars(p)) for p in pts]
    assert len(set(labels)) == 5 and labels[3].endswith("c0.5") and labels[4] == "full"


def test_infinigen_fetch_share_is_pinned_by_budget(smol_synthetic):
    (p,) = run_points(smol_synthetic, "t", ["infinigen"], 1, 200, 3, BW, budget=0.25, warmup=1, trace=False)
    assert p.status == "ok" and 0.2 < p.kv_fetched_share <= 0.25 + 1e-9
    (q,) = run_points(smol_synthetic, "t", ["infinigen"], 1, 200, 3, BW, max_kv=8, warmup=1, trace=False)
    assert q.kv_fetched_share < p.kv_fetched_share and q.h2d_bytes_per_step < p.h2d_bytes_per_step


def test_points_that_cannot_fit_are_rows(smol_synthetic):
    (p,) = run_points(smol_synthetic, "t", ["offload"], 4096, 1 << 22, 2, BW, trace=False)
    assert p.status in ("oom-host", "oom-device") and p.predicted and "GiB" in p.error and p.ms_per_step is None
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes"))
    assert is_oom(MemoryError()) == "oom-host" and is_oom(ValueError("x")) is None


def test_interval_overlap():
    assert interval_overlap([(0, 10)], [(0, 5), (3, 8)]) == pytest.approx(0.8)  # union of kernels, not the sum
    assert interval_overlap([(0, 10), (20, 30)], [(25, 40)]) == pytest.approx(0.25)
    assert interval_overlap([(0, 10)], []) == 0.0


@pytest.mark.slow
def test_bench_a_bundle_with_real_text(smollm2_bundle, tmp_path):
    r = run_cli("rt", "bench", smollm2_bundle, "--device", "cpu", "--batch", "1", "--context", "96", "--gen", "2",
                "--policies", "full,infinigen", "--text", shakespeare("hamlet_gut.txt"), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["prompt"].endswith("hamlet_gut.txt") and [p["status"] for p in res["points"]] == ["ok", "ok"]


def test_bench_bad_input(bundles, tmp_path):
    one_line_error(run_cli("rt", "bench", "--synthetic", "gpt-5"), "unknown --synthetic", "llama-2-7b")
    one_line_error(run_cli("rt", "bench"), "--synthetic")
    one_line_error(run_cli("rt", "bench", bundles["opt"], "--synthetic", "smollm2-135m"), "one of them")
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--policies", "oracle"), "unknown policy")
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--budget", "0"), "--budget")
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--spec-keys", "int8"), "--spec-keys")
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--correct", "1"), "--correct")
    r = run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--batch", "0")
    assert r.returncode != 0 and "--batch" in r.stderr and "Traceback" not in r.stderr
    one_line_error(run_cli("rt", "bench", "--synthetic", "smollm2-135m", "--text", "x.txt"), "--text needs a BUNDLE")


def test_bench_table_reads_at_80_columns():
    from infinigen_rt.cli.bench import bench_table
    from infinigen_rt.cli.console import human_bytes

    points = json.loads((RESULTS / "bench-cpu-smollm2.json").read_text())["points"]
    # 7B-scale numbers
    big = dict(
        points[6], batch=16, context=32768, ms_per_step=12345.6, tokens_per_s=12345.6, h2d_bytes_per_step=2.75e11
    )
    oom = dict(points[0], status="oom-device", batch=16, context=32768)
    text = render80(bench_table([*points, big, oom]))
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    rows = [ln.split() for ln in text.splitlines()]
    assert ["policy", "batch", "context", "ms/step", "tok/s", "H2D/step", "fetched", "x", "floor"] in rows, text
    for p in points[5:8]:  # the published 8k rows, every cell in full
        cells = [p["policy"], str(p["batch"]), str(p["context"]), f"{p['ms_per_step']:.1f}", f"{p['tokens_per_s']:.1f}",
                 *human_bytes(p["h2d_bytes_per_step"]).split(), f"{100 * p['kv_fetched_share']:.1f}%",
                 f"{p['over_floor']:.2f}"]  # fmt: skip
        assert cells in rows, (cells, text)
    big_floor = f"{points[6]['over_floor']:.2f}"
    assert ["offload", "16", "32768", "12345.6", "12345.6", "275", "GB", "100.0%", big_floor] in rows, text
    assert ["full", "16", "32768", "oom-device"] in rows, text


def test_bench_cli_table_in_a_pipe_at_80_columns(bundles):
    args = ["rt", "bench", bundles["llama31_gqa"], "--device", "cpu", "--batch", "1", "--context", "32", "--gen", "2",
            "--warmup", "1", "--policies", "full,infinigen,int4"]  # fmt: skip
    r = run_cli(*args, env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    firsts = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
    assert {"full", "infinigen", "int4"} <= set(firsts) and "prefill" not in r.stdout, r.stdout
    r = run_cli(*args, "--wide", env={"COLUMNS": "80"})  # every column, each at its full width
    assert r.returncode == 0, r.stderr
    head = next(ln for ln in r.stdout.splitlines() if ln.startswith("policy"))
    assert "…" not in r.stdout and head.split()[-2:] == ["host", "GiB"] and "prefill s" in head, r.stdout


def test_bench_times_the_step_that_generate_and_serve_take(smol_synthetic):
    """One decode path: every model call of a bench point and of generate comes from step.py, and a timed bench step
    is the runner's step (runner.step -> _decode -> step.decode_step), the call generate and serve make."""
    import inspect

    from infinigen_rt.generate import generate

    calls: list[list[str]] = []

    def record(module, args):
        frames = inspect.stack()[1:]
        chain = [f"{Path(f.filename).name}:{f.function}" for f in frames if "infinigen_rt" in f.filename]
        calls.append(chain)

    hook = smol_synthetic.model.register_forward_pre_hook(record)
    try:
        run_points(smol_synthetic, "t", ["infinigen"], 2, 32, 3, BW, warmup=1, trace=False)
        bench_calls, calls[:] = list(calls), []
        generate(smol_synthetic, [[5] * 20, [6] * 9], 4, policy="infinigen")
        generate_calls = list(calls)
    finally:
        hook.remove()

    def decode_chains(chains, caller):  # how the decode steps reached the model, below `caller`
        return {tuple(c[:3]) for c in chains if caller in c and c[0] == "step.py:decode_step"}

    assert all(c[0] in ("step.py:decode_step", "step.py:prefill") for c in bench_calls + generate_calls)
    same = ("step.py:decode_step", "runner.py:_decode", "runner.py:step")
    assert decode_chains(bench_calls, "bench.py:run_points") == {same}  # the timed steps
    assert decode_chains(generate_calls, "generate.py:generate") == {same}


def test_bench_replays_the_recorded_steps(tmp_path):
    """bench --replay: the H100 run's recorded steps (a folder) projected eager and from a graph, each point with
    --rehearse's fields; the file --out writes is what --json prints. A folder without traces, a missing file and a
    file that is not a trace are one-line errors."""
    traces, out = RESULTS / "gpu-h100-2026-11-26" / "traces", tmp_path / "r.json"
    r = run_cli("rt", "bench", "--replay", traces, "--json", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert json.loads(out.read_text()) == res and len(res["replay"]) == 9
    assert sorted(p["graphs"] for p in res["points"]) == [False] * 9 + [True] * 9
    for p in res["points"]:
        assert {"model", "policy", "batch", "context", "projected_ms", "floor_ms", "graphs"} <= set(p)
        assert p["status"] == "ok" and p["projected_ms"] >= p["floor_ms"] > 0
    one_line_error(run_cli("rt", "bench", "--replay", tmp_path), "no *.json.gz trace")
    one_line_error(run_cli("rt", "bench", "--replay", tmp_path / "none.json.gz"), "no such file")
    (tmp_path / "bad.json.gz").write_text("{}")
    one_line_error(run_cli("rt", "bench", "--replay", tmp_path / "bad.json.gz"), "not a recorded step")


def test_a_recorded_step_replays_as_it_was_rehearsed(tmp_path):
    """benchmarks/record_trace.py on this tree, then bench --replay: the same projection, eager and graphed, as
    bench --rehearse gives the same point."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    args = ["--synthetic", "smollm2-4l", "--batch", "1", "--context", "64", "--policies", "full"]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record_trace.py"), "--out", str(tmp_path), "--",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    replayed = json.loads(run_cli("rt", "bench", "--replay", tmp_path, "--json").stdout)["points"]
    rehearsed = json.loads(run_cli("rt", "bench", *args, "--rehearse", "--json").stdout)["points"]
    key = ("policy", "batch", "context", "graphs", "launches", "projected_ms", "floor_ms", "hbm_bytes", "pcie_bytes")
    assert [[p[k] for k in key] for p in replayed] == [[p[k] for k in key] for p in rehearsed]

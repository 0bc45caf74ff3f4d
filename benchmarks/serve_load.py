"""Load an `infinigen-rt serve` server: closed-loop clients, or open-loop Poisson arrivals with latencies.

python benchmarks/serve_load.py --bundle artifacts/bundles/smollm2-135m --clients 1,8 --requests 16 --max-tokens 64
python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 8 --out load.json   # a running server
python benchmarks/serve_load.py --bundle artifacts/bundles/smollm2-135m --arrival-rates 0.5,1,2 --duration 120 \
  --prompt-tokens 16:256 --max-tokens 16:128 --seed 0

Closed loop (the default): each client is a thread that sends its next request as soon as the last one is
answered, until --requests are done; prompts differ per request; greedy; requests/s and generated tokens/s.

Open loop (--arrival-rates): per rate, requests arrive as a Poisson process (seeded) for --duration seconds or
--requests requests, each sent at its time from its own thread whatever earlier ones are doing; prompts of about
--prompt-tokens tokens and --max-tokens limits drawn from the ranges (the same draws at every rate); each is
streamed, so the client measures time to first token, inter-token latency (between text chunks) and end-to-end
latency; reports achieved requests/s and tokens/s, their p50/p99, errors, and the server's queue as /health
showed it every 0.2 s.

With --bundle the script starts the server itself (--port 0, the policy and batch size given) and stops it at the
end. Prints one JSON line per client count or rate and writes them all, with the arguments, commit and machine
load, to --out. Needs httpx (the `test` extra)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

import httpx

TOPICS = [
    "the printing press",
    "the steam engine",
    "tea in China",
    "the Roman roads",
    "honey bees",
    "the moon landing",
    "chess openings",
    "the river Nile",
    "paper money",
    "volcanoes",
    "the violin",
    "lighthouses",
    "glass making",
    "the Silk Road",
    "penguins",
    "the telescope",
]
CHARS_PER_TOKEN = 4  # English text in BPE tokenizers (SmolLM2, Llama): open-loop prompt lengths are approximate
POLL_S = 0.2  # how often the open loop reads the server's queue from /health


def start_server(bundle: str, policy: str, max_batch: int, device: str, threads: int | None, extra: tuple = ()):
    """`infinigen-rt serve BUNDLE --port 0` (and `extra` options); returns (process, base url) once /health
    answers."""
    log = Path(tempfile.mkstemp(prefix="serve_load_", suffix=".log")[1])
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = [
        sys.executable,
        "-m",
        "infinigen_rt.cli",
        "serve",
        bundle,
        "--port",
        "0",
        "--device",
        device,
        "--policy",
        policy,
        "--max-batch",
        str(max_batch),
        "--max-queue",
        "1024",
        *extra,
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()}")
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not come up in 300 s:\n{log.read_text()}")


def server_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r"^(infinigen_\w+) (\S+)$", text, re.M)}


def batch_counts(before: dict, after: dict) -> tuple[float, float]:
    """Steps (or batches) the server ran and their rows: mean batch size = rows / steps. The continuous-batching
    server counts decode steps; the closed-batch one before it counted batches."""
    kind = "decode_steps" if "infinigen_decode_steps_total" in after else "batches"
    rows = "decode_rows" if kind == "decode_steps" else "batch_rows"
    return tuple(after.get(f"infinigen_{k}_total", 0) - before.get(f"infinigen_{k}_total", 0) for k in (kind, rows))


def run_load(url: str, model: str, clients: int, requests: int, max_tokens: int, api_key: str | None) -> dict:
    """`requests` completions from `clients` closed-loop threads; returns the throughput figures."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo, lock = list(range(requests)), threading.Lock()
    done: list[tuple[float, int]] = []  # (latency s, completion tokens)
    errors: list[str] = []

    def client(c: httpx.Client):
        start.wait()
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            body = {
                "model": model,
                "prompt": f"A short history of {TOPICS[i % len(TOPICS)]}:",
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            done.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]))

    # clients are made first and start together: making one (its TLS context) takes longer than the server's
    # batching window, and that would measure the clients
    conns = [httpx.Client(headers=headers, timeout=600) for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    threads = [threading.Thread(target=client, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    before = server_counts(url)
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    after = server_counts(url)
    batches, rows = batch_counts(before, after)
    latencies, tokens = [d[0] for d in done], sum(d[1] for d in done)
    return {
        "clients": clients,
        "requests": requests,
        "ok": len(done),
        "errors": len(errors),
        "max_tokens": max_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(done) / wall, 3),
        "generated_tokens": tokens,
        "generated_tokens_per_s": round(tokens / wall, 2),
        "latency_mean_s": round(statistics.mean(latencies), 3) if latencies else None,
        "latency_max_s": round(max(latencies), 3) if latencies else None,
        "mean_batch_size": round(rows / batches, 2) if batches else None,
        "first_error": errors[0] if errors else None,
    }


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None without data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def span(text: str) -> tuple[int, int]:
    """'16:256' -> (16, 256); '64' -> (64, 64)."""
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or LO:HI with 1 <= LO <= HI")
    return lo, hi


def make_prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens: topics from TOPICS as notes, then a request for the history of one of them."""
    topic, notes = rng.choice(TOPICS), []
    room = CHARS_PER_TOKEN * tokens - len(f"Notes: \nA short history of {topic}:")
    while sum(len(n) + 2 for n in notes) < room:
        notes.append(rng.choice(TOPICS))
    return f"Notes: {', '.join(notes)}\nA short history of {topic}:"


def open_loop_plan(
    rate: float, requests: int | None, duration: float | None, prompt_tokens, max_tokens, seed: int
) -> list[tuple[float, str, int]]:
    """(send time s from the start, prompt, max_tokens) per request: Poisson arrivals at `rate` for `requests`
    requests or `duration` s. One seed gives the same requests and the same arrival pattern, scaled, at every rate."""
    specs, gaps = random.Random(seed), random.Random(seed + 1)
    plan, t = [], gaps.expovariate(1.0) / rate
    while (len(plan) < requests) if duration is None else (t < duration):
        plan.append((t, make_prompt(specs, specs.randint(*prompt_tokens)), specs.randint(*max_tokens)))
        t += gaps.expovariate(1.0) / rate
    return plan


def stream_one(c: httpx.Client, url: str, body: dict) -> dict:
    """One streamed completion: its times from the send (first text, each later text chunk, the end) and usage."""
    t0, times, use = time.perf_counter(), [], None
    with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {r.read().decode(errors='replace')[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"error": f"stream: {obj['error'].get('message', obj)}"[:200]}
            if obj.get("usage"):
                use = obj["usage"]
            if any(ch.get("text") for ch in obj.get("choices", ())):
                times.append(time.perf_counter() - t0)
        end = time.perf_counter() - t0
    if use is None:
        return {"error": "the stream ended without its usage chunk"}
    return {"times": times, "e2e": end, **use}


def run_open_loop(
    url: str,
    model: str,
    rate: float,
    requests: int | None,
    prompt_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int,
    api_key: str | None,
    duration: float | None = None,
) -> dict:
    """Poisson arrivals at `rate` requests/s, each streamed from its own thread at its time; returns the figures."""
    plan = open_loop_plan(rate, requests, duration, prompt_tokens, max_tokens, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # no connection limit: a request must not wait for an earlier one's connection (that would close the loop)
    c = httpx.Client(headers=headers, timeout=600, limits=httpx.Limits(max_connections=None))
    results: list[dict] = [{} for _ in plan]
    lags: list[float] = []
    polls: list[tuple[int, int]] = []  # (queue depth, batch size) from /health
    stop_polling = threading.Event()

    def send(i: int, prompt: str, limit: int):
        body = {"model": model, "prompt": prompt, "max_tokens": limit, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            results[i] = stream_one(c, url, body)
        except (httpx.HTTPError, ValueError) as e:
            results[i] = {"error": f"{type(e).__name__}: {e}"[:200]}

    def poll():
        with httpx.Client(timeout=10) as p:
            while not stop_polling.wait(POLL_S):
                try:
                    h = p.get(url + "/health").json()
                    polls.append((h["queue_depth"], h["batch_size"]))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass

    before = server_counts(url)
    poller = threading.Thread(target=poll)
    poller.start()
    threads, t0 = [], time.perf_counter()
    for i, (at, prompt, limit) in enumerate(plan):
        if (wait := t0 + at - time.perf_counter()) > 0:
            time.sleep(wait)
        lags.append(time.perf_counter() - t0 - at)
        threads.append(threading.Thread(target=send, args=(i, prompt, limit)))
        threads[-1].start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop_polling.set()
    poller.join()
    c.close()
    after = server_counts(url)

    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["times"][0] if r["times"] else r["e2e"] for r in ok]  # no text at all: the first arrived at the end
    itl = [b - a for r in ok for a, b in pairwise(r["times"])]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["completion_tokens"] for r in ok)

    def grew(name: str) -> float | None:
        return after[name] - before[name] if name in after and name in before else None

    def mean(name: str) -> float | None:
        n, total = grew(f"infinigen_{name}_count"), grew(f"infinigen_{name}_sum")
        return round(total / n, 4) if n else None

    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    batches, rows = batch_counts(before, after)
    return {
        "rate": rate,
        "requests": len(plan),
        "ok": len(ok),
        "errors": len(errors),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "generated_tokens": tokens,
        "generated_tokens_per_s": round(tokens / wall, 2),
        "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in ok), 1) if ok else None,
        "ttft_p50_s": r4(percentile(ttft, 50)),
        "ttft_p99_s": r4(percentile(ttft, 99)),
        "itl_p50_s": r4(percentile(itl, 50)),
        "itl_p99_s": r4(percentile(itl, 99)),
        "e2e_p50_s": r4(percentile(e2e, 50)),
        "e2e_p99_s": r4(percentile(e2e, 99)),
        "send_lag_max_s": r4(max(lags, default=None)),  # how late the client sent: large means it fell behind
        "queue_depth_max": max((q for q, _ in polls), default=None),
        "queue_depth_mean": round(statistics.mean(q for q, _ in polls), 2) if polls else None,
        "batch_size_mean": round(statistics.mean(b for _, b in polls), 2) if polls else None,
        "mean_batch_size": round(rows / batches, 2) if batches else None,
        "server_ttft_mean_s": mean("time_to_first_token_seconds"),
        "server_itl_mean_s": mean("inter_token_latency_seconds"),
        "first_error": errors[0] if errors else None,
    }


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).parent, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", help="start a server on this bundle")
    where.add_argument("--url", help="use a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", default="1,8", help="closed loop: comma-separated client counts, one run each")
    ap.add_argument("--arrival-rates", default=None, help="open loop: comma-separated requests/s, one run each")
    ap.add_argument("--requests", type=int, default=None, help="per run (default 16)")
    ap.add_argument("--duration", type=float, default=None, help="open loop: seconds of arrivals per rate")
    ap.add_argument("--max-tokens", type=span, default=None, help="N, or LO:HI drawn in open loop (64; 16:128)")
    ap.add_argument("--prompt-tokens", type=span, default=(16, 256), help="open loop: LO:HI, approximate")
    ap.add_argument("--seed", type=int, default=0, help="open loop: arrivals, prompts and lengths")
    ap.add_argument("--policy", default="full", help="with --bundle")
    ap.add_argument("--max-batch", type=int, default=8, help="with --bundle")
    ap.add_argument("--device", default="cpu", help="with --bundle")
    ap.add_argument("--threads", type=int, default=None, help="with --bundle: OMP_NUM_THREADS of the server")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default="serve_load.json")
    a = ap.parse_args()
    rates = [float(r) for r in a.arrival_rates.split(",")] if a.arrival_rates else None
    if a.duration is not None and (rates is None or a.requests is not None):
        ap.error("--duration is for the open loop (--arrival-rates), instead of --requests")
    if rates is None and a.max_tokens is not None and a.max_tokens[0] != a.max_tokens[1]:
        ap.error("the closed loop takes one --max-tokens, not a range")
    if rates is not None and min(rates) <= 0:
        ap.error("--arrival-rates must be positive")
    requests = a.requests or (None if a.duration else 16)
    load_at_start = os.getloadavg()

    proc, url = start_server(a.bundle, a.policy, a.max_batch, a.device, a.threads) if a.bundle else (None, a.url)
    try:
        model = httpx.get(
            url + "/v1/models", headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}, timeout=10
        ).json()["data"][0]["id"]
        run_load(url, model, 1, 1, 8, a.api_key)  # warm-up: first-call allocations are not load
        results = []
        for n in rates or [int(c) for c in a.clients.split(",")]:
            if rates is None:
                figures = run_load(url, model, n, requests, (a.max_tokens or (64,))[0], a.api_key)
            else:
                limits = a.max_tokens or (16, 128)
                figures = run_open_loop(
                    url, model, n, requests, a.prompt_tokens, limits, a.seed, a.api_key, duration=a.duration
                )
            row = {"policy": a.policy if a.bundle else None, **figures}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    meta = {
        "mode": "closed" if rates is None else "open",
        "url": None if a.bundle else url,
        "bundle": a.bundle,
        "max_batch": a.max_batch if a.bundle else None,
        "threads": a.threads,
        "commit": git_commit(),
        "load_avg_at_start": load_at_start,
        "load_avg_at_end": os.getloadavg(),
        "args": {k: v for k, v in vars(a).items() if k != "api_key"},
    }
    Path(a.out).write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

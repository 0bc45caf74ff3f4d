"""Load an `infinigen-rt serve` server with N concurrent clients: requests/s and generated tokens/s.

python benchmarks/serve_load.py --bundle artifacts/bundles/smollm2-135m --clients 1,8 --requests 16 --max-tokens 64
python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 8 --out load.json   # a running server

Each client is a thread that sends its next request as soon as the last one is answered (closed loop), until
--requests are done; prompts differ per request; greedy. With --bundle the script starts the server itself
(--port 0, the policy and batch size given) and stops it at the end. Prints one JSON line per client count and
writes them all to --out. Needs httpx (the `test` extra)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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


def start_server(bundle: str, policy: str, max_batch: int, device: str, threads: int | None):
    """`infinigen-rt serve BUNDLE --port 0`; returns (process, base url) once /health answers."""
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
    batches = after["infinigen_batches_total"] - before["infinigen_batches_total"]
    rows = after["infinigen_batch_rows_total"] - before["infinigen_batch_rows_total"]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", help="start a server on this bundle")
    where.add_argument("--url", help="use a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts, one run each")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policy", default="full", help="with --bundle")
    ap.add_argument("--max-batch", type=int, default=8, help="with --bundle")
    ap.add_argument("--device", default="cpu", help="with --bundle")
    ap.add_argument("--threads", type=int, default=None, help="with --bundle: OMP_NUM_THREADS of the server")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default="serve_load.json")
    a = ap.parse_args()

    proc, url = start_server(a.bundle, a.policy, a.max_batch, a.device, a.threads) if a.bundle else (None, a.url)
    try:
        model = httpx.get(
            url + "/v1/models", headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}, timeout=10
        ).json()["data"][0]["id"]
        run_load(url, model, 1, 1, 8, a.api_key)  # warm-up: first-call allocations are not load
        results = []
        for n in (int(c) for c in a.clients.split(",")):
            row = {
                "policy": a.policy if a.bundle else None,
                **run_load(url, model, n, a.requests, a.max_tokens, a.api_key),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    meta = {
        "url": None if a.bundle else url,
        "bundle": a.bundle,
        "max_batch": a.max_batch if a.bundle else None,
        "threads": a.threads,
        "load_avg_at_end": os.getloadavg(),
    }
    Path(a.out).write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

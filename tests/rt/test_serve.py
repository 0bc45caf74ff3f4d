"""`infinigen-rt serve`: real server processes on loopback, the official openai client and raw HTTP.

Two servers per module: a tiny random llama (most tests; its tokens are arbitrary, but equal requests must
give equal text) with an API key and batches of 8, and SmolLM2 under the infinigen policy with one request
at a time and a queue of one (equality with `generate --json` on a real model, and the 429)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from infinigen_rt.kv.cache import KVReport
from infinigen_rt.policies import KVOptions, Policy
from infinigen_rt.policies.full import Full
from infinigen_rt.runner import Generation, Output, RunStats
from infinigen_rt.sampling import SamplingParams
from infinigen_rt.serve.metrics import Metrics
from infinigen_rt.serve.scheduler import Done, Failed, Job, Piece, QueueFull, Scheduler, ShuttingDown, TextStream
from tests.conftest import ROOT, TOKENIZER_TEXT, ServerProcess, run_cli
from tests.test_cli import one_line_error

pytestmark = pytest.mark.slow
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

KEY = "sk-test-0123"
# one torch thread per process: other tests share this machine's two cores, and oversubscribed OpenMP
# threads made small models 30-300x slower here; the reference CLI runs use the same setting
ENV = {"OMP_NUM_THREADS": "1"}
WORDS = " ".join(TOKENIZER_TEXT[:5]).split()
PROMPTS = [" ".join(WORDS[3 * i : 3 * i + 2 + i % 5]) for i in range(16)]  # different texts and lengths


class Server(ServerProcess):
    """`serve BUNDLE --device cpu ARGS` (one torch thread)."""

    def __init__(self, bundle: Path, log: Path, *args: str):
        super().__init__(["serve", str(bundle), "--device", "cpu", *args], log, env=ENV)

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def post(self, path: str, body, key: str | None = KEY, timeout: float = 60) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (bytes, str)):
            return httpx.post(
                self.url + path, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=timeout
            )
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {k: float(v) for k, v in re.findall(r"^(infinigen_\S+) (\S+)$", text, re.M)}

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


@pytest.fixture(scope="module")
def tiny(bundles, tmp_path_factory):
    s = Server(
        bundles["llama31_gqa"],
        tmp_path_factory.mktemp("serve") / "tiny.log",
        "--api-key",
        KEY,
        "--max-batch",
        "8",
        "--model-name",
        "tiny",
        "--body-timeout",
        "3",
    )
    s.model = "tiny"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def smol(smollm2_bundle, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "smol.log"
    s = Server(smollm2_bundle, log, "--policy", "infinigen", "--max-batch", "1", "--max-queue", "1")
    s.model, s.bundle = smollm2_bundle.name, smollm2_bundle
    yield s
    s.stop()


def complete(server, prompt: str, max_tokens: int, **kw) -> SimpleNamespace:
    """A greedy completion through the openai client (streamed when stream=True): text and finish reason."""
    c = server.client()
    if not kw.pop("stream", False):
        r = c.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
        return SimpleNamespace(text=r.choices[0].text, finish_reason=r.choices[0].finish_reason, usage=r.usage)
    text, finish = "", None
    for chunk in c.completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, **kw
    ):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return SimpleNamespace(text=text, finish_reason=finish)


def cli_generate(bundle, prompt: str, n: int, *args: str) -> dict:
    r = run_cli("rt", "generate", bundle, prompt, "-n", n, "--json", "--device", "cpu", *args, env=ENV)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- the openai client; equality with `generate --json` ----


def test_completions_equal_generate_json(tiny, bundles):
    ref = cli_generate(bundles["llama31_gqa"], PROMPTS[0], 20)
    plain = complete(tiny, PROMPTS[0], 20)
    streamed = complete(tiny, PROMPTS[0], 20, stream=True)
    assert plain.text == streamed.text == ref["text"]
    assert plain.finish_reason == streamed.finish_reason == ref["finish_reason"]
    assert plain.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert plain.usage.completion_tokens == len(ref["token_ids"])
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens


def test_chat_streaming_and_not(tiny):
    c, msgs = tiny.client(), [{"role": "user", "content": "The king said"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_smollm2_completion_and_chat_equal_generate_json(smol):
    prompt = "The history of the printing press"
    ref = cli_generate(smol.bundle, prompt, 24, "--policy", "infinigen")
    got = complete(smol, prompt, 24)
    assert got.text == ref["text"] and got.finish_reason == ref["finish_reason"]
    assert len(got.text) > 20  # a real model writes real text

    question = "Write a haiku about tea."
    ref = cli_generate(smol.bundle, question, 24, "--policy", "infinigen", "--chat")
    stream = smol.client().chat.completions.create(
        model=smol.model,
        messages=[{"role": "user", "content": question}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    assert chunks[-1].usage.prompt_tokens == len(ref["prompt_token_ids"])


def test_smollm2_kv_override_and_metrics(smol):
    r = smol.post(
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "infinigen": {"budget": 0.5, "alpha": 3.0}},
        key=None,
    )
    assert r.status_code == 200, r.text
    m = smol.metrics()
    assert 0 < m["infinigen_kv_fetched_share"] <= 1  # the infinigen policy reports what it fetched
    assert m["infinigen_bytes_h2d_total"] > 0
    bad = smol.post("/v1/completions", {"prompt": "x", "infinigen": {"budget": 2}}, key=None)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "infinigen"


def test_smollm2_request_speculation_keys_and_correction_equal_generate(smol):
    """A request's own speculation keys and correction: the tokens `generate` gives with the same flags."""
    prompt = ("The printing press spread across Europe within fifty years of its invention. Printers set up shop in "
              "trading towns, where paper was cheap and buyers were many, and they printed bibles, grammars, "
              "calendars and pamphlets. The history of the printing press")  # fmt: skip
    flags = {"budget": 0.1, "spec_keys": "int4", "correct": 0.25}
    ref = cli_generate(smol.bundle, prompt, 16, "--policy", "infinigen", "--budget", "0.1", "--spec-keys", "int4",
                       "--correct", "0.25")  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "infinigen": flags}
    r = smol.post("/v1/completions", body, key=None)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["text"]


# ---- concurrency ----


def test_concurrent_streams_match_single_requests_and_a_killed_client_does_not_stall(tiny):
    limits = [12 + i for i in range(16)]
    alone = [complete(tiny, p, n).text for p, n in zip(PROMPTS, limits, strict=True)]  # one at a time: batches of one
    before = tiny.metrics()
    start = threading.Barrier(17)

    def client(i):
        start.wait()
        return complete(tiny, PROMPTS[i], limits[i], stream=True).text

    def killed():  # reads two chunks of a long stream, then closes the connection
        body = {"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        start.wait()
        with httpx.stream("POST", tiny.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(4)]  # two events, two blank lines

    with ThreadPoolExecutor(17) as pool:
        gone = pool.submit(killed)
        t0 = time.monotonic()
        got = list(pool.map(client, range(16)))
        gone.result()
    assert got == alone  # rows do not leak into each other
    assert time.monotonic() - t0 < 60
    m = tiny.metrics()
    rows = m["infinigen_decode_rows_total"] - before.get("infinigen_decode_rows_total", 0)
    assert rows / (m["infinigen_decode_steps_total"] - before.get("infinigen_decode_steps_total", 0)) > 1  # shared
    deadline = time.monotonic() + 10
    while m["infinigen_requests_cancelled_total"] == before["infinigen_requests_cancelled_total"]:
        assert time.monotonic() < deadline, "the closed stream was not cancelled"
        time.sleep(0.1)
        m = tiny.metrics()
    assert complete(tiny, PROMPTS[1], limits[1]).text == alone[1]  # and the server still serves


def test_full_queue_answers_429(smol):
    long = {
        "prompt": "Count from one to one hundred: one, two, three,",
        "max_tokens": 128,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", smol.url + "/v1/completions", json=long, timeout=60) as running:
        # keep the iterator: a dropped one, once garbage collected, closes the connection (and so the request)
        lines = running.iter_lines()
        first = next(lines)  # the first token is out: this request holds the engine (batches of one)
        assert running.status_code == 200 and first.startswith("data: "), first
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(smol.post, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, None)
            deadline = time.monotonic() + 10
            while httpx.get(smol.url + "/health").json()["queue_depth"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            m = smol.metrics()
            assert m["infinigen_num_requests_running"] == 1 and m["infinigen_num_requests_waiting"] == 1
            r = smol.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, key=None)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "busy" in err["message"]
            running.close()  # the client leaves: its row stops, the waiting request runs
            assert waiting.result().status_code == 200
    assert smol.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, key=None).status_code == 200


def test_a_request_of_more_choices_than_the_queue_holds_runs_on_an_idle_server(smol):
    """--max-queue 1: each choice waits as a request of its own, and a request is taken whole whenever the queue is
    not full (it was a 429 forever: its second choice found the queue full of its first)."""
    for body in ({"prompt": "Hi", "n": 2}, {"prompt": ["Hi", "Ho", "Ha"]}):
        r = smol.post("/v1/completions", {**body, "max_tokens": 2, "temperature": 0}, key=None)
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == list(range(2 if "n" in body else 3))
    assert httpx.get(smol.url + "/health").json()["queue_depth"] == 0


# ---- bad input, auth, a flood ----

BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "n": 0}, 400, "n: input should be greater than or equal to 1"),
    ({"prompt": "x", "n": 17}, 400, "n: input should be less than or equal to 16"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs: input should be less than or equal to 20"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, 400, "set echo"),
    ({"prompt": [1, 2, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ({"prompt": [[1, 2], [-1]]}, 400, "prompt[1]: token id -1"),
    ({"prompt": []}, 400, "empty list"),
    ({"prompt": [[]]}, 400, "encodes to no tokens"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": ["x"] * 65}, 400, "at most 64"),
    ({"prompt": ["x"] * 10, "n": 7}, 400, "more than 64 choices"),
    ({"prompt": "x", "echo": 1}, 400, "echo"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "infinigen": {"score": "dense"}}, 400, "infinigen.score"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "king " * 300}, 400, "context"),
    ({"prompt": "x", "max_tokens": 1000}, 400, "context"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    # searched for in every step's text: one request's 900,000-character stop stalled every client for 38 s
    ({"prompt": "x", "stop": ["q" * 900_000], "stream": True}, 400, "at most 4,096"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "at most 16"),
    ({"prompt": "x", "infinigen": {"alpha": 1}}, 400, "infinigen policy"),
    ({"prompt": "x", "infinigen": {"budgett": 1}}, 400, "budgett"),
    ({"prompt": "x", "infinigen": {"spec_keys": "int4"}}, 400, "infinigen policy"),
    ({"prompt": "x", "infinigen": {"correct": 1.0}}, 400, "correct"),
    # valid JSON, not Unicode text: the tokenizer cannot take it (this was a 500 with a traceback)
    (b'{"prompt": "hi \\ud800"}', 400, "lone surrogate \\ud800"),
    (b'{"prompt": ["\\udfff"]}', 400, "lone surrogate"),
    (b'{"prompt": "x", "stop": "\\ud83d"}', 400, "stop"),
    ({"prompt": "x", "temperature": 5e-324, "top_p": 5e-324, "max_tokens": 2}, 200, ""),  # was a NaN and a 500
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(tiny, body, status, words):
    r = tiny.post("/v1/completions", body)
    assert r.status_code == status, r.text
    if status == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert words.lower() in err["message"].lower(), err["message"]
    assert tiny.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("prompt", [[5], "x"])
@pytest.mark.parametrize("extra", [{}, {"infinigen": {"score": "prefill"}}, {"stream": True}])
def test_a_one_token_prompt_echoed_with_logprobs_has_one_null_entry(tiny, prompt, extra):
    """Its only token has nothing before it to be scored by (this was a 500: max() of an empty sequence)."""
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3, **extra}
    r = tiny.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    if extra.get("stream"):
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        lp = chunks[0]["choices"][0]["logprobs"]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    else:
        choice = r.json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
        assert choice["finish_reason"] == "length" and len(lp["tokens"]) == 1 and "".join(lp["tokens"]) == text
    assert lp["token_logprobs"] == [None] and lp["top_logprobs"] == [None] and lp["text_offset"] == [0]


def lp_of(choice) -> SimpleNamespace:
    return choice.logprobs


def test_logprobs_echo_token_prompts_and_choices_parse_in_the_openai_client(tiny, bundles):
    """lm-evaluation-harness's requests: token-id prompts, several in one request, echo with logprobs and max_tokens
    0 or 1; the legacy logprobs object (tokens, token_logprobs with null first, top_logprobs with the chosen token,
    text_offset into the returned text) as the openai client parses it; n choices; a text prompt and its ids score
    the same."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.tokenizer import Tokenizer

    tok = Tokenizer(read_bundle(bundles["llama31_gqa"]))
    c = tiny.client()
    texts = PROMPTS[:3]
    ids = [tok.encode(t) for t in texts]
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    by_text = c.completions.create(model="tiny", prompt=texts, max_tokens=3, temperature=0, logprobs=2, echo=True)
    assert [ch.index for ch in by_ids.choices] == [0, 1, 2]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    for a, b, t, i in zip(by_ids.choices, by_text.choices, texts, ids, strict=True):
        assert a.text.startswith(tok.decode(i, skip_special_tokens=False)) and b.text.startswith(t)
        assert a.text[len(tok.decode(i, skip_special_tokens=False)):] == b.text[len(t):]
        la, lb = lp_of(a), lp_of(b)
        n = len(i) + (3 if a.finish_reason == "length" else len(la.tokens) - len(i))
        assert len(la.tokens) == len(la.token_logprobs) == len(la.top_logprobs) == len(la.text_offset) == n
        assert la.token_logprobs[0] is None and la.top_logprobs[0] is None
        assert all(abs(x - y) < 1e-5 for x, y in zip(la.token_logprobs[1:], lb.token_logprobs[1:], strict=True))
        assert la.text_offset == [sum(map(len, la.tokens[:k])) for k in range(n)]
        for k in range(1, n):
            top = la.top_logprobs[k]
            # 2 alternatives and the chosen token (keys may merge: pieces of a character all read "\ufffd")
            assert la.tokens[k] in top and 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        for k in range(len(i), n):  # greedy: each new token is its position's best
            assert la.token_logprobs[k] == max(la.top_logprobs[k].values())
    # max_tokens 0 with echo scores the prompt only: the same scores
    zero = c.completions.create(model="tiny", prompt=texts[0], max_tokens=0, echo=True, logprobs=0)
    ch = zero.choices[0]
    assert ch.text == texts[0] and ch.finish_reason == "length" and zero.usage.completion_tokens == 0
    assert len(lp_of(ch).tokens) == len(ids[0]) and all(len(t) == 1 for t in lp_of(ch).top_logprobs[1:])
    assert all(abs(x - y) < 1e-5 for x, y in zip(lp_of(ch).token_logprobs[1:], lp_of(by_text.choices[0])
                                                   .token_logprobs[1 : len(ids[0])], strict=True))  # fmt: skip
    # logprobs without echo: the new tokens only, offsets into the new text
    plain = c.completions.create(model="tiny", prompt=texts[1], max_tokens=3, temperature=0, logprobs=1)
    assert plain.choices[0].text == by_text.choices[1].text[len(texts[1]) :]
    # the same numbers, computed two ways: plain's first new token by the whole prompt's prefill, the echoed one's
    # by teacher-forced decode steps over the prompt's tail (--score decode), batched with the other prompts
    alone, echoed = lp_of(plain.choices[0]).token_logprobs, lp_of(by_text.choices[1]).token_logprobs[len(ids[1]) :]
    assert all(abs(x - y) < 1e-5 for x, y in zip(alone, echoed, strict=True))
    # n choices per prompt, seeded: each its own sample, the same again with the same seed
    kw = dict(model="tiny", prompt=texts[:2], max_tokens=8, temperature=1.0, seed=7, n=2)
    first, again = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in first.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in first.choices] == [ch.text for ch in again.choices]
    assert first.choices[0].text != first.choices[1].text
    # streamed: the same choices, each by its index, with logprobs for every new token
    texts_by, lps_by = {}, {}
    for chunk in c.completions.create(**kw, stream=True, logprobs=1):
        for ch in chunk.choices:
            texts_by[ch.index] = texts_by.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                lps_by.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    assert [texts_by[k] for k in range(4)] == [ch.text for ch in first.choices]
    assert all(len(lps_by[k]) >= 1 for k in range(4))
    # streamed with echo and logprobs: the prompt and its scores first
    chunks = list(c.completions.create(model="tiny", prompt=texts[0], max_tokens=2, temperature=0, echo=True,
                                       logprobs=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == texts[0]
    assert chunks[0].choices[0].logprobs.token_logprobs == lp_of(zero.choices[0]).token_logprobs


def test_chat_logprobs_and_the_tokenizer_routes(tiny, bundles):
    """Chat logprobs (content: token, logprob, bytes, top_logprobs) through the openai client; /tokenize,
    /detokenize and /tokenizer_info as vLLM answers them, which lm-evaluation-harness's remote tokenizer probes and
    uses; a refused request's reason in the server's log."""
    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.tokenizer import Tokenizer

    tok = Tokenizer(read_bundle(bundles["llama31_gqa"]))
    r = tiny.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:  # a token of part of a character: its text is U+FFFD, its bytes its own
        assert (e.bytes == list(e.token.encode()) or e.token == "\ufffd") and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    streamed = tiny.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True,
    )  # fmt: skip
    parts = [e for chunk in streamed for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in parts] == [(e.token, e.logprob) for e in content]
    text = PROMPTS[5]
    got = httpx.post(tiny.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=False) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 256 and got["token_strs"] is None
    back = httpx.post(tiny.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(tiny.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    info = httpx.get(tiny.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    bad = httpx.post(tiny.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    lm_utils = pytest.importorskip("lm_eval.utils")
    assert lm_utils.check_remote_tokenizer_support(tiny.url + "/v1/completions")
    remote = lm_utils.RemoteTokenizer(tiny.url + "/v1/completions")
    assert remote.eos_token_id in tok.eos_ids and remote.decode(remote.encode(text)) == text
    r = tiny.post("/v1/completions", {"prompt": "x", "n": 0})
    assert r.status_code == 400
    line = "POST /v1/completions -> 400: n: Input should be greater than or equal to 1"
    wait_for(lambda: line in tiny.log.read_text(), "the refusal's reason in the log")


def test_bad_chat_input(tiny):
    for body, words in [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "'user' or 'assistant'"),

        (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content holds a lone surrogate"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "lone surrogate"),
    ]:
        r = tiny.post("/v1/chat/completions", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages"
    for body, words, param in [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs", "top_logprobs"),
        ({"echo": True}, "echo=True is not supported", "echo"),
        ({"logprobs": 1}, "logprobs: Input should be a valid boolean", "logprobs"),
    ]:
        r = tiny.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"] and r.json()["error"]["param"] == param
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    assert tiny.post("/v1/chat/completions", {**body, "max_tokens": 2}).status_code == 200


def test_large_bodies_are_refused_before_parsing(tiny):
    """The limit for the tiny model (256 positions) is the 1 MiB floor; a 5 MB prompt is a 413 at once, whether it
    declares its length or comes in chunks, counted in /metrics, and the server keeps serving."""
    limit = 1 << 20
    before = tiny.metrics().get('infinigen_requests_total{endpoint="/v1/completions",status="413"}', 0)
    t0 = time.monotonic()
    r = tiny.post("/v1/completions", {"prompt": "king " * 1_000_000})
    assert r.status_code == 413 and f"{limit:,} bytes" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(500):
            yield b"a" * 10_000
        yield b'"}'

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(tiny.url + "/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert time.monotonic() - t0 < 10  # nothing was tokenized
    just_under = {"prompt": "x", "max_tokens": 1, "user": "a" * (limit - 200)}  # unknown fields are ignored
    assert tiny.post("/v1/completions", just_under).status_code == 200
    after = tiny.metrics()['infinigen_requests_total{endpoint="/v1/completions",status="413"}']
    assert after - before == 2


def test_fuzz_against_the_servers_own_openapi_schema(tiny):
    """schemathesis draws valid and invalid requests for every operation the server's OpenAPI schema lists: no
    5xx, and every 4xx an OpenAI error object. Seeded (derandomized) and bounded to 300 requests."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(tiny.url + "/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()]
    assert {op.label for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                        "POST /tokenize", "POST /detokenize", "GET /tokenizer_info"}  # fmt: skip
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    statuses, t0 = Counter(), time.monotonic()

    def fitting(case):
        """A drawn completion given a prompt and length that fit the tiny model, its other fields as drawn: the
        success path fuzzed too (drawn prompts and lengths rarely fit 256 positions and 512 tokens: 0-2 in 60)."""
        if isinstance(case.body, dict):
            case.body = {**case.body, "model": "tiny", "prompt": "The king said", "max_tokens": 2}
        return case

    completions = next(op for op in ops if op.label == "POST /v1/completions")
    drawn = [op.as_strategy(mode) for op in ops for mode in modes]
    fit = completions.as_strategy(schemathesis.GenerationMode.POSITIVE).map(fitting)

    @settings(max_examples=300, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=st.one_of(*drawn, fit))
    def check(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
        r = case.call(base_url=tiny.url, timeout=60)
        statuses[case.operation.label, r.status_code] += 1
        assert r.status_code < 500, f"{r.status_code} for {case.as_curl_command()}: {r.text[:300]}"
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text

    check()
    assert time.monotonic() - t0 < 60
    # refusals on both generation endpoints, and real generations among the drawn completions (drawn chat
    # requests rarely fit the tiny model's 256 positions; the tests above cover chat's 200s)
    assert statuses["POST /v1/completions", 200] > 0 and statuses["POST /v1/completions", 400] > 0, statuses
    assert statuses["POST /v1/chat/completions", 400] > 0, statuses


def test_a_body_trickled_slower_than_the_timeout_gets_a_408_and_the_connection_closes(tiny):
    """--body-timeout 3: 70 clients holding a partial body were never timed out. Twelve such clients are answered
    408 at the deadline and dropped, while a request beside them is served at once."""
    import socket

    host, port = tiny.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"prompt\": ")  # fmt: skip
    slow = []
    for _ in range(12):
        s = socket.create_connection((host, int(port)), timeout=20)
        s.sendall(head.encode())
        slow.append(s)
    start = time.monotonic()
    assert tiny.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    assert time.monotonic() - start < 2.5  # before any slow client's deadline
    for s in slow:
        reply = b""
        while chunk := s.recv(65536):  # read until the server closes the connection
            reply += chunk
        s.close()
        status, _, rest = reply.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"did not arrive within 3 s" in rest and b"request_timeout" in rest
    assert 2.5 < time.monotonic() - start < 15


def test_api_key(tiny):
    for key in (None, "wrong"):
        r = tiny.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tiny.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        tiny.client(key="wrong").models.list()
    assert [m.id for m in tiny.client().models.list()] == ["tiny"]
    assert httpx.get(tiny.url + "/health").status_code == 200  # probes need no key


def test_flood_is_served_within_bounds(tiny):
    n, rss0, t0 = 200, tiny.rss_bytes(), time.monotonic()

    def hammer(k):
        statuses = []
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            for i in range(k, n, 8):
                body = {"prompt": PROMPTS[i % 16], "max_tokens": 1 + i % 3, "temperature": 0.5, "seed": i}
                statuses.append(c.post(tiny.url + "/v1/completions", json=body).status_code)
        return statuses

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for part in pool.map(hammer, range(8)) for s in part]
    elapsed = time.monotonic() - t0
    assert len(statuses) == n and set(statuses) == {200}, statuses
    assert elapsed < 60
    # measured here: ~330 MB after start (torch, fastapi, the tiny model), +10 MB over the first 200 requests
    # (allocator and tokenizer caches warming), flat over the next 400. A leak of 400 KB a request (say, a kept
    # KV cache or event queue) would pass 64 MB in 200 requests
    grown = tiny.rss_bytes() - rss0
    assert grown < 64 * 2**20 and tiny.rss_bytes() < 2**30, f"RSS grew {grown / 2**20:.0f} MB over {n} requests"
    m = tiny.metrics()
    assert m["infinigen_queue_depth"] == 0 and m["infinigen_batch_size"] == 0
    assert m['infinigen_requests_total{endpoint="/v1/completions",status="200"}'] >= n


def test_metrics_time_every_token_and_parse(tiny):
    """After requests streamed and not: one first-token time per request that produced a token, one inter-token
    time per later token, one end-to-end time per request; the exposition parses with prometheus_client."""
    before = tiny.metrics()
    tokens = [complete(tiny, PROMPTS[i], 4 + 3 * i).usage.completion_tokens for i in range(3)]
    for i in range(3, 5):
        stream = tiny.client().completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=4 + 3 * i, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        tokens.append(list(stream)[-1].usage.completion_tokens)
    assert sum(tokens) > 5  # the tiny model's tokens are arbitrary: most requests run to their limit
    r = httpx.get(tiny.url + "/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(r.text)}
    assert families["infinigen_time_to_first_token_seconds"].type == "histogram"
    assert families["infinigen_requests"].type == "counter" and families["infinigen_queue_depth"].type == "gauge"
    assert families["infinigen_kv_pool_blocks_used"].type == "gauge"
    after = tiny.metrics()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("infinigen_time_to_first_token_seconds_count") == sum(t > 0 for t in tokens)
    assert grew("infinigen_inter_token_latency_seconds_count") == sum(max(t - 1, 0) for t in tokens)
    assert grew("infinigen_e2e_request_latency_seconds_count") == 5
    assert grew("infinigen_e2e_request_latency_seconds_sum") >= grew("infinigen_time_to_first_token_seconds_sum") > 0
    buckets = [s.value for s in families["infinigen_inter_token_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after["infinigen_inter_token_latency_seconds_count"]
    assert after["infinigen_num_requests_running"] == after["infinigen_num_requests_waiting"] == 0
    assert after["infinigen_kv_pool_blocks_used"] == 0 and after["infinigen_kv_pool_blocks_free"] > 0  # all back


def test_serve_load_open_loop(tiny):
    """benchmarks/serve_load.py's open loop: a few requests at a high rate, each streamed; sane figures."""
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    plan = load.open_loop_plan(20, 6, None, (4, 24), (2, 8), seed=3)
    assert plan == load.open_loop_plan(20, 6, None, (4, 24), (2, 8), seed=3)  # seeded
    assert [t for t, _, _ in plan] == sorted(t for t, _, _ in plan) and len({p for _, p, _ in plan}) > 1
    # the same requests at another rate, arriving in the same pattern scaled
    slower = load.open_loop_plan(10, 6, None, (4, 24), (2, 8), seed=3)
    assert [(p, n) for _, p, n in slower] == [(p, n) for _, p, n in plan]
    assert [t for t, _, _ in slower] == pytest.approx([2 * t for t, _, _ in plan])
    before = tiny.metrics()
    r = load.run_open_loop(tiny.url, "tiny", 20, 6, (4, 24), (2, 8), 3, KEY)
    assert r["requests"] == r["ok"] == 6 and r["errors"] == 0 and r["first_error"] is None, r
    assert 0 < r["generated_tokens"] <= sum(n for _, _, n in plan)
    after = tiny.metrics()
    ended = "infinigen_e2e_request_latency_seconds_count"
    assert after[ended] - before[ended] == 6  # the server saw the same requests end
    assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_s"] <= r["itl_p99_s"] and r["e2e_p50_s"] <= r["e2e_p99_s"]
    assert 0 < r["ttft_p50_s"] <= r["e2e_p50_s"] and r["ttft_p99_s"] <= r["e2e_p99_s"] < 30
    assert r["requests_per_s"] > 0 and r["generated_tokens_per_s"] > 0 and r["server_ttft_mean_s"] > 0
    assert r["queue_depth_max"] is None or r["queue_depth_max"] <= 6


# ---- the scheduler and the text stream, without a server ----


class FakeRunner:
    """The runner's interface without a model: every running request gains token i at its step i; admits up to
    max_batch at each step; `hold` (an Event) keeps the first step waiting after admission; `fail_at`: that step
    raises, ending the requests running then."""

    def __init__(self, max_batch: int, hold: threading.Event | None = None, fail_at: int | None = None):
        self.max_batch, self.hold, self.fail_at, self.n = max_batch, hold, fail_at, 0
        self.waiting, self.running, self.added = deque(), [], []
        self.ids, self.stats = itertools.count(), RunStats()
        self.decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)

    @property
    def has_work(self):
        return bool(self.waiting or self.running)

    def block_usage(self):
        return len(self.running), 10 - len(self.running)

    def add(self, req):
        seq = SimpleNamespace(id=next(self.ids), req=req, out=[])
        self.waiting.append(seq)
        self.added.append(req)
        return seq.id

    def abort(self, rid):
        for q in (self.waiting, self.running):
            for seq in q:
                if seq.id == rid:
                    q.remove(seq)
                    return Generation(self.decode(seq.out), seq.out, seq.req.prompt_ids, "cancelled")
        return None

    def step(self):
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        if self.hold is not None:
            self.hold.wait(10)
            self.hold = None
        self.n += 1
        if self.n == self.fail_at:
            self.running.clear()
            raise RuntimeError("boom")
        outs = []
        for seq in list(self.running):
            seq.out.append(len(seq.out))
            out = Output(seq.id, [seq.out[-1]], seq.out)
            if len(seq.out) >= seq.req.max_new_tokens:
                self.running.remove(seq)
                out.generation = Generation(self.decode(seq.out), seq.out, seq.req.prompt_ids, "length")
                out.report = KVReport(bytes_h2d=7)
            outs.append(out)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(outs)
        return outs


class FakeEngine:
    def __init__(self, hold=None, fail_at=None):
        import torch

        from infinigen_rt.config import ModelConfig

        self.policy, self.hold, self.fail_at = Policy(Full, KVOptions()), hold, fail_at
        # a model's config, device and dtype: what the pool's size is checked against
        self.cfg = ModelConfig(arch="llama", vocab_size=100, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                               max_position_embeddings=64)  # fmt: skip
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def runner(self, engine, policy, max_batch, prefill_chunk, kv_tokens):
        self.made = FakeRunner(max_batch, self.hold, self.fail_at)
        self.tokenizer = SimpleNamespace(decode=self.made.decode)
        return self.made


def fake_scheduler(engine: FakeEngine, max_batch: int, max_queue: int) -> Scheduler:
    return Scheduler(engine, engine.policy, max_batch=max_batch, max_queue=max_queue, kv_tokens=640,
                     runner_class=engine.runner)  # fmt: skip


def wait_for(cond, what: str):
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_requests_with_their_own_kv_options_share_steps_and_each_ends_in_its_own_step():
    engine, events = FakeEngine(), []
    sched = fake_scheduler(engine, 2, 4)
    other = Policy(Full, KVOptions(budget=0.5))

    def job(policy, n=3, stream=False):
        return Job([1, 2], n, SamplingParams(), [], policy, emit=lambda ev: events.append((n, ev)), stream=stream)

    jobs = [job(engine.policy, 3, True), job(other, 5), job(engine.policy, 4), job(engine.policy, 6)]
    for j in jobs:
        sched.submit(j)
    with pytest.raises(QueueFull):
        sched.submit(job(engine.policy))
    sched.cancel(jobs[3])  # a waiting request whose client left never runs
    sched.start()
    wait_for(lambda: sum(isinstance(ev, Done) for _, ev in events) == 3, "three answers")
    sched.stop()
    assert [r.policy for r in engine.made.added] == [engine.policy, other, engine.policy]  # each request's own
    assert [ev for n, ev in events if n == 3] == [Piece("a"), Piece("b"), Piece("c"), Done("", "length", 3)]  # streamed
    dones = [n for n, ev in events if isinstance(ev, Done)]
    assert dones == [3, 5, 4]  # the 3-token one answered at step 3; the third request took its row at step 4
    assert (5, Done("abcde", "length", 5)) in events and (4, Done("abcd", "length", 4)) in events
    m = scrape(sched.metrics)
    assert m["infinigen_decode_steps_total"] == 7 and m["infinigen_decode_rows_total"] == 12
    assert m["infinigen_requests_cancelled_total"] == 1 and m["infinigen_bytes_h2d_total"] == 21


def scrape(metrics: Metrics) -> dict[str, float]:
    """The exposition parsed by prometheus_client: 'name' or 'name{labels}' -> value."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_scheduler_gauges_while_requests_wait_and_token_timings():
    release, ended = threading.Event(), []
    engine = FakeEngine(hold=release)  # the first step waits for `release`: one request runs, the others wait
    sched = fake_scheduler(engine, 1, 4)
    limits = [3, 5, 1]
    for n in limits:
        sched.submit(Job([1, 2], n, SamplingParams(), [], engine.policy, emit=ended.append, stream=n == 3))
    sched.start()
    wait_for(lambda: sched.batch_size == 1, "a running request")
    m = scrape(sched.metrics)
    assert m["infinigen_num_requests_running"] == m["infinigen_batch_size"] == 1
    assert m["infinigen_num_requests_waiting"] == m["infinigen_queue_depth"] == 2
    assert m["infinigen_kv_pool_blocks_used"] == 1 and m["infinigen_kv_pool_blocks_free"] == 9
    assert m["infinigen_time_to_first_token_seconds_count"] == 0
    time.sleep(0.05)
    release.set()
    wait_for(lambda: sum(isinstance(e, Done) for e in ended) == 3, "three answers")
    sched.stop()
    m = scrape(sched.metrics)
    assert m["infinigen_num_requests_running"] == m["infinigen_num_requests_waiting"] == 0
    assert m["infinigen_time_to_first_token_seconds_count"] == 3
    assert m['infinigen_time_to_first_token_seconds_bucket{le="0.025"}'] == 0  # all three waited 50 ms at least
    assert m["infinigen_inter_token_latency_seconds_count"] == sum(n - 1 for n in limits)
    assert m["infinigen_e2e_request_latency_seconds_count"] == 3
    assert m["infinigen_e2e_request_latency_seconds_sum"] >= m["infinigen_time_to_first_token_seconds_sum"] >= 0.15
    assert m["infinigen_generated_tokens_total"] == sum(limits) and m["infinigen_decode_steps_total"] == sum(limits)


def test_stop_ends_every_stream_at_once_and_a_failed_step_fails_only_its_requests():
    release, ended = threading.Event(), []
    engine = FakeEngine(hold=release)
    sched = fake_scheduler(engine, 1, 4)
    for n in (3, 4):
        sched.submit(Job([1], n, SamplingParams(), [], engine.policy, emit=ended.append, stream=True))
    sched.start()
    wait_for(lambda: sched.batch_size == 1, "a running request")
    sched.stop(wait=False)
    release.set()
    sched.thread.join(5)
    assert not sched.thread.is_alive()
    assert [e.status for e in ended if isinstance(e, Failed)] == [503, 503]  # the running one and the waiting one
    with pytest.raises(ShuttingDown):
        sched.submit(Job([1], 2, SamplingParams(), [], engine.policy, emit=ended.append))

    engine, ended = FakeEngine(fail_at=2), []
    sched = fake_scheduler(engine, 1, 4)
    for n in (3, 2):
        sched.submit(Job([1], n, SamplingParams(), [], engine.policy, emit=ended.append))
    sched.start()
    wait_for(lambda: any(isinstance(e, Done) for e in ended), "the second request's answer")
    sched.stop()
    assert ended[0] == Failed(500, "internal error: RuntimeError: boom") and ended[1] == Done("ab", "length", 2)
    assert scrape(sched.metrics)["infinigen_generated_tokens_total"] == 3  # the failed one's first token counts


def test_kv_pool_gauges_read_the_callable_given():
    metrics = Metrics()
    assert not any(k.startswith("infinigen_kv_pool") for k in scrape(metrics))
    metrics.watch(waiting=lambda: 0, running=lambda: 0, kv_blocks=lambda: (3, 5))
    m = scrape(metrics)
    assert m["infinigen_kv_pool_blocks_used"] == 3 and m["infinigen_kv_pool_blocks_free"] == 5


def test_text_stream_holds_back_partial_characters_and_stops():
    ts = TextStream(["\n\n", "END"])
    steps = ["Hi", "Hi\n", "Hi\nX", "Hi\nXE", "Hi\nXEN\ufffd", "Hi\nXENd", "Hi\nXENd END more"]
    assert [ts.update(t) for t in steps] == ["Hi", "", "\nX", "", "", "ENd", " "]
    assert ts.done and ts.sent == "Hi\nXENd " and ts.finish("Hi\nXENd ") == ""
    ts = TextStream([])
    assert ts.update("caf\ufffd") == "caf" and ts.finish("café") == "é"


def test_text_stream_holds_back_what_the_quadratic_definition_does():
    """Against the definition (the longest ending that starts a stop string, every split tried) on random texts
    that grow, are re-decoded differently, and meet stop strings with many borders."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        ts, text = TextStream(stops), ""
        for _ in range(12):
            text = text[: rng.randint(len(text) - 2, len(text))] if rng.random() < 0.2 else text
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            if any(s in text for s in stops):
                break
            want = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert ts._partial_stop(text) == want, (stops, text)


def test_a_long_stop_string_costs_each_step_what_the_step_adds():
    """A 100,000-character stop string (more than the server takes) was about 5e9 characters of slicing a step."""
    ts = TextStream(["q" * 100_000 + "!"])
    text, start = "", time.perf_counter()
    for _ in range(200):
        text += "q" * 7
        assert ts.update(text) == ""  # all of it may still become the stop string
    assert time.perf_counter() - start < 2
    assert ts.update(text + "x") == text + "x"


# ---- the CLI ----


def test_serve_help_and_lazy_imports(tmp_path):
    r = run_cli("rt", "serve", "--help")
    assert r.returncode == 0 and "--max-queue" in r.stdout and "--api-key" in r.stdout, r.stdout + r.stderr
    code = (
        "import sys, infinigen_rt.cli, infinigen_rt.serve.scheduler;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'transformers')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # without the extra: one line naming the fix
    code = "import sys; sys.modules['uvicorn'] = None; from infinigen_rt.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "serve", str(tmp_path)], capture_output=True, text=True)
    one_line_error(r, "pip install 'infinigen[serve]'")
    r = run_cli("rt", "serve", str(tmp_path), "--kv-memory", "lots")
    one_line_error(r, "--kv-memory", "8GiB")
    r = run_cli("rt", "serve", str(tmp_path), "--kv-memory", "1GB", "--kv-tokens", "4096")
    one_line_error(r, "give one of them")


def test_a_request_is_counted_before_its_client_sees_its_end():
    """A scrape made as soon as a response ends includes that response's tokens."""
    engine, seen = FakeEngine(), []
    sched = fake_scheduler(engine, 2, 4)

    def emit(ev):
        if isinstance(ev, Done):
            m = scrape(sched.metrics)
            seen.append((m["infinigen_generated_tokens_total"], m["infinigen_prompt_tokens_total"]))

    for n in (2, 3):
        sched.submit(Job([1, 2], n, SamplingParams(), [], engine.policy, emit=emit))
    sched.start()
    wait_for(lambda: len(seen) == 2, "two answers")
    sched.stop()
    assert seen == [(4.0, 2.0), (5.0, 4.0)]


# ---- hostile bundles and logprobs bytes, on an app in this process ----

CHINESE = "你好，世界！今天天气很好，我们去公园散步吧。"
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@contextmanager
def app_client(bundle: Path):
    """(a TestClient of `create_app` over `bundle` on the CPU with the full policy, its engine); a server error is
    a response (a 500), not an exception in the test."""
    from fastapi.testclient import TestClient

    from infinigen_rt.bundle import read_bundle
    from infinigen_rt.engine import Engine
    from infinigen_rt.policies import configure
    from infinigen_rt.serve.app import create_app

    engine = Engine(read_bundle(bundle), device="cpu")
    app = create_app(engine, configure(engine, "full"), "tiny", max_batch=2)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine


def test_a_broken_or_hostile_chat_template_is_a_400_and_the_server_keeps_serving(bundles, tmp_path, monkeypatch):
    """A bundle whose template raises, or takes memory or time without bound: /v1/chat/completions and /tokenize
    answer 400 with the OpenAI error body naming the template (these were plain-text 500s, or the server's memory);
    a render running to its deadline does not hold up the event loop; good requests are served throughout."""
    from infinigen_rt import chat_template

    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)
    b = tmp_path / "b"
    shutil.copytree(bundles["llama31_gqa"], b)
    meta = json.loads((b / "bundle.json").read_text())
    good = meta["tokenizer"]["chat_template"]
    meta["tokenizer"]["chat_template"] = "{{ 1/0 }}"
    (b / "bundle.json").write_text(json.dumps(meta))
    messages = [{"role": "user", "content": "hi"}]
    with app_client(b) as (client, engine):
        for template, words in [
            (None, "ZeroDivisionError: division by zero"),
            ("{% include '/etc/passwd' %}", "no loader"),
            ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
            ("{{ raise_exception('no system role') }}", "chat template: no system role"),
            ("{{ 'a' * 400000000 }}", "needed more than 256 MiB"),
            (NESTED_LOOPS, "took longer than 1 s to render"),
        ]:
            if template is not None:
                engine.tokenizer.chat_template = template
            for path, body in [("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                               ("/tokenize", {"messages": messages})]:  # fmt: skip
                r = client.post(path, json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
                assert "chat template" in err["message"] and words in err["message"], err["message"]
            assert client.post("/v1/completions", json={"prompt": "The king", "max_tokens": 2}).status_code == 200
        with ThreadPoolExecutor(1) as pool:  # the endless template again: the loop answers meanwhile
            slow = pool.submit(client.post, "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            time.sleep(0.3)
            t = time.monotonic()
            assert client.get("/health").status_code == 200
            waited = time.monotonic() - t
            assert slow.result().status_code == 400
        assert waited < 0.5, f"/health waited {waited:.2f} s behind a template's render"
        engine.tokenizer.chat_template = good
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_chat_logprobs_bytes_are_each_tokens_own_and_rebuild_a_chinese_reply(bundles):
    """Each entry's `bytes` (and each top_logprobs entry's) are its token's own, so the reply's UTF-8 is their
    concatenation even where a token holds part of a character (they were U+FFFD's bytes, 239 191 189)."""
    with app_client(bundles["llama31_gqa"]) as (client, engine):
        tok = engine.tokenizer
        specials = {t.content for t in tok.tok.get_added_tokens_decoder().values() if t.special}
        body = {"messages": [{"role": "user", "content": CHINESE}], "max_tokens": 32, "temperature": 0,
                "logprobs": True, "top_logprobs": 5}  # fmt: skip
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                           for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
            else:
                choice = r.json()["choices"][0]
                text, content = choice["message"]["content"], choice["logprobs"]["content"]
            assert len(content) == 32
            joined = b"".join(bytes(e["bytes"]) for e in content if e["token"] not in specials)  # skipped in text
            assert joined.decode("utf-8", "replace") == text
            every = content + [t for e in content for t in e["top_logprobs"]]
            partial = [e for e in every if e["token"] == "\ufffd"]
            assert partial and all(e["bytes"] != [239, 191, 189] and len(e["bytes"]) == 1 for e in partial)
            assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)  # greedy: the chosen is the top


SMOLLM2_BUILT = ROOT / "artifacts" / "bundles" / "smollm2-135m"


@pytest.mark.skipif(not (SMOLLM2_BUILT / "bundle.json").is_file(), reason=f"{SMOLLM2_BUILT} is not built")
def test_chat_logprobs_bytes_rebuild_a_chinese_reply_of_the_real_smollm2():
    """SmolLM2 answering in Chinese: its byte-level tokens split characters; their bytes join to the reply."""
    with app_client(SMOLLM2_BUILT) as (client, _):
        body = {"messages": [{"role": "user", "content": "请用中文写一句关于春天的话。"}], "max_tokens": 24,
                "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == choice["message"]["content"]
        every = content + [t for e in content for t in e["top_logprobs"]]
        partial = [e for e in every if e["token"] == "\ufffd"]
        assert partial and all(e["bytes"] != [239, 191, 189] for e in partial)

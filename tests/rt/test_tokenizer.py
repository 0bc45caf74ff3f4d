"""The tokenizer against hostile bundles: chat templates that raise or take memory and time without bound (they
render in a limited child process, chat_template.py), tokenizers that do not fit their model, and the raw bytes of
each token (OpenAI's logprobs `bytes`). Tokenizers built here (no model): each test takes well under seconds."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from infinigen_rt import chat_template
from infinigen_rt.errors import InfinigenError
from infinigen_rt.tokenizer import UNKNOWN, Tokenizer
from tests.conftest import ROOT, TOKENIZER_TEXT, write_tokenizer

CHINESE = "你好，世界！今天天气很好，我们去公园散步吧。"

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
    "bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": f"  {CHINESE} 🎉 naïve café\n\nline two  "},
        {"role": "assistant", "content": "{{ not code }} {% neither %} \\n <|im_end|>"},
        {"role": "user", "content": ""},
    ],
]


def gemma3_template() -> str:
    from infinigen_prep.sources.gguf import GEMMA3_CHAT_TEMPLATE

    return GEMMA3_CHAT_TEMPLATE


def in_process_render(template: str, messages, add_generation_prompt: bool, bos="<s>", eos="</s>") -> str:
    """The in-process render the runtime did before templates ran in a child process (the reference)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise InfinigenError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, bos_token=bos, eos_token=eos,
                                            add_generation_prompt=add_generation_prompt)  # fmt: skip


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A folder with the tiny test tokenizer (a byte-level BPE of 512 tokens, as the tiny bundles have)."""
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, "llama")
    return d


def fake_bundle(folder: Path, rows: int | None = None, template: str | None = SMOLLM2_TEMPLATE, context: int = 256):
    """What Tokenizer reads of a bundle: its folder (tokenizer.json), special tokens and template, and the model's
    vocab_size (`rows`: default the tokenizer's size), context and eos ids."""
    if rows is None:
        from tokenizers import Tokenizer as HFTokenizer

        rows = HFTokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    info = SimpleNamespace(bos_token="<s>", eos_token="</s>", chat_template=template)
    cfg = SimpleNamespace(vocab_size=rows, max_position_embeddings=context, eos_token_ids=[2], pad_token_id=0)
    return SimpleNamespace(path=folder, tokenizer=info, config=cfg)


@pytest.fixture
def fast_deadline(monkeypatch):
    """A render deadline of 1 s (the default, 5 s, would make the timeout tests slow)."""
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)


# ---- case 6: a template that raises is one error naming the template ----


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ 1/0 }}", ["ZeroDivisionError", "division by zero"]),
        ("{% include '/etc/passwd' %}", ["TypeError", "no loader"]),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ["RecursionError"]),
        ("{% for %}", ["TemplateSyntaxError"]),
        ("{{ messages.pop() }}", ["SecurityError"]),
        ("{{ nothing.here }}", ["UndefinedError", "'nothing' is undefined"]),
    ],
    ids=["division", "include", "recursion", "syntax", "mutation", "undefined"],
)
def test_a_template_that_raises_is_one_error_naming_the_template(tok_dir, template, words):
    tok = Tokenizer(fake_bundle(tok_dir, template=template))
    with pytest.raises(InfinigenError) as e:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    message = str(e.value)
    assert "\n" not in message and message.startswith("the bundle's chat template failed to render")
    assert "tokenizer.chat_template in bundle.json" in message
    for w in words:
        assert w in message, message
    good = Tokenizer(fake_bundle(tok_dir))
    assert good.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_raise_exception_is_the_templates_own_message(tok_dir):
    tok = Tokenizer(fake_bundle(tok_dir, template=MISTRAL_TEMPLATE))
    with pytest.raises(InfinigenError, match=r"^chat template: Conversation roles must alternate user/assistant"):
        tok.render_chat([{"role": "assistant", "content": "hi"}])
    assert tok.render_chat(CONVERSATIONS[0]) == "<s>[INST] hi [/INST]"


# ---- case 7: a template cannot take the process's memory or time ----


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ 'a' * 400000000 }}", ["needed more than 256 MiB"]),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
         ["needed more than 256 MiB"]),
        ("{{ 'x'|center(10**9) }}", ["needed more than 256 MiB"]),
        ("{{ '%999999999s'|format(1) }}", ["needed more than 256 MiB"]),
        ("{{ 'x' * 200000000 }}", ["needed more than"]),
        ("{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", ["rendered more than 1,048,576 characters"]),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         ["took longer than 1 s to render"]),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}x{% endfor %}"
         "{% endfor %}{% endfor %}", ["rendered more than 1,048,576 characters"]),
    ],
    ids=["repeat", "doubling", "center", "format-width", "repeat-200mb", "writes-forever", "nested-ranges",
         "nested-writes"],
)  # fmt: skip
def test_a_hostile_template_is_refused_fast_and_the_next_render_works(tok_dir, fast_deadline, template, words):
    tok = Tokenizer(fake_bundle(tok_dir, template=template))
    assert tok.max_chars == 1 << 20  # the floor, for a 256-position model
    rss = rss_kb()
    t = time.monotonic()
    with pytest.raises(InfinigenError) as e:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t < 4.0, "refused, but slowly"
    message = str(e.value)
    assert message.startswith("the bundle's chat template ") and "\n" not in message
    for w in words:
        assert w in message, message
    # the render process was replaced where it had to be; this process is as small as it was
    good = Tokenizer(fake_bundle(tok_dir))
    assert good.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    assert rss_kb() - rss < 100 << 10  # kB: the text (hundreds of MB) was never built in this process


def rss_kb() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])


@pytest.mark.parametrize("template", ["smollm2", "qwen", "gemma3", "llama3", "mistral"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_render_process_gives_what_an_in_process_render_gives(tok_dir, template, add_generation_prompt):
    source = {"smollm2": SMOLLM2_TEMPLATE, "qwen": QWEN_TEMPLATE, "gemma3": gemma3_template(),
              "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}[template]  # fmt: skip
    tok = Tokenizer(fake_bundle(tok_dir, template=source))
    for messages in CONVERSATIONS:
        try:
            want = in_process_render(source, messages, add_generation_prompt)
        except InfinigenError as e:  # Mistral's: roles must alternate
            with pytest.raises(InfinigenError, match=f"^{str(e)}$"):
                tok.render_chat(messages, add_generation_prompt)
            continue
        assert tok.render_chat(messages, add_generation_prompt) == want
        assert tok.encode_chat(messages, add_generation_prompt) == tok.encode(want, add_special_tokens=False)


def test_renders_from_many_threads_each_get_their_own(tok_dir):
    tok = Tokenizer(fake_bundle(tok_dir))
    errors = []

    def work(k: int):
        for i in range(25):
            messages = [{"role": "user", "content": f"thread {k} message {i} {CHINESE[: i % 7]}"}]
            if tok.render_chat(messages) != in_process_render(SMOLLM2_TEMPLATE, messages, True):
                errors.append((k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_render_costs_under_a_millisecond_once_started(tok_dir):
    tok = Tokenizer(fake_bundle(tok_dir))
    tok.render_chat(CONVERSATIONS[1])
    t = time.perf_counter()
    for _ in range(100):
        tok.render_chat(CONVERSATIONS[1])
    assert (time.perf_counter() - t) / 100 < 5e-3  # a loaded 2-core machine: well above the usual 0.2 ms


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">Q", len(data)) + data


def _replies(out: bytes) -> list[dict]:
    replies = []
    while out:
        (n,) = struct.unpack(">Q", out[:8])
        replies.append(json.loads(out[8 : 8 + n]))
        out = out[8 + n :]
    return replies


def test_the_render_process_imports_neither_torch_nor_the_package_and_ends_with_its_stdin():
    """Run alone, as the runtime runs it: its imports (-X importtime) are jinja2's and the standard library's; it
    answers, then exits when its stdin closes."""
    request = {"template": "{{ bos_token }}{{ messages[0]['content'] }}", "max_chars": 100, "cpu_s": 5,
               "context": {"messages": [{"content": CHINESE}], "bos_token": "<s>"}}  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-X", "importtime", str(chat_template.WORKER), str(chat_template.MEMORY_HEADROOM)],
        input=_frame(request), capture_output=True, timeout=60, cwd=ROOT / "infinigen_rt",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    bare = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, timeout=60)

    def imported(stderr: bytes) -> set[str]:
        return {ln.rsplit("|", 1)[-1].strip().split(".")[0] for ln in stderr.decode().splitlines() if "time:" in ln}

    # beyond what any interpreter here imports at startup (site's hooks) and the standard library: jinja2, and
    # neither torch nor the package nor a module of its folder (where the worker file lies) shadowing another
    extra = imported(r.stderr) - imported(bare.stderr) - set(sys.stdlib_module_names)
    package = {p.stem for p in (ROOT / "infinigen_rt").iterdir()}
    assert {"jinja2", "markupsafe"} <= extra and not extra & {"torch", "numpy", "tokenizers", "infinigen_rt", *package}
    ready, reply = _replies(r.stdout)
    assert ready["ready"] and ready["memory_limit"] > chat_template.MEMORY_HEADROOM
    assert reply == {"text": "<s>" + CHINESE}


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` has exited (gone, or a zombie nobody reaps) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["killed", "exits-mid-render"])
def test_the_render_process_does_not_outlive_its_parent(how):
    """A parent killed (os._exit: no atexit) leaves a render process that ends at the end of its stdin; one that
    exits while a render of an endless loop is running (60 s deadline) kills it at exit."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    code = f"""
import os, sys, threading, time
from infinigen_rt import chat_template as ct
ct.render("x", {{}})
print(ct._RENDERER.proc.pid, flush=True)
if {how == "killed"}:
    os._exit(0)
threading.Thread(target=lambda: ct.render({loop!r}, {{}}, timeout=60), daemon=True).start()
time.sleep(0.5)
sys.exit(0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert _gone(int(r.stdout.split()[0]), 5.0)


def test_a_killed_render_process_is_replaced(tok_dir):
    tok = Tokenizer(fake_bundle(tok_dir))
    tok.render_chat(CONVERSATIONS[0])
    proc = chat_template._RENDERER.proc
    proc.kill()
    proc.wait()
    assert tok.render_chat(CONVERSATIONS[0]) == in_process_render(SMOLLM2_TEMPLATE, CONVERSATIONS[0], True)
    assert chat_template._RENDERER.proc.pid != proc.pid


def test_a_render_process_that_cannot_start_is_one_error(tok_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(chat_template, "WORKER", tmp_path / "missing.py")
    chat_template._RENDERER.close()
    with pytest.raises(InfinigenError, match="the process that renders chat templates did not start"):
        Tokenizer(fake_bundle(tok_dir)).render_chat(CONVERSATIONS[0])
    monkeypatch.undo()
    assert Tokenizer(fake_bundle(tok_dir)).render_chat(CONVERSATIONS[0]).startswith("<|im_start|>system")


# ---- case 9: the tokenizer must fit the model ----


def _with_token_past(tok_dir: Path, folder: Path) -> int:
    """`folder`: the tiny tokenizer plus one added token, "<extra>", at the id after its last; returns the id."""
    from tokenizers import Tokenizer as HFTokenizer

    folder.mkdir()
    hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    n = hf.get_vocab_size(with_added_tokens=True)
    hf.add_tokens(["<extra>"])
    hf.save(str(folder / "tokenizer.json"))
    assert hf.token_to_id("<extra>") == n
    return n


def test_a_token_id_past_the_models_rows_is_refused_at_load(tok_dir, tmp_path):
    n = _with_token_past(tok_dir, tmp_path / "t")
    with pytest.raises(InfinigenError) as e:
        Tokenizer(fake_bundle(tmp_path / "t", rows=n))
    assert str(e.value) == (f"the bundle's tokenizer has token id {n} ('<extra>'), past the model's vocabulary of "
                            f"{n} rows; re-convert the bundle")  # fmt: skip
    tok = Tokenizer(fake_bundle(tmp_path / "t", rows=n + 1))  # a row for it: fine
    assert tok.encode("hi <extra>", add_special_tokens=False)[-1] == n


def test_a_tokenizer_far_smaller_than_the_model_is_refused_and_a_padded_one_is_not(tok_dir):
    n = Tokenizer(fake_bundle(tok_dir)).n_ids
    with pytest.raises(InfinigenError, match=rf"has {n} tokens for the model's 49,152 rows .* not this model's"):
        Tokenizer(fake_bundle(tok_dir, rows=49152))
    # Qwen2.5's padding (151,665 tokens, 151,936 rows), Gemma 3's and the refusal's edge load
    for rows in (round(n * 151936 / 151665), n + 64, 2 * n):
        assert Tokenizer(fake_bundle(tok_dir, rows=rows)).model_rows == rows


def test_an_id_the_tokenizer_lacks_shows_in_the_text_and_its_bytes(tok_dir):
    """A padded row sampled (or sent to /detokenize) is U+FFFD where it stands, not dropped."""
    tok = Tokenizer(fake_bundle(tok_dir, rows=600))
    n = tok.n_ids
    ids = tok.encode("The king said hello", add_special_tokens=False)
    assert tok.tok.decode(ids[:2] + [n + 3] + ids[2:]) == tok.decode(ids)  # what the tokenizers library does
    assert tok.decode(ids[:2] + [n + 3] + ids[2:]) == tok.decode(ids[:2]) + UNKNOWN + tok.decode(ids[2:])
    assert tok.decode([n, n + 1]) == UNKNOWN * 2 and tok.decode([599]) == UNKNOWN
    assert tok.token_bytes(n + 3) == UNKNOWN.encode() and not tok.has_token(n) and tok.has_token(n - 1)
    assert tok.decode(ids) == "The king said hello"  # ids it has: the library's text


@pytest.mark.slow
def test_every_tiny_bundles_tokenizer_fits_its_model(bundles):
    """The families' tokenizers as converted (OPT's from vocab.json and merges.txt) pass the load's check."""
    from infinigen_rt.bundle import read_bundle

    for name, path in bundles.items():
        tok = Tokenizer(read_bundle(path, verify=False))
        assert tok.n_ids == tok.model_rows, name
        ids = tok.encode(CHINESE, add_special_tokens=False)
        assert _joined(tok, ids) == CHINESE.encode(), name


def test_encode_never_gives_an_id_past_the_models_rows(tok_dir):
    """The load's check makes it unreachable; the belt: a one-line error, never an IndexError in the model."""
    tok = Tokenizer(fake_bundle(tok_dir))
    tok.model_rows = 10
    with pytest.raises(InfinigenError, match="encoded the text to token id .* past the model's vocabulary of 10 rows"):
        tok.encode("The king said")


# ---- case 14: a token's own bytes ----


def _joined(tok: Tokenizer, ids) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


def test_token_bytes_of_a_byte_level_bpe_rebuild_the_text(tok_dir):
    tok = Tokenizer(fake_bundle(tok_dir))
    for text in (CHINESE, "naïve café 🎉 — ok", " ".join(TOKENIZER_TEXT[:2]), "<s>user: 你好</s>"):
        ids = tok.encode(text, add_special_tokens=False)
        assert _joined(tok, ids) == text.encode()
    ids = tok.encode(CHINESE, add_special_tokens=False)
    partial = [i for i in ids if tok.decode([i]) == UNKNOWN]
    assert partial, "the tiny tokenizer knows no Chinese: its characters are byte tokens"
    assert all(tok.token_bytes(i) != UNKNOWN.encode() for i in partial)
    assert {len(tok.token_bytes(i)) for i in partial} == {1}
    # any ids at all: the tokens' bytes decode (invalid UTF-8 replaced as the library does) to decode's text
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.n_ids) for _ in range(rng.randrange(1, 10))]
        assert _joined(tok, ids).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=False), ids


def _sentencepiece(folder: Path) -> None:
    """A SentencePiece-style BPE as infinigen-prep converts a GGUF's (Llama 2, Mistral, Gemma): "▁" for spaces,
    <0xNN> byte-fallback tokens, the decoder Replace, ByteFallback, Fuse, Strip."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace("▁", "first", split=False)
    hf.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                               show_progress=False))  # fmt: skip
    spec = json.loads(hf.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    _sentencepiece(tmp_path / "sp")
    tok = Tokenizer(fake_bundle(tmp_path / "sp"))
    for text in (CHINESE, "The king said 你好 to the queen", "naïve 🎉"):
        ids = tok.encode(text, add_special_tokens=False)
        # the text's first space is the decoder's to strip (Strip): each token's bytes keep theirs
        assert _joined(tok, ids) == b" " + text.encode() and tok.decode(ids) == text
    ids = tok.encode(CHINESE, add_special_tokens=False)
    fallback = [i for i in ids if tok.tok.id_to_token(i).startswith("<0x")]
    assert fallback and all(tok.token_bytes(i) == bytes([int(tok.tok.id_to_token(i)[3:5], 16)]) for i in fallback)
    spaced = {t: i for t, i in tok.tok.get_vocab().items() if t.startswith("▁") and len(t) > 1}
    assert spaced and all(tok.token_bytes(i) == t.replace("▁", " ").encode() for t, i in spaced.items())


def test_token_bytes_fall_back_to_the_decoded_token_for_other_decoders(tok_dir, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders

    hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf.decoder = decoders.WordPiece()
    (tmp_path / "wp").mkdir()
    hf.save(str(tmp_path / "wp" / "tokenizer.json"))
    tok = Tokenizer(fake_bundle(tmp_path / "wp"))
    assert all(tok.token_bytes(i) == tok.decode([i], skip_special_tokens=False).encode() for i in range(tok.n_ids))


SMOLLM2 = ROOT / "artifacts" / "bundles" / "smollm2-135m"


@pytest.mark.skipif(not (SMOLLM2 / "bundle.json").is_file(), reason=f"{SMOLLM2} is not built")
def test_the_real_smollm2_tokenizer_fits_its_model_and_its_token_bytes_rebuild_chinese():
    from infinigen_rt.bundle import read_bundle

    tok = Tokenizer(read_bundle(SMOLLM2, verify=False))
    assert tok.n_ids == tok.model_rows == 49152
    ids = tok.encode(CHINESE, add_special_tokens=False)
    assert _joined(tok, ids) == CHINESE.encode()
    assert any(tok.decode([i]) == UNKNOWN and tok.token_bytes(i) != UNKNOWN.encode() for i in ids)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.n_ids) for _ in range(rng.randrange(1, 10))]
        assert _joined(tok, ids).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=False), ids
    messages = [{"role": "user", "content": CHINESE}]
    want = in_process_render(tok.chat_template, messages, True, tok.bos_token or "", tok.eos_token or "")
    assert tok.render_chat(messages) == want


def test_chat_logprobs_bytes_are_each_tokens_own(tok_dir):
    from infinigen_rt.runner import Logprob
    from infinigen_rt.serve.protocol import chat_logprobs

    tok = Tokenizer(fake_bundle(tok_dir))
    ids = tok.encode(CHINESE, add_special_tokens=False)
    entries = [Logprob(t, -0.5, [(t, -0.5), (ids[(k + 1) % len(ids)], -1.5)]) for k, t in enumerate(ids)]
    got = chat_logprobs(entries, lambda t: tok.decode([t], skip_special_tokens=False), tok.token_bytes)["content"]
    assert bytes(b for e in got for b in e["bytes"]).decode() == CHINESE
    assert [239, 191, 189] not in [e["bytes"] for e in got] + [t["bytes"] for e in got for t in e["top_logprobs"]]
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in got)

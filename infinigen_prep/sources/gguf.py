"""A llama.cpp GGUF file as a checkpoint source.

GGUF metadata becomes an HF `config.json` dict, GGUF tensors are renamed to HF names and dequantized
one at a time (with llama.cpp's rotary row permutation undone), and the vocabulary stored in the
metadata is rebuilt as a `tokenizers` tokenizer.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from infinigen_prep.sources.base import Source, TokenizerInfo
from infinigen_rt.bundle import sha256_file
from infinigen_rt.errors import InfinigenError

log = logging.getLogger(__name__)

SUPPORTED = "GGUF architectures 'llama' (Llama, SmolLM2, ...), 'qwen2' and 'gemma3' (text), dense, without RoPE scaling"
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> HF model_type, where they differ

# GGUF name -> HF name. Per-layer tensors are `blk.{i}.{part}.{weight|bias}`.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3: norms after attention and after the MLP, q/k norms; llama.cpp's ffn_norm is the norm before the MLP
_GEMMA3_PARTS = {
    **_LAYER_PARTS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's: every sixth layer is global (the GGUF does not say)
GEMMA3_LOCAL_THETA = 10000.0
# Gemma's turn format, for a Gemma 3 GGUF that carries no template: a system message opens the first user turn,
# the assistant's role is "model", every turn ends with <end_of_turn> (an end-of-sequence token for generation)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ sys if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"

_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


def _split_regex(numbers: str) -> str:
    """The Llama-3 / Qwen2 pre-tokenizer split; they differ only in how many digits make one piece."""
    return (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        + numbers
        + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, BPE ignore_merges) for llama.cpp's `tokenizer.ggml.pre`."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM/SmolLM2: every digit its own piece, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    if pre in _LLAMA3_PRE or pre == "qwen2":
        regex = pre_tokenizers.Split(Regex(_split_regex("{1,3}" if pre in _LLAMA3_PRE else "")), "isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        # Llama 3 takes a word that is itself a token whole, before any merge (llama.cpp does too).
        return pre_tokenizers.Sequence([regex, byte_level]), pre in _LLAMA3_PRE
    if pre not in (None, "default", "gpt-2", "gpt2"):
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
    return gpt2, False


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece GGUFs usually store scores but no merges. Rebuild them as transformers does: every
    split of a token into two vocab pieces is a merge, ranked by that token's score, best first."""
    vocab = {token: i for i, token in enumerate(tokens)}
    found = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = [(left, right) for left, right in pairs if left in vocab and right in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(score, left, right) for left, right in pairs]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep vocab order
    return [(left, right) for _, left, right in found]


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of attn_q/attn_k rows (weights or biases).

    Per head HF keeps the rotary halves apart (rows [0, d/2) pair with [d/2, d)); llama.cpp interleaves
    them (rows 2j, 2j+1). GGUF rows viewed as (head, d/2, 2) -> swap -> (head, 2, d/2) is the HF order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Corrupt(Exception):
    """A length or count in a GGUF's tables that its file cannot hold."""


# GGUF value types (gguf.GGUFValueType) -> bytes of one value; 8 (string) and 9 (array) have their own layout
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# gguf's reader makes a numpy object per array element (about 100 bytes each): a real vocabulary's tables hold
# about a million (Gemma 3: 3 x 262,144); a file claiming more is refused before the reader runs
MAX_ARRAY_ELEMENTS = 1 << 22
_MAX_NESTING = 4  # arrays of arrays (the reader recurses per level)
_MAX_DIMS = 4  # GGML_MAX_DIMS


def check_lengths(path: Path) -> None:
    """Walk a GGUF's header, metadata and tensor table, checking every count and length against the file's size,
    before gguf's reader (which loops over a lying array length without end, growing its memory) sees it.
    Raises _Corrupt; a file that is not GGUF v2/v3 at all is left to the reader's own checks."""
    import mmap
    import struct

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise _Corrupt("shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
            if struct.unpack_from(order + "I", data, 4)[0] not in (2, 3):
                return
            pos, elements = 8, 0

            def take(fmt: str):
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise _Corrupt(f"ends inside a field at byte {pos}")
                value = struct.unpack_from(order + fmt, data, pos)
                pos += n
                return value[0] if len(value) == 1 else value

            def skip(n: int) -> None:
                nonlocal pos
                if n > size - pos:
                    raise _Corrupt(f"a length at byte {pos} runs {n:,} bytes past the end")
                pos += n

            def value(kind: int, depth: int) -> None:
                nonlocal elements
                if kind == _STRING:
                    skip(take("Q"))
                elif kind == _ARRAY:
                    item, count = take("I"), take("Q")
                    elements += count
                    if elements > MAX_ARRAY_ELEMENTS or depth >= _MAX_NESTING:
                        raise _Corrupt(f"metadata arrays of {elements:,} elements or {depth + 1} levels")
                    if item in _VALUE_BYTES:
                        skip(count * _VALUE_BYTES[item])
                    else:
                        for _ in range(count):  # bounded: each element takes at least 8 bytes of the file
                            value(item, depth + 1)
                elif kind in _VALUE_BYTES:
                    skip(_VALUE_BYTES[kind])
                else:
                    raise _Corrupt(f"unknown value type {kind}")

            n_tensors, n_fields = take("Q"), take("Q")
            if n_fields * 13 > size or n_tensors * 24 > size:  # a key of >= 1 byte, its type and value
                raise _Corrupt(f"{n_fields:,} fields and {n_tensors:,} tensors cannot fit")
            for _ in range(n_fields):
                skip(take("Q"))  # the key
                value(take("I"), 0)
            for _ in range(n_tensors):
                skip(take("Q"))  # the name
                dims = take("I")
                if dims > _MAX_DIMS:
                    raise _Corrupt(f"a tensor of {dims} dimensions")
                skip(8 * dims + 4 + 8)  # the dimensions, the ggml type, the data offset


class GGUFSource(Source):
    """A single-file llama.cpp GGUF checkpoint (see `SUPPORTED`); any quant type gguf can dequantize."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise InfinigenError(f"GGUF file not found: {self.path}")
        try:
            check_lengths(self.path)  # gguf's reader trusts every length: a lying one makes it loop or eat memory
            self._reader = gguf.GGUFReader(self.path)
        except OSError as e:
            raise InfinigenError(f"cannot read {self.path} ({e.strerror or e})") from None
        except (ValueError, IndexError, KeyError, OverflowError, MemoryError, TypeError, RecursionError, _Corrupt):
            # numpy's own text (reshape sizes, dtype views) says nothing to a user: say what is wrong instead
            with open(self.path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise InfinigenError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')") from None
            raise InfinigenError(
                f"{self.path} is a truncated or corrupt GGUF file ({self.path.stat().st_size:,} bytes: its tables or "
                "tensors end early, or a length in them is impossible); download it again"
            ) from None
        arch = self._meta("general.architecture")
        if arch not in _HF_CLASSES:
            raise self._unsupported(f"architecture {arch!r}")
        self._parts = _GEMMA3_PARTS if arch == "gemma3" else _LAYER_PARTS
        self._tensors = {self._hf_name(t.name): t for t in self._reader.tensors}
        self._check_tensors(self._meta(f"{arch}.block_count", 0))
        self.config = self._read_config(arch)
        self.provenance = {"kind": "gguf", "file": self.path.name, "sha256": sha256_file(self.path)}
        self.license = self._meta("general.license")
        self.base_model = self._read_base_model()

    # --- metadata -------------------------------------------------------------------------------------

    def _meta(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _unsupported(self, what: str) -> InfinigenError:
        return InfinigenError(f"{self.path.name}: {what} is not supported; supported: {SUPPORTED}")

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        m = _LAYER_NAME.fullmatch(name)
        if m and m[2] in self._parts:
            return f"model.layers.{m[1]}.{self._parts[m[2]]}.{m[3]}"
        if name == "rope_freqs.weight":
            raise self._unsupported("RoPE scaling stored as factors (rope_freqs.weight, Llama-3.1 style)")
        raise self._unsupported(f"tensor {name!r}")

    def _check_tensors(self, n_layers: int) -> None:
        needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
            f"model.layers.{i}.{part}.weight" for i in range(n_layers) for part in self._parts.values()
        ]
        missing = [name for name in needed if name not in self._tensors]
        if missing or not n_layers:
            what = f"{len(missing)} tensors, e.g. {missing[0]}" if missing else "layers"
            raise InfinigenError(f"{self.path.name}: the GGUF file lacks {what}")

    def _read_config(self, arch: str) -> dict:
        def key(name, default=None):
            value = self._meta(f"{arch}.{name}", default)
            if value is None:
                raise InfinigenError(f"{self.path.name}: GGUF metadata lacks {arch}.{name}")
            return value

        if key("rope.scaling.type", "none") != "none":
            raise self._unsupported(f"RoPE scaling {key('rope.scaling.type')!r}")
        if key("expert_count", 0):
            raise self._unsupported("a mixture-of-experts model")
        hidden, heads = key("embedding_length"), key("attention.head_count")
        head_dim = key("attention.key_length", hidden // heads)
        if key("rope.dimension_count", head_dim) != head_dim:
            raise self._unsupported("partial rotary embedding")
        config = {
            "architectures": [_HF_CLASSES[arch]],
            "model_type": _MODEL_TYPES.get(arch, arch),
            "vocab_size": int(self._tensors["model.embed_tokens.weight"].shape[-1]),  # GGUF: (dim, vocab)
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "max_position_embeddings": key("context_length"),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._meta("tokenizer.ggml.padding_token_id"),
            "hidden_act": "silu",
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,  # always so for qwen2
            "torch_dtype": "float16",
        }
        if arch == "gemma3":  # what llama.cpp fixes for Gemma 3 rather than storing
            n = config["num_hidden_layers"]
            config.update(
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=key("attention.sliding_window"),
                layer_types=["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                             for i in range(n)],
                rope_local_base_freq=GEMMA3_LOCAL_THETA,
                query_pre_attn_scalar=head_dim,
                torch_dtype="bfloat16",
            )  # fmt: skip
        return config

    def _read_base_model(self) -> str | None:
        for key in ("general.base_model.0.repo_url", "general.source.repo_url"):
            m = re.fullmatch(r"https?://huggingface\.co/([\w.-]+/[\w.-]+)/?", self._meta(key) or "")
            if m:
                return m[1]
        return None

    # --- tensors --------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape: GGUF lists dimensions innermost first, e.g. (in_features, out_features)."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def load(self, name: str) -> torch.Tensor:
        """One tensor as float32 in HF layout; only this tensor is read and dequantized."""
        tensor = self._tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise InfinigenError(
                f"{self.path.name}: {tensor.name} is {tensor.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        w = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape(name))
        if self.config["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w (the scale itself)
        if self.config["model_type"] == "llama":  # qwen2 and gemma3 (NeoX rotary) are stored unpermuted
            if ".self_attn.q_proj." in name:
                w = _unpermute_rope(w, self.config["num_attention_heads"])
            elif ".self_attn.k_proj." in name:
                w = _unpermute_rope(w, self.config["num_key_value_heads"])
        return w

    # --- tokenizer ------------------------------------------------------------------------------------

    def tokenizer(self) -> TokenizerInfo:
        """The GGUF vocabulary as a `tokenizers` tokenizer: byte-level BPE ('gpt2') or SentencePiece BPE
        ('llama'), with control tokens as special added tokens and BOS prepended when the file says so."""
        kind, tokens = self._meta("tokenizer.ggml.model"), self._meta("tokenizer.ggml.tokens")
        if not tokens:
            raise InfinigenError(f"{self.path.name}: the GGUF file has no tokenizer vocabulary")
        if kind == "gpt2":
            tok, add_bos_default = self._byte_level_bpe(tokens)
        elif kind == "llama":
            tok, add_bos_default = self._sentencepiece_bpe(tokens), True  # llama.cpp's default
        else:
            raise InfinigenError(
                f"{self.path.name}: tokenizer model {kind!r} is not supported; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )

        # llama.cpp token types: 2 unknown, 3 control -> special; 4 user-defined (<think>) -> matched whole.
        types = self._meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        typed = list(zip(tokens, types, strict=True))
        special = [AddedToken(t, normalized=False, special=True) for t, k in typed if k in (2, 3)]
        tok.add_special_tokens(special)
        tok.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == 4])

        def token(key: str) -> tuple[str | None, int | None]:
            token_id = self._meta(f"tokenizer.ggml.{key}_token_id")
            found = token_id is not None and token_id < len(tokens)
            return (tokens[token_id], token_id) if found else (None, None)

        (bos, bos_id), (eos, eos_id) = token("bos"), token("eos")
        add_bos = bool(self._meta("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
        add_eos = bool(self._meta("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            first, last = [f"{bos}:0"] * add_bos, [f"{eos}:0"] * add_eos
            single = [*first, "$A:0", *last]
            pair = single + [t.replace(":0", ":1") for t in [*first, "$B:0", *last]]
            specials = dict([(bos, bos_id)] * add_bos + [(eos, eos_id)] * add_eos)
            tok.post_processor = processors.TemplateProcessing(
                single=" ".join(single), pair=" ".join(pair), special_tokens=list(specials.items())
            )
        return TokenizerInfo(
            tokenizer_json=tok.to_str(),
            bos_token=bos,
            eos_token=eos,
            pad_token=token("padding")[0],
            add_bos_token=add_bos,
            chat_template=self._meta("tokenizer.chat_template") or self._default_template(),
        )

    def _default_template(self) -> str | None:
        return GEMMA3_CHAT_TEMPLATE if self._meta("general.architecture") == "gemma3" else None

    def generation_eos_ids(self) -> list[int]:
        """Gemma 3 ends a reply with <end_of_turn> (its generation_config lists it; a GGUF keeps one eos id)."""
        if self._meta("general.architecture") != "gemma3":
            return []
        tokens = self._meta("tokenizer.ggml.tokens") or []
        return [tokens.index(GEMMA3_END_OF_TURN)] if GEMMA3_END_OF_TURN in tokens else []

    def _byte_level_bpe(self, tokens: list[str]) -> tuple[Tokenizer, bool]:
        """GPT-2 style BPE: tokens are already in the byte-to-unicode alphabet; merges are "left right"."""
        pre = self._meta("tokenizer.ggml.pre")
        pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self._meta("tokenizer.ggml.merges") or []]
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        if pre == "qwen2":  # Qwen2's HF tokenizer NFC-normalizes first
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        return tok, pre in _LLAMA3_PRE  # llama.cpp adds BOS by default for Llama 3 only

    def _sentencepiece_bpe(self, tokens: list[str]) -> Tokenizer:
        """SentencePiece BPE: spaces are "▁", unknown characters fall back to <0xNN> byte tokens."""
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self._meta("tokenizer.ggml.merges") or []]
        merges = merges or _merges_from_scores(tokens, self._meta("tokenizer.ggml.scores"))
        unk_id = self._meta("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        # One "▁" goes before the start of the text only (transformers' non-legacy Llama behaviour).
        prefix = self._meta("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", "first" if prefix else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
        return tok

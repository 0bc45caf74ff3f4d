"""The typed model config the runtime reads from bundle.json, and its translation from HF `config.json`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from infinigen_rt.errors import InfinigenError
from infinigen_rt.schema import Section

# model_type in a HF config.json -> our architecture (one model file each)
ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "opt": "opt", "gemma3_text": "gemma3",
}  # fmt: skip
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new")
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # HF's layer_types


# the sizes every model has, each a positive count
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip


@dataclass
class ModelConfig(Section):
    """Everything the model code needs; field names follow the HF Llama config where one exists."""

    where: ClassVar[str] = "config"  # in bundle.json
    arch: str  # "llama", "gemma3" or "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2); OPT has all biases
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # sliding-window attention: a layer of type SLIDING attends to its last `sliding_window` tokens (itself
    # included); layer_types None: every layer is GLOBAL (or SLIDING when sliding_window is set)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # the sliding layers' RoPE base, when it differs (Gemma 3)
    query_scale: float = 1.0  # queries are multiplied by this before the usual 1/sqrt(head_dim) (Gemma 3)
    # OPT only
    word_embed_proj_dim: int | None = None  # != hidden_size -> project_in/project_out
    do_layer_norm_before: bool = True
    position_offset: int = 0  # OPT's learned positions start at 2
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in _SIZES:
            n = getattr(self, name)
            if type(n) is not int or n < 1:
                raise InfinigenError(f"the model config's {name} must be a positive integer, got {n!r}")
        if self.arch not in ("llama", "gemma3", "opt"):
            raise InfinigenError(f"unsupported architecture {self.arch!r}; supported: llama, gemma3, opt")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InfinigenError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise InfinigenError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise InfinigenError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        self._check_numbers()
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, GLOBAL}:
                raise InfinigenError(f"layer_types must list {SLIDING!r} or {GLOBAL!r} for each of the "
                                     f"{self.num_hidden_layers} layers")  # fmt: skip
            if SLIDING in self.layer_types and not self.sliding_window:
                raise InfinigenError("layer_types has sliding layers but the config sets no sliding_window")

    def _check_numbers(self) -> None:
        """The config's numbers are ones a model can run with: finite where a float, positive where a size or a
        scale, token ids inside the vocabulary (a NaN eps or a zero RoPE base gives garbage at rc 0, a negative
        window a traceback deep in the KV code)."""

        def bad(name: str, value, want: str):
            return InfinigenError(f"the model config's {name} must be {want}, got {value!r}; re-convert the bundle")

        def positive(name: str, value, above: float = 0.0, below: float = math.inf) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not above < value < below:
                bound = f"above {above:g}" if below == math.inf else f"between {above:g} and {below:g}"
                raise bad(name, value, f"a finite number {bound}")

        positive("norm_eps", self.norm_eps, below=1.0)
        positive("query_scale", self.query_scale, below=math.inf)
        if self.arch != "opt":  # OPT's positions are learned
            positive("rope_theta", self.rope_theta, above=1.0)
            if self.rope_local_theta is not None:
                positive("rope_local_theta", self.rope_local_theta, above=1.0)
            if self.head_dim % 2:
                raise bad("head_dim", self.head_dim, "even (RoPE turns its dimensions in pairs)")
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", "default")
        if kind in ("linear", "llama3"):
            positive("rope_scaling.factor", scaling.get("factor"))
        if kind == "llama3":
            positive("rope_scaling.low_freq_factor", scaling.get("low_freq_factor"))
            positive("rope_scaling.high_freq_factor", scaling.get("high_freq_factor"), above=scaling["low_freq_factor"])
            old = scaling.get("original_max_position_embeddings")
            if type(old) is not int or old < 1:
                raise bad("rope_scaling.original_max_position_embeddings", old, "a positive integer")
        for name in ("sliding_window", "word_embed_proj_dim"):
            n = getattr(self, name)
            if n is not None and (type(n) is not int or n < 1):
                raise bad(name, n, "a positive integer or null")
        if type(self.position_offset) is not int or self.position_offset < 0:
            raise bad("position_offset", self.position_offset, "an integer >= 0")
        for name, ids in (("bos_token_id", [self.bos_token_id]), ("pad_token_id", [self.pad_token_id]),
                          ("eos_token_ids", self.eos_token_ids)):  # fmt: skip
            if (t := next((t for t in ids if t is not None and not 0 <= t < self.vocab_size), None)) is not None:
                raise bad(name, t, f"a token id inside the vocabulary (0..{self.vocab_size - 1})")

    def window(self, layer: int) -> int | None:
        """The tokens layer `layer` attends to (itself included), or None: every token before it (global)."""
        if not self.sliding_window:
            return None
        kind = SLIDING if self.layer_types is None else self.layer_types[layer]
        return self.sliding_window if kind == SLIDING else None

    @property
    def global_layers(self) -> list[int]:
        """The layers that attend to the whole context (the ones whose KV grows with it)."""
        return [i for i in range(self.num_hidden_layers) if self.window(i) is None]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.window(i) is not None]

    @classmethod
    def from_hf(cls, hf: dict, generation_eos: list[int] | None = None) -> ModelConfig:
        """Translate a Hugging Face `config.json` dict; unsupported model types are a clear error."""
        model_type = hf.get("model_type")
        arch = ARCHITECTURES.get(model_type)
        if model_type == "gemma3":  # the multimodal checkpoint (vision tower, language_model.* names)
            raise InfinigenError("unsupported model_type 'gemma3' (multimodal); Gemma 3's text models are supported "
                                 "(model_type gemma3_text: gemma-3-270m, gemma-3-1b), or its GGUF")  # fmt: skip
        if arch is None:
            raise InfinigenError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        eos = hf.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        for e in generation_eos or []:
            if e not in eos_ids:
                eos_ids.append(e)
        vocab = hf["vocab_size"]

        def token(t):  # some checkpoints write -1 (or an id past the embedding) for "none"
            return t if type(t) is int and 0 <= t < vocab else None

        eos_ids = [e for e in eos_ids if token(e) is not None]
        common = dict(
            vocab_size=vocab,
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_token_id=token(hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
            pad_token_id=token(hf.get("pad_token_id")),
        )
        if arch == "opt":
            return cls(
                arch="opt",
                intermediate_size=hf["ffn_dim"],
                num_key_value_heads=hf["num_attention_heads"],
                head_dim=hf["hidden_size"] // hf["num_attention_heads"],
                norm_eps=1e-5,
                hidden_act=hf.get("activation_function", "relu"),
                tie_word_embeddings=hf.get("tie_word_embeddings", True),
                attention_bias=hf.get("enable_bias", True),
                attention_out_bias=hf.get("enable_bias", True),
                mlp_bias=hf.get("enable_bias", True),
                word_embed_proj_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
                do_layer_norm_before=hf.get("do_layer_norm_before", True),
                position_offset=2,
                **common,
            )
        rope_params = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        local_theta = None
        if arch == "gemma3" and isinstance(rope_params, dict) and GLOBAL in rope_params:  # per layer type
            local_theta = (rope_params.get(SLIDING) or {}).get("rope_theta")
            rope_params = rope_params[GLOBAL]
        rope_scaling = _rope_scaling(hf.get("rope_scaling"), rope_params)
        default_theta = 1_000_000.0 if arch == "gemma3" else 10000.0
        theta = hf.get("rope_theta") or (rope_params or {}).get("rope_theta") or default_theta
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        window, layer_types = _sliding(hf, model_type)
        act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if arch == "gemma3":
            if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
                raise InfinigenError("logit soft-capping (Gemma 2 style) is not supported")
            local_theta = local_theta or hf.get("rope_local_base_freq") or 10000.0
        scalar = hf.get("query_pre_attn_scalar")
        return cls(
            arch=arch,
            intermediate_size=hf["intermediate_size"],
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act="gelu_new" if act == "gelu_pytorch_tanh" else act,
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", arch == "gemma3"),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            attention_out_bias=hf.get("attention_bias", False) and model_type != "qwen2",
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=None if local_theta is None else float(local_theta),
            query_scale=1.0 if not scalar else (head_dim / scalar) ** 0.5,
            **common,
        )


def _rope_scaling(rope_scaling: dict | None, rope_params: dict | None) -> dict | None:
    """The RoPE scaling of an HF config (`rope_scaling`, or transformers 5's `rope_parameters`), without theta."""
    rope_scaling = rope_scaling or None
    if rope_scaling is None and isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
        rope_scaling.pop("rope_theta", None)
        if rope_scaling["rope_type"] == "default":
            return None
    return rope_scaling


def _sliding(hf: dict, model_type: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of an HF config: Mistral slides on every layer when it sets a window, Gemma 3
    on five layers of six (or as its layer_types say), Qwen only with use_sliding_window (layers from
    max_window_layers on); (None, None) when no layer slides."""
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        return None, None
    if not window or model_type == "llama":
        return None, None
    types = hf.get("layer_types")
    if types is None and model_type == "gemma3_text":
        pattern = hf.get("sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    elif types is None and model_type in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", n)
        types = [SLIDING if i >= first else GLOBAL for i in range(n)]
    if types is not None and SLIDING not in types:
        return None, None
    return int(window), None if types is None or GLOBAL not in types else list(types)

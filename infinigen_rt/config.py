"""The typed model config the runtime reads from bundle.json, and its translation from HF `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from infinigen_rt.errors import InfinigenError

# model_type in a HF config.json -> our architecture (one model file each)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "opt": "opt"}
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new")


@dataclass
class ModelConfig:
    """Everything the model code needs; field names follow the HF Llama config where one exists."""

    arch: str  # "llama" or "opt"
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
    # OPT only
    word_embed_proj_dim: int | None = None  # != hidden_size -> project_in/project_out
    do_layer_norm_before: bool = True
    position_offset: int = 0  # OPT's learned positions start at 2
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.arch not in ("llama", "opt"):
            raise InfinigenError(f"unsupported architecture {self.arch!r}; supported: llama, opt")
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from bundle.json's "config"; unknown keys are dropped, missing required keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise InfinigenError(f"bundle config is incomplete ({e}); re-convert the model") from None

    @classmethod
    def from_hf(cls, hf: dict, generation_eos: list[int] | None = None) -> ModelConfig:
        """Translate a Hugging Face `config.json` dict; unsupported model types are a clear error."""
        model_type = hf.get("model_type")
        arch = ARCHITECTURES.get(model_type)
        if arch is None:
            raise InfinigenError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        eos = hf.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        for e in generation_eos or []:
            if e not in eos_ids:
                eos_ids.append(e)
        common = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
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
        rope_scaling = hf.get("rope_scaling") or None
        rope_params = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if (
            rope_scaling is None
            and isinstance(rope_params, dict)
            and rope_params.get("rope_type", "default") != "default"
        ):
            rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            rope_scaling.pop("rope_theta", None)
        theta = hf.get("rope_theta") or (rope_params or {}).get("rope_theta") or 10000.0
        heads = hf["num_attention_heads"]
        return cls(
            arch="llama",
            intermediate_size=hf["intermediate_size"],
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_act", "silu"),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            attention_out_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            **common,
        )

"""Synthetic models for bench: random weights of real shapes (the presets' Hugging Face config.json fields), built
straight on the device (fixed seed, no download). Speculation on random weights selects nothing meaningful, so their
fetch share is pinned by `budget` (alpha = inf: every speculated layer fetches exactly budget x context rows per
head)."""

from __future__ import annotations

import math

import torch

from infinigen_rt.config import ModelConfig
from infinigen_rt.engine import Engine, Speculation
from infinigen_rt.errors import InfinigenError
from infinigen_rt.system import host_available

# Hugging Face config.json fields of the real models (the peer script builds transformers models from these)
PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "opt-13b": dict(
        model_type="opt", vocab_size=50272, hidden_size=5120, ffn_dim=20480, num_hidden_layers=40,
        num_attention_heads=40, max_position_embeddings=2048, word_embed_proj_dim=5120, do_layer_norm_before=True,
        activation_function="relu", bos_token_id=2, eos_token_id=2, pad_token_id=1,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen2.5-Coder-Instruct (q/k/v biases; GQA 7:1 and 6:1): the shapes of the real models `just qwen` converts
    "qwen2.5-coder-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen2.5-coder-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
    # Gemma 3: one global layer in six, the others slide over 512 (270M) or 1024 (4B) tokens on the device
    "gemma-3-270m": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    ),
    "gemma-3-4b": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=1024, query_pre_attn_scalar=256,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
}  # fmt: skip
# SmolLM2-135M's shapes in 4 layers (two dense, two speculated): benchmarks/gpu.sh's rehearsals on a CPU, where every
# layer's kernels run in Triton's interpreter
PRESETS["smollm2-4l"] = {**PRESETS["smollm2-135m"], "num_hidden_layers": 4}
PARTIAL_RATIO = 0.3  # synthetic partial columns per head, as in converted bundles


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise InfinigenError(f"unknown --synthetic preset {name!r}; available: {', '.join(PRESETS)}")
    return ModelConfig.from_hf(PRESETS[name])


@torch.no_grad()
def synthetic_engine(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Engine:
    """A random-weight model of a preset's shapes, built straight on the device, with random orthogonal skews."""
    from infinigen_rt.bundle import InfinigenDefaults, dense_layers_for, partial_idx_name, partial_q_name, skew_name
    from infinigen_rt.models import MODELS, fuse
    from infinigen_rt.models.gemma3 import Gemma3
    from infinigen_rt.models.llama import Llama, rope_inv_freq

    cfg = preset_config(name)
    with torch.device("meta"):
        model = MODELS[cfg.arch](cfg)
    need = sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=dtype).element_size()
    have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_available()
    if need > 0.9 * have:
        where = "free on the GPU" if device.type == "cuda" else "available in host memory"
        raise InfinigenError(
            f"{name} in {str(dtype).removeprefix('torch.')} needs {need / 2**30:.1f} GiB of weights, "
            f"{have / 2**30:.1f} GiB is {where}; use a smaller preset or another device"
        )
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=gen)
        else:  # norm scales 1 (Gemma's norms scale by 1 + weight), biases 0
            norm = "norm" in pname and pname.endswith("weight") and cfg.arch != "gemma3"
            p.fill_(1.0 if norm else 0.0)
    fuse(model)
    if isinstance(model, Llama):
        model.inv_freq = rope_inv_freq(cfg).to(device)
    elif isinstance(model, Gemma3):
        model.rope_buffers()
    model.eval()
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    d_prime = max(1, math.ceil(PARTIAL_RATIO * d))
    cpu = torch.Generator().manual_seed(seed)
    tensors = {}
    for j in range(cfg.num_hidden_layers):
        tensors[partial_idx_name(j)] = torch.arange(d_prime).repeat(hkv, 1)
        if cfg.arch != "opt":
            tensors[skew_name(j)] = torch.linalg.qr(torch.randn(hkv, d, d, generator=cpu))[0]
        else:
            tensors[partial_q_name(j, "weight")] = torch.randn(cfg.num_attention_heads * d_prime, cfg.hidden_size,
                                                               generator=cpu) * 0.02  # fmt: skip
            tensors[partial_q_name(j, "bias")] = torch.zeros(cfg.num_attention_heads * d_prime)
    defaults = InfinigenDefaults(alpha=math.inf, dense_layers=dense_layers_for(cfg.num_hidden_layers))
    return Engine.from_model(cfg, model, device, dtype, speculation=Speculation(tensors, defaults))

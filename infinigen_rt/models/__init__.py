"""Model classes by architecture, and loading a bundle's weights into one."""

from __future__ import annotations

import torch

from infinigen_rt.bundle import Bundle, load_weights
from infinigen_rt.errors import InfinigenError
from infinigen_rt.kv import cpu
from infinigen_rt.models.gemma3 import Gemma3
from infinigen_rt.models.llama import MLP, Attention, Linear, Llama, rope_inv_freq
from infinigen_rt.models.opt import OPT
from infinigen_rt.tp import TP, shard_config

MODELS = {"llama": Llama, "gemma3": Gemma3, "opt": OPT}


def load_model(
    bundle: Bundle, device, dtype: torch.dtype, tp: TP | None = None, narrow: bool = True
) -> torch.nn.Module:
    """Build on the meta device, then assign the bundle's tensors: no second copy, no random init. `tp`: this
    rank's slices only, and an all-reduce after each attention output and MLP (tp.py). `narrow`: a bundle's
    half-width matrices stay so where a CPU's kernel reads them (keeps_narrow); False: every tensor in `dtype`
    (calibration's passes, all prefill, would widen them at every call)."""
    cfg = shard_config(bundle.config, tp)
    with torch.device("meta"):
        model = MODELS[cfg.arch](cfg) if tp is None else MODELS[cfg.arch](cfg, tp.all_reduce)
    kept = narrow_names(model, cfg) if narrow and keeps_narrow(device, dtype) else frozenset()
    state = load_weights(bundle, device, dtype, tp, kept)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = set(shapes)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise InfinigenError(f"bundle weights do not fit a {cfg.arch} model ({what}); re-convert the model")
    for name, t in state.items():
        if t.shape != shapes[name]:
            raise InfinigenError(
                f"bundle tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(shapes[name])}"
            )
    model.load_state_dict(state, assign=True)
    if model.embed_tokens.weight.dtype != dtype:  # a tied head's, kept narrow: its rows widened as they are looked up
        model.embed_tokens.out_dtype = dtype
    fuse(model)
    if isinstance(model, Llama):
        model.inv_freq = rope_inv_freq(cfg).to(device)  # non-persistent buffer: recompute off meta
    elif isinstance(model, Gemma3):
        model.rope_buffers()
    return model.eval()


def fuse(model: torch.nn.Module) -> None:
    """A decode step's q, k and v one matrix multiply, gate and up one (Attention.fuse, MLP.fuse): on a CPU one call
    of the linear kernel, on a GPU one cuBLAS call instead of three and two."""
    for m in model.modules():
        if isinstance(m, Attention | MLP):
            m.fuse()


def keeps_narrow(device, dtype: torch.dtype) -> bool:
    """Whether a model computing in `dtype` on `device` keeps a bundle's float16 and bfloat16 matrices as they are:
    float32 on a CPU whose linear kernel reads them (cpu.narrow_weights). A decode step then reads half the bytes for
    its weights and computes the same sums, since every narrow value widens to float32 exactly (a matrix read from
    memory takes about as much less time as it has fewer bytes); elsewhere they are widened once, here."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and cpu.narrow_weights()


def narrow_names(model: torch.nn.Module, cfg) -> frozenset[str]:
    """The tensors a model reads only through `linear` (kv/cpu.py's kernel, or F.linear on a widened copy where the
    kernel does not apply): each Linear's weight, and the token embeddings where the head is tied to them."""
    names = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    if cfg.tie_word_embeddings:
        names.add("embed_tokens.weight")
    return frozenset(names)

"""Model classes by architecture, and loading a bundle's weights into one."""

from __future__ import annotations

import torch

from infinigen_rt.bundle import Bundle, load_weights
from infinigen_rt.errors import InfinigenError
from infinigen_rt.models.gemma3 import Gemma3
from infinigen_rt.models.llama import Llama, rope_inv_freq
from infinigen_rt.models.opt import OPT
from infinigen_rt.tp import TP, shard_config

MODELS = {"llama": Llama, "gemma3": Gemma3, "opt": OPT}


def load_model(bundle: Bundle, device, dtype: torch.dtype, tp: TP | None = None) -> torch.nn.Module:
    """Build on the meta device, then assign the bundle's tensors: no second copy, no random init. `tp`: this
    rank's slices only, and an all-reduce after each attention output and MLP (tp.py)."""
    cfg = shard_config(bundle.config, tp)
    with torch.device("meta"):
        model = MODELS[cfg.arch](cfg) if tp is None else MODELS[cfg.arch](cfg, tp.all_reduce)
    state = load_weights(bundle, device, dtype, tp)
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
    if isinstance(model, Llama):
        model.inv_freq = rope_inv_freq(cfg).to(device)  # non-persistent buffer: recompute off meta
    elif isinstance(model, Gemma3):
        model.rope_buffers()
    return model.eval()

"""The engine: a bundle loaded once for a device and dtype, frozen after load. It holds what every request shares
(config, model, tokenizer, device, dtype, tensor-parallel group, the InfiniGen tensors on the device) and runs
nothing itself: a request's KV policy is a `policies.Policy` made against it, the model runs in step.py, and
requests run through runner.py."""

from __future__ import annotations

import torch

from infinigen_rt.bundle import DTYPES, Bundle, load_infinigen
from infinigen_rt.errors import InfinigenError
from infinigen_rt.models import load_model
from infinigen_rt.system import keep_host_heap, resolve_device
from infinigen_rt.tokenizer import Tokenizer
from infinigen_rt.tp import TP, shard_config, shard_speculation

DENSE_LAYERS = 2  # layers attending to everything when a bundle does not say


def resolve_dtype(dtype: str, bundle_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # CPUs compute half precision slowly: use fp32 there
        return bundle_dtype if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InfinigenError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Engine:
    """See the module docstring. `speculation`: (InfiniGen tensors by bundle name on the device, their defaults),
    or None for a bundle converted without them; `dense_layers`: the bundle's default count of dense layers."""

    def __init__(self, bundle: Bundle, device: str = "auto", dtype: str = "auto", tp: TP | None = None):
        """`tp`: this process is one rank of a tensor-parallel group (tp.py): its model, caches and speculation
        hold its share of the heads (`cfg` is that share), and every rank runs the same steps."""
        self.bundle, self.tp = bundle, tp
        self.cfg = shard_config(bundle.config, tp)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, bundle.dtype, self.device)
        if self.device.type == "cpu":
            keep_host_heap()
        info = bundle.meta.get("infinigen")
        self.speculation = None
        if info:  # on the device once: every request's cache uses the same tensors
            self.speculation = shard_speculation(load_infinigen(bundle, self.device), tp), info["defaults"]
        self.dense_layers = self.speculation[1]["dense_layers"] if self.speculation else DENSE_LAYERS
        self.tokenizer = Tokenizer(bundle)
        self.model = load_model(bundle, self.device, self.dtype, tp)

    @classmethod
    def from_model(
        cls, cfg, model, device: torch.device, dtype: torch.dtype, speculation: tuple[dict, dict] | None = None,
    ) -> Engine:  # fmt: skip
        """An engine around a model built in memory (synthetic benchmarks): no bundle and no tokenizer.
        `speculation` is (InfiniGen tensors by bundle name, {"alpha", "dense_layers"})."""
        self = cls.__new__(cls)
        if torch.device(device).type == "cpu":
            keep_host_heap()
        self.bundle, self.cfg, self.device, self.dtype, self.tp = None, cfg, torch.device(device), dtype, None
        self.model, self.tokenizer = model, None
        if speculation is not None:  # on the device once, as a bundle's are
            speculation = {k: t.to(self.device) for k, t in speculation[0].items()}, speculation[1]
        self.speculation = speculation
        self.dense_layers = speculation[1]["dense_layers"] if speculation else DENSE_LAYERS
        return self

    def require_speculation(self) -> None:
        """A one-line error when the bundle has no InfiniGen tensors (a speculating policy needs them)."""
        if self.speculation is None:
            where = f"bundle {self.bundle.path}" if self.bundle is not None else "this model"
            raise InfinigenError(f"{where} has no InfiniGen tensors (converted with --no-infinigen); re-convert it "
                                 "without that flag, or use --policy full/offload")  # fmt: skip

"""The engine: a bundle loaded once for a device and dtype, frozen after load. It holds what every request shares
(config, model, tokenizer, device, dtype, tensor-parallel group, the InfiniGen tensors and the Speculator built from
them, on the device) and runs
nothing itself: a request's KV policy is a `policies.Policy` made against it, the model runs in step.py, and
requests run through runner.py."""

from __future__ import annotations

from typing import NamedTuple

import torch

from infinigen_rt.bundle import DENSE_LAYERS, Bundle, InfinigenDefaults, load_infinigen, no_infinigen
from infinigen_rt.models import load_model
from infinigen_rt.system import keep_host_heap, resolve_device, resolve_dtype
from infinigen_rt.tokenizer import Tokenizer
from infinigen_rt.tp import TP, shard_config, shard_speculation


class Speculation(NamedTuple):
    tensors: dict[str, torch.Tensor]  # the InfiniGen tensors by bundle name, on the compute device
    defaults: InfinigenDefaults  # what a run leaves unset


class Engine:
    """See the module docstring. `speculation`: None for a bundle converted without InfiniGen tensors;
    `dense_layers`: the bundle's default count of dense layers."""

    def __init__(self, bundle: Bundle, device: str = "auto", dtype: str = "auto", tp: TP | None = None):
        """`tp`: this process is one rank of a tensor-parallel group (tp.py): its model, caches and speculation
        hold its share of the heads (`cfg` is that share), and every rank runs the same steps."""
        self.bundle, self.tp = bundle, tp
        self.cfg = shard_config(bundle.config, tp)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, bundle.dtype, self.device)
        if self.device.type == "cpu":
            keep_host_heap()
        self.speculation = None
        if bundle.infinigen is not None:  # on the device once: every request's cache uses the same tensors
            tensors = shard_speculation(load_infinigen(bundle, self.device), tp)
            self.speculation = Speculation(tensors, bundle.infinigen.defaults)
        self.dense_layers = bundle.dense_layers
        self.tokenizer = Tokenizer(bundle)
        self.model = load_model(bundle, self.device, self.dtype, tp)
        self.speculator = self._speculator()

    @classmethod
    def from_model(
        cls, cfg, model, device: torch.device, dtype: torch.dtype, speculation: Speculation | None = None,
    ) -> Engine:  # fmt: skip
        """An engine around a model built in memory (synthetic benchmarks): no bundle and no tokenizer."""
        self = cls.__new__(cls)
        if torch.device(device).type == "cpu":
            keep_host_heap()
        self.bundle, self.cfg, self.device, self.dtype, self.tp = None, cfg, torch.device(device), dtype, None
        self.model, self.tokenizer = model, None
        if speculation is not None:  # on the device once, as a bundle's are
            speculation = Speculation({k: t.to(self.device) for k, t in speculation.tensors.items()},
                                      speculation.defaults)  # fmt: skip
        self.speculation = speculation
        self.dense_layers = speculation.defaults.dense_layers if speculation else DENSE_LAYERS
        self.speculator = self._speculator()
        return self

    def _speculator(self):
        """The speculation pieces every request's InfiniGen cache uses (policies/speculation.py), built once."""
        if self.speculation is None:
            return None
        from infinigen_rt.policies.speculation import Speculator

        return Speculator(self.cfg, self.model.speculation_taps(), self.speculation.tensors, self.device, self.dtype)

    def require_speculation(self) -> None:
        """A one-line error when the bundle has no InfiniGen tensors (a speculating policy needs them)."""
        if self.speculation is None:  # (a synthetic model always has them)
            raise no_infinigen(self.bundle)

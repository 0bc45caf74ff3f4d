"""What moved, per request: the counts a store adds each step (bytes each way, rows fetched, evictions, a policy's
own), kept as they come (host numbers, or device tensors never read inside a step) and summed when a report asks."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

LEDGER_HELD = 4096  # host counts a ledger keeps before it sums them (see Ledger.add)


class Ledger:
    """What moved, per request: counts added each step (host ints, or device tensors [B] of the step's rows), read
    to the host in one copy when a report asks (never inside a decode step)."""

    def __init__(self):
        self.pending: list[tuple[str, list[int], torch.Tensor, float]] = []
        self.later: list[tuple[str, tuple[int, ...], object, float]] = []  # host counts not yet summed (see add)
        self.total: dict[tuple[str, int], float] = defaultdict(float)
        self.top: dict[tuple[str, int], float] = {}
        self.tap: list | None = None  # while a decode step is captured in a CUDA graph: its adds (graphs.py)

    def add(self, key: str, rids: list[int], counts, scale: float = 1.0) -> None:
        """counts (times `scale`): a number for every row, or [B] (host or device: a device tensor is kept as it is,
        no launch)."""
        if self.tap is not None:
            self.tap.append((key, rids, counts, scale))
            return
        if isinstance(counts, torch.Tensor):
            if counts.device.type != "cpu":
                self.pending.append((key, rids, counts, scale))
                return
            counts = counts.tolist()
        elif isinstance(counts, np.ndarray):
            counts = counts.tolist()
        # plain Python from here: a few calls a layer and request, each step (numpy's per-call overhead is larger
        # than the work); summed when read, not one by one
        if isinstance(counts, list) and len(counts) not in (1, len(rids)):
            raise ValueError(f"{len(counts)} counts for {len(rids)} requests")
        self.later.append((key, tuple(rids), counts, scale))  # (as they are now)
        if len(self.later) >= LEDGER_HELD:
            self._sum()

    def _sum(self) -> None:
        later, self.later = self.later, []
        for key, rids, counts, scale in later:
            if not isinstance(counts, list):
                counts = [counts] * len(rids)
            elif len(counts) == 1:
                counts = counts * len(rids)
            for r, c in zip(rids, counts, strict=True):
                self._put(key, r, float(c) * scale)

    def _put(self, key: str, rid: int, c: float) -> None:
        self.total[key, rid] += c
        self.top[key, rid] = max(self.top.get((key, rid), c), c)

    def settle(self) -> None:
        self._sum()
        if not self.pending:
            return
        got = torch.cat([c.double().reshape(-1) for _, _, c, _ in self.pending]).tolist()
        at = 0
        for key, rids, _, scale in self.pending:
            for r in rids:
                self._put(key, r, got[at] * scale)
                at += 1
        self.pending = []

    def get(self, key: str, rid: int) -> float:
        self._sum()
        return self.total.get((key, rid), 0.0)

    def max(self, key: str, rid: int) -> float | None:
        self._sum()
        return self.top.get((key, rid))

    def forget(self, rid: int) -> None:
        self.settle()
        for d in (self.total, self.top):
            for k in [k for k in d if k[1] == rid]:
                del d[k]

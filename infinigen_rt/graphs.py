"""Decode steps replayed from CUDA graphs, as vLLM and SGLang replay decode: one graph per shape of step (the batch,
the bucket of tokens its table, attention and selection are sized for: kv/store.bucket_end), captured the second
time that shape comes and replayed from then on; the host's part of a step (its slots and tables, written into the
same staging buffers every step: kv/store.py) runs before each replay, eagerly. Eager stays the reference and the
fallback: a step whose device work cannot be replayed (`Selector.graphs`), a shape seen once, or a step whose inputs
are not where the graph read them (a staging buffer grew) runs eagerly and is captured again; a shape whose inputs
keep moving is left eager. `measure/capture.py` names what stops a policy's step from being replayed; the tests hold
graphed tokens to eager ones under fake CUDA (tests/rt/test_graphs.py), and `benchmarks/gpu.sh graphs` on a GPU."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from infinigen_rt.kv.cache import KVCache

MOVES = 2  # a shape whose inputs moved more often after a capture stays eager


def _where(inputs: list[torch.Tensor]) -> tuple:
    """The addresses a graph reads its inputs at."""
    return tuple(t.data_ptr() for t in inputs)


class _Begun(KVCache):
    """A decode step whose host part (`prepare`) ran already, eagerly, before the graph, and whose `end` runs after
    it: the device part of its begin and the layers' calls go into the graph."""

    def __init__(self, step):
        self.step = step

    def begin(self, positions) -> None:
        self.step.begin_device()

    def observe(self, layer, x) -> None:
        self.step.observe(layer, x)

    def attend(self, layer, q, k, v) -> torch.Tensor:
        return self.step.attend(layer, q, k, v)


@dataclass
class _Captured:
    graph: object
    logits: torch.Tensor  # the graph's output: [B, V]
    where: tuple  # the addresses of what it reads from outside (inputs, staged tables)
    counts: list  # the ledger's adds the step made while captured: (key, a number, or a slice of `flat`, scale)
    flat: torch.Tensor | None  # the device counts among them, one float64 buffer the graph fills


@dataclass
class GraphStats:
    captured: int = 0
    replayed: int = 0
    eager: int = 0  # graphable steps run eagerly (a shape's first, or inputs moved)
    moved: dict = field(default_factory=dict)  # shape -> how often its inputs moved after a capture
    failed: list = field(default_factory=list)  # why captures failed (their shapes then run eagerly)


class StepGraphs:
    """A runner's decode-step graphs (see the module docstring), sharing one memory pool (one replays at a time)."""

    def __init__(self, engine):
        self.engine = engine
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: set[tuple] = set()
        self.broken: set[tuple] = set()  # shapes whose capture failed
        self.pool = None
        self.stats = GraphStats()

    def step(self, step, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of `step` (a store.StoreStep whose device work a graph may replay) over ids and positions
        [B, 1] (the same device buffers every step): its logits [B, V]."""
        step.prepare(positions)
        inputs = [ids, positions, *step.graph_inputs()]
        key = (step.batch.longest, step.t if step.bucketed else None, *((tuple(t.shape), t.dtype) for t in inputs))
        where = _where(inputs)
        got = self.graphs.get(key)
        if got is not None and got.where != where:  # its inputs moved (a staging buffer grew, or a copy from one was
            del self.graphs[key]  # not done yet): never replayed against other memory; eager now, captured again next
            got = None
            self.stats.moved[key] = self.stats.moved.get(key, 0) + 1
            self.seen.discard(key)
        if got is None:
            # a shape's first step warms up what a capture must not do (kernels compiled, library handles made)
            if key not in self.seen or self.stats.moved.get(key, 0) > MOVES or key in self.broken:
                return self._eager(step, ids, positions, key)
            try:
                got = self.graphs[key] = self._capture(step, ids, positions, where)
            except RuntimeError as e:  # nothing ran while capturing: the step runs eagerly, and its shape from now on
                self.broken.add(key)
                self.stats.failed.append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                if len(self.stats.failed) == 1:
                    warnings.warn(f"a decode step could not be captured in a CUDA graph; it runs eagerly "
                                  f"({self.stats.failed[0]})", stacklevel=2)  # fmt: skip
                return self._eager(step, ids, positions, key)
        got.graph.replay()
        self.stats.replayed += 1
        _counted(step.store.ledger, got, step.rids)
        step.end()
        return got.logits

    def _eager(self, step, ids, positions, key) -> torch.Tensor:
        self.seen.add(key)
        self.stats.eager += 1
        logits = self._forward(step, ids, positions)
        step.end()
        return logits

    def _forward(self, step, ids, positions) -> torch.Tensor:
        return self.engine.model(ids, positions, _Begun(step), last_only=True)[:, -1]

    def _capture(self, step, ids, positions, where: tuple) -> _Captured:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        ledger = step.store.ledger
        ledger.tap = []  # the counts the step adds: a replay adds them again (_counted)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(step, ids, positions)
                counts, flat = _flattened(ledger.tap)
        finally:
            ledger.tap = None
        self.stats.captured += 1
        return _Captured(graph, logits, where, counts, flat)


def _flattened(tap: list) -> tuple[list, torch.Tensor | None]:
    """The ledger's adds made while capturing (Ledger.tap: key, rids, counts, scale), their device counts as slices
    of one float64 buffer that the graph fills (read when a report asks, as the ledger reads its device counts)."""
    device = [c for _, _, c, _ in tap if isinstance(c, torch.Tensor) and c.device.type != "cpu"]
    flat = torch.cat([c.double().reshape(-1) for c in device]) if device else None
    out, at = [], 0
    for key, _, c, scale in tap:
        if isinstance(c, torch.Tensor) and c.device.type != "cpu":
            out.append((key, slice(at, at + c.numel()), scale))
            at += c.numel()
        else:
            out.append((key, c, scale))
    return out, flat


def _counted(ledger, got: _Captured, rids: list[int]) -> None:
    """A replay's counts into the ledger: the numbers as captured (the step's shape fixes them), the device counts
    from a copy of the graph's buffer (the next replay overwrites it)."""
    flat = got.flat.clone() if got.flat is not None else None
    for key, c, scale in got.counts:
        ledger.add(key, rids, flat[c] if isinstance(c, slice) else c, scale)

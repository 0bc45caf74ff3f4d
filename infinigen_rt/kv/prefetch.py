"""How a speculated layer's rows move while the layer before it computes.

`start(layer, fn, *args)` runs fn (the selection and the copy it starts) off the critical path; `result(layer)`
returns fn's result once the layer may use it. Three ways, one interface:
  Inline        fn runs at once (a CPU with one thread: nothing to overlap with)
  WorkerThread  fn runs on this cache's own worker thread (a CPU with a core to spare: torch ops release the
                GIL, so layer j's selection and row gather run on the second core while layer j-1 computes)
  SideStream    fn's kernels run on a CUDA side stream that first waits for the compute stream; the compute
                stream waits for that layer's event only, when the layer takes its rows
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class Prefetch:
    def __init__(self):
        self.pending: dict[int, Any] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.pending

    def start(self, layer: int, fn, *args) -> None:
        self.pending[layer] = fn(*args)

    def result(self, layer: int):
        return self.pending.pop(layer)

    def close(self) -> None:
        self.pending.clear()


Inline = Prefetch


class WorkerThread(Prefetch):
    """A worker thread of its own, shut down by `close` (or when the prefetcher is collected)."""

    def __init__(self):
        super().__init__()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-prefetch")
        self._finalizer = weakref.finalize(self, self.pool.shutdown, wait=False)

    def start(self, layer: int, fn, *args) -> None:
        self.pending[layer] = self.pool.submit(fn, *args)

    def result(self, layer: int):
        out = self.pending.pop(layer)
        return out.result() if isinstance(out, Future) else out

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        super().close()
        self._finalizer()


class SideStream(Prefetch):
    """fn's kernels on a side stream; each layer's rows are ready when its event is, and no host sync waits."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.stream = device, torch.cuda.Stream(device)

    def start(self, layer: int, fn, *args) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # fn reads what the compute stream wrote (its input, the pools)
        for a in args:  # inputs made on the compute stream stay alive until the side stream is done with them
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = fn(*args)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending[layer] = (out, done)

    def result(self, layer: int):
        out, done = self.pending.pop(layer)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for t in _tensors(out):  # made on the side stream, used on the compute stream
            if t.is_cuda:
                t.record_stream(compute)
        return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def prefetcher(device: torch.device, overlap: bool = True) -> Prefetch:
    """The way rows move on `device` (`overlap` False: inline, as on a one-thread CPU)."""
    if device.type == "cuda":
        return SideStream(device)
    return WorkerThread() if overlap and torch.get_num_threads() > 1 else Inline()

"""How a speculated layer's rows move while the layer before it computes.

`start(layer, fn, *args, copy=None)` runs fn, then copy(fn's result) when given (the selection, then the copy of
the rows it chose), off the critical path; `result(layer)` returns the last stage's result once the layer may use
it. Three ways, one interface:
  Inline        both run at once (a CPU with one thread: nothing to overlap with)
  WorkerThread  both run on a worker thread (a CPU with a core to spare: torch ops release the GIL, so layer j's
                selection and row gather run on the second core while layer j-1 computes)
  SideStream    fn's kernels run on the compute stream and the copy's on a CUDA side stream that waits for them
                (without a copy stage, fn runs there); the compute stream waits for that layer's event only, when
                the layer takes its rows. The selection on the compute stream: the side stream carries only copies,
                so layer j+1's copy never queues behind layer j+1's selection and the link stays busy (projected at
                Llama-3.1-8B 32k with int4 keys: 1.58x the step's floor with both on the side stream, 1.07x so)
A runner makes one and gives each request's cache a `Lane` of it: one side stream or worker thread for the batch,
and runs each decode step inside its `sharing()` (a worker thread's core is then not the step's).

`start(..., defer=True)` holds both stages back until `flush()` (or the layer's result). On a side stream: layer j's
correction issues the gather of its rows there (`side(key, fn)`), then the flush runs layer j+1's selection on the
compute stream while those rows cross, and queues j+1's copy behind them on the link; the compute stream waits for
the correction's rows (`result(key)`) only when layer j attends. The link so carries layer j's correction first (the
rows layer j waits for) and the compute stream does not stand still while they cross. On a worker thread:
`beside(fn)` hands it a share of layer j's correction first, and where attention reads the rows in the pool (a CPU:
store.PoolRows) a share of layer j's attention (the two threads take the pairs from one counter), then the held
stages start; the worker, idle while the compute thread did those alone, now shares them; and the other way round,
a compute thread that asks for a layer's result before the worker is done takes pairs of the kernel call the worker
offers (a CPU's speculation: cpu.take_offered) rather than wait idle. An inline prefetcher runs every stage at once.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from infinigen_rt.kv import cpu


class Prefetch:
    side_stream = False  # its copies run on a CUDA side stream

    def __init__(self):
        self.pending: dict[Any, Any] = {}  # key (a layer, or a lane's (lane, layer)) -> what start made

    def __contains__(self, layer) -> bool:
        return layer in self.pending

    def lane(self) -> Lane:
        """A cache's share of this prefetcher (one per runner: its caches' copies on one side stream or worker)."""
        return Lane(self)

    def drop(self, keys) -> None:
        """Forget what was started under `keys` (a closed cache's)."""
        for k in keys:
            self.pending.pop(k, None)

    def start(self, layer: int, fn, *args, copy=None, defer: bool = False) -> None:
        self.pending[layer] = _staged(fn, args, copy)

    def flush(self) -> None:
        """Start the copies held back (`defer`)."""

    def beside(self, fn, then: bool = True) -> Future | None:
        """Hand fn (a share of work on the critical path that the compute thread also takes part in) to the thread
        beside the compute thread, ahead of the stages held back (`defer`), which then start (`then` False: they
        wait for a later share, or `flush`): its Future, or None where no thread is beside it (inline, a side
        stream: then nothing starts)."""
        return None

    def sharing(self):
        """Around a decode step: what the compute thread may use while this prefetcher works beside it (nothing to
        change but for a worker thread, below)."""
        return nullcontext()

    def result(self, layer: int):
        return self.pending.pop(layer)

    def close(self) -> None:
        self.pending.clear()


Inline = Prefetch


class WorkerThread(Prefetch):
    """A worker thread of its own, shut down by `close` (or when the prefetcher is collected)."""

    def __init__(self):
        super().__init__()
        # its torch ops on its own thread alone: torch's thread count is each thread's own (OpenMP's), so the worker
        # kept the two it started with, and its ops (the speculated query's matmul, the scoring split in two)
        # ran a second team of threads beside the compute thread's (SmolLM2 8k, batch 8: 4 % of the step, twice)
        self.thread: dict[str, int] = {}  # its ident, once it has started (cpu.take_offered)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-prefetch",
                                       initializer=_worker_started, initargs=(self.thread,))  # fmt: skip
        self.used = False  # has been given work (see sharing)
        self.held: dict[Any, tuple] = {}  # the stages deferred: layer -> (fn, its arguments, copy)
        self._finalizer = weakref.finalize(self, self.pool.shutdown, wait=False)

    def start(self, layer: int, fn, *args, copy=None, defer: bool = False) -> None:
        self.used = True
        if defer:  # both stages wait for `flush` or `beside`: the share of the critical path goes first
            self.held[layer] = (fn, args, copy)
            return
        self.pending[layer] = self.pool.submit(_staged, fn, args, copy)

    def flush(self) -> None:
        for layer, (fn, args, copy) in list(self.held.items()):
            self.pending[layer] = self.pool.submit(_staged, fn, args, copy)
        self.held.clear()

    def beside(self, fn, then: bool = True) -> Future:
        share = self.pool.submit(fn)
        if then:
            self.flush()
        return share

    def __contains__(self, layer) -> bool:
        return layer in self.pending or layer in self.held

    @contextmanager
    def sharing(self):
        """Once the worker has work (a speculative policy decodes), the decode step's own ops run on one core fewer
        than torch's threads, restored after: the worker's speculation and copies take the core left. Both on every
        core oversubscribe the machine: the step's matmuls slow down beside the worker by more than the second
        thread gives them."""
        n = torch.get_num_threads()
        if not self.used or n < 2:
            yield
            return
        torch.set_num_threads(n - 1)
        try:
            with cpu.lending(lambda fn: self.beside(fn, then=False)):  # (a head's rows; an MLP's at batch 8)
                yield
        finally:
            torch.set_num_threads(n)

    def result(self, layer: int):
        if layer in self.held:
            self.flush()
        out = self.pending.pop(layer)
        if not isinstance(out, Future):
            return out
        if not out.done():  # the wait: spent on the worker's offered kernel call, where it makes one (speculation's)
            cpu.take_offered(self.thread.get("ident"), out)
        return out.result()

    def drop(self, keys) -> None:
        for k in keys:
            self.held.pop(k, None)
            f = self.pending.pop(k, None)
            if isinstance(f, Future):
                f.cancel()

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        self.held.clear()
        super().close()
        self._finalizer()


class SideStream(Prefetch):
    """fn's kernels on a side stream; each layer's rows are ready when its event is, and no host sync waits."""

    side_stream = True

    def __init__(self, device: torch.device):
        super().__init__()
        # above the compute stream's priority: the block scheduler starts the copy's few programs (kernels.gather_grid)
        # as soon as an SM frees, rather than behind every block of the compute kernels queued before them
        self.device, self.stream = device, torch.cuda.Stream(device, priority=-1)
        self.held: dict[Any, tuple] = {}  # the copies deferred: layer -> (copy, its argument)

    def start(self, layer: int, fn, *args, copy=None, defer: bool = False) -> None:
        if defer:  # both stages wait for `flush`: the caller's copy (`side`) first on the link, these kernels beside it
            self.held[layer] = (fn, args, copy)
            return
        self._staged(layer, fn, args, copy)

    def flush(self) -> None:
        for layer, (fn, args, copy) in list(self.held.items()):
            self._staged(layer, fn, args, copy)
        self.held.clear()

    def side(self, key, fn, *args) -> None:
        """fn(*args) on the side stream now, after what the compute stream has issued; `result(key)` makes the compute
        stream wait for it."""
        self._side(key, fn, args)

    def _staged(self, layer, fn, args, copy) -> None:
        if copy is not None:  # the first stage on the compute stream, the copy on the side stream
            args, fn = (fn(*args),), copy
        self._side(layer, fn, args)

    def _side(self, layer, fn, args) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # fn reads what the compute stream wrote (its input, the pools)
        for a in _tensors(args):  # inputs made on the compute stream stay alive until the side stream is done with them
            if a.is_cuda:
                a.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = fn(*args)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending[layer] = (out, done)

    def __contains__(self, layer) -> bool:
        return layer in self.pending or layer in self.held

    def drop(self, keys) -> None:
        for k in keys:
            self.held.pop(k, None)
        super().drop(keys)

    def close(self) -> None:
        self.held.clear()
        super().close()

    def result(self, layer: int):
        out = self.peek(layer)
        _, done = self.pending.pop(layer)
        torch.cuda.current_stream(self.device).wait_event(done)
        return out

    def peek(self, layer):
        """What `result(layer)` returns, without the compute stream waiting for it: tensors the side stream has yet to
        write, to hand back to it (`side`) before the compute stream reads them (`result`)."""
        if layer in self.held:
            self.flush()
        out, _ = self.pending[layer]
        compute = torch.cuda.current_stream(self.device)
        for t in _tensors(out):  # made on the side stream, used on the compute stream
            if t.is_cuda:
                t.record_stream(compute)
        return out


class Lane:
    """One cache's layers on a shared prefetcher: the same interface, its keys its own, so that the caches of a
    runner's requests (each starting layer j in the same step) share one side stream or worker thread."""

    def __init__(self, base: Prefetch):
        self.base, self.keys = base, set()
        self.side_stream = base.side_stream

    def __contains__(self, layer: int) -> bool:
        return (self, layer) in self.base

    def start(self, layer: int, fn, *args, copy=None, defer: bool = False) -> None:
        self.keys.add((self, layer))
        self.base.start((self, layer), fn, *args, copy=copy, defer=defer)

    def flush(self) -> None:
        self.base.flush()

    def beside(self, fn, then: bool = True) -> Future | None:
        return self.base.beside(fn, then)

    def side(self, key, fn, *args) -> None:
        self.keys.add((self, key))
        self.base.side((self, key), fn, *args)

    def peek(self, layer: int):
        return self.base.peek((self, layer))

    def result(self, layer: int):
        self.keys.discard((self, layer))
        return self.base.result((self, layer))

    def close(self) -> None:
        self.base.drop(self.keys)
        self.keys.clear()


def _worker_started(box: dict) -> None:
    """A worker thread's start: torch's ops on it run on one thread (see WorkerThread), and its ident recorded."""
    torch.set_num_threads(1)
    box["ident"] = threading.get_ident()


def _staged(fn, args, copy):
    out = fn(*args)
    return out if copy is None else copy(out)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def engine_prefetcher(engine) -> Prefetch:
    """The way an engine's rows move: on a CPU under tensor parallelism inline (every rank's collectives in the
    same order), else overlapped with compute."""
    return prefetcher(engine.device, overlap=engine.tp is None or engine.device.type == "cuda")


def prefetcher(device: torch.device, overlap: bool = True) -> Prefetch:
    """The way rows move on `device` (`overlap` False: inline, as on a one-thread CPU)."""
    if device.type == "cuda":
        return SideStream(device)
    return WorkerThread() if overlap and torch.get_num_threads() > 1 else Inline()

"""Fake CUDA: the runtime's GPU code path, run by the normal test suite on a machine without a GPU.

    with FakeCuda() as gpu:                      # tensors on cuda:N are CPU tensors in disguise: real values
        engine = Engine(bundle, device="cuda", dtype="float32", policy="infinigen")
        with gpu.region("decode") as step:
            runner.step()
        assert len(step.syncs) == 1 and not gpu.races

    with FakeCuda(values=False) as gpu:          # every tensor a meta tensor in disguise: real shapes for free
        engine = synthetic_engine("llama-2-7b", torch.device("cuda"), torch.float16)

The stand-in runs every operator of the code under test through a dispatch mode that keeps each tensor's device
as the code sees it and computes on CPU tensors (`values=True`: tiny shapes, real tokens, Triton kernels through
its interpreter) or on meta tensors (`values=False`: Llama-2-7B at 4 x 32k in a second, nothing ever known of a
value). It checks what a GPU would refuse, and what a GPU user needs of the code:

- devices: an operator mixing devices raises as CUDA does (CPU scalars, and CPU index tensors, which CUDA copies
  over with a wait, excepted);
- host syncs, each with where it happened: a read of a device value (`.item()`, `.tolist()`, `int()`, a
  data-dependent shape), a copy between host and pageable memory that is not asynchronous, `synchronize`;
- kernel launches (the Triton kernels' `run`, as their launcher sees them): on the current device, every pointer
  on it or in page-locked host memory, every tensor contiguous; each launch's specialisation key (`kernel_keys`);
- streams: each access to memory is checked against other streams' accesses with vector clocks (events, waits,
  host syncs); memory freed while another stream may still use it (no `record_stream`) is a race too;
- memory, as the caching allocator keeps it: live and peak bytes per device, blocks freed with uses recorded on
  other streams held until the host knows those streams passed them, capacity (then torch.OutOfMemoryError);
  page-locked host memory, whose registration fails past `host_limit` with CUDA error 2 and leaves the runtime's
  last error set, as the real runtime does: the next operator on the device raises it unless it was cleared.

Only for a CPU-only build of torch (a small C++ device guard is compiled and loaded: fakecuda_guard.cpp, beside
this file).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from infinigen_rt.kv.kernels import BODIES
from infinigen_rt.measure.projection import Op

GUARD_SRC = Path(__file__).with_name("fakecuda_guard.cpp")
HARNESS_FILE = "measure/fakecuda.py"  # its own frames are never where the code under test is
GiB = 1 << 30
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_MEMORY_ALLOCATION, CUDA_ERROR_NOT_REGISTERED = 1, 2, 713
aten = torch.ops.aten

# operators whose output shape depends on values: a GPU waits for them (a sync), the meta stand-in cannot run them
DATA_DEPENDENT = {
    "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount",
    "equal", "is_nonzero", "argwhere", "histc", "_local_scalar_dense", "item", "allclose",
}  # fmt: skip
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # CUDA accepts host index tensors (and waits)


def available() -> str | None:
    """None when fake CUDA can run here; else why not (a reason to skip)."""
    if torch.backends.cuda.is_built():
        return "torch is built with CUDA: tests/rt/test_gpu.py runs the real thing"
    if not _compiler():
        return "no C++ compiler to build the fake CUDA device guard"
    return None


def _compiler() -> str | None:
    from shutil import which

    return next((c for c in (os.environ.get("CXX"), "c++", "g++") if c and which(c)), None)


_guard_loaded = False


def load_guard() -> None:
    """Build (once per torch version, cached) and load the C++ device guard."""
    global _guard_loaded
    if _guard_loaded:
        return
    tdir = Path(torch.__file__).parent
    key = hashlib.sha256(GUARD_SRC.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinigen-tests"
    lib = cache / f"fakecuda-guard-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            cmd = [_compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                   f"-I{tdir / 'include'}", str(GUARD_SRC), "-o", str(out), f"-L{tdir / 'lib'}",
                   f"-Wl,-rpath,{tdir / 'lib'}", "-lc10"]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(out, lib)
    ctypes.CDLL(str(lib))
    _guard_loaded = True


# ------------------------------------------------------------------------------------------------ findings
class HostReadUnknown(RuntimeError):
    """A value was read from a tensor whose values the shapes-only stand-in does not know."""


@dataclass
class Sync:
    kind: str  # what waited: "read" (a device value to the host), "copy", "synchronize", "data-dependent", ...
    what: str
    where: str  # the innermost frames of the project's code

    def __str__(self):
        return f"{self.kind} {self.what} at {self.where}"


@dataclass
class Region:
    name: str
    syncs: list[Sync] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)
    allocated: int = 0  # bytes allocated on the devices inside the region
    peak: int = 0  # the most device bytes live inside it


def where(skip_harness: bool = True) -> str:
    """The innermost frames in the project's packages (infinigen_rt, infinigen_prep, benchmarks)."""
    frames = [f for f in traceback.extract_stack()
              if re.search(r"infinigen_(rt|prep)/|benchmarks/", f.filename) and not f.filename.endswith(HARNESS_FILE)]
    return " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                       for f in reversed(frames[-3:])) or "(outside the project)"  # fmt: skip


# ---------------------------------------------------------------------------------------- tensors in disguise
class VTensor(torch.Tensor):
    """A tensor whose device is what the code sees (`device`) and whose data is `inner`, a CPU or meta tensor."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=device, requires_grad=False,
        )  # fmt: skip
        r.inner = inner
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"fake CUDA: {func} on a disguised tensor outside FakeCuda")

    def __repr__(self):
        return f"VTensor({self.device}, {tuple(self.shape)}, {self.dtype})"

    # reads to the host: through the harness (counted; the shapes-only stand-in asks its value provider)
    def tolist(self):
        host = _HARNESS.read(self, "tolist")
        with _paused():
            return host.tolist()

    def numpy(self, *a, **kw):
        host = _HARNESS.read(self, "numpy")
        with _paused():
            return host.numpy().copy()

    def data_ptr(self):
        return _HARNESS.address(self)


def inner_of(t):
    return t.inner if isinstance(t, VTensor) else t


def vdev(t: torch.Tensor) -> torch.device:
    return t.device


def storage_key(t: torch.Tensor) -> int:
    return inner_of(t).untyped_storage()._cdata


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that a view can reach: [lo, hi)."""
    x = inner_of(t)
    esz = x.element_size()
    if x.numel() == 0:
        return 0, 0
    last = x.storage_offset() + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 1)
    return x.storage_offset() * esz, (last + 1) * esz


# the row kernels' pointer arguments that are indexed by a row-number argument: with values, only those rows count
INDEXED = {"gather_rows_kernel": {"src_a": "rows", "src_b": "rows"},
           "scatter_rows_kernel": {"dst": "rows", "dst_b": "rows"},
           "gather_reused_kernel": {"src_a": "rows", "src_b": "rows"}}  # fmt: skip


def _indexed_ranges(kernel: str, param: str, t: torch.Tensor, params: list, args: tuple):
    """The byte ranges of t a row kernel touches, from its row numbers (values only); None: its whole span."""
    by = INDEXED.get(kernel, {}).get(param)
    if by is None:
        return None
    rows = inner_of(args[params.index(by)])
    x = inner_of(t)
    if rows.device.type != "cpu":  # shapes only: which rows is unknown, so no race on them can be told
        return []
    if "table" in params and args[params.index("table")] is not args[params.index(by)]:  # slots of a table's rows
        table = inner_of(args[params.index("table")])
        with _paused():
            rows = torch.gather(table.view(-1, table.shape[-1]), 1, rows.view(table.shape[0], -1).long())
    if x.dim() != 2:
        return None
    row = x.stride(0) * x.element_size()
    base = x.storage_offset() * x.element_size()
    with _paused():  # the harness's own look at the values: not the code's
        r = torch.unique(rows.reshape(-1)).tolist()
    out = []
    for i in r:  # runs of consecutive rows as one range
        if out and out[-1][1] == base + i * row:
            out[-1] = (out[-1][0], base + (i + 1) * row)
        else:
            out.append((base + i * row, base + (i + 1) * row))
    return out


@dataclass(eq=False)
class Block:
    """One allocation: a device tensor's storage, or page-locked host memory (the pool's pages)."""

    device: str
    nbytes: int
    actor: str  # the stream it was allocated on ("host" for host memory)
    addr: int = 0
    accesses: dict = field(default_factory=dict)  # actor -> [(lo, hi, tick, write)] not yet known done by the host
    uses: dict = field(default_factory=dict)  # stream -> tick of its last use (streams other than `actor`)
    recorded: set = field(default_factory=set)  # streams given by record_stream
    what: str = ""


# ---------------------------------------------------------------------------------------------- torch.cuda
class Stream:
    """torch.cuda.Stream on the fake: an actor with a vector clock."""

    def __init__(self, device=None, priority=0, _name=None):
        h = _HARNESS
        self.device = h.normalize(torch.device("cuda") if device is None else torch.device(device))
        self.name = _name or f"stream{next(h.counter)}@{self.device}"
        h.vc.setdefault(self.name, defaultdict(int))
        self.cuda_stream = abs(hash(self.name)) % (1 << 40)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"<fake {self.name}>"

    def wait_event(self, event) -> None:
        if event.vc is not None:
            _merge(_HARNESS.vc[self.name], event.vc)
            _HARNESS.note(Op("wait", "wait_event", self.name, event=event.serial))

    def wait_stream(self, stream) -> None:
        self.wait_event(Event().record(stream))

    def record_event(self, event=None):
        return (event or Event()).record(self)

    def synchronize(self) -> None:
        _HARNESS.host_waits([self.name], "Stream.synchronize")

    def query(self) -> bool:
        return Event().record(self).query()

    def __enter__(self):  # `with stream:` (torch.Stream's way) is torch.cuda.stream(stream)
        self._ctx = _StreamContext(self)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.vc, self.stream, self.serial = None, None, 0

    def record(self, stream=None):
        h = _HARNESS
        stream = stream or h.current_stream()
        _merge(h.vc[stream.name], h.vc["host"])
        self.vc, self.stream = dict(h.vc[stream.name]), stream
        self.serial = next(h.counter)
        h.note(Op("record", "record_event", stream.name, event=self.serial))
        return self

    def wait(self, stream=None) -> None:
        (stream or _HARNESS.current_stream()).wait_event(self)

    def query(self) -> bool:
        """Done as far as the host knows (the fake cannot know more: a real GPU may have finished earlier)."""
        host = _HARNESS.vc["host"]
        return self.vc is None or all(host.get(a, 0) >= t for a, t in self.vc.items() if a != "host")

    def synchronize(self) -> None:
        if self.stream is not None:
            _HARNESS.host_waits([self.stream.name], "Event.synchronize", vc=self.vc)

    def elapsed_time(self, end) -> float:
        return 0.0


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class _DeviceContext:
    """torch.cuda.device(...)"""

    def __init__(self, device):
        self.index = None if device is None else _HARNESS.index_of(device)

    def __enter__(self):
        self.prev = _HARNESS.current_index()
        if self.index is not None and self.index >= 0:
            _HARNESS.tls.device = self.index
        return self

    def __exit__(self, *exc):
        _HARNESS.tls.device = self.prev
        return False


class _StreamContext:
    """torch.cuda.stream(s): s becomes its device's current stream, and its device the current device."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        h = _HARNESS
        self.prev_device = h.current_index()
        if self.stream is None:
            return self
        idx = self.stream.device.index
        self.prev = h.streams_tls().get(idx)
        h.streams_tls()[idx] = self.stream
        h.tls.device = idx
        return self

    def __exit__(self, *exc):
        h = _HARNESS
        if self.stream is not None:
            h.streams_tls()[self.stream.device.index] = self.prev
        h.tls.device = self.prev_device
        return False


class _Capture:
    """What a CUDA graph's capture holds: its nodes (closures over the inner tensors, run in issue order by a replay:
    the same kernels on the same memory, none of the host code around them), the Ops noted while capturing (noted
    again by each replay, for a recording), the memory from outside the graph it touched (touched again by each
    replay, on the replaying stream), and what capturing wrote there, restored when the capture ends: a real GPU
    runs nothing while it captures."""

    def __init__(self):
        self.nodes: list = []
        self.ops: list[Op] = []
        self.stream = ""  # the capturing stream (a replay's ops run on the replaying one)
        self.made: set[int] = set()  # storage keys of what the graph's own ops made (its memory pool)
        self.outputs: list[torch.Tensor] = []  # those of them in floating point, poisoned once captured
        self.outside: dict[int, tuple] = {}  # storage key -> (tensor, written) outside the graph
        self.saved: dict[int, tuple] = {}  # storage key -> (its storage, a copy of it from before the capture)


class Graph:
    """torch.cuda.CUDAGraph on the fake (see _Capture): `with torch.cuda.graph(g): ...` captures, `g.replay()` runs
    the captured kernels again on the memory they were captured with. Inside a capture a host sync or a copy from
    pageable memory raises, as CUDA refuses them while a stream captures."""

    def __init__(self, keep_graph=False):
        self.captured: _Capture | None = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        h = _HARNESS
        assert h.capture is None, "fake CUDA: a capture inside a capture"
        h.capture = _Capture()
        h.capture.stream = h.current_stream().name

    def capture_end(self):
        h = _HARNESS
        c, h.capture = h.capture, None
        with _paused():
            for storage, copy in c.saved.values():
                storage.copy_(copy)
            for t in c.outputs:  # nothing ran: what a kernel would have written is not there
                t.fill_(float("nan"))
        c.saved.clear()
        _merge(h.vc["host"], h.vc[c.stream])  # (its accesses never happened: none to order a replay after)
        self.captured = c

    def replay(self):
        h = _HARNESS
        c = self.captured
        if c is None:
            raise RuntimeError("CUDA error: replay of a graph that was not captured (fake CUDA)")
        h.raise_last_error()
        stream = h.current_stream()
        tick = h.tick(stream.name)
        for t, written in c.outside.values():
            h.touch(t, stream.name, tick, written, "CUDA graph replay")
        with _paused():
            for node in c.nodes:
                node()
        for op in c.ops:
            h.note(replace(op, stream=stream.name if op.stream == c.stream else op.stream))
        h.profile_event(stream.name, "cudaGraphLaunch")

    def reset(self):
        self.captured = None

    def pool(self):
        return ("fake pool", id(self))


class _GraphContext:
    """torch.cuda.graph(g, pool, stream): the device synchronized, then g captures what is issued on `stream` (a
    side stream of its own by default) until the block ends."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.graph, self.stream = cuda_graph, stream

    def __enter__(self):
        h = _HARNESS
        h.device_sync(what="torch.cuda.graph: synchronize before capturing")
        if h.capture_stream is None:
            h.capture_stream = Stream()
        self.ctx = _StreamContext(self.stream or h.capture_stream)
        self.ctx.__enter__()
        self.graph.capture_begin()
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self.graph.capture_end()
            else:
                _HARNESS.capture = None
        finally:
            self.ctx.__exit__(*exc)
        return False


def _again(func, a, k, out):
    """A graph's node for an operator: run again on the same inner tensors, its results into the same memory."""

    def node():
        new = func(*a, **k)
        for dst, src in zip(_flat(out), _flat(new), strict=True):
            if isinstance(dst, torch.Tensor) and dst is not src:
                dst.copy_(src)

    return node


def _flat(x) -> list:
    return [y for v in x for y in _flat(v)] if isinstance(x, (list, tuple)) else [x]


class _Cudart:
    """torch.cuda.cudart() on the fake: page-locking against `host_limit`, with CUDA's sticky last error."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        h = _HARNESS
        if h.pinned_bytes + size > h.host_limit:
            h.last_error = CUDA_ERROR_MEMORY_ALLOCATION
            return CUDA_ERROR_MEMORY_ALLOCATION
        h.registered[ptr] = size
        h.pinned_bytes += size
        h.pinned_peak = max(h.pinned_peak, h.pinned_bytes)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        h = _HARNESS
        if ptr not in h.registered:
            h.last_error = CUDA_ERROR_NOT_REGISTERED
            return CUDA_ERROR_NOT_REGISTERED
        h.pinned_bytes -= h.registered.pop(ptr)
        return 0

    def cudaGetErrorString(self, err: int) -> str:
        return {0: "no error", 2: "out of memory", 713: "host memory not registered"}.get(int(err), "error")

    def cudaMemGetInfo(self, device: int):
        return _HARNESS.mem_get_info(device)


class _LoadedCudart:
    """What ctypes.CDLL returns for the fake runtime library's path (infinigen_rt.system.clear_cuda_error)."""

    def cudaGetLastError(self) -> int:
        h = _HARNESS
        err, h.last_error = h.last_error, 0
        return err


FAKE_CUDART_PATH = "/fakecuda/libcudart.so.13"


# ------------------------------------------------------------------------------------------------ the harness
_HARNESS: FakeCuda | None = None
_PACKAGE = str(Path(__file__).resolve().parents[1])


def site() -> str:
    """Which code issues the op being noted: "kv" (kv/, policies/) or "model" (the first of the project's frames
    outside measure/ and the launcher every Triton kernel goes through (kv/kernels.py: the models' fused ops too)
    decides; "model" where none is)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PACKAGE) and "/measure/" not in name and not name.endswith("/kv/kernels.py"):
            return "kv" if "/kv/" in name or "/policies/" in name else "model"
        f = f.f_back
    return "model"


class FakeCuda:
    """See the module docstring. One at a time; everything it patches is restored on exit."""

    def __init__(self, values: bool = True, devices: int = 2, capacity: int = 80 * GiB, host_memory: int = 128 * GiB,
                 host_limit: int | None = None, provider=None, strict: bool = True):  # fmt: skip
        """`values`: CPU tensors inside (real values) or meta tensors (shapes only). `capacity`: bytes per device.
        `host_memory`: what the host reports available (the lent H100 machine's 128 GiB by default); `host_limit`:
        page-locked bytes it grants (default: all of it). `provider(t)` -> a CPU tensor of t's shape: the values the
        shapes-only stand-in reads (default zeros). `strict`: a race raises at once (else it is only recorded)."""
        self.values, self.n_devices, self.capacity = values, devices, capacity
        self.host_memory, self.host_limit = host_memory, host_memory if host_limit is None else host_limit
        self.provider, self.strict = provider, strict
        self.reused: float | None = None  # the share of rows a reusing gather finds held (see _row_kernel_op)
        self.inner_device = torch.device("cpu" if values else "meta")
        self.tls = threading.local()
        self.counter = iter(range(1, 1 << 62))
        self.vc: dict[str, dict] = {"host": defaultdict(int)}
        self.default_streams: dict[int, Stream] = {}
        self.registered: dict[int, int] = {}  # page-locked host ranges: address -> bytes
        self.pinned_bytes = self.pinned_peak = 0
        self.pinned_storages: set[int] = set()  # storages made page-locked by pin_memory()
        self.last_error = 0
        self.blocks: dict[int, Block] = {}  # storage key -> block (device memory, and host memory we watch)
        self.live = defaultdict(int)  # device -> bytes (pending frees included)
        self.peak = defaultdict(int)
        self.pending: list[tuple[Block, dict]] = []  # freed blocks still held for other streams' uses
        self.unsafe_frees: dict[str, list] = defaultdict(list)  # stream -> blocks freed with uses it does not know
        self.syncs: list[Sync] = []
        self.races: list[str] = []
        self.launches: list[tuple] = []  # (kernel name, device, stream)
        self.kernel_keys: dict[str, set] = defaultdict(set)
        self.regions: list[Region] = []
        self.sync_debug = "default"
        self.sync_debug_noticed = False
        self.next_addr = 1 << 44
        self.profile: list | None = None  # events while a fake profiler runs
        self.ticks = defaultdict(float)  # per actor: a fake timeline for the profiler
        self.ops: list[Op] | None = None  # what the device is asked to do, while `recording`
        self.shapes: set[tuple] = set()  # the fused attentions' shapes run outside `recording` (Op.new_shape)
        self.detailed, self.mark = False, 0  # `recording(detail=True)`: Op.detail; blocks from `mark` on are its own
        self.capture: _Capture | None = None  # a CUDA graph capturing (Graph)
        self.capture_stream: Stream | None = None

    # ---- thread state
    def streams_tls(self) -> dict:
        if not hasattr(self.tls, "streams"):
            self.tls.streams = {}
        return self.tls.streams

    def current_index(self) -> int:
        return getattr(self.tls, "device", 0)

    def index_of(self, device) -> int:
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return self.current_index() if d.index is None else d.index

    def normalize(self, device: torch.device) -> torch.device:
        if device.type == "cuda":
            idx = self.current_index() if device.index is None else device.index
            if idx >= self.n_devices:
                raise RuntimeError(f"CUDA error: invalid device ordinal (fake CUDA has {self.n_devices} devices)")
            return torch.device("cuda", idx)
        return device

    def current_stream(self, device=None) -> Stream:
        idx = self.current_index() if device is None else self.index_of(device)
        s = self.streams_tls().get(idx)
        if s is None:
            if idx not in self.default_streams:
                self.default_streams[idx] = Stream(torch.device("cuda", idx), _name=f"default@cuda:{idx}")
            s = self.default_streams[idx]
        return s

    # ---- clocks
    def tick(self, actor: str) -> int:
        vc = self.vc.setdefault(actor, defaultdict(int))
        if actor != "host":
            _merge(vc, self.vc["host"])
        vc[actor] += 1
        return vc[actor]

    def host_waits(self, actors, what: str, kind: str = "synchronize", vc: dict | None = None) -> None:
        """The host waited for `actors` (streams): everything they did is done, as far as the host knows."""
        for a in actors:
            _merge(self.vc["host"], vc if vc is not None else self.vc.get(a, {}))
        self.note(Op("sync", kind, streams=tuple(actors)))
        self.note_sync(kind, what)
        self.release_pending()

    def note_sync(self, kind: str, what: str) -> None:
        if self.capture is not None:
            self.capture = None
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing (fake CUDA: {what}, a "
                               f"{kind} inside a CUDA graph's capture, at {where()})")  # fmt: skip
        s = Sync(kind, what, where())
        self.syncs.append(s)
        for r in self.regions:
            r.syncs.append(s)
        if self.sync_debug in ("warn", 1):
            warnings.warn(f"called a synchronizing CUDA operation (fake CUDA: {s})", stacklevel=3)
        elif self.sync_debug in ("error", 2):
            raise RuntimeError(f"called a synchronizing CUDA operation (fake CUDA: {s})")

    def device_sync(self, device=None, what="torch.cuda.synchronize") -> None:
        idx = self.current_index() if device is None else self.index_of(device)
        actors = [a for a in self.vc if a.endswith(f"@cuda:{idx}")]
        self.host_waits(actors, what)

    # ---- memory
    def address(self, t: torch.Tensor) -> int:
        """A device-independent address for a tensor's data: real for CPU data, made up for meta data."""
        inner = inner_of(t)
        if inner.device.type == "cpu":
            return inner.data_ptr()
        b = self.blocks.get(storage_key(t))
        base = b.addr if b is not None else 0
        return base + inner.storage_offset() * inner.element_size()

    def is_pinned(self, t: torch.Tensor) -> bool:
        if storage_key(t) in self.pinned_storages:
            return True
        if vdev(t).type != "cpu":
            return False
        ptr = self.address(t)
        return any(a <= ptr < a + n for a, n in self.registered.items())

    def track(self, t: torch.Tensor, actor: str, what: str) -> Block | None:
        """The block of t's storage, made on first sight (device tensors always; host ones when page-locked or
        disguised) and released when the storage is (torch keeps one Python object per storage: its finalizer)."""
        key = storage_key(t)
        b = self.blocks.get(key)
        if b is None:
            dev = vdev(t)
            if dev.type == "cpu" and not isinstance(t, VTensor) and not self.is_pinned(t):
                return None
            storage = inner_of(t).untyped_storage()
            nbytes = storage.nbytes()
            b = Block(str(dev), nbytes, actor if dev.type == "cuda" else "host", what=what)
            b.addr, self.next_addr = self.next_addr, self.next_addr + ((nbytes + 511) // 512 + 1) * 512
            self.blocks[key] = b
            weakref.finalize(storage, self.release, key, b)
            if dev.type == "cuda":
                self.allocate(b)
        return b

    def allocate(self, b: Block) -> None:
        dev = b.device
        vc = self.vc.get(b.actor, {})
        for unknown, what, at in self.unsafe_frees.pop(b.actor, []):
            late = [s for s, t in unknown.items() if vc.get(s, 0) < t]
            if late:
                self.race(f"{what}, allocated on {b.actor} and freed at {at} while {', '.join(late)} may still use "
                          "it (no record_stream), may be reused by this allocation before that use is done")
        if self.live[dev] + b.nbytes > self.capacity and self.pending:
            # the caching allocator waits for the events of blocks freed with pending uses before it gives up
            self.host_waits([], f"the allocator waited for freed blocks to allocate {b.nbytes / GiB:.2f} GiB",
                            kind="allocator", vc=self._pending_vc())  # fmt: skip
        if self.live[dev] + b.nbytes > self.capacity:
            free = (self.capacity - self.live[dev]) / GiB
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {b.nbytes / GiB:.2f} GiB. GPU has a total capacity of "
                f"{self.capacity / GiB:.2f} GiB of which {free:.2f} GiB is free (fake CUDA, {b.what})"
            )
        self.live[dev] += b.nbytes
        self.peak[dev] = max(self.peak[dev], self.live[dev])
        for r in self.regions:
            r.allocated += b.nbytes
            r.peak = max(r.peak, sum(self.live.values()))

    def _pending_vc(self) -> dict:
        vc: dict = {}
        for _, at in self.pending:
            _merge(vc, at)
        return vc

    def release(self, key: int, b: Block) -> None:
        if _HARNESS is not self or self.blocks.get(key) is not b:  # (a storage outliving its fake)
            return
        del self.blocks[key]
        if not b.device.startswith("cuda"):
            return
        home = self.vc.get(b.actor, {})
        # another stream used it and the allocating stream does not know that use done: the allocator may hand the
        # block to that stream's next allocation, which must then be ordered after the use (else: a race, found
        # when it is made: `allocate`)
        unknown = {s: t for s, t in b.uses.items() if s not in b.recorded and home.get(s, 0) < t}
        if unknown:
            self.unsafe_frees[b.actor].append((unknown, f"{b.what} ({b.nbytes} bytes)", where()))
        if b.recorded:
            self.pending.append((b, {s: self.vc.get(s, {}).get(s, 0) for s in b.recorded}))
            self.release_pending()
        else:
            self.live[b.device] -= b.nbytes

    def release_pending(self) -> None:
        host, keep = self.vc["host"], []
        for b, at in self.pending:
            if all(host.get(s, 0) >= t for s, t in at.items()):
                self.live[b.device] -= b.nbytes
            else:
                keep.append((b, at))
        self.pending = keep

    def mem_get_info(self, device=None):
        idx = self.current_index() if device is None else self.index_of(device)
        dev = str(self.normalize(torch.device("cuda", idx)))
        return self.capacity - self.live[dev], self.capacity

    # ---- accesses and races
    def touch(self, t: torch.Tensor, actor: str, tick: int, write: bool, what: str, ranges=None) -> None:
        """An access to t's bytes (`ranges`: (lo, hi) byte ranges of its storage; default: the span of its view) by
        `actor` at `tick`, checked against the other actors' accesses to the same bytes that it has not waited for."""
        b = self.track(t, actor, what)
        if b is None:
            return
        c = self.capture
        if c is not None and storage_key(t) not in c.made and what != "CUDA graph replay":
            key = storage_key(t)
            c.outside[key] = (t, write or c.outside.get(key, (t, False))[1])
        ranges = ranges if ranges is not None else [span(t)]
        vc, host = self.vc[actor], self.vc["host"]
        for a, acc in list(b.accesses.items()):
            if not acc or host.get(a, 0) >= max(x[2] for x in acc):  # the host knows it done: it orders all later
                del b.accesses[a]
                continue
            if a == actor:
                continue
            for lo, hi, at, w in acc:
                if (write or w) and vc.get(a, 0) < at and any(lo < rhi and rlo < hi for rlo, rhi in ranges):
                    kind = ("write after write" if w else "write after read") if write else "read after write"
                    self.race(f"{kind}: {what} on {actor} and {b.what} on {a}, not waited for")
        mine = b.accesses.setdefault(actor, [])
        if len(ranges) == 1:  # an older access of the same actor inside this one says nothing more
            rlo, rhi = ranges[0]
            mine[:] = [x for x in mine if not (rlo <= x[0] and x[1] <= rhi and (write or not x[3]))]
        mine += [(lo, hi, tick, write) for lo, hi in ranges]
        if actor != b.actor and actor != "host":
            b.uses[actor] = tick

    def keep(self, t: torch.Tensor) -> None:
        """Before a write to t while a graph captures: a copy of its storage, if from outside the graph, put back
        when the capture ends (nothing ran)."""
        c = self.capture
        key = storage_key(t)
        if c is not None and self.values and key not in c.made and key not in c.saved:
            storage = inner_of(t).untyped_storage()
            with _paused():
                c.saved[key] = (storage, storage.clone())

    def race(self, text: str) -> None:
        text = f"{text} at {where()}"
        self.races.append(text)
        if self.strict:
            raise AssertionError(f"fake CUDA found a race: {text}")

    def record_stream(self, t: torch.Tensor, stream) -> None:
        b = self.track(t, self.current_stream(vdev(t)).name, "record_stream")
        if b is not None:
            b.recorded.add(stream.name)

    # ---- reads to the host
    def read(self, t: torch.Tensor, how: str) -> torch.Tensor:
        """t's values on the host (a plain CPU tensor): counted as a sync when t is on a device."""
        dev = vdev(t)
        if dev.type == "cuda":
            s = self.current_stream(dev)
            self.touch(t, s.name, self.tick(s.name), False, how)
            self.host_waits([s.name], f"{how} of {tuple(t.shape)} {t.dtype}", kind="read")
        inner = inner_of(t)
        if inner.device.type == "cpu":
            return inner
        with _paused():
            return torch.zeros(inner.shape, dtype=inner.dtype) if self.provider is None else self.provider(t)

    @contextmanager
    def region(self, name: str):
        """What happens inside the block: its syncs, launches, allocations and peak (Region)."""
        r = Region(name, peak=sum(self.live.values()))
        self.regions.append(r)
        try:
            yield r
        finally:
            self.regions.remove(r)

    @contextmanager
    def recording(self, detail: bool = False):
        """The ops issued inside the block, in order (projection.Op: kernels with their bytes and FLOPs, Triton
        launches, copies, events, syncs): what `projection.project` replays. With `detail`, each launch's arguments
        too (Op.detail: `described`), for capture.py."""
        outer, self.ops = self.ops, []
        ops = self.ops
        self.detailed, self.mark = detail, self.next_addr
        try:
            yield ops
        finally:
            self.ops, self.detailed = outer, False

    def described(self, *values) -> tuple:
        """Arguments as a CUDA graph captures them (Op.detail), when recording with detail: a tensor by its shape,
        dtype and where it lives (the address of a device or page-locked block made before the recording began: a
        buffer from outside the step; "step": made inside it; "host": pageable host memory), a number or any other
        value as it is, lists and dicts item by item; () otherwise."""
        if not self.detailed:
            return ()

        def one(v):
            if isinstance(v, torch.Tensor):
                b = self.blocks.get(storage_key(v))  # (every argument was touched: its block made)
                where = ("host" if vdev(v).type == "cpu" else "step") if b is None else b.addr if b.addr < self.mark \
                    else "step"  # fmt: skip
                return ("tensor", tuple(v.shape), str(v.dtype), where)
            if isinstance(v, (list, tuple)):
                return tuple(one(x) for x in v)
            if isinstance(v, dict):
                return tuple((k, one(x)) for k, x in sorted(v.items()))
            return v if isinstance(v, (int, float, bool, str, type(None))) else str(v)

        return tuple(one(v) for v in values)

    def note(self, op: Op) -> None:
        if self.capture is not None:  # (noted when the graph replays)
            op.site = op.site or site()
            self.capture.ops.append(op)
        elif self.ops is not None:
            op.site = op.site or site()
            self.ops.append(op)

    # ---- launches: every Triton kernel of the runtime (kv/_*_kernel.py, models/_fused_kernel.py), at the call torch's
    # launcher makes
    def launch(self, kernel, grid, *args, **meta) -> None:
        """kernel[grid](*args, **meta) as Triton's launcher sees it: on the current device and stream."""
        self.raise_last_error()
        fn = getattr(kernel, "fn", kernel)
        name = fn.__name__
        params = list(kernel.arg_names)
        idx = self.current_index()
        stream = self.current_stream(idx)
        dns = set((getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or
                  getattr(kernel, "do_not_specialize", ()) or ())  # fmt: skip
        written = set(re.findall(r"tl\.store\(\s*(\w+)", _source(fn)))
        key = []
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        named = list(zip(params, args, strict=False))
        for i, (pname, a) in enumerate(named):  # what the launcher and the device refuse, before anything runs
            if not isinstance(a, torch.Tensor):
                continue
            d = vdev(a)
            if d.type == "cuda" and d.index != idx:
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered (fake CUDA: {name} "
                                   f"launched on cuda:{idx} with argument {pname} on {d})")  # fmt: skip
            if d.type == "cpu" and not self.is_pinned(a):
                raise ValueError(f"Pointer argument (at {i}) cannot be accessed from Triton (cpu tensor?)")
            if not a.is_contiguous():
                raise AssertionError(f"fake CUDA: {name} argument {pname} is not contiguous")
        tick = self.tick(stream.name)
        for pname, a in named:
            if isinstance(a, torch.Tensor):
                self.touch(a, stream.name, tick, pname in written, f"{name}({pname})",
                           _indexed_ranges(name, pname, a, params, args))
                key.append(native_specialize_impl(BaseBackend, inner_of(a), False, True, True))
            else:
                key.append(native_specialize_impl(BaseBackend, a, False, pname not in dns, True))
        key += sorted(meta.items())
        self.kernel_keys[name].add(tuple(key))
        self.launches.append((name, f"cuda:{idx}", stream.name))
        if self.ops is not None or self.capture is not None:
            op = _row_kernel_op if "rows" in params else OPS.get(name, _span_op)
            self.note(replace(op(name, stream.name, named, written, grid, meta), programs=math.prod(grid),
                              detail=self.described(args, meta, grid)))  # fmt: skip
        for r in self.regions:
            r.launches.append(name)
        self.profile_event(stream.name, name)
        if self.values:
            for pname, a in named:
                if pname in written and isinstance(a, torch.Tensor):
                    self.keep(a)
            run, inner = self.kernel_runs[name], [inner_of(a) for a in args]
            with _paused():
                run(*inner, grid=grid, warmup=False, **meta)
            if self.capture is not None:
                self.capture.nodes.append(lambda: run(*inner, grid=grid, warmup=False, **meta))

    def raise_last_error(self) -> None:
        if self.last_error:
            err = self.last_error
            what = _Cudart().cudaGetErrorString(err)
            raise RuntimeError(f"CUDA error: {what} (error {err}, left set by an earlier call: fake CUDA raises it at "
                               "the next launch, as torch's launch check does)")  # fmt: skip

    def profile_event(self, actor: str, name: str) -> None:
        if self.profile is not None:
            start = self.ticks[actor]
            self.ticks[actor] = start + 1.0
            self.profile.append(types.SimpleNamespace(
                device_type=torch.autograd.DeviceType.CUDA, name=name,
                time_range=types.SimpleNamespace(start=start, end=start + 1.0),
            ))  # fmt: skip

    def thread(self, target) -> threading.Thread:
        """A thread that runs `target` inside the fake too (torch's modes are per thread; its current CUDA device
        starts at 0, as a new thread's does on CUDA)."""

        def run():
            with _Functions(self), _Dispatch(self):
                target()

        return threading.Thread(target=run)

    # ---- entering and leaving
    def __enter__(self):
        global _HARNESS
        why = available()
        if why:
            raise RuntimeError(f"fake CUDA cannot run here: {why}")
        assert _HARNESS is None, "one FakeCuda at a time"
        load_guard()
        import torch._dynamo  # noqa: F401  (imported by the modes on first use: before anything is patched)
        _HARNESS = self
        self._patches = _patch_torch(self)
        # nn.Module.to / to_empty replace parameters instead of assigning `.data` (a disguised tensor cannot be
        # poured into a plain one)
        self._overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        self.dispatch = _Dispatch(self)
        self.function = _Functions(self)
        self.function.__enter__()
        self.dispatch.__enter__()
        return self

    def __exit__(self, *exc):
        global _HARNESS
        import gc

        gc.collect()  # what the code left to be collected goes while the fake still stands (pinned pages, blocks)
        from infinigen_rt.system import reap

        reap(wait=True)  # pools closed under the fake: their pages unregistered now (at exit the fake is gone)
        try:
            self.dispatch.__exit__(*exc)
            self.function.__exit__(*exc)
        finally:
            for obj, name, old in reversed(self._patches):
                setattr(obj, name, old)
            torch.__future__.set_overwrite_module_params_on_conversion(self._overwrite)
            _HARNESS = None
        return False


_SOURCES: dict = {}


def _source(fn) -> str:
    if fn not in _SOURCES:
        import inspect

        _SOURCES[fn] = inspect.getsource(fn)
    return _SOURCES[fn]


@contextmanager
def _paused():
    """Neither fake mode, for the real computation inside a fused stand-in (SDPA, a kernel's interpreter)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def _patch_torch(h: FakeCuda) -> list:
    saved = []

    def put(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    cuda = torch.cuda

    def set_device(d):
        idx = h.index_of(d)
        if idx >= h.n_devices:
            raise RuntimeError("CUDA error: invalid device ordinal")
        h.tls.device = idx

    def properties(d=None):
        return types.SimpleNamespace(name="fake CUDA", total_memory=h.capacity, multi_processor_count=132, major=9,
                                     minor=0, pci_domain_id=0, pci_bus_id=0, pci_device_id=0)  # fmt: skip

    def set_sync_debug_mode(mode):
        if not h.sync_debug_noticed:  # as torch does, once a process (TORCH_WARN_ONCE): a notice, not a sync
            h.sync_debug_noticed = True
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations", stacklevel=2)  # fmt: skip
        h.sync_debug = mode

    def reset_peak(device=None):
        dev = str(h.normalize(torch.device("cuda", h.index_of(device if device is not None else h.current_index()))))
        h.peak[dev] = h.live[dev]

    def dev_key(device=None):
        return str(h.normalize(torch.device("cuda", h.index_of(device if device is not None else h.current_index()))))

    cudart = _Cudart()
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: h.n_devices, "current_device": h.current_index,
        "set_device": set_device, "device": _DeviceContext, "_lazy_init": lambda: None, "init": lambda: None,
        "is_initialized": lambda: True, "get_device_name": lambda d=None: "fake CUDA (a CPU in disguise)",
        "get_device_properties": properties, "get_device_capability": lambda d=None: (9, 0),
        "mem_get_info": h.mem_get_info, "memory_allocated": lambda d=None: h.live[dev_key(d)],
        "max_memory_allocated": lambda d=None: h.peak[dev_key(d)], "memory_reserved": lambda d=None: h.live[dev_key(d)],
        "reset_peak_memory_stats": reset_peak, "empty_cache": lambda: None, "synchronize": h.device_sync,
        "Stream": Stream, "Event": Event, "current_stream": h.current_stream,
        "default_stream": lambda d=None: h.current_stream(d), "stream": _StreamContext,
        "set_sync_debug_mode": set_sync_debug_mode, "get_sync_debug_mode": lambda: h.sync_debug,
        "cudart": lambda: cudart, "CUDAGraph": Graph, "graph": _GraphContext, "graph_pool_handle": lambda: ("pool",),
        "is_current_stream_capturing": lambda: h.capture is not None,
    }.items():  # fmt: skip
        put(cuda, name, value)
    put(torch, "Generator", _Generator)
    put(torch, "Stream", Stream)  # the device-generic stream (transformers' offloaded cache makes one)
    put(torch, "Event", Event)
    put(torch.Tensor, "record_stream", lambda t, s: h.record_stream(t, s))
    from torch import profiler

    put(profiler, "profile", _FakeProfile)
    import infinigen_rt.kv._agg_kernel
    import infinigen_rt.kv._attention_kernel
    import infinigen_rt.kv._gather_kernel
    import infinigen_rt.kv._quant_kernel
    import infinigen_rt.kv._topk_kernel
    import infinigen_rt.kv.kernels
    import infinigen_rt.models._fused_kernel
    import infinigen_rt.system

    h.kernel_runs = {}
    for kernels in (infinigen_rt.kv._gather_kernel, infinigen_rt.kv._attention_kernel, infinigen_rt.kv._quant_kernel,
                    infinigen_rt.kv._agg_kernel, infinigen_rt.kv._topk_kernel,
                    infinigen_rt.models._fused_kernel):  # fmt: skip
        for name, k in vars(kernels).items():  # kernel[grid](...) calls kernel.run(..., grid=grid, warmup=False)
            if hasattr(k, "run") and hasattr(k, "arg_names"):
                h.kernel_runs[name] = k.run
                put(k, "run", lambda *a, grid, warmup=False, _k=k, **meta: h.launch(_k, grid, *a, **meta))
    import sys

    real_available = infinigen_rt.system.host_available
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("infinigen_rt") and m is not None]:
        if getattr(mod, "host_available", None) is real_available:  # wherever it was imported by name
            put(mod, "host_available", lambda: h.host_memory - h.pinned_bytes)
    real_loaded = infinigen_rt.system.loaded_cudart
    put(infinigen_rt.system, "loaded_cudart", lambda maps=None: FAKE_CUDART_PATH if maps is None else real_loaded(maps))
    fake_ctypes = types.SimpleNamespace(CDLL=lambda path, *a, **k: _LoadedCudart() if path == FAKE_CUDART_PATH
                                        else ctypes.CDLL(path, *a, **k))  # fmt: skip
    put(infinigen_rt.system, "ctypes", fake_ctypes)
    return saved


class _Generator(torch.Generator):
    """torch.Generator on the fake: a CUDA generator draws on the CPU."""

    def __new__(cls, device="cpu"):
        return torch._C.Generator.__new__(cls, "cpu" if torch.device(device).type == "cuda" else device)

    def __init__(self, device="cpu"):
        pass


class _FakeProfile:
    """torch.profiler.profile on the fake: CUDA events of the kernels launched inside (one unit of time each, on
    their stream's own timeline), with the names a CUDA profiler shows (a Triton kernel by its function name)."""

    def __init__(self, *a, **kw):
        pass

    def __enter__(self):
        _HARNESS.profile = []
        return self

    def __exit__(self, *exc):
        self._events, _HARNESS.profile = _HARNESS.profile, None
        return False

    def events(self):
        return self._events


# ------------------------------------------------------------------------------------------------ the modes
class _Functions(TorchFunctionMode):
    """Python-level entry points that skip the dispatcher's modes: tensors from data, and attention (one fused
    kernel on a GPU: it allocates its output, never the [B, H, S, T] scores the math fallback would)."""

    def __init__(self, h: FakeCuda):
        super().__init__()
        self.h = h

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and "device" in kwargs and kwargs["device"] is not None:
            dev = torch.device(kwargs["device"])
            if dev.type == "cuda":
                rest = {k: v for k, v in kwargs.items() if k != "device"}
                host = func(*args, **rest)  # (inside the handler: this mode is off)
                return host.to(dev)  # from pageable memory, not asynchronous: a sync, counted
        if func is torch.nn.functional.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        h = self.h
        devs = {vdev(t) for t in (q, k, v) + ((attn_mask,) if attn_mask is not None else ())}
        if len(devs) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found {sorted(map(str, devs))} "
                               "(fake CUDA: scaled_dot_product_attention)")  # fmt: skip
        if q.shape[-3] % k.shape[-3] or (k.shape[-3] != q.shape[-3] and not enable_gqa):
            raise RuntimeError(f"scaled_dot_product_attention: {q.shape[-3]} query heads, {k.shape[-3]} key heads")
        if attn_mask is not None:
            torch.broadcast_shapes(attn_mask.shape, (*q.shape[:-1], k.shape[-2]))
        dev = devs.pop()
        shape = (*q.shape[:-1], v.shape[-1])
        if h.values:
            with _paused():
                out = torch.nn.functional.scaled_dot_product_attention(
                    inner_of(q), inner_of(k), inner_of(v), attn_mask=None if attn_mask is None else inner_of(attn_mask),
                    dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                )  # fmt: skip
            if h.capture is not None and dev.type == "cuda":
                a = [inner_of(x) for x in (q, k, v)] + [None if attn_mask is None else inner_of(attn_mask)]
                kw = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
                h.capture.nodes.append(_again(lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, **kw), a, {}, out))  # fmt: skip
                h.capture.made.add(storage_key(out))
                h.capture.outputs.append(out)
            out = VTensor(out, dev) if dev.type == "cuda" else out
        else:
            with _paused():
                out = VTensor(torch.empty(shape, dtype=q.dtype, device="meta"), dev)
        actor = h.current_stream(dev).name if dev.type == "cuda" else "host"
        t = h.tick(actor)
        for x in (q, k, v, attn_mask):
            if x is not None:
                h.touch(x, actor, t, False, "scaled_dot_product_attention")
        h.touch(out, actor, t, True, "scaled_dot_product_attention")
        if dev.type == "cuda":
            b_h_s, kv_len = q.numel() // q.shape[-1], k.shape[-2]
            flops = 2 * b_h_s * kv_len * (q.shape[-1] + v.shape[-1])  # q.k and p.v
            shapes = ("fused_attention", tuple(q.shape), tuple(k.shape))
            h.note(Op("kernel", "fused_attention", actor, _bytes(q, k, v, attn_mask, out), flops,
                      new_shape=shapes not in h.shapes, detail=h.described(q, k, v, attn_mask, scale, is_causal)))
            if h.ops is None:  # (a step recorded: its shapes against those of the steps before it)
                h.shapes.add(shapes)
        h.profile_event(actor, "fused_attention")
        return out


class _Dispatch(TorchDispatchMode):
    """Every operator: devices checked, run on the inner tensors, outputs disguised, memory and accesses kept."""

    def __init__(self, h: FakeCuda):
        super().__init__()
        self.h = h

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        h = self.h
        kwargs = dict(kwargs or {})
        body = BODIES.get(func)
        if body is not None:  # one of the runtime's GPU operators: its body, each op and launch in it seen as ever
            with self:
                return body(*args, **kwargs)
        info = _info(func)
        name = info.name
        tensors = _tensors(args, kwargs)
        explicit = kwargs.get("device") if info.has_device else None
        explicit = None if explicit is None else torch.device(explicit)
        if (explicit is not None and explicit.type == "cuda") or any(t.device.type == "cuda" for t in tensors):
            h.raise_last_error()
        if info.special:
            out = self.special(func, name, args, kwargs)
            if out is not _NOT_SPECIAL:
                return out
        # the operator's device, checked as CUDA checks it
        index_args = _index_tensors(func, args) if name in INDEX_OPS else ()
        devs = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)
                and not any(t is x for x in index_args)}  # fmt: skip
        if len(devs) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{', '.join(sorted(map(str, devs)))}! (fake CUDA: {func} at {where()})")  # fmt: skip
        dev = h.normalize(explicit) if explicit is not None else (devs.pop() if devs else torch.device("cpu"))
        if dev.type == "cuda":
            if any(x.device.type == "cpu" for x in index_args):
                h.note_sync("copy", f"{name} with an index tensor in host memory")
            if name in DATA_DEPENDENT and not (name == "repeat_interleave" and kwargs.get("output_size")):
                h.host_waits([h.current_stream(dev).name], f"{name}: a shape that depends on values",
                             "data-dependent")  # fmt: skip
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            out = self.run(func, args, kwargs, dev)
            h.pinned_storages.add(storage_key(out))
            return out
        return self.run(func, args, kwargs, dev, tensors)

    def special(self, func, name, args, kwargs):
        """Reads, page-locking and copies: what the harness counts and models itself."""
        h = self.h
        if func in (aten._local_scalar_dense.default, aten.item.default):  # (item: under inference_mode)
            return h.read(args[0], "item()").item()
        if func is aten.is_nonzero.default:
            return bool(h.read(args[0], "bool()").item())
        if func is aten.is_pinned.default:
            return h.is_pinned(args[0])
        if func in (aten._pin_memory.default, aten.pin_memory.default):
            out = self.run(aten.clone.default, (args[0],), {}, torch.device("cpu"))
            h.pinned_storages.add(storage_key(out))
            return out
        if func is aten.lift_fresh.default:
            return args[0]
        if func is aten.copy_.default:
            return self.copy(args[0], args[1], bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False))
        if name in ("_to_copy", "to") and _arg(func, args, kwargs, "device") is not None:
            src = args[0]
            dst_dev = h.normalize(torch.device(_arg(func, args, kwargs, "device")))
            dtype = _arg(func, args, kwargs, "dtype")
            if dst_dev != src.device:
                if dtype not in (None, src.dtype):
                    src = self.run(aten._to_copy.default, (src,), {"dtype": dtype}, src.device)
                src = self.run(aten.contiguous.default, (src,), {}, src.device)
                dst = self.run(aten.empty_strided.default, (src.shape, src.stride()), {"dtype": src.dtype}, dst_dev)
                non_blocking = bool(_arg(func, args, kwargs, "non_blocking"))
                if non_blocking and dst_dev.type == "cpu":  # torch makes an asynchronous copy's host side pinned
                    h.pinned_storages.add(storage_key(dst))
                return self.copy(dst, src, non_blocking)
            if name == "to":  # the same device: a cast, or the tensor itself
                if dtype in (None, src.dtype) and not _arg(func, args, kwargs, "copy"):
                    return self.run(aten.alias.default, (src,), {}, src.device)
                return self.run(aten._to_copy.default, (src,), {"dtype": dtype or src.dtype}, src.device)
        return _NOT_SPECIAL

    def run(self, func, args, kwargs, dev: torch.device, tensors=None):
        """func on the inner tensors, on `dev` as the code sees it; outputs disguised and tracked."""
        h = self.h
        info = _info(func)
        meta = h.inner_device.type == "meta"

        def unwrap(x):
            if isinstance(x, VTensor):
                return x.inner
            if meta and x.device.type != "meta":
                return x.to("meta")
            return x

        a, k = _map(unwrap, args), {kk: _map(unwrap, v) for kk, v in kwargs.items()}
        if info.has_device and (k.get("device") is not None or meta):  # a factory: made on the inner device
            k["device"] = h.inner_device
        if h.capture is not None:
            for i in info.written:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    h.keep(args[i])
            if isinstance(kwargs.get("out"), torch.Tensor):
                h.keep(kwargs["out"])
        try:
            out = func(*a, **k)
        except NotImplementedError as e:
            if meta and info.name in DATA_DEPENDENT:
                raise HostReadUnknown(f"{func}: its output shape depends on values (at {where()})") from e
            raise
        tensors = _tensors(args, kwargs) if tensors is None else tensors
        written = [args[i] for i in info.written if i < len(args) and isinstance(args[i], torch.Tensor)]
        if isinstance(kwargs.get("out"), torch.Tensor):
            written.append(kwargs["out"])
        in_keys = {storage_key(t): t for t in tensors}
        wrap_needed = dev.type == "cuda" or meta

        def wrap(x):
            key = storage_key(x)
            for t in written:  # an in-place result is the argument itself
                i = inner_of(t)
                if storage_key(t) == key and i.shape == x.shape and i.stride() == x.stride() \
                        and i.storage_offset() == x.storage_offset():  # fmt: skip
                    return t
            if not wrap_needed:
                return x
            base = in_keys.get(key)
            if base is not None and not base.is_inference() and torch.is_inference_mode_enabled():
                with torch.inference_mode(False):  # a view of a normal tensor is a normal tensor, as in torch
                    return VTensor(x, base.device)
            return VTensor(x, dev if base is None else base.device)

        result = _map(wrap, out)
        results = _tensors(result if isinstance(result, (list, tuple)) else (result,), {})
        if info.is_view and all(storage_key(x) in in_keys for x in results):  # metadata only: nothing read or written
            return result  # (`to` is a view where it changes nothing, a kernel where it casts)
        c = h.capture
        if c is not None and dev.type == "cuda":  # the graph's own memory, and its node
            fresh = [x for x in _tensors(result if isinstance(result, (list, tuple)) else (result,), {})
                     if not any(x is w for w in written)]  # fmt: skip
            c.made.update(storage_key(x) for x in fresh)
            if h.values and info.name not in NO_KERNEL:
                c.nodes.append(_again(func, a, k, out))
                c.outputs += [inner_of(x) for x in fresh if x.dtype.is_floating_point]
        # accesses: reads of the inputs, writes of the outputs and of what the operator mutates
        actor = h.current_stream(dev).name if dev.type == "cuda" else "host"
        t = h.tick(actor)
        for x in tensors:
            h.touch(x, actor, t, any(x is w for w in written), info.name)
        for x in _tensors(result if isinstance(result, (list, tuple)) else (result,), {}):
            if not any(x is w for w in written):
                h.touch(x, actor, t, storage_key(x) not in in_keys, info.name)
        if dev.type == "cuda":
            h.profile_event(actor, f"aten::{info.name}")
            if (h.ops is not None or h.capture is not None) and info.name not in NO_KERNEL:
                outs = [x for x in _tensors(result if isinstance(result, (list, tuple)) else (result,), {})
                        if not any(x is w for w in written)]  # fmt: skip
                h.note(Op("kernel", info.name, actor, _op_bytes(info.name, tensors, written, outs),
                          _flops(info.name, args), detail=h.described(args, kwargs)))  # fmt: skip
        return result

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool):
        """dst.copy_(src): between devices, a DMA on the device side's current stream; the host waits unless it is
        asynchronous and the host side is page-locked (or the copy is device to host into page-locked memory)."""
        h = self.h
        dd, sd = vdev(dst), vdev(src)
        if dd == sd or (dd.type == "cpu" and sd.type == "cpu"):
            return self.run(aten.copy_.default, (dst, src), {}, dd)
        if dd.type == "cuda" and sd.type == "cuda":
            raise RuntimeError(f"fake CUDA: a copy from {sd} to {dd} needs peer access, which this code never sets up")
        cuda_side, host_side = (dd, src) if dd.type == "cuda" else (sd, dst)
        stream = h.current_stream(cuda_side)
        tick = h.tick(stream.name)
        direction = "HtoD" if dd.type == "cuda" else "DtoH"
        h.touch(src, stream.name, tick, False, f"copy {direction} (source)")
        h.touch(dst, stream.name, tick, True, f"copy {direction} (destination)")
        d, s = inner_of(dst), inner_of(src)  # (inside the handler: the dispatch mode is off)
        h.keep(dst)
        if d.device.type == "meta" or s.device.type == "meta":
            s = s.to(d.device)
        d.copy_(s)
        if h.capture is not None and h.values:
            h.capture.nodes.append(lambda: d.copy_(s))
        pinned = h.is_pinned(host_side)
        h.profile_event(stream.name, f"Memcpy {direction} ({'Pinned' if pinned else 'Pageable'})")
        n = _bytes(src)
        h.note(Op("copy", f"Memcpy {direction}", stream.name, hbm_bytes=n, pcie_bytes=n if dd.type == "cuda" else 0,
                  d2h_bytes=0 if dd.type == "cuda" else n, detail=h.described(dst, src)))  # fmt: skip
        if not non_blocking or not pinned:
            h.host_waits([stream.name], f"copy {direction} of {tuple(src.shape)} {src.dtype}"
                         + (" from/to pageable memory" if not pinned else ""), kind="copy")  # fmt: skip
        return dst


_NOT_SPECIAL = object()
# operators that launch nothing on a GPU: allocation and metadata
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "resize_",
             "set_", "record_stream", "lift_fresh", "lift_fresh_copy", "detach_", "_reshape_alias"}  # fmt: skip
# indexing operators: of their indexed argument they touch only what the index picks (the output's size)
INDEXED_OPS = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_select", "index",
               "index_put", "index_put_", "_index_put_impl_", "index_copy", "index_copy_", "index_fill_",
               "embedding", "take_along_dim"}  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches of a tensor view: its elements, or less where it is expanded (strides of 0)."""
    lo, hi = span(t)
    return min(t.numel() * t.element_size(), hi - lo) if t.numel() else 0


def _bytes(*ts) -> int:
    return sum(_nbytes(t) for t in ts if isinstance(t, torch.Tensor))


def _op_bytes(name: str, inputs: list, written: list, outputs: list) -> int:
    """Device bytes an operator reads and writes: its inputs, its outputs, what it writes in place (read and
    written); an indexing operator reads of its indexed tensor what its output holds."""
    if name in INDEXED_OPS and inputs:
        small = [t for t in inputs if t is not inputs[0]]
        moved = max([_nbytes(t) for t in outputs + small] or [0])
        return _bytes(*small) + _bytes(*outputs) + moved * (1 + len(written))
    return _bytes(*inputs) + _bytes(*outputs) + _bytes(*written)


def _flops(name: str, args) -> int:
    """Matrix products' FLOPs (2 per multiply-add); other operators are memory-bound and count 0."""
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm", "matmul") else (args[1], args[2])
        return 2 * a.numel() * b.shape[-1]
    if name == "linear":  # x [..., in] by weight [out, in]
        return 2 * args[0].numel() * args[1].shape[0]
    return 0


def _attention_op(name: str, stream: str, named: list, written: set, grid, meta) -> Op:
    """Paged decode attention's op: each program reads its split of keys and values for its KV head once (shapes
    only: every sequence as long as its table), its queries, and writes its partial results; 4 FLOPs a key and query
    head per dim."""
    args = dict(named)
    b, hkv, splits = grid
    k = args["k"]
    keys = b * hkv * min(splits * meta["SPLIT"], args["max_blocks"] * meta["BLOCK"])  # (at most its table's tokens)
    read = 2 * keys * k.shape[-1] * k.element_size()
    small = sum(_nbytes(args[p]) for p in ("q", "table", "lengths", "out_m", "out_l", "out_acc"))
    return Op("triton", name, stream, hbm_bytes=read + small, flops=4 * keys * meta["G"] * k.shape[-1])


def _score_op(name: str, stream: str, named: list, written: set, grid, meta) -> Op:
    """Low-bit scoring's op: each program reads its tokens' codes and scales once (not the whole store it indexes),
    its queries and slot numbers, and writes a score per query head and token; 2 FLOPs a value and query head."""
    args = dict(named)
    b, hkv, _ = grid
    tokens, codes, meta_ = b * hkv * args["n_tok"], args["codes"], args["meta"]
    scales = meta_.shape[-1] * meta_.shape[-2] * meta_.element_size()  # a token's, or (CHANNEL) its run's
    read = tokens * (codes.shape[-1] * codes.element_size() + scales / (meta["RUN"] if meta.get("CHANNEL") else 1))
    small = sum(_nbytes(args[p]) for p in ("q", "out")) + (_nbytes(args["slots"]) if meta["HAS_SLOTS"] else 0)
    return Op("triton", name, stream, hbm_bytes=read + small, flops=2 * tokens * meta["G"] * meta["D"])


def _quantize_op(name: str, stream: str, named: list, written: set, grid, meta) -> Op:
    """Quantizing new rows: each read once and its codes and scales written once into its slot."""
    args = dict(named)
    total, codes, meta_ = args["total"], args["codes"], args["meta"]
    row = codes.shape[-1] * codes.element_size() + meta_.shape[-1] * meta_.shape[-2] * meta_.element_size()
    return Op("triton", name, stream, hbm_bytes=_nbytes(args["x"]) + _nbytes(args["slots"]) + total * row)


def _channel_write_op(name: str, stream: str, named: list, written: set, grid, meta) -> Op:
    """A new key into its run of per-channel codes: each program reads its key row and slot, and reads and writes its
    run's codes, scales and held flags once (not the store it indexes)."""
    args = dict(named)
    rows, x, d, run = grid[0], args["x"], meta["D"], meta["RUN"]
    per_run = run * (d // 2) + 2 * d * 2 + run  # codes, fp16 scale and minimum per channel, flags
    return Op("triton", name, stream, hbm_bytes=rows * (d * x.element_size() + 8 + 1 + 2 * per_run))


def _span_op(name: str, stream: str, named: list, written: set, grid, meta) -> Op:
    """Any other kernel's op: every tensor argument read whole (what it writes once more)."""
    hbm = sum(_nbytes(a) * (2 if p in written else 1) for p, a in named if isinstance(a, torch.Tensor))
    return Op("triton", name, stream, hbm_bytes=hbm)


def _row_kernel_op(name: str, stream: str, named: list, written: set, grid=None, meta=None) -> Op:
    """A row kernel's op: each row it moves, read and written once per tensor of the pair, across PCIe for the
    tensors in pinned host memory (read: host to device; written: device to host); its row numbers (and validity,
    and where a row was held) read from the device. Shapes only: every row counts as moved. The gather that reuses
    the last step's rows reads `_HARNESS.reused` of them from device memory (the previous output) and the rest from
    the pool (a measured share, stated by the caller: which rows were held is a value, which meta tensors lack)."""
    args = dict(named)
    rows = args["rows"]
    held = _HARNESS.reused if name == "gather_reused_kernel" and _HARNESS is not None else None
    hbm = h2d = d2h = 0
    for pname, a in named:
        if not isinstance(a, torch.Tensor):
            continue
        if pname in ("rows", "ok", "pos"):
            hbm += _nbytes(a)
            continue
        if pname == "table":  # (a selection's slots looked up in the step's table: a row number each)
            hbm += 0 if a is args["rows"] else rows.numel() * a.element_size()
            continue
        moved = rows.numel() * a.shape[-1] * a.element_size()
        if held is not None and pname.startswith("prev"):
            hbm += int(moved * held)
        elif held is not None and pname.startswith("src"):
            h2d += int(moved * (1 - held))
        elif vdev(a).type != "cpu":
            hbm += moved
        elif pname in written:
            d2h += moved
        else:
            h2d += moved
    return Op("triton", name, stream, hbm_bytes=hbm, pcie_bytes=h2d, d2h_bytes=d2h)


SPECIAL = {"_local_scalar_dense", "item", "is_nonzero", "is_pinned", "_pin_memory", "pin_memory", "lift_fresh",
           "copy_", "_to_copy", "to"}  # fmt: skip
# the Triton kernels priced by their own op (the rest: _row_kernel_op if they move rows, else _span_op)
OPS = {"paged_decode_kernel": _attention_op, "score_codes_kernel": _score_op, "quantize_rows_kernel": _quantize_op,
       "quantize_channel_kernel": _channel_write_op}


@dataclass(frozen=True)
class _Info:
    """What the harness needs of an operator's schema (cached per operator)."""

    name: str
    written: tuple  # indices of the arguments it writes
    has_device: bool  # it takes a device (a factory, or a copy to one)
    is_view: bool  # every output is a view of an input: it touches no data
    special: bool


_INFOS: dict = {}


def _info(func) -> _Info:
    info = _INFOS.get(func)
    if info is None:
        schema, name = func._schema, func.overloadpacket.__name__
        written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        rets = schema.returns
        is_view = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
        has_device = any(a.name == "device" for a in schema.arguments)
        info = _INFOS[func] = _Info(name, written, has_device, is_view, name in SPECIAL)
    return info


def _tensors(args, kwargs) -> list:
    """The tensors among an operator's arguments (one level of lists, as operators take them)."""
    out = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
    return out


def _map(fn, x):
    """fn on every tensor in x (tensors, lists and tuples of them)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        items = [_map(fn, y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _arg(func, args, kwargs, name: str):
    """The value of argument `name` of a call of func (positional or keyword), or None."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else None
    return None


def _kw_device(kwargs) -> torch.device:
    d = kwargs.get("device")
    return torch.device(d) if d is not None else torch.device("cpu")


def _index_tensors(func, args) -> list:
    """The index tensors of an indexing operator (its `indices` argument)."""
    for i, arg in enumerate(func._schema.arguments[: len(args)]):
        if arg.name == "indices":
            return [t for t in args[i] if isinstance(t, torch.Tensor)]
    return []


def main(argv: list[str] | None = None) -> None:
    """python -m infinigen_rt.measure.fakecuda [--shapes] (-m MODULE | SCRIPT) ARGS...: a command of the GPU path, run
    on this CPU inside fake CUDA (values by default: tiny shapes; --shapes: meta tensors). The benchmarks' rehearsal."""
    import runpy
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    values = True
    if args and args[0] == "--shapes":
        values, args = False, args[1:]
    if not args:
        raise SystemExit(main.__doc__)
    module = args[0] == "-m"
    target = args[1] if module else args[0]
    sys.argv = [target, *args[2 if module else 1 :]]
    with FakeCuda(values=values, strict=False) as gpu:
        try:
            runpy.run_module(target, run_name="__main__", alter_sys=True) if module else runpy.run_path(
                target, run_name="__main__")  # fmt: skip
        finally:
            print(f"fake CUDA: {len(gpu.syncs)} syncs, {len(gpu.launches)} kernel launches, {len(gpu.races)} races, "
                  f"peak {max(gpu.peak.values(), default=0) / GiB:.2f} GiB on a device", file=sys.stderr)
            if gpu.races:
                print("fake CUDA races:\n  " + "\n  ".join(gpu.races[:10]), file=sys.stderr)
                raise SystemExit(3)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported: the kernels run on CPU tensors)
    main()

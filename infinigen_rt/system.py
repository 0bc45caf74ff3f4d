"""The machine: which device computes, page-locked host memory, waiting for the device, host memory figures.

The ground floor of the runtime: it imports nothing of the package but its error type, so every module may use it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import time
from contextlib import contextmanager

import torch

from infinigen_rt.errors import InfinigenError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


class HostMemoryError(InfinigenError, MemoryError):
    """Host memory could not be allocated or page-locked (bench writes an `oom-host` row for it)."""


def resolve_device(device: str) -> torch.device:
    """`auto`, `cpu`, `cuda` (torch's current GPU) or `cuda:N`. `cuda:N` becomes this thread's current CUDA device,
    so that what runs on torch's current device (Triton launches, the default stream) runs on the one asked for."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InfinigenError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InfinigenError(f"--device {device} asked for, but torch sees no CUDA GPU; use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None:
            if dev.index >= n:
                raise InfinigenError(f"--device {device}: torch sees {n} GPU(s), cuda:0 to cuda:{n - 1}")
            torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise InfinigenError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return dev


def sync(device: torch.device) -> None:
    """Wait for the device (outside a step: timings of whole runs, releasing pinned pages)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting: through page-locked memory on a GPU (a copy from pageable memory
    waits for the device), as it is elsewhere."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Staging:
    """Host arrays uploaded every step into the same memory: a page-locked staging buffer and a device buffer for
    each name, made once (again, twice as large, when a step needs more), so that a step's copies read and write
    the same addresses step after step, as a CUDA graph replays them (measure/capture.py). The staging buffer is
    written only once the last copy from it is done (the step's one host sync sees to that); where it is not yet
    (no sync since), the array goes up through fresh page-locked memory instead, never waited for. Elsewhere than
    on a GPU the array itself."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, {}

    def put(self, name: str, a) -> torch.Tensor:
        """The array `a` (numpy, or a host tensor) on the device, in `name`'s buffers: the copy is not waited for."""
        t = torch.as_tensor(a)
        if self.device.type != "cuda":
            return t.to(self.device)
        n = t.numel()
        host, dev, copied = self.buffers.get(name, (None, None, None))
        if copied is not None and not copied.query():
            return to_device(t, self.device)
        if host is None or host.numel() < n or host.dtype != t.dtype:
            size = max(n, 64 if host is None else 2 * host.numel())
            host = torch.empty(size, dtype=t.dtype).pin_memory()
            dev = torch.empty(size, dtype=t.dtype, device=self.device)
        host[:n].copy_(t.reshape(-1))
        out = dev[:n].copy_(host[:n], non_blocking=True).view(t.shape)
        copied = torch.cuda.Event()
        copied.record()
        self.buffers[name] = host, dev, copied
        return out


# ---------------------------------------------------------------------------------------- page-locked memory
def host_buffer(shape, dtype, pinned: list | None, zero: bool = True) -> torch.Tensor:
    """Host memory (zeroed unless `zero` is False); with a `pinned` list (a GPU computes): page-locked at its exact
    size, its address appended to the list (torch's caching host allocator would round each block up to a power of
    two: a 514 MiB layer would take 1 GiB). `unpin` releases what the list holds. Memory that cannot be allocated
    or locked raises HostMemoryError."""
    try:
        t = torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
    except RuntimeError as e:  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory"
        raise HostMemoryError(f"cannot allocate {_gib(shape, dtype)} of host memory for the KV pool ({e})") from None
    if pinned is not None and t.numel():
        pin(t)
        pinned.append(t.data_ptr())
    return t


def pin(t: torch.Tensor) -> None:
    """Page-lock t's memory in place (cudaHostRegister). A failure is cleared from CUDA's last error, which would
    otherwise surface at the next unrelated kernel launch, and raised here: HostMemoryError when the memory could not
    be locked, RuntimeError for anything else."""
    n_bytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n_bytes, 0))
    if err == 0:
        return
    clear_cuda_error()
    what = f"page-locking {n_bytes / 2**30:.2f} GiB of host memory for the KV pool failed with CUDA error {err}"
    if err == CUDA_ERROR_MEMORY_ALLOCATION:
        raise HostMemoryError(f"{what} (out of memory); lower --kv-tokens, --kv-memory, the batch or the context")
    raise RuntimeError(what)


def unpin(pinned: list, device: torch.device) -> None:
    """Unregister the pages whose addresses `pinned` lists, waiting for the device to be done with them (a pool that
    is being collected: its memory goes right after)."""
    if pinned:
        sync(device)
        for ptr in pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        pinned.clear()


_RETIRED: list[tuple] = []  # (event, addresses, tensors) of pools closed while the device may still use them


def retire(pinned: list, tensors: list, device: torch.device) -> None:
    """Unregister a closed pool's pages once the device has passed the point where it was closed, without waiting
    for it: an event marks that point, and the pages (kept alive until then) go when a later call finds it done."""
    if pinned:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        _RETIRED.append((done, list(pinned), list(tensors)))
        pinned.clear()
    reap()


def reap(wait: bool = False) -> None:
    """Unregister the retired pages whose event is done (all of them with `wait`: at exit)."""
    left = []
    for done, ptrs, tensors in _RETIRED:
        if not done.query():
            if not wait:
                left.append((done, ptrs, tensors))
                continue
            done.synchronize()
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    _RETIRED[:] = left


atexit.register(lambda: _RETIRED and reap(wait=True))


def clear_cuda_error() -> int:
    """Reset the CUDA runtime's last error (cudaGetLastError) and return it; 0 where it cannot be reached.

    torch's cudart bindings have no cudaGetLastError; the runtime library torch loaded is found by its path in
    /proc/self/maps (opening it again returns the same library, whose error state is the one torch checks)."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is not None:
        return int(fn())
    path = loaded_cudart()
    if path is None:
        return 0
    return int(ctypes.CDLL(path).cudaGetLastError())


def loaded_cudart(maps: str | None = None) -> str | None:
    """The path of the CUDA runtime library this process has loaded (libcudart.so.N), from /proc/self/maps."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        path = line.split(None, 5)[-1] if len(line.split(None, 5)) == 6 else ""
        if "/libcudart.so" in path:
            return path
    return None


def _gib(shape, dtype) -> str:
    n = 1
    for x in shape:
        n *= x
    return f"{n * torch.empty(0, dtype=dtype).element_size() / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------------------------ host memory
def _proc_bytes(path: str, key: str, default: int) -> int:
    """A `KEY: N kB` line of a /proc file, in bytes (default where there is no /proc)."""
    try:
        for line in open(path):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return default


def host_available() -> int:
    """Bytes of host memory this process may still take: the machine's MemAvailable, or less where the process's
    cgroup (memory.max) or its address-space limit (RLIMIT_AS, `ulimit -v`) leaves less."""
    room = _proc_bytes("/proc/meminfo", "MemAvailable", 1 << 62)
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            room = min(room, max(0, limit - _proc_bytes("/proc/self/status", "VmSize", 0)))
    except (ImportError, OSError, ValueError):
        pass
    return min(room, _cgroup_room())


def _cgroup_room() -> int:
    """What this process's memory cgroup leaves free (v2's memory.max, v1's memory.limit_in_bytes, less what the
    group uses), 2^62 where none limits it. Inside a container the group's own folder is the mount's root."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return 1 << 62
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            base, names = "/sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in (base + group.rstrip("/"), base):
            try:
                limit, used = (open(f"{folder}/{n}").read().strip() for n in names)
                if limit.isdigit() and int(limit) < 1 << 62:  # "max" (v2) or a huge number (v1): no limit
                    return max(0, int(limit) - int(used))
            except (OSError, ValueError):
                continue
            break
    return 1 << 62


def host_rss() -> int:
    return _proc_bytes("/proc/self/status", "VmRSS", 0)


def memory_stats(device: torch.device) -> dict:
    """Peak device memory (CUDA) and peak host resident memory of this process, in bytes."""
    import resource

    out = {"peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


# ------------------------------------------------------------------------------------------------------ time
class Clock:
    """Time spent on device work without waiting for it: on a GPU, events around each span on the current stream,
    read once they are done (`seconds`, after a step's token read or at the end); on a CPU, the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done = 0.0
        self.pending: list[tuple] = []

    @contextmanager
    def span(self):
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.done += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.pending.append((start, end))

    def seconds(self, wait: bool = True) -> float:
        """The total so far; `wait` False counts only the spans already finished (no host sync)."""
        left = []
        for start, end in self.pending:
            if not end.query():
                if not wait:
                    left.append((start, end))
                    continue
                end.synchronize()
            self.done += start.elapsed_time(end) / 1000
        self.pending = left
        return self.done


def keep_host_heap() -> None:
    """Keep freed mid-sized host blocks in the heap (glibc only; an explicit MALLOC_* setting wins).

    By default glibc hands blocks above 128 KiB back to the OS on free and takes fresh zeroed pages on the
    next allocation. A CPU decode step allocates dozens of such temporaries per layer (scores over the
    context, fetched rows), so it pays page faults on every one (infinigen's step, which makes the most of them,
    gains the most). Blocks up to 32 MiB now come from the heap,
    and the heap is not trimmed; the process keeps its peak footprint instead."""
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def resolve_dtype(dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--dtype: auto is the model's own on a GPU, float32 on a CPU (which computes half precision slowly)."""
    if dtype == "auto":
        return model_dtype if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InfinigenError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]

"""A GPU decode step projected from the operations it issues: the stopwatch for the GPU when none is at hand.

The fake-CUDA harness (fakecuda.py) records one step's operations as `Op`s: every aten kernel on a CUDA tensor
with the bytes it reads and writes in device memory and its FLOPs, each Triton launch with what it moves (the
gather kernel's rows cross PCIe from pinned host memory), copies between host and device, events recorded and
waited on, and host syncs. `project` prices each op by a roofline on `Hardware` (published figures, stated once
below, never fitted) and replays the code's own streams and events: the host issues each launch in `launch_s`, a
stream runs its ops in order, an event wait holds a stream until the recorded work is done, a sync holds the
host; device memory and each direction of the PCIe link are one resource every stream shares. The projected
step ends when the last of them does. Its floor (floor.py, at these rates): the weights and the device-resident
KV read at HBM speed beside the fetched rows over PCIe, overlapped.

What the projection cannot see (docs/performance.md): a small kernel may run beside another on a real GPU (here
the device runs one op's device part at a time: two streams' kernels interleave, never share the device); kernels
take a few microseconds at least and small grids use few SMs (here a tiny op costs only its bytes); the L2 cache
(50 MB: repeated small reads cost less); the host time of a launch varies with the Python around it (here a flat
`launch_s`); a gather kernel's rows that do not count (`ok` False) are counted as moved, as meta tensors carry no
values."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float  # device memory bandwidth
    flops_per_s: float  # dense 16-bit tensor-core throughput
    pcie_bytes_per_s: float  # pinned host memory read by the device (DMA or zero-copy)
    launch_s: float  # host time to issue one kernel or copy (eager PyTorch and Triton launchers)


# H100 SXM: HBM3 3.35 TB/s peak (3.0 taken), bf16 dense 989 TFLOP/s peak (700 taken); pinned host memory over PCIe
# 25 GB/s each way (REFERENCE.md section 1: achievable on Gen4; a Gen5 host reaches about 50); 4 us of host a launch
H100 = Hardware("H100", hbm_bytes_per_s=3.0e12, flops_per_s=700e12, pcie_bytes_per_s=25e9, launch_s=4e-6)


@dataclass
class Op:
    """One operation of a step as the harness saw it. kind: "kernel" (aten or fused attention), "triton", "copy"
    (host <-> device), "record" (an event on `stream`), "wait" (`stream` waits for event `event`), "sync" (the host
    waits for `streams`)."""

    kind: str
    name: str
    stream: str = ""
    hbm_bytes: int = 0
    flops: int = 0
    pcie_bytes: int = 0  # host to device
    event: int = 0
    streams: tuple = ()
    d2h_bytes: int = 0  # device to host (PCIe is full duplex: the other direction's link)

    @property
    def launch(self) -> bool:
        return self.kind in ("kernel", "triton", "copy")


@dataclass
class Projection:
    launches: int
    seconds: float  # the projected step
    issue_s: float  # the host's time issuing its launches
    hbm_bytes: int
    pcie_bytes: int
    flops: int
    syncs: int
    streams: int  # streams that ran work


def op_seconds(op: Op, hw: Hardware) -> tuple[float, float, float]:
    """The roofline, per resource: (device time: its bytes in HBM or its FLOPs, whichever is slower; its time on the
    host-to-device link; on the device-to-host link). An op takes the longest of them."""
    dev = max(op.hbm_bytes / hw.hbm_bytes_per_s, op.flops / hw.flops_per_s)
    return dev, op.pcie_bytes / hw.pcie_bytes_per_s, op.d2h_bytes / hw.pcie_bytes_per_s


class Timeline:
    """A resource's busy spans (sorted, disjoint): an op takes the earliest gap long enough at or after the time it
    may start, as a GPU runs whichever stream's work is ready (work issued later may fill an earlier gap)."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def take(self, start: float, length: float) -> float:
        """Book `length` seconds from the earliest free time >= start; returns when they end."""
        i = max(0, bisect.bisect_right(self.ends, start))
        t = start
        while i < len(self.starts) and self.starts[i] < t + length:  # a span overlaps [t, t + length): after it
            t = max(t, self.ends[i])
            i += 1
        self.starts.insert(i, t)
        self.ends.insert(i, t + length)
        return t + length


def project(ops: list[Op], hw: Hardware = H100) -> Projection:
    """Replay a step's ops (see the module docstring). Three resources are shared by every stream: the host issues
    each launch in turn, the device's memory and SMs run one op's device part at a time (decode kernels are bound
    by HBM, which concurrent kernels split), and each direction of the PCIe link carries one transfer at a time. An op
    may start once the host issued it and its stream is done with the one before; its device and link parts each
    take the first gap of their resource from then."""
    host = 0.0
    resources = Timeline(), Timeline(), Timeline()  # the device, PCIe host to device, PCIe device to host
    ready: dict[str, float] = {}  # stream -> when its last op ends
    busy: set[str] = set()  # streams that ran work
    events: dict[int, float] = {}
    syncs = 0
    for op in ops:
        if op.launch:
            host += hw.launch_s
            start = max(host, ready.get(op.stream, 0.0))
            times = op_seconds(op, hw)
            ready[op.stream] = max([start] + [r.take(start, t) for r, t in zip(resources, times, strict=True) if t])
            if max(times):
                busy.add(op.stream)
        elif op.kind == "record":
            events[op.event] = ready.get(op.stream, 0.0)
        elif op.kind == "wait":
            ready[op.stream] = max(ready.get(op.stream, 0.0), events.get(op.event, 0.0))
        elif op.kind == "sync":
            syncs += 1
            host = max([host] + [ready.get(s, 0.0) for s in op.streams])
    launched = [op for op in ops if op.launch]
    return Projection(
        launches=len(launched), seconds=max([host, *ready.values()]), issue_s=len(launched) * hw.launch_s,
        hbm_bytes=sum(op.hbm_bytes for op in launched), pcie_bytes=sum(op.pcie_bytes for op in launched),
        flops=sum(op.flops for op in launched), syncs=syncs, streams=len(busy),
    )  # fmt: skip

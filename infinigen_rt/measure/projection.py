"""A GPU decode step projected from the operations it issues: the stopwatch for the GPU when none is at hand, held to
what the lent GPUs measured.

The fake-CUDA harness (fakecuda.py) records one step's operations as `Op`s: every aten kernel on a CUDA tensor
with the bytes it reads and writes in device memory and its FLOPs, each Triton launch with what it moves (the
gather kernel's rows cross PCIe from pinned host memory), copies between host and device, events recorded and
waited on, host syncs, and which code issued each (the model's layers, or kv/ and policies/). `project` prices each
op on `Hardware` and replays the code's own streams and events: the host issues each launch (eager: the host time
an op of its kind took on the lent GPU's machine; captured in a CUDA graph: one replay for the step), a stream runs
its ops in order, an event wait holds a stream until the recorded work is done, a sync holds the host; the device
(its SMs), and each direction of the PCIe link, are each one resource every stream shares. The projected step ends
when the last of them does. Its floor (floor.py): the weights and the device-resident KV read at HBM's copy rate
beside the fetched rows at the DMA engine's, overlapped.

Each kernel's device time is its family's rate as the H100 reached it inside the measured step (H100 below, each
constant with the file and figure it comes from), never a datasheet's peak: the matrix multiplies, the paged
attention, the int4 scoring and the row gather each have their own; a top-k (torch's or ours) its time a call; the
rest HBM's copy rate, and no kernel less than `kernel_s`. A kernel that reads pinned host memory holds the SMs for as
long as its rows cross PCIe (the H100's profile: the gather, a program per 16 rows, overlapped the compute stream's
kernels 7-15 % of the time), or, where its programs are fewer than the SMs, their share of that time (a program
taken as a whole SM that no other kernel's block shares); the rest of the SMs run the other streams' kernels. The
overlap a projection reports is bench's: the share of the host-to-device link's busy time during which a kernel that
reads no host memory runs.

What it cannot see (docs/performance.md): two kernels sharing the SMs (the device runs one op's device part at a
time); the L2 cache; kernels that cuBLAS or a sort add to an op (the profile counted 1.25 kernels an op for `full`,
1.64 for the defaults: `launches` counts ops, host time is priced per op); a gather's rows that do not count (`ok`
False) are priced as moved."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

H100_RUN = "artifacts/results/gpu-h100-2026-11-26"
H200_RUN = "artifacts/results/gpu-h200-2026-11-26"
MATMUL = ("linear", "mm", "addmm", "bmm", "matmul")
ATTENTION = ("paged_decode_kernel", "merge_splits_kernel")
SCORING = ("score_codes_kernel", "score_codes_dot_kernel")
# a top-k: torch's, and the selection's own kernel (kv/_topk_kernel.py: one launch, no sort), priced as torch's
# until a GPU profiles it
TOPK = ("topk", "top_rows_kernel")


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float  # device memory, a plain copy (and the floor's rate)
    flops_per_s: float  # dense 16-bit matrix throughput
    pcie_bytes_per_s: float  # host to device by the copy engine (DMA; the floor's rate for fetched rows)
    launch_s: float  # eager: host time an op of the model's layers takes (its launch and the Python around it)
    kv_launch_s: float | None = None  # eager: an op that kv/ or policies/ issue (None: launch_s)
    gather_bytes_per_s: float | None = None  # a kernel reading pinned host memory (None: pcie_bytes_per_s)
    matmul_bytes_per_s: float | None = None  # the family's rates inside a step (None: hbm_bytes_per_s)
    attention_bytes_per_s: float | None = None
    scoring_bytes_per_s: float | None = None
    topk_s: float = 0.0  # device time of a top-k
    kernel_s: float = 0.0  # the least device time of a kernel
    plan_s: float = 0.0  # host time of a cuDNN attention over shapes no step before ran (Op.new_shape)
    graph_launch_s: float = 0.0  # a captured step: host time of its replay
    graph_gap_s: float = 0.0  # a captured step: the device's time between two of its kernels
    sms: int = 0  # streaming multiprocessors (0: a kernel reading pinned host memory holds them all)


# The H100 of 2026-11-26 (H100_RUN; tree 5a5a7e7, fp16, whose recorded steps are H100_RUN/traces): the rates from
# its profiles (per step: the family's device time against the bytes the recorded step moves for it), host time from
# bench's batch-1 medians (host-bound: the device busy 16.0 of 24.2 ms for `full`, 33.2 of 142.4 for the defaults).
H100 = Hardware(
    "H100",
    hbm_bytes_per_s=2.831e12,  # bench's probe, HBM copy 2,831-2,884 GB/s (README.md)
    flops_per_s=700e12,  # not reached by a decode step's matmuls (bytes bound them); bf16 dense, 989 peak
    pcie_bytes_per_s=47.1e9,  # bench's probe, host-to-device DMA 47.1-54.1 GB/s (README.md)
    # bench-llama-3.1-8b-32k.json, batch 1: `full` 24.6 ms over 1,146 model ops and 128 kv ops, the defaults 116.7
    # over 1,275 and 1,726 (the traces, copies by `to`, `contiguous` and `reshape` counted): the two equations' solution
    launch_s=15.2e-6,
    kv_launch_s=56.4e-6,
    gather_bytes_per_s=42.9e9,  # profile-llama31-8b-32k-b4.json, defaults: gather_rows_kernel 38.03 ms, 1.630 GB
    matmul_bytes_per_s=2.51e12,  # profile-llama31-8b-32k-b1.json, full: aten::mm 5.97 ms, 15.01 GB of weights
    attention_bytes_per_s=544e9,  # profile-llama31-8b-32k-b4.json, full: paged_decode_kernel 31.62 ms, 17.21 GB
    scoring_bytes_per_s=305e9,  # profile-llama31-8b-32k-b4.json, defaults: score_codes_kernel 18.36 ms, 5.60 GB
    topk_s=79e-6,  # profile-llama31-8b-32k-b4.json, defaults: aten::topk 4.75 ms for 60 calls
    kernel_s=1.9e-6,  # profile-llama31-8b-32k-b1.json, full: aten::mul 0.54 ms for 291 calls
    plan_s=2.0e-3,  # H200_RUN/profile-llama31-8b-32k-b1.json, offload: aten::_cudnn_attention_forward 64.22 ms of
    # host for 32 calls, each over a KV length no step before had (the defaults' repeated shapes: 105 us a call)
    # NVIDIA's "Getting Started with CUDA Graphs" (developer.nvidia.com/blog/cuda-graphs, V100): 20 kernels of 2.9 us
    # took 3.8 us each issued to a stream and 3.4 us each from a graph, its launch included: 0.5 us a kernel, and
    # the 20 kernels' 10 us again as a replay's host time (counted twice: on the safe side). Until a lent GPU
    # measures both (benchmarks/graph_probe.py)
    graph_launch_s=10e-6,
    graph_gap_s=0.5e-6,
    sms=132,  # H100 SXM5 (the "H100 80GB HBM3" of H100_RUN): NVIDIA H100 Tensor Core GPU Architecture, table 3
)


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
    site: str = ""  # the code that issued it: "model" (the layers, the runner) or "kv" (kv/ and policies/)
    new_shape: bool = False  # a fused attention over shapes no step before it ran (cuDNN then builds a plan)
    detail: tuple = ()  # with `recording(detail=True)`: its arguments as a CUDA graph would hold them (capture.py)
    programs: int = 0  # a Triton launch's programs (0: not recorded)

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
    overlap: float | None = None  # the share of host-to-device transfer time under a kernel reading no host memory


def op_seconds(op: Op, hw: Hardware, graphs: bool = False) -> tuple[float, float, float]:
    """Per resource: (the device's time: its family's rate, FLOPs, or the least a kernel takes, whichever is
    longest, and the whole time its rows cross PCIe where a kernel reads pinned host memory; the host-to-device
    link's; the device-to-host link's). An op takes the longest of them."""
    if op.kind == "copy":  # the copy engine: the link, not the SMs
        return 0.0, op.pcie_bytes / hw.pcie_bytes_per_s, op.d2h_bytes / hw.pcie_bytes_per_s
    rate = hw.hbm_bytes_per_s
    for names, family in ((MATMUL, hw.matmul_bytes_per_s), (ATTENTION, hw.attention_bytes_per_s),
                          (SCORING, hw.scoring_bytes_per_s)):  # fmt: skip
        if op.name in names and family:
            rate = family
    dev = max(hw.kernel_s, op.hbm_bytes / rate, op.flops / hw.flops_per_s, hw.topk_s if op.name in TOPK else 0)
    h2d = op.pcie_bytes / (hw.gather_bytes_per_s or hw.pcie_bytes_per_s)
    gap = hw.graph_gap_s if graphs else 0.0
    return max(dev, h2d * sm_share(op, hw)) + gap, h2d, op.d2h_bytes / hw.pcie_bytes_per_s


def sm_share(op: Op, hw: Hardware) -> float:
    """The share of the SMs a kernel holds while its rows cross PCIe: its programs' (a program a whole SM) where
    they are fewer than the SMs, else all of them."""
    return min(1.0, op.programs / hw.sms) if op.programs and hw.sms else 1.0


def host_seconds(op: Op, hw: Hardware) -> float:
    """Eager: the host's time issuing the op (its kind's, and a cuDNN attention's plan over new shapes)."""
    base = hw.kv_launch_s if op.site == "kv" and hw.kv_launch_s is not None else hw.launch_s
    return base + (hw.plan_s if op.new_shape else 0.0)


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


def project(ops: list[Op], hw: Hardware = H100, graphs: bool = False) -> Projection:
    """Replay a step's ops (see the module docstring). Three resources are shared by every stream: the host issues
    each launch in turn (with `graphs`, the step's one replay issues them all), the device's SMs run one op's device
    part at a time, and each direction of the PCIe link carries one transfer at a time. An op may start once the
    host issued it and its stream is done with the one before; its device and link parts each take the first gap
    of their resource from then."""
    host = hw.graph_launch_s if graphs else 0.0
    resources = Timeline(), Timeline(), Timeline()  # the device, PCIe host to device, PCIe device to host
    ready: dict[str, float] = {}  # stream -> when its last op ends
    busy: set[str] = set()  # streams that ran work
    events: dict[int, float] = {}
    syncs = 0
    spans: tuple[list, list] = ([], [])  # (host-to-device transfers, kernels that read no host memory): (start, end)
    for op in ops:
        if op.launch:
            if op.new_shape and not graphs:  # (the host does not run ahead of the device across it: see H100.plan_s)
                host = max(host, ready.get(op.stream, 0.0))
            host += 0.0 if graphs else host_seconds(op, hw)
            start = max(host, ready.get(op.stream, 0.0))
            times = op_seconds(op, hw, graphs)
            ends = [r.take(start, t) if t else start for r, t in zip(resources, times, strict=True)]
            ready[op.stream] = max(start, *ends)
            if times[1]:
                spans[0].append((ends[1] - times[1], ends[1]))
            elif times[0] and op.kind != "copy":
                spans[1].append((ends[0] - times[0], ends[0]))
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
    issue = hw.graph_launch_s if graphs else sum(host_seconds(op, hw) for op in launched)
    return Projection(
        launches=len(launched), seconds=max([host, *ready.values()]), issue_s=issue,
        hbm_bytes=sum(op.hbm_bytes for op in launched), pcie_bytes=sum(op.pcie_bytes for op in launched),
        flops=sum(op.flops for op in launched), syncs=syncs, streams=len(busy),
        overlap=round(interval_overlap(*spans), 4) if spans[0] else None,
    )  # fmt: skip


def merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    """Intervals (start, end) merged where they overlap, in order."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def interval_overlap(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float:
    """Share of the copies' total time during which some kernel runs (intervals as (start, end))."""
    merged_kernels = merged(kernels)
    total = sum(e - s for s, e in copies)
    if total <= 0:
        return 0.0
    covered = 0.0
    for s, e in copies:
        for ms, me in merged_kernels:
            covered += max(0.0, min(e, me) - max(s, ms))
    return covered / total


def read_trace(path) -> tuple[dict, list[Op]]:
    """A recorded step (benchmarks/record_trace.py: gzipped JSON, its point's fields and its ops as rows of
    `fields`): (the fields, the ops). A field a recording lacks takes Op's default."""
    import gzip
    import json

    with gzip.open(path, "rt") as f:
        record = json.load(f)
    names = record.pop("fields")
    ops = []
    for row in record.pop("ops"):
        kw = {k: v for k, v in zip(names, row, strict=True) if v is not None}
        kw["streams"] = tuple(kw.get("streams", ()))
        ops.append(Op(**kw))
    return record, ops

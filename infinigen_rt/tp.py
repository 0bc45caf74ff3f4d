"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs), launched by `torchrun`.

Each rank holds a slice of every layer, as in Megatron-LM and gpt-fast's tp.py: the query heads with their KV
heads (a GQA group is never split), the MLP's intermediate columns; the output projection and the MLP's down
projection are split along their input, so one all-reduce after each makes every rank's residual stream whole
again. Embeddings, norms and the LM head are replicated: every rank computes the same logits, so every rank
samples the same tokens and runs the same steps without exchanging them. A rank reads only its slices of the
bundle's safetensors (`get_slice`), builds its caches for its own KV heads (its own host pool and, for
`infinigen`, its own partial keys and speculation tensors), and where the method needs a value over every query
head (the fetch count of a sequence) the ranks all-reduce a small tensor.

    torchrun --nproc-per-node 2 -m infinigen_rt.cli generate BUNDLE "The king said" --device cpu
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from infinigen_rt.config import ModelConfig
from infinigen_rt.errors import InfinigenError

TIMEOUT_S = 60  # a collective that waits longer than this: a peer died (INFINIGEN_TP_TIMEOUT overrides)


@dataclass(eq=False)
class TP:
    rank: int
    size: int
    reduces: int = 0  # all-reduces made, and the seconds spent in them (gloo: the whole exchange; NCCL: enqueueing)
    reduce_s: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank gets the same tensor)."""
        t0 = time.perf_counter()
        try:
            dist.all_reduce(x)
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (or a subclass) on a timeout or a lost peer
            raise peer_lost(self, e) from None
        self.reduces += 1
        self.reduce_s += time.perf_counter() - t0
        return x

    def reduce_counts(self, *values: float) -> list[float]:
        """Host numbers summed over ranks (one small all-reduce)."""
        return self.all_reduce(_on_backend(torch.tensor(values, dtype=torch.float64))).tolist()


def _on_backend(t: torch.Tensor) -> torch.Tensor:
    """NCCL reduces device tensors only."""
    return t.cuda() if dist.get_backend() == "nccl" else t


def peer_lost(tp: TP, e: Exception) -> InfinigenError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return InfinigenError(
        f"tensor-parallel rank {tp.rank} of {tp.size}: a collective failed ({first[:160]}); another rank stopped "
        "(see its output) or did not answer in time (INFINIGEN_TP_TIMEOUT seconds)"
    )


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def follower_env() -> bool:
    """This process is a rank other than 0 of a group torchrun started (it prints nothing)."""
    return world_size() > 1 and os.environ.get("RANK", "0") != "0"


def from_env(device: torch.device, cfg: ModelConfig | None = None) -> TP | None:
    """The process group `torchrun` describes in the environment (WORLD_SIZE, RANK, MASTER_ADDR...), or None
    when this process runs alone. NCCL for a GPU (each rank on the GPU of its LOCAL_RANK), gloo for a CPU.
    `cfg`: the model, whose heads the size must divide (checked before waiting for the other ranks)."""
    size = world_size()
    if size <= 1:
        return None
    if cfg is not None:
        check_size(cfg, size)
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get("INFINIGEN_TP_TIMEOUT", TIMEOUT_S)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            bind_to_node(gpu_node(local))  # before any host pool is allocated: its pages land on that node
        dist.init_process_group(backend, timeout=timeout)
        atexit.register(_close)  # torch's groups left open at exit abort the process ("terminate called...")
    return TP(rank, size)


def _close() -> None:
    """At exit: wait (briefly) until every rank is done, then tear the group down. A rank leaving while another is
    still in the group's last exchange made gloo abort the process (seen under load)."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=10))
        else:
            dist.barrier()
    except Exception:  # a rank that is gone (its error is already printed): nothing left to wait for
        pass
    dist.destroy_process_group()


def gpu_node(index: int, sysfs: Path = Path("/sys")) -> int | None:
    """The NUMA node a GPU hangs off (its PCI device's `numa_node`), or None when the machine does not say."""
    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in ids:
        return None
    path = sysfs / "bus/pci/devices" / f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0" / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: Path = Path("/sys")) -> set[int]:
    """The CPUs of NUMA node `node` (its `cpulist`, e.g. "0-15,32-47"); empty when there is no such node."""
    try:
        text = (sysfs / "devices/system/node" / f"node{node}" / "cpulist").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_node(node: int | None, sysfs: Path = Path("/sys")) -> bool:
    """Run this process on the CPUs of `node` when the machine has several nodes, so the host pool (allocated
    and page-locked by this process, first touch) sits next to this rank's GPU. Returns whether it bound."""
    nodes = list((sysfs / "devices/system/node").glob("node[0-9]*"))
    cpus = node_cpus(node, sysfs) if node is not None and len(nodes) > 1 else set()
    allowed = os.sched_getaffinity(0) & cpus
    if not allowed:
        return False
    os.sched_setaffinity(0, allowed)
    return True


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes that split the KV heads (and so the query heads, group by group) and the MLP evenly."""
    return [n for n in range(1, cfg.num_key_value_heads + 1) if not cfg.num_key_value_heads % n
            and not cfg.intermediate_size % n]  # fmt: skip


def check_size(cfg: ModelConfig, size: int) -> None:
    ok = allowed_sizes(cfg)
    if size not in ok:
        raise InfinigenError(
            f"tensor-parallel size {size} does not divide the model's {cfg.num_key_value_heads} KV heads (each rank "
            f"holds whole KV heads and their query heads); use one of: {', '.join(map(str, ok))}"
        )


def shard_config(cfg: ModelConfig, tp: TP | None) -> ModelConfig:
    """What one rank's model and caches see: its share of the heads and of the MLP."""
    if tp is None:
        return cfg
    check_size(cfg, tp.size)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp.size,
        num_key_value_heads=cfg.num_key_value_heads // tp.size, intermediate_size=cfg.intermediate_size // tp.size,
    )  # fmt: skip


# the checkpoint tensors each rank slices: by the last two parts of their name -> the dimension split
_ROWS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
         "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias", "fc1.weight", "fc1.bias"}  # fmt: skip
_COLUMNS = {"o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight"}
_SUMMED_BIAS = {"o_proj.bias", "down_proj.bias", "out_proj.bias", "fc2.bias"}  # added once: by rank 0


def split(name: str) -> str | None:
    """How tensor `name` is split across ranks: "rows", "columns", "rank0" (a bias after an all-reduce), or None
    (replicated)."""
    tail = ".".join(name.split(".")[-2:])
    if ".layers." not in f".{name}":
        return None
    return "rows" if tail in _ROWS else "columns" if tail in _COLUMNS else "rank0" if tail in _SUMMED_BIAS else None


def read_slice(f, name: str, tp: TP | None) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, only this rank's part of it read."""
    how = None if tp is None else split(name)
    if how is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if how == "rank0":  # a bias (small): read, and zero on every other rank
        return sl[:] if tp.rank == 0 else torch.zeros_like(sl[:])
    dim = 0 if how == "rows" else 1
    n = shape[dim] // tp.size
    a, b = tp.rank * n, (tp.rank + 1) * n
    return sl[a:b] if dim == 0 else sl[:, a:b]


def shard_speculation(tensors: dict[str, torch.Tensor], tp: TP | None) -> dict[str, torch.Tensor]:
    """A rank's part of the InfiniGen tensors: every one is per KV head (or per query head) along its first
    dimension (partial-key columns [Hkv, d'], skews [Hkv, D, D], OPT's partial query rows [H * d', hidden])."""
    if tp is None:
        return tensors
    out = {}
    for name, t in tensors.items():
        n = t.shape[0] // tp.size
        out[name] = t[tp.rank * n : (tp.rank + 1) * n].contiguous()
    return out


def total_report(report, tp: TP | None):
    """A cache report over every rank: bytes and evictions summed, shares and recall averaged (every rank holds as
    many heads, so the mean of the ranks' shares is the share over all heads), the largest per-head count."""
    if tp is None:
        return report
    sums = tp.reduce_counts(report.bytes_h2d, report.bytes_d2h, report.evictions, report.share_rows or 0)
    report.bytes_h2d, report.bytes_d2h, report.evictions = (int(x) for x in sums[:3])
    report.share_rows = int(sums[3]) if report.share_rows is not None else None
    for f in ("kv_fetched_share", "kv_attended_share", "attention_recall", "tokens_per_head_mean"):
        v = getattr(report, f)
        if v is not None:
            setattr(report, f, round(tp.reduce_counts(v)[0] / tp.size, 6))
    if report.tokens_per_head_max is not None:
        t = _on_backend(torch.tensor([float(report.tokens_per_head_max)]))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        report.tokens_per_head_max = t.item()
    if report.per_layer:
        report.per_layer = {"bytes_h2d": [int(x) for x in tp.reduce_counts(*report.per_layer["bytes_h2d"])]}
    return report


def tp_time(tp: TP, before: tuple[int, float]) -> dict:
    """This rank's all-reduces during a run (`before`: the counters at its start): how many, and their seconds."""
    return {"allreduces": tp.reduces - before[0], "allreduce_s": round(tp.reduce_s - before[1], 6)}


def check_tp_option(n: int) -> bool:
    """Validate `--tp`; True when this process should start the ranks itself (N > 1, not under torchrun)."""
    if n < 1:
        raise InfinigenError(f"--tp must be >= 1, got {n}")
    if world_size() > 1 and n not in (1, world_size()):
        raise InfinigenError(f"--tp {n} under torchrun with WORLD_SIZE {world_size()}: drop --tp or make them agree")
    return n > 1 and world_size() == 1

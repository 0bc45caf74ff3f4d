"""InfiniGen's speculation: from layer j-1's attention input, a speculative query of layer j, its scores over
layer j's speculation keys, and the rows layer j fetches (a Selection). Device-agnostic tensor code; how rows
move is prefetch.py's business, which slot holds which token is pool.py's.

The speculation keys live on the compute device, one store per choice (`spec_keys`): `PartialKeys`, the paper's
d' skewed columns in the model's dtype; `QuantKeys`, every column at 4 or 2 bits, a scale per token and group of
columns; `ChannelKeys`, every column at 4 bits, a scale per channel and run of slots. The correction step
(infinigen.py) scores layer j's true query against the same store (`Speculator.keys_side`).

Per speculated layer j and sequence b: scores s = q~ . K~ / sqrt(D) over every held token; n = the mean over
query heads of the tokens within `alpha` of the head's maximum, capped by the budget; the top-n tokens per KV
head (the group's probabilities summed, or its logits' max) are chosen. Sinks and recent tokens are always
among them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from infinigen_rt.bundle import partial_idx_name, partial_q_name, skew_name
from infinigen_rt.config import ModelConfig
from infinigen_rt.kv import cpu, quant
from infinigen_rt.kv.quant import code_bytes
from infinigen_rt.models.llama import SpeculationTaps, linear, rope_heads
from infinigen_rt.system import to_device

if TYPE_CHECKING:  # the policies import this module
    from infinigen_rt.policies.options import KVOptions


FORCED = float(2**23)  # a forced token's rank value (integers below 2**24 are exact in float32)


class Speculator:
    """The per-layer pieces of speculation, built once from a model's taps and a bundle's InfiniGen tensors:
    partial query weights (RoPE models: the full query, then the skew's chosen columns; OPT: the folded partial
    rows), the partial-key columns, and the renorm map from layer j-1's norm to layer j's."""

    def __init__(self, cfg: ModelConfig, taps: SpeculationTaps, tensors: dict, device, dtype):
        self.cfg, self.taps = cfg, taps
        n_layers, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.group = cfg.num_attention_heads // hkv
        self.idx = [tensors[partial_idx_name(j)].to(device) for j in range(n_layers)]  # [Hkv, d']
        self.d_prime = self.idx[0].shape[-1]
        self.scale = scale = 1 / math.sqrt(d)  # folded into the query side, never applied to scores over the context
        if taps.rope is not None:  # the skew's chosen columns: [Hkv, D, d'] (keys) and scaled (queries)
            self.a_part = [
                torch.gather(tensors[skew_name(j)].to(device), 2, self.idx[j][:, None, :].expand(hkv, d, -1)).to(dtype)
                for j in range(n_layers)
            ]
            self.a_part_q = [(a * scale)[None] for a in self.a_part]
        else:  # OPT: skew folded into the weights; the partial query weight is a real smaller matmul
            self.pq = [
                (tensors[partial_q_name(j, "weight")].to(device, dtype) * scale,
                 tensors[partial_q_name(j, "bias")].to(device, dtype) * scale
                 if partial_q_name(j, "bias") in tensors else None)
                for j in range(n_layers)
            ]  # fmt: skip
        self.renorm = [None] + [self._renorm_affine(j) for j in range(1, n_layers)]  # (scale, shift or None)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin for the speculative queries of a pass at `positions` (None without RoPE)."""
        return None if self.taps.rope is None else self.taps.rope(positions, dtype)

    def partial_key(self, j: int, k: torch.Tensor) -> torch.Tensor:
        """k: [B, Hkv, s, D] (post-RoPE) -> the skewed partial key [B, Hkv, s, d']."""
        if self.taps.rope is not None:
            return k @ self.a_part[j]
        idx = self.idx[j]
        return torch.gather(k, -1, idx[None, :, None, :].expand(k.shape[0], -1, k.shape[2], -1))

    def _renorm_affine(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        (pw, pb), (cw, cb) = self.taps.norms[j - 1], self.taps.norms[j]
        ratio = cw / torch.where(pw.abs() < 1e-6, 1e-6, pw)
        if pb is None and cb is None:
            return ratio, None
        shift = (cb if cb is not None else 0) - (pb * ratio if pb is not None else 0)
        return ratio, shift

    def renormed(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j-1's normalised input as layer j's norm would give it: exact for RMSNorm (x * g_j / g_{j-1});
        for LayerNorm (x - b_{j-1}) / g_{j-1} * g_j + b_j (one affine map, computed once per layer)."""
        ratio, shift = self.renorm[j]
        return x * ratio if shift is None else torch.addcmul(shift, x, ratio)

    def query(self, j: int, x: torch.Tensor, cos_sin, renorm: bool, full: bool = False) -> torch.Tensor:
        """Layer j's speculative query from layer j-1's attention input x: [B, 1, hidden] -> [B, Hkv, G, d'] (the
        skewed columns; `full`: every column, [B, Hkv, G, D]), already divided by sqrt(head_dim). `cos_sin`: this
        pass's rope (see `rope`)."""
        if renorm and self.taps.normalised_input:  # post-LN OPT: the input is not normalised
            x = self.renormed(j, x)
        b, hkv, g, d = x.shape[0], self.cfg.num_key_value_heads, self.group, self.cfg.head_dim
        if self.taps.rope is None and not full:  # OPT: the folded partial rows, a real smaller matmul
            w, bias = self.pq[j]
            return linear(x, w, bias).view(b, hkv, g, -1)
        weight, bias = self.taps.q_proj[j]  # RoPE sits between projection and dot product: full query, rotate
        q = linear(x, weight, bias).view(b, 1, hkv * g, d).transpose(1, 2)
        if self.taps.q_norm is not None and self.taps.q_norm[j] is not None:  # the head's norm, as layer j's own
            q = self.taps.q_norm[j](q)
        if self.taps.rope is not None:
            q = rope_heads(q, q.shape[1], *cos_sin)
        if self.taps.query_scale != 1.0:  # as the model scales its queries (the correction's true query comes so)
            q = q * self.taps.query_scale
        return self.keys_side(j, q.reshape(b, hkv, g, d), full)

    def keys_side(self, j: int, q: torch.Tensor, full: bool) -> torch.Tensor:
        """Layer j's query [B, Hkv, G, D] (post-RoPE, unscaled) as it meets the speculation keys: divided by
        sqrt(head_dim), and the skewed columns [.., d'] unless `full`. The correction step scores layer j's true
        query this way."""
        if full:
            return q * self.scale
        if self.taps.rope is not None:
            return q @ self.a_part_q[j]
        idx = self.idx[j]  # OPT: the skew is folded into the weights, so the skewed columns are the query's own
        return torch.gather(q, -1, idx[None, :, None, :].expand(q.shape[0], -1, q.shape[2], -1)) * self.scale


class PartialKeys:
    """The paper's speculation keys: each token's d' skewed key columns in the model's dtype, per speculated layer
    [B, Hkv, d', S] (transposed: the scores are one batched matmul), on the compute device."""

    name = "partial"

    def __init__(self, spec: Speculator, layers, batch: int, max_len: int, device, dtype):
        self.spec, self.full = spec, False
        hkv = spec.cfg.num_key_value_heads
        self.pk = {j: torch.zeros(batch, hkv, spec.d_prime, max_len, device=device, dtype=dtype) for j in layers}

    @staticmethod
    def token_bytes(head_dim: int, d_prime: int, dtype_bytes: int) -> int:
        """Device bytes per token, KV head and speculated layer."""
        return d_prime * dtype_bytes

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pk.values())

    def write(self, j: int, k: torch.Tensor, start, distinct: bool = False, appends=None) -> None:
        """k: the new tokens' keys [B, Hkv, s, D] (post-RoPE), into slots start.. (an int) or `start` [B, Hkv, s]
        (`distinct`, `appends`: see ChannelKeys.write)."""
        part = self.spec.partial_key(j, k).transpose(-1, -2)  # [B, Hkv, d', s]
        if isinstance(start, int):
            self.pk[j][..., start : start + k.shape[2]] = part
        else:  # freed slots, each (sequence, KV head) its own
            self.pk[j].scatter_(3, start[:, :, None, :].expand_as(part), part)

    def scores(self, j: int, q: torch.Tensor, t: int) -> torch.Tensor:
        """q [B, Hkv, G, d'] (scaled) against the first t slots: [B, Hkv, G, t] in float32."""
        return (q @ self.pk[j][..., :t]).float()

    def scores_at(self, j: int, q: torch.Tensor, idx: torch.Tensor | slice) -> torch.Tensor:
        """A store's keys (batch 1, its flat slots): q [B, Hkv, G, d'] against row b's slots idx[b] ([B, T]):
        [B, Hkv, G, T] in float32. `idx` a slice: one row whose slots are one run (read in place); [B, Hkv, T]:
        each (sequence, KV head) its own slots (of its own row where the keys have a row per sequence)."""
        if isinstance(idx, slice):
            return (q @ self.pk[j][..., idx]).float()
        if idx.dim() == 3:
            pk = self.pk[j].expand(q.shape[0], -1, -1, -1)
            return (q @ pk.gather(3, idx[:, :, None, :].expand(-1, -1, pk.shape[2], -1))).float()
        return (q @ self.pk[j][0][:, :, idx].permute(2, 0, 1, 3)).float()


class QuantKeys:
    """Every key column at `bits` bits (asymmetric, per token in groups of `group` columns, fp16 scale and
    minimum: kv/quant.py), per speculated layer [B, Hkv, S, D * bits / 8] on the compute device, written as each
    token's key arrives. At 4 bits and head_dim 64 that is 36 bytes per token and KV head, a little under the 40 of
    the paper's 20 columns (r = 0.3) in fp16; the scores see every column."""

    def __init__(self, spec: Speculator, layers, batch: int, max_len: int, device, dtype, bits: int):
        self.spec, self.full, self.bits = spec, True, bits
        d, hkv = spec.cfg.head_dim, spec.cfg.num_key_value_heads
        self.group = key_group(d, bits)
        self.name = f"int{bits}"
        shape = (batch, hkv, max_len)
        self.codes = {j: torch.zeros(*shape, d * bits // 8, device=device, dtype=torch.uint8) for j in layers}
        self.meta = {j: torch.zeros(*shape, 2, d // self.group, device=device, dtype=torch.float16) for j in layers}

    @staticmethod
    def token_bytes(head_dim: int, bits: int) -> int:
        return code_bytes(head_dim, key_group(head_dim, bits), bits)

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.codes, self.meta) for t in d.values())

    def write(self, j: int, k: torch.Tensor, start, distinct: bool = False, appends=None) -> None:
        """k: the new tokens' keys [B, Hkv, s, D] (post-RoPE), into slots start.. (an int) or `start` [B, Hkv, s]
        (`distinct`, `appends`: see ChannelKeys.write)."""
        quant.store(k, self.codes[j], self.meta[j], start, self.group, self.bits)

    def scores(self, j: int, q: torch.Tensor, t: int) -> torch.Tensor:
        """q [B, Hkv, G, D] (scaled) against the first t slots' keys: [B, Hkv, G, t] in float32 (quant.scores)."""
        return quant.scores(q, self.codes[j], self.meta[j], t, self.group, self.bits)

    def scores_at(self, j: int, q: torch.Tensor, idx: torch.Tensor | slice) -> torch.Tensor:
        """A store's keys (batch 1, its flat slots): q [B, Hkv, G, D] against row b's slots idx[b] ([B, T]):
        [B, Hkv, G, T] in float32. `idx` a slice: one row whose slots are one run (read in place); [B, Hkv, T]:
        each (sequence, KV head) its own slots (of its own row where the keys have a row per sequence)."""
        return quant.scores(q, self.codes[j], self.meta[j], idx, self.group, self.bits)


CHANNEL_TOKENS = 16  # the slots a channel's scale spans in ChannelKeys (a store page, kv/store.py's BLOCK)
# the new keys a GPU's ChannelKeys.write puts in at once where several may share a run: as many as keep the runs it
# forms (one per key at worst, [keys x rows x KV heads, CHANNEL_TOKENS, D] float32) within WRITE_BYTES, at least
# WRITE_SPAN (a 32k prompt at Llama-3.1-8B's shape: 1,024 keys a write, 32 writes a layer where 256 made 128)
WRITE_SPAN = 256
WRITE_BYTES = 64 << 20


def write_span(pairs: int, head_dim: int) -> int:
    """ChannelKeys.write's keys a write on a GPU for `pairs` (row, KV head) pairs: whole runs (a span that ended
    inside a run would quantize it twice, once with part of its keys), at least WRITE_SPAN."""
    fit = WRITE_BYTES // (pairs * CHANNEL_TOKENS * head_dim * 4)
    return max(WRITE_SPAN, fit // CHANNEL_TOKENS * CHANNEL_TOKENS)


class ChannelKeys:
    """Every key column at 4 bits with a scale and minimum per channel over each run of CHANNEL_TOKENS slots (KIVI's
    layout for keys: a channel keeps its offset, so that a few huge channels, as Qwen's key biases make, cost the
    others no precision), per speculated layer: codes [B, Hkv, S, D / 2], meta [B, Hkv, S / CHANNEL_TOKENS, 2, D]
    (fp16 scale, minimum) and which slots were written [B, Hkv, S] (bool), on the compute device. At head_dim 64
    that is 32 + 16 + 1 = 49 bytes per token and KV head.

    A run fills as tokens arrive: each write dequantizes the runs it touches, puts the new keys in and quantizes
    them again over the slots written, so no key is kept at full precision (KIVI keeps the unfilled group so). The
    scores: on a GPU the low-bit scoring kernel, which forms a tile's keys in registers from their codes and their
    run's scales (kv/_quant_kernel.py); elsewhere a span of keys dequantized at a time and one product."""

    name = "int4c"

    def __init__(self, spec: Speculator, layers, batch: int, max_len: int, device, dtype):
        self.spec, self.full, self.bits = spec, True, 4
        d, hkv, t, bits = spec.cfg.head_dim, spec.cfg.num_key_value_heads, CHANNEL_TOKENS, 4
        runs = -(-max_len // t)
        self.codes = {j: torch.zeros(batch, hkv, runs * t, d * bits // 8, device=device, dtype=torch.uint8)
                      for j in layers}  # fmt: skip
        self.meta = {j: torch.zeros(batch, hkv, runs, 2, d, device=device, dtype=torch.float16) for j in layers}
        self.held = {j: torch.zeros(batch, hkv, runs * t, device=device, dtype=torch.bool) for j in layers}

    @staticmethod
    def token_bytes(head_dim: int) -> int:
        """Device bytes per token and KV head: its codes, its share of its run's scales and minimums, its flag (the
        store holds whole runs: a length not a multiple of CHANNEL_TOKENS rounds up)."""
        return head_dim // 2 + 2 * 2 * head_dim // CHANNEL_TOKENS + 1

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.codes, self.meta, self.held) for t in d.values())

    def write(self, j: int, k: torch.Tensor, start, distinct: bool = False, appends=None) -> None:
        """k: the new tokens' keys [R, Hkv, s, D] (post-RoPE), into slots start.. (an int) or `start` [R, Hkv, s].
        `distinct`: no two of `start`'s slots share a run within a (row, KV head) (one new token per sequence; a
        run never holds two sequences' slots), so no device read sorts them out. `appends`: which new keys go to
        the end of their sequence's slots, so that a run's slots after them hold none of its keys (a page another
        sequence left): True, bool [R, Hkv, s] or [R, 1, s]; None: every one where `start` is an int (a row's next
        slots), none where it is a tensor (freed slots too). A run's range spans the slots written to it since."""
        r, hkv, s, d = k.shape
        if s == 0:
            return
        t, dev = CHANNEL_TOKENS, k.device
        codes, meta, held = self.codes[j], self.meta[j], self.held[j]
        if appends is None:
            appends = isinstance(start, int)
        fused = quant.fused(k, d)
        if (fused or dev.type == "cpu") and (s == 1 or distinct and not isinstance(start, int)):  # a run a key
            slots = torch.full((r, hkv, 1), start, device=dev, dtype=torch.int64) if isinstance(start, int) else start
            if fused:  # one launch, a row a program
                mode = 2 if isinstance(appends, torch.Tensor) else int(appends)
                quant.quantize_channel(k, slots.expand(r, hkv, s), appends if mode == 2 else None, codes, meta, held,
                                       mode, t, quant.FP16_TINY)  # fmt: skip
                return
            if cpu.quantize_channel(k, slots, appends, codes, meta, held, t, quant.FP16_TINY):  # the CPU's kernel
                return
        span = write_span(r * hkv, d)
        if not isinstance(start, int) and not distinct and dev.type != "cpu" and s > span:
            for i in range(0, s, span):  # (what the sorted runs below hold stays small)
                self.write(j, k[:, :, i : i + span], start[..., i : i + span],
                           appends=appends[..., i : i + span] if isinstance(appends, torch.Tensor) else appends)
            return
        pair = (torch.arange(r, device=dev)[:, None] * hkv + torch.arange(hkv, device=dev)[None]).view(r, hkv, 1)
        at, touched, which, lead = self._runs(pair, start, s, meta.shape[2], distinct)
        held.view(-1)[(pair * held.shape[2] + at).reshape(-1)] = True
        runs_held = held.view(-1, t)[touched]  # [u, t]
        if appends is not False:  # the runs' slots after a key appended: none of its own
            off = (at % t).reshape(-1)
            end = off if appends is True else torch.where(appends.expand(r, hkv, s).reshape(-1), off, -1)
            last = torch.full((touched.numel(),), -1, dtype=off.dtype, device=dev).scatter_reduce(0, which, end, "amax")
            runs_held &= (torch.arange(t, device=dev) <= last[:, None]) | (last[:, None] < 0)
            if lead is not None:
                runs_held = runs_held[lead]
            held.view(-1, t)[touched] = runs_held
        c_runs, m_runs = codes.view(-1, t, codes.shape[-1]), meta.view(-1, 2, d)
        x = quant.dequantize(c_runs[touched], m_runs[touched, 0][:, None], m_runs[touched, 1][:, None], 1,
                             torch.float32, self.bits)  # [u, t, D]  # fmt: skip
        x[which, (at % t).reshape(-1)] = k.reshape(-1, d).float()
        c, m = quant.quantize_channels(x, runs_held, self.bits)
        if lead is not None:
            c, m = c[lead], m[lead]
        c_runs[touched], m_runs[touched] = c, m

    @staticmethod
    def _runs(pair: torch.Tensor, start, s: int, runs: int, distinct: bool) -> tuple:
        """Where `write`'s new keys go: (at: their slots [R, Hkv, s]; touched: the flat ids of the runs they touch;
        which: each key's entry in `touched`; lead: where a run repeats in `touched`, each entry's first, whose
        result every repeat writes, else None). `pair` [R, Hkv, 1]: each (row, KV head)'s flat index."""
        t, dev = CHANNEL_TOKENS, pair.device
        if isinstance(start, int):  # runs first..last of every (row, KV head), in order
            first, last = start // t, (start + s - 1) // t
            at = torch.arange(start, start + s, device=dev).expand(*pair.shape[:2], s)
            touched = (pair * runs + torch.arange(first, last + 1, device=dev)).reshape(-1)
            return at, touched, (pair * (last - first + 1) + at // t - first).reshape(-1), None
        run_ids = (pair * runs + start // t).reshape(-1)
        if distinct or s == 1:
            return start, run_ids, torch.arange(run_ids.numel(), device=dev), None
        if dev.type == "cpu":
            touched, which = torch.unique(run_ids, return_inverse=True)
            return start, touched, which, None
        # no device read (unique's count): sorted, a run's keys all go into its first entry
        touched, order = run_ids.sort()
        n = touched.numel()
        starts = torch.ones(n, dtype=torch.bool, device=dev)
        starts[1:] = touched[1:] != touched[:-1]
        lead = (torch.arange(n, device=dev) * starts).cummax(0).values
        return start, touched, torch.empty_like(lead).scatter_(0, order, lead), lead

    def _keys(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """codes [.., n, bytes] and each slot's meta [.., n, 2, D] -> the keys [.., n, D] in float32."""
        return quant.dequantize(codes, meta[..., 0, :], meta[..., 1, :], 1, torch.float32, self.bits)

    def scores(self, j: int, q: torch.Tensor, t: int) -> torch.Tensor:
        """q [B, Hkv, G, D] (scaled) against the first t slots' keys: [B, Hkv, G, t] in float32."""
        return self.scores_at(j, q, t)

    def scores_at(self, j: int, q: torch.Tensor, idx: torch.Tensor | slice | int) -> torch.Tensor:
        """As QuantKeys.scores_at (`idx` an int t: each sequence's own row, its first t slots), a span of slots at a
        time (what the dequantized keys hold stays near quant.CHUNK_BYTES)."""
        codes, meta, tok = self.codes[j], self.meta[j], CHANNEL_TOKENS
        b, hkv, g, d = q.shape
        n = idx if isinstance(idx, int) else idx.stop - idx.start if isinstance(idx, slice) else idx.shape[-1]
        if quant.fused(q, d):  # the low-bit scoring kernel, a run's scales per channel
            return quant._scores_kernel(q, codes, meta, idx, n, d, self.bits, tok)
        if q.device.type == "cpu" and (out := cpu.score_channel(q, codes, meta, idx, n, tok)) is not None:
            return out
        if isinstance(idx, int):
            idx = slice(0, idx)
        out = torch.empty(b, hkv, g, n, dtype=torch.float32, device=q.device)
        span = max(tok, quant.CHUNK_BYTES // (b * hkv * d * 4) // tok * tok)
        qf = q.float()
        for i in range(0, n, span):
            e = min(n, i + span)
            if isinstance(idx, slice):  # every row's slots idx.start + i .. (R = B, or one row for one sequence)
                lo, hi = idx.start + i, idx.start + e
                m = meta[:, :, lo // tok : -(-hi // tok)].repeat_interleave(tok, 2)[:, :, lo % tok : lo % tok + e - i]
                keys = self._keys(codes[:, :, lo:hi], m)
            elif idx.dim() == 3:  # [B, Hkv, T]: each (sequence, KV head) its own slots
                at = idx[..., i:e]
                heads = torch.arange(hkv, device=at.device)[None, :, None]
                rows = torch.arange(b, device=at.device)[:, None, None] if codes.shape[0] > 1 else 0
                keys = self._keys(codes[rows, heads, at], meta[rows, heads, at // tok])
            else:  # [B, T]: row 0's slots per sequence
                at = idx[:, i:e]
                keys = self._keys(codes[0][:, at], meta[0][:, at // tok]).transpose(0, 1)
            out[..., i:e] = qf @ keys.expand(b, -1, -1, -1).transpose(-1, -2)
        return out


def key_group(head_dim: int, bits: int) -> int:
    """The columns sharing a scale: 64 at 4 bits, 32 at 2 bits (a head_dim they do not divide: the whole row)."""
    g = 64 if bits == 4 else 32
    return g if head_dim % g == 0 else head_dim


def spec_key_bytes(name: str, head_dim: int, d_prime: int, dtype_bytes: int) -> int:
    """Device bytes per token, KV head and speculated layer of the speculation keys `name`."""
    if name == "partial":
        return PartialKeys.token_bytes(head_dim, d_prime, dtype_bytes)
    if name == ChannelKeys.name:
        return ChannelKeys.token_bytes(head_dim)
    return QuantKeys.token_bytes(head_dim, int(name.removeprefix("int")))


def spec_keys(name: str, spec: Speculator, layers, batch: int, max_len: int, device, dtype):
    """The speculation key store called `name` (SPEC_KEYS)."""
    if name == "partial":
        return PartialKeys(spec, layers, batch, max_len, device, dtype)
    if name == ChannelKeys.name:
        return ChannelKeys(spec, layers, batch, max_len, device, dtype)
    return QuantKeys(spec, layers, batch, max_len, device, dtype, int(name.removeprefix("int")))


@dataclass
class Selection:
    """The rows a speculated layer fetches: pool slots [B, Hkv, n] and which of them count (ok [B, Hkv, n]: False
    pads n out for rows fetching fewer, or marks a free slot), both on the compute device. `every`: all of them
    count (known on the host); `per_row`: each sequence's mean fetch count per KV head ([B], for the statistics).
    `cand` [B, Hkv, n + m]: where the correction scores a shortlist, speculation's best slots in order, its own n
    first (those of them `ok` are the ones it fetched), then the m it ranked next. `more` [B, Hkv, c]: a correction's
    slots, after speculation's (`ok` then covers both and the rest of the room after them: [B, Hkv, n + room]);
    `all_slots` joins them where something reads them (a capacity's marks, the recall trace), not every layer."""

    slots: torch.Tensor
    ok: torch.Tensor
    every: bool
    per_row: torch.Tensor
    counted: torch.Tensor | None = None  # ok's count per sequence, where a step counted it (the batch's store)
    cand: torch.Tensor | None = None
    more: torch.Tensor | None = None

    def all_slots(self) -> torch.Tensor:
        """The slots `ok` covers: speculation's, and a correction's after them (`more`) with slot 0 for the room
        that no row took (never counted) [B, Hkv, ok's width]."""
        if self.more is None:
            return self.slots
        b, hkv, n = self.slots.shape
        pad = self.ok.shape[-1] - n - self.more.shape[-1]
        return torch.cat([self.slots, self.more, *([self.more.new_zeros(b, hkv, pad)] if pad else [])], -1)


BUCKET = 64  # the fetch size of a sync-free step is a multiple of this (fewer distinct shapes)


def fetch_count(held: int, opts: KVOptions) -> int:
    """The budget's count for `held` tokens: floor(budget * held), at least 1, at most max_kv and held."""
    return min(max(1, math.floor(opts.budget * held)), opts.max_kv or held, held)


def fetch_width(held_max: int, t: int, opts: KVOptions, bucket: int) -> int:
    """The fetch size of a step known on the host: the budget's count for the fullest (sequence, KV head), rounded
    up to a multiple of `bucket` (at most t). Alpha's smaller counts become `ok` masks inside it."""
    return max(1, min(t, -(-fetch_count(held_max, opts) // bucket) * bucket))


def select(
    s: torch.Tensor, alpha: float, opts: KVOptions, held: torch.Tensor | None = None, pos: torch.Tensor | None = None,
    width: int | None = None, tp=None, shortlist: int = 0, memo: dict | None = None,
) -> Selection:  # fmt: skip
    """Choose the rows to fetch from the speculative scores s [B, Hkv, G, t] (float32) over the t slots taken.

    `held` None: every slot holds a token, in position order (no eviction, no padding), so the host knows every
    count and no mask over the context is needed (sinks are the first slots, recent the last). Else `held`
    [B, Hkv, t] bool and `pos` [B, Hkv, t] (the positions, -1 when free).

    `width` None: the counts are read to the host (one sync; a CPU's way: each row fetches exactly its count).
    Else every row selects `width` slots (see fetch_width) and `ok` keeps the first n of each: nothing is read.

    `tp` (tp.TP): s holds one rank's heads; the per-sequence count is the mean over every rank's query
    heads (one all-reduce of [B]). Without eviction or with it, every KV head holds as many tokens (eviction keeps
    the same count per head), so the budget's cap needs nothing from the other ranks.

    `shortlist` > 0: the best `shortlist` slots (at least the chosen ones) are kept too, in order (Selection.cand:
    the correction's candidates, see shortlist_size).

    `memo`: a step's dict, where what depends on `held` and `pos` alone (the free slots, each sequence's cap, the
    forced tokens; with no margin the counts, and `ok`) is made once for every layer of the step. Given only where
    every KV head of a sequence holds the same slots (no capacity): each row's first n then are held ones (its count
    is at most what it holds, and a free slot scores below every held one), so `ok` needs no look at `held`."""
    inf = float("inf")
    t = s.shape[-1]
    prefix = held is None
    # a GPU's masked group softmax and forced values in one op (kernels.group_agg), not torch's four kernels
    fuse = not prefix and opts.group_agg == "sum" and math.isinf(alpha) and agg_kernel(s)
    if prefix:
        cap = fetch_count(t, opts)
    else:
        if not fuse:
            s = s.masked_fill(_memo(memo, "free", lambda: ~held[:, :, None, :]), -inf)
        cap = _memo(memo, ("cap", opts.budget, opts.max_kv),
                    lambda: device_counts(held.sum(-1).amax(-1), opts)[:, None])  # fmt: skip
    if fuse:
        forced = (_memo(memo, ("forced", opts.sinks, opts.recent), lambda: _forced(held, pos, opts, s.dtype))
                  if opts.sinks or opts.recent else (None, None))  # fmt: skip
        agg, within = torch.ops.infinigen_gpu.group_agg(s, held, *forced, None, None, False), None
    else:
        agg, within = group_softmax(s, alpha) if opts.group_agg == "sum" else (s.amax(2), None)
    if math.isinf(alpha):  # no margin: the budget decides
        n = cap
    else:
        if within is None:  # tokens within alpha of each query head's max
            within = s > (s.amax(-1, keepdim=True) - alpha)
        if opts.per_head:  # [B, Hkv]: each KV head its group's mean count
            n = within.sum(-1).float().mean(2).ceil().long()
        else:  # [B, 1]: one count per sequence, the mean over every query head
            total, heads = within.sum(dim=(1, 2, 3)).float(), s.shape[1] * s.shape[2]
            if tp is not None:
                total, heads = tp.all_reduce(total), heads * tp.size
            n = (total / heads).ceil().long()[:, None]
        n = n.clamp(1, cap) if prefix else torch.minimum(n, cap).clamp(min=1)
    # agg [B, Hkv, t]: "sum", a token's share of the group's attention; "max", a token any head of the group wants
    # sinks and recent tokens first, inside the budget: distinct values above any score, sinks then the newest
    # (so a budget smaller than both takes the same ones on every path, whatever top-k does with ties)
    if prefix:
        if opts.recent:
            r = min(opts.recent, t)
            agg[..., t - r :] = FORCED - opts.sinks - torch.arange(r - 1, -1, -1, device=agg.device)
        agg[..., : opts.sinks] = FORCED - torch.arange(min(opts.sinks, t), device=agg.device)
    elif (opts.sinks or opts.recent) and not fuse:
        forced, value = _memo(memo, ("forced", opts.sinks, opts.recent), lambda: _forced(held, pos, opts, agg.dtype))
        agg = torch.where(forced, value, agg)
    b = s.shape[0]
    capped = memo if math.isinf(alpha) else None  # the counts are the caps: the same for every layer of the step
    if isinstance(n, int):  # known on the host
        per_row = torch.full((b,), float(n), device=s.device)
        n_min = n_max = n
    else:
        per_row = _memo(capped, ("per_row", opts.budget, opts.max_kv), lambda: n.float().mean(-1))
        if width is None:  # the one host sync of a speculation on a CPU: the fetch size
            n_min, n_max = (int(x) for x in torch.stack([n.min(), n.max()]).tolist())
    order = run_order(agg, opts.runs, opts.group_agg == "sum", held) if opts.runs > 1 else None
    if width is not None:  # sorted: the first n of each row are its best
        most = max(width, min(t, shortlist))
        if order is None and not shortlist and agg_kernel(agg):  # a GPU: each row's own n first, with no sort
            cand = top = torch.ops.infinigen_gpu.top_rows(agg, width, *((n, -1) if isinstance(n, torch.Tensor)
                                                                       else (None, n)))[1]  # fmt: skip
        else:
            cand = agg.topk(most, dim=-1, sorted=True).indices if order is None else order[..., :most]  # [B, Hkv, most]
            top = cand[..., :width]
        limit = n[..., None] if isinstance(n, torch.Tensor) else n
        key = ("ok", width, opts.budget, opts.max_kv)
        ok = _memo(capped, key, lambda: (torch.arange(width, device=top.device) < limit).expand(top.shape))
        counted = None if capped is None else _memo(capped, ("counted", *key), lambda: ok.sum((1, 2)))
        if not prefix and memo is None:  # (with a memo a row's first n are held: see above)
            ok = ok & torch.gather(held, 2, top)
        return Selection(top, ok, False, per_row, counted, cand=cand if shortlist else None)
    # every row fetching the same count needs no order among the chosen (an unsorted top-k is several times
    # cheaper on a CPU once k is a sizeable share); rows fetching fewer take the first n of a sorted top-k
    if order is not None:  # in runs: the first n of each row's order
        cand = order[..., : max(n_max, min(t, shortlist))] if shortlist else None
        top = order[..., :n_max]
    else:
        cand = top_k(agg, max(n_max, min(t, shortlist)), True)[1] if shortlist else None  # the first n_max: as below
        top = top_k(agg, n_max, n_min != n_max)[1] if cand is None else cand[..., :n_max]  # [B, Hkv, n]
    if prefix:  # every chosen slot holds a token (rows fetching fewer drop their tail)
        ok = torch.ones(top.shape, dtype=torch.bool, device=top.device)
        if n_min != n_max:
            ok &= torch.arange(n_max, device=top.device) < n[..., None]
    else:
        ok = torch.gather(held, 2, top)
        if n_min != n_max:
            ok &= torch.arange(n_max, device=top.device) < n[..., None]
    return Selection(top, ok, prefix and n_min == n_max, per_row, cand=cand)


def run_order(agg: torch.Tensor, runs: int, mass: bool, held: torch.Tensor | None = None) -> torch.Tensor:
    """The slots [B, Hkv, t] in the order a selection in runs takes them: runs of `runs` consecutive slots (the last
    one shorter where t is not a multiple), ranked by what their tokens hold (`mass`: the sum of agg, each token's
    share of the group's attention; else their best: agg the group's largest logit), each run's slots in order. A
    forced token's rank value ranks its run first. With `held` [B, Hkv, t], the free slots go last (a run may hold
    both), so a row's first n are held ones wherever it holds n, as select's memo has them."""
    t = agg.shape[-1]
    pad = -t % runs
    blocks = F.pad(agg, (0, pad), value=0.0 if mass else float("-inf")).unflatten(-1, (-1, runs))
    score = blocks.sum(-1) if mass else blocks.amax(-1)  # [B, Hkv, t / runs]
    order = score.argsort(dim=-1, descending=True, stable=True)
    slots = (order[..., None] * runs + torch.arange(runs, device=agg.device)).flatten(-2)  # [B, Hkv, t + pad]
    if not pad and held is None:
        return slots
    # to the end, in order: the free slots, then the short run's missing ones (exactly `pad` a row), cut; a stable
    # sort rather than a mask's selection, which would read a count back to the host (a sync on a GPU)
    last = (slots >= t).to(torch.uint8) * 2
    if held is not None:
        last += ~torch.gather(held, -1, slots.clamp(max=t - 1))
    return slots.gather(-1, last.argsort(dim=-1, stable=True))[..., :t]


def agg_kernel(s: torch.Tensor) -> bool:
    """Whether a selection over the scores s goes through the kernels (kernels.group_agg for its group softmax,
    kernels.top_rows for its top-k): on a GPU with Triton."""
    from infinigen_rt.kv.kernels import available

    return s.device.type == "cuda" and available()


def _memo(memo: dict | None, key, make):
    """make(), once per key where there is a memo."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _forced(held: torch.Tensor, pos: torch.Tensor, opts: KVOptions, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks and recent tokens among the held ones, [B, Hkv, T] bool, and their rank values (see select)."""
    newest = pos.amax(-1, keepdim=True)
    forced = held & ((pos < opts.sinks) | (pos > newest - opts.recent))
    rank = torch.where(pos < opts.sinks, pos, opts.sinks + newest - pos)
    return forced, FORCED - rank.to(dtype)


def selected(keys, j: int, q: torch.Tensor, at, t: int, alpha: float, opts: KVOptions, held: torch.Tensor | None,
             width: int | None, tp, shortlist: int) -> Selection | None:  # fmt: skip
    """select(keys.scores_at(j, q, at), alpha, opts, held, ..., width, tp, shortlist) in one call of a CPU's kernel
    (cpu.speculate_channel: the same slots, its pairs shared with the thread waiting for them) where it applies:
    per-channel keys, every slot held in position order (held None), no margin (alpha inf), the group softmax summed,
    the counts known on the host (width None), one rank (tp None), no shortlist. None elsewhere."""
    if (not isinstance(keys, ChannelKeys) or q.device.type != "cpu" or held is not None or not math.isinf(alpha)
            or opts.group_agg != "sum" or width is not None or tp is not None or shortlist or not t
            or opts.runs > 1):  # fmt: skip
        return None
    n = fetch_count(t, opts)
    top = cpu.speculate_channel(q, keys.codes[j], keys.meta[j], at, t, CHANNEL_TOKENS, opts.sinks, opts.recent, n)
    if top is None:
        return None
    return Selection(top, torch.ones(top.shape, dtype=torch.bool), True, torch.full((q.shape[0],), float(n)))


def group_softmax(s: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """s [B, Hkv, G, t] float32: s.softmax(-1).sum(2), and where alpha is finite the slots within alpha of each
    head's largest, summed over the last dimension for each head's count: a CPU's kernel computes both in one pass
    (kv/cpu.py; the counts [B, Hkv, G, 1]), elsewhere torch's ops (the mask [B, Hkv, G, t])."""
    fused = cpu.group_softmax(s, alpha) if s.device.type == "cpu" else None
    if fused is not None:
        agg, counts = fused
        return agg, None if counts is None else counts[..., None]
    within = None if math.isinf(alpha) else s > (s.amax(-1, keepdim=True) - alpha)
    return s.softmax(-1).sum(2), within


def top_k(x: torch.Tensor, k: int, sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, -1, sorted=sorted): (values, indices); a CPU's kernel passes over a few times k candidates (a
    sample of each row sets the bar) rather than sorting pairs (kv/cpu.py: 4-5x torch's at SmolLM2's 8k)."""
    got = cpu.topk(x, k, sorted) if x.device.type == "cpu" else None
    return got if got is not None else tuple(x.topk(k, -1, sorted=sorted))


def speculated_share(layer_opts: dict, correct: float) -> dict:
    """Each layer's options for speculation when a correction step takes `correct` of the budget: 1 - correct of it
    (and of max_kv), the rest the correction's (infinigen.py)."""
    if not correct:
        return layer_opts
    return {j: replace(o, budget=o.budget * (1 - correct), max_kv=o.max_kv and max(1, int(o.max_kv * (1 - correct))))
            for j, o in layer_opts.items()}  # fmt: skip


def shortlist_size(held_max: int, t: int, spec_opts: KVOptions, counts: list[int], shortlist: float) -> int:
    """The correction's candidates (0: every held slot): speculation's best slots up to its widest fetch (fetch_width:
    the same on a CPU and a GPU, whatever each row's own count) and `shortlist` times the correction's largest count
    `counts` after them, at most the t slots."""
    if not shortlist or max(counts, default=0) <= 0:
        return 0
    return min(t, fetch_width(held_max, t, spec_opts, BUCKET) + math.ceil(shortlist * max(counts)))


def correction_counts(held: list[int], opts: KVOptions, spec_opts: KVOptions) -> list[int]:
    """What the correction fetches per sequence holding `held` tokens: the budget's count less speculation's."""
    return [fetch_count(h, opts) - fetch_count(h, spec_opts) for h in held]


def device_counts(held: torch.Tensor, opts: KVOptions) -> torch.Tensor:
    """fetch_count of each held count [B] (int64, on the device), computed there: the same float64 product and floor
    as the host's."""
    n = (held.double() * opts.budget).floor().long().clamp(min=1)
    return torch.minimum(n.clamp(max=opts.max_kv) if opts.max_kv else n, held)


def correction_room(lo: int, hi: int, opts: KVOptions, spec_opts: KVOptions) -> int:
    """The most the correction fetches for any held count from lo to hi (at most that count): the room a bucketed
    step leaves it."""
    h = np.arange(max(1, lo), max(1, hi) + 1, dtype=np.int64)

    def count(o: KVOptions) -> np.ndarray:
        n = np.maximum(1, np.floor(o.budget * h).astype(np.int64))
        return np.minimum(np.minimum(n, o.max_kv) if o.max_kv else n, h)

    return int(np.minimum(count(opts) - count(spec_opts), h).max())


def correction_rows(s: torch.Tensor, sel: Selection, held: torch.Tensor | None, per_row: list[int] | torch.Tensor,
                    group_agg: str, room: int | None = None,
                    memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The correction's choice from the true query's scores s [B, Hkv, G, t]: each sequence's best `per_row` slots
    that speculation (`sel`) did not take, among the held ones (`held` [B, Hkv, t], None: all). (slots, ok)
    [B, Hkv, max(per_row)]; sorted where the counts differ, so a sequence with a smaller count keeps the first.
    With a shortlist (sel.cand), s [B, Hkv, G, n + m] scores the candidates only (a group's softmax over them).
    `per_row` a tensor [B] on the device (a bucketed step): `room` rows each, sorted, those past its count not ok.
    `memo`: see select (the free slots, where every slot is a candidate)."""
    b, hkv, _, t = s.shape
    n = max(per_row) if room is None else room
    cand = sel.cand
    if group_agg == "sum" and s.device.type == "cpu" and room is None:  # one call of the CPU's kernel, if in use
        taken = sel.slots if cand is None else torch.arange(sel.slots.shape[-1]).view(1, 1, -1)
        cut = held if held is None or cand is None else torch.gather(held, 2, cand)
        got = cpu.correct_pick(s if cut is None else s.masked_fill(~cut[:, :, None], float("-inf")), taken,
                               None if sel.every else sel.ok, min(n, t), min(per_row) < n, cut)  # fmt: skip
        if got is not None:
            return _counted(*got, cand, per_row)
    uneven = room is not None or min(per_row) < n  # (sorted only then: an unsorted top-k is cheaper on a CPU)
    if cand is None and group_agg == "sum" and agg_kernel(s):  # one op on a GPU (kernels.group_agg): not seven
        ok = None if sel.every else sel.ok.expand(sel.slots.shape)
        agg = torch.ops.infinigen_gpu.group_agg(s, held, None, None, sel.slots, ok, True)
        if isinstance(per_row, torch.Tensor) or not uneven:  # each row's own count first, and which count
            count = per_row if isinstance(per_row, torch.Tensor) else None  # (kernels.top_rows: as _counted's)
            return torch.ops.infinigen_gpu.top_rows(agg, min(n, t), count)[1:]
        return _counted(*top_k(agg, min(n, t), uneven), cand, per_row, memo)
    if cand is None:
        taken = torch.zeros(b, hkv, t, dtype=torch.bool, device=s.device)
        taken.scatter_(2, sel.slots, sel.ok)  # what speculation fetched (its slots distinct within a row: top-k's)
    else:  # speculation's own first, then the next-ranked
        taken = torch.cat([sel.ok.expand(sel.slots.shape), sel.ok.new_zeros(b, hkv, t - sel.slots.shape[-1])], -1)
        held = None if held is None else torch.gather(held, 2, cand)
    if held is not None:
        free = _memo(memo if cand is None else None, "free", lambda: ~held[:, :, None, :])
        s = s.masked_fill(free, float("-inf"))
        taken |= free[:, :, 0]
    agg = group_softmax(s, math.inf)[0] if group_agg == "sum" else s.amax(2)
    return _counted(*top_k(agg.masked_fill(taken, float("-inf")), min(n, t), uneven), cand, per_row, memo)


def correction_gathered(keys, j: int, q: torch.Tensor, at, t: int, sel: Selection, held: torch.Tensor | None,
                        per_row: list[int], out_k: torch.Tensor | None, out_v: torch.Tensor | None,
                        src_k: torch.Tensor, src_v: torch.Tensor, beside=None) -> tuple | None:  # fmt: skip
    """correction_rows over every held slot (no shortlist, the group softmax summed) and the gather of the rows it
    picks, in one call of a CPU's kernel where the keys are per-channel ones (ChannelKeys): q [B, Hkv, G, D] scored
    against layer j's keys at `at` (each row's first t held slots), the rows that count copied from the pool's
    src_k, src_v into out_k, out_v [B, Hkv, room, X] (the room speculation's gather left; rows after the picks
    zeros; out_k None: nothing copied). (slots, ok, the rows that count per (sequence, KV head) [B, Hkv], and with
    out_k None each pick's pool row, -1 where it does not count) as correction_rows' and the gather's, or None
    where the kernel does not apply. `beside`: see cpu.correct_channel."""
    if not isinstance(keys, ChannelKeys) or q.device.type != "cpu" or not t:
        return None
    n = max(per_row)
    return cpu.correct_channel(q, keys.codes[j], keys.meta[j], at, t, CHANNEL_TOKENS, sel.slots,
                               None if sel.every else sel.ok, held, min(n, t), min(per_row) < n, per_row, src_k, src_v,
                               out_k, out_v, beside=beside)  # fmt: skip


def _counted(values, slots, cand, per_row, memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """correction_rows' (slots, ok) from the top-k of the candidates: the slots themselves (a shortlist's through
    `cand`), the rows that count (a score, and within each sequence's count; `memo`: that mask made once a step)."""
    ok = values > float("-inf")
    if cand is not None:
        slots = torch.gather(cand, 2, slots)
    if isinstance(per_row, torch.Tensor):  # each its own count, on the device
        c = slots.shape[-1]
        ok &= _memo(memo, ("within", c, id(per_row)),
                    lambda: torch.arange(c, device=ok.device) < per_row[:, None, None])  # fmt: skip
    elif min(per_row) < max(per_row):  # sequences of other lengths: each its own count (a host-made mask)
        limit = to_device(torch.tensor(per_row), ok.device)
        ok &= torch.arange(slots.shape[-1], device=ok.device) < limit[:, None, None]
    return slots, ok

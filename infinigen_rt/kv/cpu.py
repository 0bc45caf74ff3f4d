"""The CPU's native kernels (kv/_cpu_kernels.c): scoring queries against low-bit keys without forming the keys,
and the selection's group softmax and top-k (policies/speculation.py).

Each kernel is a typed torch operator, torch.ops.infinigen.<name> (kv/_cpu_ops.cpp: its schema, and the checks of
its tensors against each other before the kernel reads them), built on first use and loaded by kv/cpu_build.py
(where the cache is, and what it trusts). The library holds the kernels compiled for each instruction set (plain
x86-64, AVX2, AVX-512); the one in use is chosen once, when it loads: the best this CPU runs, or the one
`$INFINIGEN_CPU_ISA` names (plain, avx2 or avx512: the same scores on every machine that runs it).

Without a compiler, with `$CC` naming a program that is not found (no other compiler is taken in its place), after
a failed build, or with `INFINIGEN_CPU_ISA` naming a variant this CPU does not run, a warning says so and the torch
path runs (kv/quant.py: the same scores up to float32 rounding); with `INFINIGEN_CPU_KERNELS=0` it runs without one.
`reason()` says why. Warnings go through errors.notice (the CLIs print one `warning:` line each), each once a
process. An operator's call releases the GIL while its kernel runs: the speculation's scoring on the runner's worker
thread runs beside the main thread's layers, and a large call is split over torch's threads."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from infinigen_rt.errors import notice
from infinigen_rt.kv.cpu_build import cc_missing, compiler, load

ENV = "INFINIGEN_CPU_KERNELS"
ISA_ENV = "INFINIGEN_CPU_ISA"  # the variant to run (plain, avx2, avx512); unset: the best this CPU runs
SPLIT_WORK = 1 << 16  # (sequence, KV head, slot) triples under which a call stays on its calling thread
LINEAR_ROWS = 8  # rows of x a linear layer's kernel takes (a decode step's batch); more: torch's matmul
INTEGER = True  # per-channel keys scored by integer dot products where the machine has them (AVX-512 VNNI); the
# GPU's kernel and the torch path score in float32 (docs/performance.md: the held-out means unchanged, 13 % off a
# batch 8 step at 8k)
LEND_WORK = 1 << 22  # a linear layer's multiply-adds (rows x weights) from which `lending` shares its rows: a head's
# at any batch (SmolLM2's 28 M weights), an MLP matrix's at batch 5 or more (0.9 M weights), never at batch 1
ERRORS = {-1: "shapes the CPU kernel does not take", -2: "a slot outside the keys' rows"}

_off = 0  # `disabled()` depth
_lock = threading.Lock()
_lib = None  # torch.ops.infinigen, once loaded
_failed: str | None = None
_warned: set[str] = set()  # the warnings this process has given (each once)
_pool: ThreadPoolExecutor | None = None
_offers: dict[int, _Offer] = {}  # a thread's ident -> the kernel call it runs now, open to another (take_offered)
_offering = threading.Condition()  # notified when a call is offered (and by `take_offered`'s future when it is done)
_lent = threading.local()  # `lending`'s beside, per calling thread


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        notice(message)


def library():
    """The kernels' operators (torch.ops.infinigen, its variant chosen), or None (disabled, no compiler, a failed
    build, or a variant this CPU does not run: `reason()` says which)."""
    if _lib is not None or _failed is not None:
        return _lib
    notes: list[str] = []
    with _lock:
        _start(notes)
    for message in notes:  # (outside the lock: a warning filter that raises leaves the state whole)
        _warn(message)
    return _lib


def _start(notes: list[str]) -> None:
    """library()'s work under the lock: _lib or _failed set."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _failed = f"{ENV}=0"
        return
    cc = compiler()
    if cc is None:
        missing = cc_missing()
        _failed = missing or "no C compiler (set CC)"
        if missing:
            notes.append(f"{missing}; the CPU kernels are not built (unset CC or point it at a C compiler)")
        else:
            notes.append(f"no C compiler (cc, gcc or clang): the CPU kernels are not built and torch's ops run, "
                         f"slower (install gcc and g++, set CC, or set {ENV}=0)")  # fmt: skip
        return
    try:
        load(cc, notes)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _failed = f"the build failed: {e}"
        why = " ".join(str(e).split())
        notes.append(f"the CPU kernels' build failed ({why[:300]}): torch's ops run, slower (a C and C++ compiler "
                     f"and torch's headers are needed: install gcc and g++, set CC, or set {ENV}=0)")  # fmt: skip
        return
    ops = torch.ops.infinigen
    here, want = list(ops.variants()), os.environ.get(ISA_ENV, "").strip().lower()
    if want and want not in here:
        _failed = f"{ISA_ENV}={want}: not a variant this CPU runs ({', '.join(here)})"
        notes.append(f"{_failed}; the CPU kernels are not used (unset {ISA_ENV} or name one of those)")
        return
    try:
        ops.choose(want or here[0])
    except RuntimeError as e:  # (another variant chosen in this process before)
        _failed = str(e).splitlines()[0]
        return
    _lib = ops


def integer_scores() -> bool:
    """Whether score_channel and correct_channel score by integer dot products here (INTEGER, and the variant in use
    has them: AVX-512 VNNI): each key against the query folded with its run's scales in int8."""
    lib = None if _off else library()
    return bool(INTEGER and lib is not None and lib.integer_scores())


def isa() -> str | None:
    """The kernels' variant in use (plain, avx2 or avx512), or None where they are not."""
    lib = None if _off else library()
    return None if lib is None else lib.isa()


def reason() -> str | None:
    """Why the CPU kernels are not in use (None: they are, or were not needed yet)."""
    return _failed


@contextmanager
def disabled():
    """The torch path for the CPU calls made inside (what the kernels are tested against)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                # the machine's cores, not torch's threads now: a decode step beside the speculation worker runs on
                # fewer (prefetch.WorkerThread.sharing), and the pool, made once, must serve the others too
                _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                           thread_name_prefix="infinigen-cpu-kernel")  # fmt: skip
    return _pool


def _taking(codes: torch.Tensor, meta: torch.Tensor):
    """The kernels, where they are in use and take these keys (packed uint8 codes, fp16 meta, both contiguous)."""
    lib = None if _off else library()
    if lib is None or codes.dtype != torch.uint8 or meta.dtype != torch.float16:
        return None
    return lib if codes.is_contiguous() and meta.is_contiguous() else None


def score_codes(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, t: int, group: int,
                bits: int) -> torch.Tensor | None:  # fmt: skip
    """quant.scores on a CPU through the kernel ([B, Hkv, G, t] float32), or None where it does not apply (no
    kernel, or tensors it does not take): the caller's torch path then runs."""
    return _score("score_codes", "low-bit keys", q, codes, meta, at, t, (group, bits))


def score_channel(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, t: int,
                  run: int) -> torch.Tensor | None:  # fmt: skip
    """ChannelKeys.scores_at on a CPU through the kernel ([B, Hkv, G, t] float32; `at` an int t, a slice, [B, t] or
    [B, Hkv, t] slots), or None where it does not apply: the caller's torch path then runs."""
    return _score("score_channel", "per-channel keys", q, codes, meta, at, t, (run,), (INTEGER,))


def _score(kernel: str, what: str, q, codes, meta, at, t: int, layout: tuple, after: tuple = ()) -> torch.Tensor | None:
    """A scoring kernel's call: q [B, Hkv, G, D] against codes and meta at `at` (an int t: each row's first t
    slots; a slice: one run; [B, t] or [B, Hkv, t] slots), `layout` the kernel's own shape arguments after D."""
    lib = _taking(codes, meta)
    if lib is None:
        return None
    b, hkv, g, d = q.shape
    q = q.float().contiguous()
    slots, start = _slots_of(at)
    out = torch.empty(b, hkv, g, t, dtype=torch.float32)
    if t == 0:
        return out
    bad = _split(getattr(lib, kernel), (q, codes, meta, slots, out, *layout, start, *after), b * hkv, t)
    if bad == -1:
        return None
    if bad:
        raise IndexError(f"scoring {what}: {ERRORS.get(bad, f'error {bad}')}")
    return out


def _split(f, args: tuple, rows: int, per_row: int) -> int:
    """f(*args, lo, hi) over rows 0 .. rows: on the calling thread, or in shares over torch's threads where the
    work (rows x per_row) is large enough to pay for them. The first non-zero return code, else 0."""
    n = max(1, torch.get_num_threads())
    if n == 1 or rows == 1 or rows * per_row < SPLIT_WORK:
        return f(*args, 0, rows)
    cuts = [rows * i // min(n, rows) for i in range(min(n, rows) + 1)]
    rcs = list(_threads().map(lambda lo_hi: f(*args, *lo_hi), zip(cuts, cuts[1:], strict=False)))
    return next((rc for rc in rcs if rc), 0)


def _shared(f, args: tuple, pairs: int, per_pair: int, beside, what: str) -> bool:
    """f(*args, next, lo, hi) over pairs 0 .. pairs, a kernel whose pairs the threads calling it at once take from
    the counter `next` (NULL: lo .. hi in order): with `beside` (prefetch's: a worker thread) the worker takes them
    beside the calling thread, whichever is free taking the next; without it, _split's shares. True where it ran,
    False for shapes it does not take (-1); MemoryError or IndexError (a row outside the pool), named by `what`."""
    share = None
    if beside is not None and pairs > 1:
        nxt = torch.zeros(1, dtype=torch.int64)
        share = beside(lambda: f(*args, nxt, 0, pairs))
    if share is None:
        rc = _split(f, (*args, None), pairs, per_pair)
    else:
        rc = f(*args, nxt, 0, pairs)
        rc = rc or (0 if share.cancel() else share.result())  # (not started: the pairs ran out here)
    return _ran(rc, what)


class _Offer:
    """A kernel call f(*args, next, 0, pairs) whose pairs the threads calling it take from the counter `next`: the
    thread that made it, and any that `take` it while it is open."""

    def __init__(self, f, args: tuple, pairs: int):
        self.f, self.args, self.pairs = f, args, pairs
        self.next = torch.zeros(1, dtype=torch.int64)
        self.done = threading.Condition()
        self.open, self.active, self.rc = True, 0, 0

    def run(self) -> int:
        return self.f(*self.args, self.next, 0, self.pairs)

    def take(self) -> None:
        """Take pairs until none is left (nothing once the call has closed)."""
        with self.done:
            if not self.open:
                return
            self.active += 1
        rc = self.run()
        with self.done:
            self.active -= 1
            self.rc = self.rc or rc
            self.done.notify_all()

    def close(self) -> int:
        """No thread joins from now; once those that joined are done: their first non-zero return code, else 0."""
        with self.done:
            self.open = False
            while self.active:
                self.done.wait()
            return self.rc


def _offered(f, args: tuple, pairs: int, what: str) -> bool:
    """f(*args, next, lo, hi) over pairs 0 .. pairs, a kernel whose pairs the threads calling it at once take from
    the counter `next`, on the calling thread (the speculation worker's), offered meanwhile to the thread that waits
    for its result (`take_offered`: the compute thread, which joins rather than waits). True where it ran, False for
    shapes it does not take (-1); MemoryError or IndexError named by `what`, as `_shared`."""
    offer, me = _Offer(f, args, pairs), threading.get_ident()
    with _offering:
        _offers[me] = offer
        _offering.notify_all()
    try:
        rc = offer.run()
    finally:
        with _offering:
            _offers.pop(me, None)
        joined = offer.close()
    rc = rc or joined
    return _ran(rc, what)


def take_offered(thread: int | None, until) -> None:
    """On the thread that waits for `until` (a Future) from the worker thread `thread` (its ident): join the kernel
    call the worker offers (`_offered`) once it does, taking its pairs beside it, rather than wait idle; returns when
    none is left to take, or `until` is done without one."""
    if thread is None:
        return
    with _offering:
        until.add_done_callback(_wake)
        while thread not in _offers and not until.done():
            _offering.wait()
        offer = _offers.get(thread)
    if offer is not None:
        offer.take()


def _wake(_) -> None:
    with _offering:
        _offering.notify_all()


def _ran(rc: int, what: str) -> bool:
    """A pair-taking kernel's return code: True where it ran, False for shapes it does not take (-1); MemoryError
    (-3) or IndexError (a row outside the pool) named by `what`."""
    if rc == -3:
        raise MemoryError(f"the CPU {what} kernel could not allocate its buffers")
    if rc not in (0, -1):
        raise IndexError(f"the {what}'s rows: {ERRORS.get(rc, f'error {rc}')}")
    return rc == 0


def _slots_of(at) -> tuple[torch.Tensor | None, int]:
    """A kernel's slots argument `at` (an int t: each row's first t slots; a slice: one run; a tensor of slots) as
    (the slots, int64 and contiguous, or None; the first slot of a slice, else 0)."""
    slots = at.to(torch.int64).contiguous() if isinstance(at, torch.Tensor) else None
    return slots, at.start if isinstance(at, slice) else 0


@contextmanager
def lending(beside):
    """Within it, a linear layer on the calling thread with LEND_WORK multiply-adds or more (a head; an MLP's at
    batch 8) shares its rows with beside(fn) (a Future: prefetch.WorkerThread.sharing's worker, idle once a layer's
    speculation is done and once the step's layers are), in blocks to whichever thread is free; a share the worker
    has not started when the rows are done is cancelled."""
    before = getattr(_lent, "beside", None)
    _lent.beside = beside
    try:
        yield
    finally:
        _lent.beside = before


def lent():
    """The calling thread's `lending` beside (None outside it): what a kernel call shares its pairs with."""
    return getattr(_lent, "beside", None)


def each(n: int, fn) -> None:
    """fn(i) for i in 0 .. n: on the calling thread, and within `lending` on its worker too, each taking the next i
    (a dense layer's attention, sequence by sequence, while the worker has nothing else to do)."""
    beside = getattr(_lent, "beside", None)
    if beside is None or n < 2:
        for i in range(n):
            fn(i)
        return
    at = itertools.count()  # (its next is atomic under the GIL)

    def take():
        while (i := next(at)) < n:
            fn(i)

    share = beside(take)
    try:
        take()
    finally:
        if not share.cancel():  # (started: waited for, as it writes what the caller reads)
            share.result()


WIDE = (torch.float32, torch.float16, torch.bfloat16)  # the weights' widths the linear kernel reads


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x, weight.float(), bias) through the kernel for a decode step's rows (at most LINEAR_ROWS of x [..., K]
    float32 on a CPU, weight [N, K] contiguous in float32, or in float16 or bfloat16 as a bundle stores it: see
    narrow_weights), on the calling thread (and `lending`'s worker): the same sums whatever the batch, the share
    and the weight's width, up to float32 rounding of F.linear's; None where it does not apply.

    On one thread it reads small models' weights faster than torch's matmul does on one thread or two. It runs on one
    thread: shares over a second thread were slower inside a decode step, most likely because torch's OpenMP
    threads, which spin a while after each parallel op, held the core the share needed."""
    lib = _floats(x)
    if (lib is None or x.dim() < 1 or weight.dtype not in WIDE or weight.device.type != "cpu"
            or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or not weight.is_contiguous()
            or x.numel() > LINEAR_ROWS * x.shape[-1] or not x.numel()
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):  # fmt: skip
        return None
    n, k = weight.shape
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    beside = getattr(_lent, "beside", None) if n * k * rows.shape[0] >= LEND_WORK else None
    if beside is None:
        rc = lib.linear(rows, weight, out, None, 0, n)
    else:  # the rows in blocks to whichever of the two threads is free
        nxt = torch.zeros(1, dtype=torch.int64)
        share = beside(lambda: lib.linear(rows, weight, out, nxt, 0, n))
        rc = lib.linear(rows, weight, out, nxt, 0, n)
        if not share.cancel():  # (started: waited for whatever rc, as it writes `out`)
            rc = rc or share.result()
    if rc:
        return None
    return out if bias is None else out.add_(bias)


def narrow_weights() -> bool:
    """Whether the linear kernel takes float16 and bfloat16 weights here (the kernels in use, on a machine with
    AVX-512): a float32 model on a CPU may then keep a bundle's half-width weights as they are (models.load_model),
    half the bytes a decode step reads for them, the same sums. Elsewhere a narrow weight would be widened at every
    call (F.linear's), so it is widened once at load."""
    x = torch.ones(1, 1)
    return all(linear(x, torch.ones(1, 1, dtype=dt)) is not None for dt in (torch.float16, torch.bfloat16))


def _floats(x: torch.Tensor):
    """The kernels, where they are in use and x is a CPU float32 tensor."""
    lib = None if _off else library()
    return lib if lib is not None and x.dtype == torch.float32 and x.device.type == "cpu" else None


def group_softmax(s: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """s [..., G, T] float32 (-inf where a slot does not count): (s.softmax(-1).sum(-2), and where alpha is finite
    the slots within alpha of each head's largest, (s > s.amax(-1, keepdim=True) - alpha).sum(-1)), in one pass of
    the kernel (the same up to float32 rounding; a head whose every score is -inf adds 0, not NaN). None where
    the kernels are not in use."""
    lib = _floats(s)
    if lib is None or s.dim() < 2 or not s.shape[-1] or not s.shape[-2]:
        return None
    *lead, g, t = s.shape
    s = s.contiguous()
    agg = torch.empty(*lead, t, dtype=torch.float32)
    within = torch.empty(*lead, g, dtype=torch.int64) if math.isfinite(alpha) else None
    rows = agg.numel() // t
    # (on the calling thread: shared, the hand-off cost more)
    if lib.group_softmax(s, agg, within, alpha if within is not None else math.inf, 0, rows):
        return None
    return agg, within


def topk(x: torch.Tensor, k: int, sorted: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x.topk(k, -1, sorted=sorted) of a CPU float32 x through the kernel: (values, indices); unsorted ones in slot
    order, and of equal values the lower slots first. None where the kernels are not in use."""
    lib = _floats(x)
    t = x.shape[-1] if x.dim() else 0
    if lib is None or not 0 < k <= t or t > 0x7FFFFFFF:
        return None
    x = x.contiguous()
    idx = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    val = torch.empty(*x.shape[:-1], k, dtype=torch.float32)
    rows = idx.numel() // k
    rc = lib.topk(x, idx, val, sorted, 0, rows)
    if rc == -3:
        raise MemoryError("the CPU top-k kernel could not allocate its buffers")
    return (val, idx) if rc == 0 else None


def correct_pick(s: torch.Tensor, taken: torch.Tensor, taken_ok: torch.Tensor | None, k: int, sorted: bool,
                 held: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """The correction's choice in one call: s [B, Hkv, G, T] float32 (the true query's scores, -inf where a slot is
    not held), each row's group softmax summed over G, the columns taken [B, Hkv, n] (where taken_ok [B, Hkv, n]
    is True; None: all) and those not held (held [B, Hkv, T] False; None: all held) set to -inf, then topk(k,
    sorted): (values, indices) [B, Hkv, k], the same as group_softmax, masked_fill and topk one after another.
    None where the kernels are not in use."""
    lib = _floats(s)
    if lib is None or s.dim() != 4 or not 0 < k <= s.shape[-1] or s.shape[-1] > 0x7FFFFFFF:
        return None
    b, h, g, t = s.shape
    n = taken.shape[-1]
    s, taken = s.contiguous(), taken.to(torch.int64).expand(b, h, n).contiguous()
    idx = torch.empty(b, h, k, dtype=torch.int64)
    val = torch.empty(b, h, k, dtype=torch.float32)
    rc = lib.correct_pick(s, taken, _flags(taken_ok, (b, h, n)), _flags(held, (b, h, t)), idx, val, sorted, 0, b * h)
    if rc == -2:
        raise IndexError("the correction's taken slots: a slot outside the scores")
    if rc == -3:
        raise MemoryError("the CPU correction kernel could not allocate its buffers")
    return (val, idx) if rc == 0 else None


def quantize_rows(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, group: int, bits: int) -> bool:
    """quant.store on a CPU through the kernel: new keys x [R, Hkv, s, D] quantized into codes [R, Hkv, S, bytes]
    and meta [R, Hkv, S, 2, groups] at slots at.. (an int) or at [R, Hkv, s]. False where it does not apply (the
    torch path then runs); the codes are quant.quantize's, bit for bit."""
    lib = _taking(codes, meta)
    if lib is None:
        return False
    r, hkv, s, d = x.shape
    n_slots = codes.shape[2]
    base = (torch.arange(r * hkv, dtype=torch.int64) * n_slots).view(r, hkv, 1)
    rows = base + (torch.arange(at, at + s, dtype=torch.int64) if isinstance(at, int) else at.to(torch.int64))
    rc = lib.quantize_rows(x.float().contiguous(), rows.contiguous(), codes, meta, group, bits)
    if rc == -1:
        return False
    if rc:
        raise IndexError(f"quantizing keys: {ERRORS.get(rc, f'error {rc}')}")
    return True


def quantize_channel(x: torch.Tensor, starts: torch.Tensor, appends, codes: torch.Tensor, meta: torch.Tensor,
                     held: torch.Tensor, run: int, tiny: float) -> bool:  # fmt: skip
    """ChannelKeys.write on a CPU through the kernel, one new key per run touched: keys x [R, Hkv, s, D] into slots
    starts [R, Hkv, s] of codes [R, Hkv, S, D / 2], meta [R, Hkv, S / run, 2, D] and held [R, Hkv, S] (bool);
    appends True, False or bool [R, Hkv, s] (the run's slots after an appended key no longer held). False where it
    does not apply (the torch path then runs); the codes and meta are the torch path's, bit for bit."""
    lib = _taking(codes, meta)
    if lib is None or held.dtype != torch.bool or not held.is_contiguous() or x.device.type != "cpu":
        return False
    r, hkv, s, d = x.shape
    mode = 2 if isinstance(appends, torch.Tensor) else int(bool(appends))
    x, starts = x.float().contiguous(), starts.to(torch.int64).expand(r, hkv, s).contiguous()
    flags = _flags(appends, (r, hkv, s)) if mode == 2 else None
    rc = lib.quantize_channel(x, starts, flags, mode, codes, meta, held, run, tiny)
    if rc == -1:
        return False
    if rc:
        raise IndexError(f"quantizing per-channel keys: {ERRORS.get(rc, f'error {rc}')}")
    return True


def gather_rows(src_k: torch.Tensor, src_v: torch.Tensor, rows: torch.Tensor, out_k: torch.Tensor,
                out_v: torch.Tensor) -> bool:  # fmt: skip
    """rows.copy_rows on a CPU: out_x[b, h, :n] = rows rows [B, Hkv, n] of src_x (viewed as [-1, X]) for x = k, v,
    and the rows after n of out_x [B, Hkv, n', X] zeros, in one call for both. out_x may be a window of n' rows
    of a contiguous [B, Hkv, N, X] (the room a speculated gather left for the correction). False where it does not
    apply (the caller's index_select then runs); IndexError for a row outside the pool."""
    lib = None if _off else library()
    b, h, n = rows.shape
    if lib is None or not _rows_alike(src_k, src_v, out_k, out_v, b, h):
        return False
    rc = lib.gather_rows(src_k, src_v, rows.to(torch.int64).contiguous(), out_k, out_v, 0, b * h)
    if rc == -2:
        raise IndexError(f"gathering rows: {ERRORS[-2]}")
    return rc == 0


def correct_channel(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, t: int, run: int,
                    taken: torch.Tensor, taken_ok: torch.Tensor | None, held: torch.Tensor | None, k: int,
                    sorted: bool, limit: list[int], src_k: torch.Tensor, src_v: torch.Tensor,
                    out_k: torch.Tensor | None, out_v: torch.Tensor | None, beside=None) -> tuple | None:  # fmt: skip
    """The correction step with per-channel keys in one call (the kernel's infinigen_correct_channel): q [B, Hkv,
    G, D] scored as score_channel against each row's first t held slots (`at` [B, t] flat slots, or a slice), the
    pick as correct_pick's (taken [B, Hkv, n] token slots, taken_ok, held [B, Hkv, t]; k, sorted), the picks past
    each sequence's `limit` not counting, and the rows that count copied as gather_rows does into out_k, out_v
    [B, Hkv, k', X] (k' >= k: rows after k zeros; a window of a contiguous tensor) from the pool src_k, src_v (rows
    flat slot x Hkv + KV head); out_k None: nothing copied, each pick's pool row (-1 where it does not count)
    returned for attention to read it there (attend_rows). (slots [B, Hkv, k] int64, ok [B, Hkv, k] bool, the rows
    that count per (sequence, KV head) [B, Hkv] int64, those pool rows [B, Hkv, k] int64 or None where they were
    copied), or None where it does not apply: the caller's steps then run one after another.
    `beside`: prefetch's `beside` (a worker thread that takes a share of the pairs), or None: the pairs split as
    `_split` does."""
    lib = _taking(codes, meta)
    b, hkv, g, d = q.shape
    if lib is None or codes.shape[0] != 1 or isinstance(at, int) or not 0 < k <= t:
        return None
    rows = None
    if out_k is None:  # the picks' pool rows, nothing copied
        if not _pool_pair(src_k, src_v):
            return None
        rows = torch.empty(b, hkv, k, dtype=torch.int64)
    elif out_k.shape[2] < k or not _rows_alike(src_k, src_v, out_k, out_v, b, hkv):
        return None
    n = taken.shape[-1]
    slots, start = _slots_of(at)
    s = torch.empty(b, hkv, g, t, dtype=torch.float32)
    idx = torch.empty(b, hkv, k, dtype=torch.int64)
    val = torch.empty(b, hkv, k, dtype=torch.float32)
    ok = torch.empty(b, hkv, k, dtype=torch.bool)
    got = torch.empty(b, hkv, dtype=torch.int64)
    args = (q.float().contiguous(), codes, meta, slots, s, taken.to(torch.int64).expand(b, hkv, n).contiguous(),
            _flags(taken_ok, (b, hkv, n)), _flags(held, (b, hkv, t)), idx, val, ok, got,
            torch.tensor(limit, dtype=torch.int64), src_k, src_v, out_k, out_v, rows, run, start, sorted,
            INTEGER)  # fmt: skip
    if not _shared(lib.correct_channel, args, b * hkv, t, beside, "correction"):
        return None
    return idx, ok, got, rows


def speculate_channel(q: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, at, t: int, run: int, sinks: int,
                      recent: int, k: int) -> torch.Tensor | None:  # fmt: skip
    """Speculation's choice with per-channel keys in one call (the kernel's infinigen_speculate_channel): q [B, Hkv,
    G, D] scored as score_channel against each row's first t slots (`at` [B, t] flat slots, or a slice), the group
    softmax summed over the query heads, the first `sinks` and last `recent` slots forced, the k largest in slot order:
    their slots [B, Hkv, k] int64, as group_softmax and topk one after another would choose; or None where the kernel
    does not apply. Its pairs are offered to the thread that waits for this one's result (`take_offered`)."""
    lib = _taking(codes, meta)
    b, hkv, g, d = q.shape
    if lib is None or codes.shape[0] != 1 or isinstance(at, int) or not 0 < k <= t or t > 0x7FFFFFFF:
        return None
    slots, start = _slots_of(at)
    s = torch.empty(b, hkv, g, t, dtype=torch.float32)
    idx = torch.empty(b, hkv, k, dtype=torch.int64)
    args = (q.float().contiguous(), codes, meta, slots, s, idx, run, start, sinks, recent, INTEGER)
    return idx if _offered(lib.speculate_channel, args, b * hkv, "speculation") else None


def _pool_pair(src_k: torch.Tensor, src_v: torch.Tensor) -> bool:
    """A pool's K and V ([..., X]) as the row kernels read them: CPU tensors, contiguous, alike."""
    return (src_k.device.type == "cpu" and src_v.device.type == "cpu" and src_k.is_contiguous()
            and src_v.is_contiguous() and src_k.shape == src_v.shape and src_k.dtype == src_v.dtype)  # fmt: skip


def attend_rows(q: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor, rows: list[torch.Tensor],
                k_new: torch.Tensor, v_new: torch.Tensor, beside=None) -> torch.Tensor | None:  # fmt: skip
    """A decode step's attention over the rows where the pool holds them (the kernel's infinigen_attend_rows): q
    [B, H, 1, D] (a KV head's H / Hkv query heads together), the pool's rows `rows` (one or two [B, Hkv, n_i] int64,
    flat slot x Hkv + KV head, -1 where a row does not count) of src_k, src_v ([..., D] float32), then each pair's
    new token k_new, v_new [B, Hkv, 1, D]: [B, H, 1, D], SDPA's over those rows up to float32 rounding (its scale,
    1 / sqrt(D)). None where it does not apply (the caller gathers the rows and runs SDPA); IndexError for a row
    outside the pool. `beside`: as correct_channel's."""
    lib = None if _off else library()
    b, h, _, d = q.shape
    hkv = k_new.shape[1]
    if (lib is None or not _pool_pair(src_k, src_v) or src_k.dtype != torch.float32 or src_k.shape[-1] != d
            or q.dtype != torch.float32 or h % hkv or h // hkv > 16 or len(rows) not in (1, 2)
            or q.device.type != "cpu"):  # fmt: skip
        return None
    qs = (q * d**-0.5).contiguous()
    ra = rows[0].to(torch.int64).contiguous()
    rb = rows[1].to(torch.int64).contiguous() if len(rows) > 1 else None
    out = torch.empty_like(qs)
    args = (qs, src_k, src_v, ra, rb, k_new.float().contiguous(), v_new.float().contiguous(), out)
    return out if _shared(lib.attend_rows, args, b * hkv, ra.shape[-1] * h, beside, "attention") else None


def _rows_alike(src_k, src_v, out_k, out_v, b: int, h: int) -> bool:
    """Whether the row kernels take a pool src_k, src_v ([..., X], contiguous, alike) and outputs out_k, out_v
    [B, Hkv, n', X] (alike), all CPU tensors of one dtype. (Each output must be a window of rows of a contiguous
    tensor: the operator checks, and returns -1 where it is not.)"""
    return (_pool_pair(src_k, src_v) and out_k.device.type == "cpu" and out_v.device.type == "cpu"
            and out_k.stride() == out_v.stride() and out_k.dtype == src_k.dtype and out_v.dtype == src_k.dtype
            and out_k.shape == out_v.shape and out_k.dim() == 4 and out_k.shape[:2] == (b, h)
            and out_k.shape[-1] == src_k.shape[-1])  # fmt: skip


def _flags(x: torch.Tensor | None, shape: tuple) -> torch.Tensor | None:
    """A flag tensor (True or non-zero) as the kernels read it: x expanded to shape, a byte an element, contiguous."""
    if x is None:
        return None
    x = x.expand(shape)
    return (x if x.dtype in (torch.bool, torch.uint8) else x.to(torch.uint8)).contiguous()

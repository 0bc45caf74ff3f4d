// The CPU kernels (kv/_cpu_kernels.c) as typed torch operators, torch.ops.infinigen.<name> (kv/cpu.py calls them).
// Each op's schema types its arguments; its CPU implementation checks every tensor's device, dtype, layout and
// shape against the others before the kernel reads a byte (a mismatch raises RuntimeError, never reaches memory),
// reads the sizes the kernel takes from the tensors, and calls the kernel of the variant in use. Each op returns the
// kernel's code: 0, -1 for arguments it does not take (nothing written; the caller's torch path runs), -2 for a slot
// or row outside its buffer, -3 when its buffers could not be allocated.
//
// kv/cpu_build.py compiles the C source once per instruction set into this library (infinigen_<isa>_<name>, as
// _cpu_kernels.h names them); the variant is chosen once a process: `choose`, or on first use the best this CPU
// runs. A torch.ops call releases the GIL while its kernel runs, so the threads that share a call's pairs through
// `next` (an int64 counter tensor) run at once.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

extern "C" {
#define INFINIGEN_ISA plain
#include "_cpu_kernels.h"

// one variant's kernels
struct Kernels {
    const char *isa;
#define INFINIGEN_FIELD(name) decltype(&INFINIGEN_KERNEL(name)) name;
    INFINIGEN_KERNELS(INFINIGEN_FIELD)
};
#define INFINIGEN_POINTER(name) &INFINIGEN_KERNEL(name),
static const Kernels PLAIN{"plain", INFINIGEN_KERNELS(INFINIGEN_POINTER)};
#undef INFINIGEN_ISA

#if defined(__x86_64__)
#define INFINIGEN_ISA avx2
#include "_cpu_kernels.h"
static const Kernels AVX2{"avx2", INFINIGEN_KERNELS(INFINIGEN_POINTER)};
#undef INFINIGEN_ISA
#define INFINIGEN_ISA avx512
#include "_cpu_kernels.h"
static const Kernels AVX512{"avx512", INFINIGEN_KERNELS(INFINIGEN_POINTER)};
#undef INFINIGEN_ISA
#endif
}

namespace {

using at::Tensor;
using Opt = std::optional<Tensor>;

// ---- the variant in use

// Whether this CPU (and its OS: the builtins check the saved register state) runs variant k's instructions: the
// flags kv/cpu_build.py VARIANTS compiles it with.
bool runs_here(const Kernels &k) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                      __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("lzcnt") &&
                      __builtin_cpu_supports("popcnt");
    if (&k == &AVX2) return avx2;
    if (&k == &AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return &k == &PLAIN;
}

// every variant in this library, the best first
std::vector<const Kernels *> built() {
#if defined(__x86_64__)
    return {&AVX512, &AVX2, &PLAIN};
#else
    return {&PLAIN};
#endif
}

std::atomic<const Kernels *> active{nullptr};

const Kernels &use() {
    const Kernels *k = active.load(std::memory_order_acquire);
    if (k != nullptr) return *k;
    for (const Kernels *v : built())
        if (runs_here(*v)) {
            const Kernels *none = nullptr;
            active.compare_exchange_strong(none, v);  // (another thread's choice, made first, stands)
            return *active.load(std::memory_order_acquire);
        }
    TORCH_INTERNAL_ASSERT(false, "the plain variant runs anywhere");
}

std::vector<std::string> variants() {
    std::vector<std::string> out;
    for (const Kernels *v : built())
        if (runs_here(*v)) out.emplace_back(v->isa);
    return out;
}

void choose(std::string isa) {
    const Kernels *pick = nullptr;
    for (const Kernels *v : built())
        if (isa == v->isa) pick = v;
    TORCH_CHECK(pick != nullptr, "infinigen::choose: no variant '", isa, "' in this library");
    TORCH_CHECK(runs_here(*pick), "infinigen::choose: this CPU does not run the ", isa, " variant");
    const Kernels *none = nullptr;
    if (!active.compare_exchange_strong(none, pick))
        TORCH_CHECK(none == pick, "infinigen::choose: the ", none->isa, " variant is in use (chosen once a process)");
}

std::string isa() { return use().isa; }

bool integer_scores() { return use().integer_scores() != 0; }

// ---- the checks

// t as a kernel reads it through its pointer: a dense CPU tensor of dtype, its elements in order from data_ptr
void take(const char *op, const char *name, const Tensor &t, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided && t.has_storage(), op, ": ", name, " is ",
                t.device(), " ", t.layout(), "; the kernels read dense CPU tensors");
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " is ", t.scalar_type(), ", not ", dtype);
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous");
}

// a flag tensor (bool or uint8, a byte an element, zero or not)
void take_flags(const char *op, const char *name, const Tensor &t) {
    take(op, name, t, t.scalar_type() == at::kBool ? at::kBool : at::kByte);
}

void shape(const char *op, const char *name, const Tensor &t, at::IntArrayRef want) {
    TORCH_CHECK(t.sizes().equals(want), op, ": ", name, " is ", t.sizes(), " where ", want, " is expected");
}

void elements(const char *op, const char *name, const Tensor &t, int64_t want) {
    TORCH_CHECK(t.numel() == want, op, ": ", name, " has ", t.numel(), " elements where ", want, " are expected");
}

void dims(const char *op, const char *name, const Tensor &t, int64_t want) {
    TORCH_CHECK(t.dim() == want, op, ": ", name, " has ", t.dim(), " dimensions, not ", want);
}

void at_least(const char *op, const char *name, const Tensor &t, int64_t want) {
    TORCH_CHECK(t.dim() >= want, op, ": ", name, " has ", t.dim(), " dimensions, fewer than ", want);
}

template <typename T>
T *ptr(const Tensor &t) {
    return static_cast<T *>(t.data_ptr());
}

template <typename T>
T *ptr(const Opt &t) {
    return t ? static_cast<T *>(t->data_ptr()) : nullptr;
}

// `next`: the counter the threads calling a kernel at once take its pairs from (an int64 tensor of one or more)
int64_t *counter(const char *op, const Opt &next) {
    if (!next) return nullptr;
    take(op, "next", *next, at::kLong);
    TORCH_CHECK(next->numel() >= 1, op, ": next holds no counter");
    return ptr<int64_t>(*next);
}

// A pool's K and V as the row kernels read them: src [..., X] alike, dense and contiguous; (rows, bytes a row).
std::pair<int64_t, int64_t> pool_of(const char *op, const Tensor &src_k, const Tensor &src_v) {
    take(op, "src_k", src_k, src_k.scalar_type());
    take(op, "src_v", src_v, src_k.scalar_type());
    at_least(op, "src_k", src_k, 1);
    shape(op, "src_v", src_v, src_k.sizes());
    const int64_t x = src_k.size(-1);
    return {x ? src_k.numel() / x : 0, x * static_cast<int64_t>(src_k.element_size())};
}

// The rows from one (sequence, KV head) pair's start to the next's in out [B, Hkv, n, X], a window of rows of a
// contiguous [B, Hkv, N, X] (N >= n); -1 where out is not one. And room in its storage for the P pairs' windows.
int64_t window(const char *op, const char *name, const Tensor &out, const Tensor &src) {
    TORCH_CHECK(out.device().is_cpu() && out.layout() == at::kStrided && out.has_storage(), op, ": ", name,
                " is not a dense CPU tensor");
    TORCH_CHECK(out.scalar_type() == src.scalar_type(), op, ": ", name, " is ", out.scalar_type(), ", not ",
                src.scalar_type());
    dims(op, name, out, 4);
    const int64_t b = out.size(0), h = out.size(1), n = out.size(2), x = out.size(3);
    TORCH_CHECK(x == src.size(-1), op, ": ", name, "'s rows are ", x, " wide, the pool's ", src.size(-1));
    const auto st = out.strides();
    if ((st[3] != 1 && x > 1) || (st[2] != x && n > 1)) return -1;
    const int64_t pair = h > 1 ? st[1] : (b > 1 ? st[0] : n * x);
    if (x == 0 || pair % x || pair / x < n || (b > 1 && h > 1 && st[0] != h * pair)) return -1;
    if (b * h > 0 && n > 0) {
        const int64_t end = (b * h - 1) * pair + n * x, room = static_cast<int64_t>(out.storage().nbytes()) /
                                                                  static_cast<int64_t>(out.element_size()) -
                                                              out.storage_offset();
        TORCH_CHECK(end <= room, op, ": ", name, "'s windows run past its storage");
    }
    return pair / x;
}

// ---- the ops (schemas in TORCH_LIBRARY below; shapes as each kernel's comment in _cpu_kernels.c)

// the scored slots: [B, Hkv, T] (true: a list per (sequence, KV head)), [B, T], or none (false)
bool slot_pairs(const char *op, const Opt &slots, int64_t B, int64_t Hkv, int64_t T) {
    if (!slots) return false;
    take(op, "slots", *slots, at::kLong);
    const bool pairs = slots->dim() == 3;
    if (pairs) shape(op, "slots", *slots, {B, Hkv, T});
    else shape(op, "slots", *slots, {B, T});
    return pairs;
}

int64_t score_codes(const Tensor &q, const Tensor &codes, const Tensor &meta, const Opt &slots, const Tensor &out,
                    int64_t group, int64_t bits, int64_t start, int64_t lo, int64_t hi) {
    const char *op = "infinigen::score_codes";
    take(op, "q", q, at::kFloat), take(op, "codes", codes, at::kByte), take(op, "meta", meta, at::kHalf);
    take(op, "out", out, at::kFloat);
    dims(op, "q", q, 4), dims(op, "codes", codes, 4), dims(op, "meta", meta, 5), dims(op, "out", out, 4);
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), R = codes.size(0), S = codes.size(2),
                  T = out.size(3);
    if ((bits != 2 && bits != 4 && bits != 8) || group < 1 || D % group || (group * bits) % 8) return -1;
    TORCH_CHECK(R == 1 || R == B, op, ": codes hold ", R, " sequences' rows, not 1 or ", B);
    shape(op, "codes", codes, {R, Hkv, S, D * bits / 8}), shape(op, "meta", meta, {R, Hkv, S, 2, D / group});
    shape(op, "out", out, {B, Hkv, G, T});
    const bool pairs = slot_pairs(op, slots, B, Hkv, T);
    return use().score_codes(ptr<float>(q), ptr<uint8_t>(codes), ptr<uint16_t>(meta), ptr<int64_t>(slots), pairs,
                             ptr<float>(out), B, R, Hkv, G, D, group, bits, T, S, start, lo, hi);
}

// per-channel keys' codes [R, Hkv, S, D / 2] and meta [R, Hkv, S / run, 2, D] for q [B, Hkv, G, D]; false where
// the run does not divide S (the kernel does not take it)
bool channel_keys(const char *op, const Tensor &q, const Tensor &codes, const Tensor &meta, int64_t run) {
    take(op, "q", q, at::kFloat), take(op, "codes", codes, at::kByte), take(op, "meta", meta, at::kHalf);
    dims(op, "q", q, 4), dims(op, "codes", codes, 4), dims(op, "meta", meta, 5);
    const int64_t Hkv = q.size(1), D = q.size(3), R = codes.size(0), S = codes.size(2);
    if (D % 2 || run < 1 || S % run) return false;
    TORCH_CHECK(R == 1 || R == q.size(0), op, ": codes hold ", R, " sequences' rows, not 1 or ", q.size(0));
    shape(op, "codes", codes, {R, Hkv, S, D / 2}), shape(op, "meta", meta, {R, Hkv, S / run, 2, D});
    return true;
}

int64_t score_channel(const Tensor &q, const Tensor &codes, const Tensor &meta, const Opt &slots, const Tensor &out,
                      int64_t run, int64_t start, bool integer, int64_t lo, int64_t hi) {
    const char *op = "infinigen::score_channel";
    if (!channel_keys(op, q, codes, meta, run)) return -1;
    take(op, "out", out, at::kFloat), dims(op, "out", out, 4);
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), T = out.size(3);
    shape(op, "out", out, {B, Hkv, G, T});
    const bool pairs = slot_pairs(op, slots, B, Hkv, T);
    return use().score_channel(ptr<float>(q), ptr<uint8_t>(codes), ptr<uint16_t>(meta), ptr<int64_t>(slots), pairs,
                               ptr<float>(out), B, codes.size(0), Hkv, G, D, run, T, codes.size(2), start, integer,
                               lo, hi);
}

int64_t quantize_rows(const Tensor &x, const Tensor &rows, const Tensor &codes, const Tensor &meta, int64_t group,
                      int64_t bits) {
    const char *op = "infinigen::quantize_rows";
    take(op, "x", x, at::kFloat), take(op, "rows", rows, at::kLong), take(op, "codes", codes, at::kByte);
    take(op, "meta", meta, at::kHalf);
    at_least(op, "x", x, 1), at_least(op, "codes", codes, 1), at_least(op, "meta", meta, 2);
    const int64_t D = x.size(-1);
    if (D < 1 || (bits != 2 && bits != 4 && bits != 8) || group < 1 || D % group || (group * bits) % 8) return -1;
    const int64_t N = x.numel() / D, nb = D * bits / 8, groups = D / group;
    TORCH_CHECK(codes.size(-1) == nb, op, ": codes rows are ", codes.size(-1), " bytes, not ", nb);
    const int64_t n_rows = codes.numel() / nb;
    TORCH_CHECK(meta.size(-1) == groups && meta.size(-2) == 2, op, ": meta is ", meta.sizes(), ", not [..., 2, ",
                groups, "]");
    elements(op, "meta", meta, n_rows * 2 * groups), elements(op, "rows", rows, N);
    return use().quantize_rows(ptr<float>(x), ptr<int64_t>(rows), ptr<uint8_t>(codes), ptr<uint16_t>(meta), N, D,
                               group, bits, n_rows);
}

int64_t quantize_channel(const Tensor &x, const Tensor &slots, const Opt &appends, int64_t mode, const Tensor &codes,
                         const Tensor &meta, const Tensor &held, int64_t run, double tiny) {
    const char *op = "infinigen::quantize_channel";
    take(op, "x", x, at::kFloat), take(op, "slots", slots, at::kLong), take(op, "codes", codes, at::kByte);
    take(op, "meta", meta, at::kHalf), take_flags(op, "held", held);
    at_least(op, "x", x, 2), at_least(op, "codes", codes, 2), at_least(op, "meta", meta, 2);
    const int64_t D = x.size(-1), n_new = x.size(-2), S = codes.size(-2);
    if (D < 2 || D % 2 || run < 1 || S % run || mode < 0 || mode > 2) return -1;
    int64_t P = 1;
    for (int64_t i = 0; i < x.dim() - 2; i++) P *= x.size(i);
    TORCH_CHECK(codes.size(-1) == D / 2, op, ": codes rows are ", codes.size(-1), " bytes, not ", D / 2);
    TORCH_CHECK(meta.size(-1) == D && meta.size(-2) == 2, op, ": meta is ", meta.sizes(), ", not [..., 2, ", D, "]");
    elements(op, "codes", codes, P * S * (D / 2)), elements(op, "meta", meta, P * (S / run) * 2 * D);
    elements(op, "held", held, P * S), elements(op, "slots", slots, P * n_new);
    TORCH_CHECK(mode != 2 || appends, op, ": mode 2 reads appends");
    if (appends) take_flags(op, "appends", *appends), elements(op, "appends", *appends, P * n_new);
    return use().quantize_channel(ptr<float>(x), ptr<int64_t>(slots), ptr<uint8_t>(appends), mode,
                                  ptr<uint8_t>(codes), ptr<uint16_t>(meta), ptr<uint8_t>(held), P, n_new, S, D, run,
                                  static_cast<float>(tiny));
}

int64_t group_softmax(const Tensor &s, const Tensor &agg, const Opt &within, double alpha, int64_t lo, int64_t hi) {
    const char *op = "infinigen::group_softmax";
    take(op, "s", s, at::kFloat), take(op, "agg", agg, at::kFloat), at_least(op, "s", s, 2);
    const int64_t G = s.size(-2), T = s.size(-1);
    if (G < 1 || T < 1) return -1;
    const int64_t R = s.numel() / (G * T);
    elements(op, "agg", agg, R * T);
    TORCH_CHECK(!(alpha < INFINITY) || within, op, ": within is written where alpha is below +inf");
    if (within) take(op, "within", *within, at::kLong), elements(op, "within", *within, R * G);
    return use().group_softmax(ptr<float>(s), ptr<float>(agg), ptr<int64_t>(within), R, G, T,
                               static_cast<float>(alpha), lo, hi);
}

int64_t topk(const Tensor &x, const Tensor &idx, const Tensor &val, bool sorted, int64_t lo, int64_t hi) {
    const char *op = "infinigen::topk";
    take(op, "x", x, at::kFloat), take(op, "idx", idx, at::kLong), take(op, "val", val, at::kFloat);
    at_least(op, "x", x, 1), at_least(op, "idx", idx, 1);
    const int64_t T = x.size(-1), k = idx.size(-1);
    if (T < 1 || k < 1) return -1;
    const int64_t R = x.numel() / T;
    elements(op, "idx", idx, R * k), elements(op, "val", val, R * k);
    return use().topk(ptr<float>(x), ptr<int64_t>(idx), ptr<float>(val), R, T, k, sorted, lo, hi);
}

int64_t correct_pick(const Tensor &s, const Tensor &taken, const Opt &taken_ok, const Opt &held, const Tensor &idx,
                     const Tensor &val, bool sorted, int64_t lo, int64_t hi) {
    const char *op = "infinigen::correct_pick";
    take(op, "s", s, at::kFloat), take(op, "taken", taken, at::kLong), take(op, "idx", idx, at::kLong);
    take(op, "val", val, at::kFloat);
    at_least(op, "s", s, 2), at_least(op, "taken", taken, 1), at_least(op, "idx", idx, 1);
    const int64_t G = s.size(-2), T = s.size(-1), n = taken.size(-1), k = idx.size(-1);
    if (G < 1 || T < 1 || k < 1) return -1;
    const int64_t R = s.numel() / (G * T);
    elements(op, "taken", taken, R * n), elements(op, "idx", idx, R * k), elements(op, "val", val, R * k);
    if (taken_ok) take_flags(op, "taken_ok", *taken_ok), elements(op, "taken_ok", *taken_ok, R * n);
    if (held) take_flags(op, "held", *held), elements(op, "held", *held, R * T);
    return use().correct_pick(ptr<float>(s), ptr<int64_t>(taken), ptr<uint8_t>(taken_ok), n, ptr<uint8_t>(held),
                              ptr<int64_t>(idx), ptr<float>(val), R, G, T, k, sorted, lo, hi);
}

int64_t gather_rows(const Tensor &src_k, const Tensor &src_v, const Tensor &rows, const Tensor &out_k,
                    const Tensor &out_v, int64_t lo, int64_t hi) {
    const char *op = "infinigen::gather_rows";
    const auto [n_src, rb] = pool_of(op, src_k, src_v);
    take(op, "rows", rows, at::kLong), dims(op, "rows", rows, 3);
    const int64_t stride = window(op, "out_k", out_k, src_k);
    TORCH_CHECK(window(op, "out_v", out_v, src_k) == stride && out_v.sizes().equals(out_k.sizes()) &&
                    out_v.strides().equals(out_k.strides()),
                op, ": out_v is not laid out as out_k");
    if (stride < 0 || rb < 1) return -1;
    const int64_t B = out_k.size(0), Hkv = out_k.size(1), n = rows.size(2);
    shape(op, "rows", rows, {B, Hkv, n});
    return use().gather_rows(ptr<uint8_t>(src_k), ptr<uint8_t>(src_v), ptr<int64_t>(rows), ptr<uint8_t>(out_k),
                             ptr<uint8_t>(out_v), B * Hkv, n, out_k.size(2), stride, rb, n_src, lo, hi);
}

int64_t correct_channel(const Tensor &q, const Tensor &codes, const Tensor &meta, const Opt &slots, const Tensor &s,
                        const Tensor &taken, const Opt &taken_ok, const Opt &held, const Tensor &idx, const Tensor &val,
                        const Tensor &ok, const Tensor &got, const Tensor &limit, const Tensor &src_k,
                        const Tensor &src_v, const Opt &out_k, const Opt &out_v, const Opt &rows, int64_t run,
                        int64_t start, bool sorted, bool integer, const Opt &next, int64_t lo, int64_t hi) {
    const char *op = "infinigen::correct_channel";
    if (!channel_keys(op, q, codes, meta, run)) return -1;
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3);
    TORCH_CHECK(codes.size(0) == 1, op, ": codes hold ", codes.size(0), " sequences' rows, not the pool's one");
    take(op, "s", s, at::kFloat), take(op, "taken", taken, at::kLong), take(op, "idx", idx, at::kLong);
    take(op, "val", val, at::kFloat), take_flags(op, "ok", ok), take(op, "got", got, at::kLong);
    take(op, "limit", limit, at::kLong);
    dims(op, "s", s, 4), dims(op, "taken", taken, 3), dims(op, "idx", idx, 3);
    const int64_t T = s.size(3), n = taken.size(2), k = idx.size(2);
    shape(op, "s", s, {B, Hkv, G, T}), shape(op, "taken", taken, {B, Hkv, n}), shape(op, "val", val, {B, Hkv, k});
    shape(op, "ok", ok, {B, Hkv, k}), shape(op, "got", got, {B, Hkv}), shape(op, "limit", limit, {B});
    if (slots) take(op, "slots", *slots, at::kLong), shape(op, "slots", *slots, {B, T});
    if (taken_ok) take_flags(op, "taken_ok", *taken_ok), shape(op, "taken_ok", *taken_ok, {B, Hkv, n});
    if (held) take_flags(op, "held", *held), shape(op, "held", *held, {B, Hkv, T});
    const auto [n_src, rb] = pool_of(op, src_k, src_v);
    TORCH_CHECK(out_k.has_value() == out_v.has_value() && out_k.has_value() != rows.has_value(), op,
                ": either out_k and out_v (the rows copied) or rows (each pick's pool row)");
    int64_t stride = k, width = k;
    if (out_k) {
        stride = window(op, "out_k", *out_k, src_k);
        TORCH_CHECK(window(op, "out_v", *out_v, src_k) == stride && out_v->sizes().equals(out_k->sizes()) &&
                        out_v->strides().equals(out_k->strides()),
                    op, ": out_v is not laid out as out_k");
        if (stride < 0) return -1;
        width = out_k->size(2);
        TORCH_CHECK(out_k->size(0) == B && out_k->size(1) == Hkv, op, ": out_k is ", out_k->sizes(), " for [", B,
                    ", ", Hkv, ", ...]");
    } else {
        take(op, "rows", *rows, at::kLong), shape(op, "rows", *rows, {B, Hkv, k});
    }
    return use().correct_channel(ptr<float>(q), ptr<uint8_t>(codes), ptr<uint16_t>(meta), ptr<int64_t>(slots),
                                 ptr<float>(s), ptr<int64_t>(taken), ptr<uint8_t>(taken_ok), n, ptr<uint8_t>(held),
                                 ptr<int64_t>(idx), ptr<float>(val), ptr<uint8_t>(ok), ptr<int64_t>(got),
                                 ptr<int64_t>(limit), ptr<uint8_t>(src_k), ptr<uint8_t>(src_v), ptr<uint8_t>(out_k),
                                 ptr<uint8_t>(out_v), width, stride, rb, n_src, B, Hkv, G, D, run, T, codes.size(2),
                                 start, k, sorted, ptr<int64_t>(rows), integer, counter(op, next), lo, hi);
}

int64_t speculate_channel(const Tensor &q, const Tensor &codes, const Tensor &meta, const Opt &slots, const Tensor &s,
                          const Tensor &idx, int64_t run, int64_t start, int64_t sinks, int64_t recent, bool integer,
                          const Opt &next, int64_t lo, int64_t hi) {
    const char *op = "infinigen::speculate_channel";
    if (!channel_keys(op, q, codes, meta, run)) return -1;
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3);
    TORCH_CHECK(codes.size(0) == 1, op, ": codes hold ", codes.size(0), " sequences' rows, not the pool's one");
    take(op, "s", s, at::kFloat), take(op, "idx", idx, at::kLong), dims(op, "s", s, 4), dims(op, "idx", idx, 3);
    const int64_t T = s.size(3), k = idx.size(2);
    shape(op, "s", s, {B, Hkv, G, T}), shape(op, "idx", idx, {B, Hkv, k});
    if (slots) take(op, "slots", *slots, at::kLong), shape(op, "slots", *slots, {B, T});
    return use().speculate_channel(ptr<float>(q), ptr<uint8_t>(codes), ptr<uint16_t>(meta), ptr<int64_t>(slots),
                                   ptr<float>(s), ptr<int64_t>(idx), B, Hkv, G, D, run, T, codes.size(2), start, sinks,
                                   recent, k, integer, counter(op, next), lo, hi);
}

int64_t attend_rows(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &ra, const Opt &rb,
                    const Tensor &k_new, const Tensor &v_new, const Tensor &out, const Opt &next, int64_t lo,
                    int64_t hi) {
    const char *op = "infinigen::attend_rows";
    take(op, "k", k, at::kFloat), take(op, "v", v, at::kFloat), take(op, "q", q, at::kFloat);
    take(op, "k_new", k_new, at::kFloat), take(op, "v_new", v_new, at::kFloat), take(op, "out", out, at::kFloat);
    take(op, "ra", ra, at::kLong);
    at_least(op, "k", k, 1), at_least(op, "q", q, 1), at_least(op, "k_new", k_new, 1), at_least(op, "ra", ra, 1);
    shape(op, "v", v, k.sizes()), shape(op, "v_new", v_new, k_new.sizes()), shape(op, "out", out, q.sizes());
    const int64_t D = k.size(-1);
    TORCH_CHECK(q.size(-1) == D && k_new.size(-1) == D, op, ": q and k_new are not ", D, " wide as k is");
    if (D < 1) return -1;
    const int64_t n_src = k.numel() / D, P = k_new.numel() / D, na = ra.size(-1);
    if (P < 1) return 0;
    TORCH_CHECK(q.numel() % (P * D) == 0, op, ": q [", q.sizes(), "] is not whole heads of ", P, " pairs");
    elements(op, "ra", ra, P * na);
    int64_t nb = 0;
    if (rb) take(op, "rb", *rb, at::kLong), at_least(op, "rb", *rb, 1), nb = rb->size(-1);
    if (rb) elements(op, "rb", *rb, P * nb);
    return use().attend_rows(ptr<float>(q), ptr<float>(k), ptr<float>(v), ptr<int64_t>(ra), na, ptr<int64_t>(rb), nb,
                             ptr<float>(k_new), ptr<float>(v_new), ptr<float>(out), n_src, P, q.numel() / (P * D), D,
                             counter(op, next), lo, hi);
}

int64_t linear(const Tensor &x, const Tensor &w, const Tensor &out, const Opt &next, int64_t lo, int64_t hi) {
    const char *op = "infinigen::linear";
    const auto dt = w.scalar_type();
    const int64_t wide = dt == at::kFloat ? 0 : dt == at::kHalf ? 1 : dt == at::kBFloat16 ? 2 : -1;
    if (wide < 0) return -1;
    take(op, "x", x, at::kFloat), take(op, "w", w, dt), take(op, "out", out, at::kFloat);
    dims(op, "w", w, 2), at_least(op, "x", x, 1), at_least(op, "out", out, 1);
    const int64_t N = w.size(0), K = w.size(1);
    TORCH_CHECK(x.size(-1) == K, op, ": x rows are ", x.size(-1), " wide, the weight's ", K);
    if (K < 1) return -1;
    const int64_t M = x.numel() / K;
    TORCH_CHECK(out.size(-1) == N, op, ": out rows are ", out.size(-1), " wide, not ", N);
    elements(op, "out", out, M * N);
    return use().linear(ptr<float>(x), w.data_ptr(), ptr<float>(out), M, N, K, counter(op, next), lo, hi, wide);
}

}  // namespace

TORCH_LIBRARY(infinigen, m) {
    m.def("variants() -> str[]", &variants);
    m.def("choose(str isa) -> ()", &choose);
    m.def("isa() -> str", &isa);
    m.def("integer_scores() -> bool", &integer_scores);
    m.def("score_codes(Tensor q, Tensor codes, Tensor meta, Tensor? slots, Tensor(a!) out, int group, int bits, "
          "int start, int lo, int hi) -> int");
    m.def("score_channel(Tensor q, Tensor codes, Tensor meta, Tensor? slots, Tensor(a!) out, int run, int start, "
          "bool integer, int lo, int hi) -> int");
    m.def("quantize_rows(Tensor x, Tensor rows, Tensor(a!) codes, Tensor(b!) meta, int group, int bits) -> int");
    m.def("quantize_channel(Tensor x, Tensor slots, Tensor? appends, int mode, Tensor(a!) codes, Tensor(b!) meta, "
          "Tensor(c!) held, int run, float tiny) -> int");
    m.def("group_softmax(Tensor s, Tensor(a!) agg, Tensor(b!)? within, float alpha, int lo, int hi) -> int");
    m.def("topk(Tensor x, Tensor(a!) idx, Tensor(b!) val, bool sorted, int lo, int hi) -> int");
    m.def("correct_pick(Tensor s, Tensor taken, Tensor? taken_ok, Tensor? held, Tensor(a!) idx, Tensor(b!) val, "
          "bool sorted, int lo, int hi) -> int");
    m.def("gather_rows(Tensor src_k, Tensor src_v, Tensor rows, Tensor(a!) out_k, Tensor(b!) out_v, int lo, int hi) "
          "-> int");
    m.def("correct_channel(Tensor q, Tensor codes, Tensor meta, Tensor? slots, Tensor(a!) s, Tensor taken, "
          "Tensor? taken_ok, Tensor? held, Tensor(b!) idx, Tensor(c!) val, Tensor(d!) ok, Tensor(e!) got, "
          "Tensor limit, Tensor src_k, Tensor src_v, Tensor(f!)? out_k, Tensor(g!)? out_v, Tensor(h!)? rows, int run, "
          "int start, bool sorted, bool integer, Tensor(i!)? next, int lo, int hi) -> int");
    m.def("speculate_channel(Tensor q, Tensor codes, Tensor meta, Tensor? slots, Tensor(a!) s, Tensor(b!) idx, "
          "int run, int start, int sinks, int recent, bool integer, Tensor(c!)? next, int lo, int hi) -> int");
    m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor ra, Tensor? rb, Tensor k_new, Tensor v_new, "
          "Tensor(a!) out, Tensor(b!)? next, int lo, int hi) -> int");
    m.def("linear(Tensor x, Tensor w, Tensor(a!) out, Tensor(b!)? next, int lo, int hi) -> int");
}

TORCH_LIBRARY_IMPL(infinigen, CPU, m) {
    m.impl("score_codes", &score_codes);
    m.impl("score_channel", &score_channel);
    m.impl("quantize_rows", &quantize_rows);
    m.impl("quantize_channel", &quantize_channel);
    m.impl("group_softmax", &group_softmax);
    m.impl("topk", &topk);
    m.impl("correct_pick", &correct_pick);
    m.impl("gather_rows", &gather_rows);
    m.impl("correct_channel", &correct_channel);
    m.impl("speculate_channel", &speculate_channel);
    m.impl("attend_rows", &attend_rows);
    m.impl("linear", &linear);
}

/* The CPU's kernel for scoring queries against low-bit keys (kv/quant.py's layout): compiled once per instruction
   set (kv/cpu_build.py: plain x86-64, AVX2, AVX-512; the `#if defined(__AVX...)` branches below are what each
   variant gets), its kernels named per variant by _cpu_kernels.h, called through the typed torch operators of
   kv/_cpu_ops.cpp (which check the tensors first), whose calls release the GIL, so a Python thread per core can
   take a share of the (sequence, KV head) pairs.

   It reads each held key's packed codes and its fp16 scale and minimum once, through the slot table, and writes
   the scores; no key is ever formed in memory. Per group of columns the dot product is
   scale * (q . codes) + minimum * sum(q), as the torch path computes it (quant.score_span). */

#include <stdint.h>

#include "_cpu_kernels.h"

#define MAX_G 64    /* query heads a KV head serves */
#define MAX_D 512   /* head_dim */
#define AHEAD 16    /* keys ahead whose rows a scattered scoring requests before it needs them */

#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT_SCORES 1 /* per-channel keys' scores by integer dot products (infinigen_score_channel's `integer`) */
#endif

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}
#endif

/* Where the (sequence, KV head) pair's keys, their scales, its slots and its scores start: codes [R, Hkv, S, nb],
   meta [R, Hkv, meta_row] (per slot [S, 2, groups], or per run of slots [S / run, 2, D]), slots [B, T] or, where
   `pairs`, [B, Hkv, T] (or none), out [B, Hkv, G, T]. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *meta;
    const int64_t *slots;
    float *out;
} Rows;

static inline Rows rows_of(const uint8_t *codes, const uint16_t *meta, const int64_t *slots, int64_t pairs,
                           float *out, int64_t pair, int64_t R, int64_t Hkv, int64_t G, int64_t T, int64_t S,
                           int64_t nb, int64_t meta_row) {
    const int64_t b = pair / Hkv, row = (R == 1 ? 0 : b) * Hkv + pair % Hkv;
    Rows at = {codes + row * S * nb, meta + row * meta_row, slots ? slots + (pairs ? pair : b) * T : 0,
               out + pair * G * T};
    return at;
}

/* The pairs lo .. hi (see infinigen_score_codes); bits, D and group are constants where the caller below is
   specialised (the common layouts), so the loops over a key's bytes unroll and vectorise. */
static inline __attribute__((always_inline)) int score_pairs(
        const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots, int64_t pairs, float *out,
        int64_t R,
        int64_t Hkv, int64_t G, const int64_t D, const int64_t group, const int64_t bits, int64_t T, int64_t S,
        int64_t start, int64_t lo, int64_t hi) {
    const int64_t per = 8 / bits, nb = D / per, groups = D / group, gb = group / per, mask = (1 << bits) - 1;
    float qp[MAX_G * MAX_D]; /* qp[h][k][p] = q[h][p * per + k]: each code position's columns contiguous */
    float qs[MAX_G * MAX_D]; /* qs[h][g]: the sum of head h's query over group g's columns */
    float cf[MAX_D];         /* one key's codes as floats, cf[k][p] */
    for (int64_t pair = lo; pair < hi; pair++) {
        const float *qh = q + pair * G * D;
        for (int64_t x = 0; x < G; x++) {
            for (int64_t p = 0; p < nb; p++)
                for (int64_t k = 0; k < per; k++) qp[x * D + k * nb + p] = qh[x * D + p * per + k];
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.f;
                for (int64_t c = 0; c < group; c++) s += qh[x * D + g * group + c];
                qs[x * groups + g] = s;
            }
        }
        const Rows at = rows_of(codes, meta, slots, pairs, out, pair, R, Hkv, G, T, S, nb, S * 2 * groups);
        const uint8_t *cb = at.codes;
        const uint16_t *mb = at.meta;
        const int64_t *st = at.slots;
        float *o = at.out;
        for (int64_t t = 0; t < T; t++) {
            const int64_t slot = st ? st[t] : start + t;
            if (slot < 0 || slot >= S) return -2;
            const uint8_t *c = cb + slot * nb;
            for (int64_t k = 0; k < per; k++)
                for (int64_t p = 0; p < nb; p++) cf[k * nb + p] = (float)((c[p] >> (bits * k)) & mask);
            const uint16_t *m = mb + slot * 2 * groups;
            float scale[MAX_D], minimum[MAX_D];
            for (int64_t g = 0; g < groups; g++) scale[g] = half_to_float(m[g]), minimum[g] = half_to_float(m[groups + g]);
            for (int64_t x = 0; x < G; x++) {
                float total = 0.f;
                for (int64_t g = 0; g < groups; g++) {
                    float acc = 0.f;
                    for (int64_t k = 0; k < per; k++) {
                        const float *qk = qp + x * D + k * nb + g * gb, *ck = cf + k * nb + g * gb;
                        for (int64_t p = 0; p < gb; p++) acc += qk[p] * ck[p];
                    }
                    total += scale[g] * acc + minimum[g] * qs[x * groups + g];
                }
                o[x * T + t] = total;
            }
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* 4-bit codes in groups of 64 columns (the speculation keys' layout at 4 bits): per key and group, 32 bytes split
   into their low and high nibbles (columns 2p and 2p + 1), widened to 8 floats at a time, 8 fused multiply-adds a
   query head, the heads' sums four at a time. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static int score_pairs_u4g64(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                             int64_t pairs, float *out, int64_t R, int64_t Hkv, int64_t G, int64_t D, int64_t T, int64_t S,
                             int64_t start, int64_t lo, int64_t hi) {
    const int64_t nb = D / 2, groups = D / 64;
    const int64_t G4 = (G + 3) & ~3;  /* query heads padded to fours (zero queries) */
    float qp[MAX_G * MAX_D] __attribute__((aligned(32)));  /* qp[h][g][k][p]: a group's 32 low-nibble columns,
                                                              then its 32 high-nibble ones */
    float qs[MAX_G * MAX_D];
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t pair = lo; pair < hi; pair++) {
        const float *qh = q + pair * G * D;
        for (int64_t x = 0; x < G4; x++)
            for (int64_t g = 0; g < groups; g++) {
                float sum = 0.f;
                for (int64_t p = 0; p < 32; p++) {
                    float a = x < G ? qh[x * D + g * 64 + 2 * p] : 0.f, c = x < G ? qh[x * D + g * 64 + 2 * p + 1] : 0.f;
                    qp[x * D + g * 64 + p] = a, qp[x * D + g * 64 + 32 + p] = c, sum += a + c;
                }
                qs[x * groups + g] = sum;
            }
        const Rows at = rows_of(codes, meta, slots, pairs, out, pair, R, Hkv, G, T, S, nb, S * 2 * groups);
        const uint8_t *cb = at.codes;
        const uint16_t *mb = at.meta;
        const int64_t *st = at.slots;
        float *o = at.out;
        for (int64_t t = 0; t < T; t++) {
            const int64_t slot = st ? st[t] : start + t;
            if (slot < 0 || slot >= S) return -2;
            if (st && t + AHEAD < T) { /* scattered slots (a shortlist): their rows requested ahead, not waited for */
                const int64_t next = st[t + AHEAD];
                if (next >= 0 && next < S) {
                    for (int64_t i = 0; i < nb; i += 64) __builtin_prefetch(cb + next * nb + i);
                    __builtin_prefetch(mb + next * 2 * groups);
                }
            }
            const uint8_t *c = cb + slot * nb;
            const uint16_t *m = mb + slot * 2 * groups;
            float res[MAX_G + 4];
            for (int64_t x = 0; x < G4; x++) res[x] = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(c + g * 32));
                uint8_t nib[64] __attribute__((aligned(32)));
                _mm256_store_si256((__m256i *)nib, _mm256_and_si256(bytes, low));
                _mm256_store_si256((__m256i *)(nib + 32), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
#if defined(__AVX512F__)  /* 16 codes a conversion and a product, the heads' sums halved to 8 lanes */
                __m512 cw[4];
                for (int i = 0; i < 4; i++)
                    cw[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(nib + 16 * i))));
#else
                __m256 cf[8];
                for (int i = 0; i < 8; i++)
                    cf[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nib + 8 * i))));
#endif
                const float scale = _cvtsh_ss(m[g]), minimum = _cvtsh_ss(m[groups + g]);
                for (int64_t x = 0; x < G4; x += 4) {
                    __m256 acc[4];
                    for (int j = 0; j < 4; j++) {
#if defined(__AVX512F__)
                        const float *qw = qp + (x + j) * D + g * 64;
                        __m512 w0 = _mm512_mul_ps(_mm512_loadu_ps(qw), cw[0]);
                        __m512 w1 = _mm512_mul_ps(_mm512_loadu_ps(qw + 16), cw[1]);
                        w0 = _mm512_fmadd_ps(_mm512_loadu_ps(qw + 32), cw[2], w0);
                        w1 = _mm512_fmadd_ps(_mm512_loadu_ps(qw + 48), cw[3], w1);
                        w0 = _mm512_add_ps(w0, w1);
                        acc[j] = _mm256_add_ps(_mm512_castps512_ps256(w0),
                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w0), 1)));
#else
                        const float *qx = qp + (x + j) * D + g * 64;
                        __m256 a0 = _mm256_mul_ps(_mm256_load_ps(qx), cf[0]);
                        __m256 a1 = _mm256_mul_ps(_mm256_load_ps(qx + 8), cf[1]);
                        for (int i = 2; i < 8; i += 2) {
                            a0 = _mm256_fmadd_ps(_mm256_load_ps(qx + 8 * i), cf[i], a0);
                            a1 = _mm256_fmadd_ps(_mm256_load_ps(qx + 8 * i + 8), cf[i + 1], a1);
                        }
                        acc[j] = _mm256_add_ps(a0, a1);
#endif
                    }
                    __m128 dot = hsum4(acc[0], acc[1], acc[2], acc[3]);
                    __m128 qsum = _mm_setr_ps(qs[x * groups + g], qs[(x + 1) * groups + g], qs[(x + 2) * groups + g],
                                              qs[(x + 3) * groups + g]);
                    __m128 v = _mm_fmadd_ps(_mm_set1_ps(scale), dot, _mm_mul_ps(_mm_set1_ps(minimum), qsum));
                    _mm_storeu_ps(res + x, _mm_add_ps(_mm_loadu_ps(res + x), v));
                }
            }
            for (int64_t x = 0; x < G; x++) o[x * T + t] = res[x];
        }
    }
    return 0;
}
#endif

#define SPECIALISED(BITS, DIM, GROUP)                                                                       \
    if (bits == BITS && D == DIM && group == GROUP)                                                         \
        return score_pairs(q, codes, meta, slots, pairs, out, R, Hkv, G, DIM, GROUP, BITS, T, S, start, lo, hi);

/* q [B, Hkv, G, D] float32 (contiguous); codes [R, Hkv, S, D * bits / 8] uint8; meta [R, Hkv, S, 2, D / group]
   fp16 (scale, minimum); slots [B, T] int64 (each sequence's, for every KV head) or, where `pairs` is non-zero,
   [B, Hkv, T] (each pair's own), or NULL for the run start .. start + T; out [B, Hkv, G, T] float32.
   R is B (each sequence its own rows) or 1 (rows shared through slot tables). Computes the (sequence, KV head)
   pairs lo .. hi of the B * Hkv. Returns 0, or -1 for shapes it does not take, or -2 for a slot outside 0 .. S. */
int infinigen_score_codes(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                          int64_t pairs, float *out, int64_t B, int64_t R, int64_t Hkv, int64_t G, int64_t D,
                          int64_t group, int64_t bits, int64_t T, int64_t S, int64_t start, int64_t lo, int64_t hi) {
    if (G < 1 || G > MAX_G || D < 1 || D > MAX_D || (bits != 2 && bits != 4 && bits != 8) || group < 1 ||
        D % group || (group * bits) % 8 || (R != 1 && R != B) || lo < 0 || hi > B * Hkv)
        return -1;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (bits == 4 && group == 64 && D % 64 == 0 && G >= 3) /* (fewer heads: the padding to four costs more) */
        return score_pairs_u4g64(q, codes, meta, slots, pairs, out, R, Hkv, G, D, T, S, start, lo, hi);
#endif
    SPECIALISED(4, 64, 64)
    SPECIALISED(4, 128, 64)
    SPECIALISED(4, 256, 64)
    SPECIALISED(2, 64, 32)
    SPECIALISED(2, 128, 32)
    SPECIALISED(2, 256, 32)
    return score_pairs(q, codes, meta, slots, pairs, out, R, Hkv, G, D, group, bits, T, S, start, lo, hi);
}

#if defined(__AVX512F__) && defined(__F16C__)
/* Sixteen vectors' sums (lane i the sum of vector i's lanes) in two halves: sums4 folds four vectors (pairs
   interleaved and added, then pairs of pairs) into one holding their partial sums; sums16_last four of those (of
   vectors 0-3, 4-7, 8-11, 12-15) into the sixteen sums, 128-bit chunks interleaved and added. */
static inline __m512 sums4(const __m512 *v) {
    const __m512 s0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 s1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    const __m512d a = _mm512_castps_pd(s0), b = _mm512_castps_pd(s1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

#ifdef INT_SCORES
/* Four vectors' maxima, lane x the largest of v[x]'s lanes (as sums4_of, max for add) */
static inline __m128 max4_of(const __m512 *v) {
    const __m512 s0 = _mm512_max_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 s1 = _mm512_max_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    const __m512d a = _mm512_castps_pd(s0), b = _mm512_castps_pd(s1);
    const __m512 s = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Four vectors' sums, lane x the sum of v[x]'s lanes (sums4's, then its four 128-bit lanes added). */
static inline __m128 sums4_of(const __m512 *v) {
    const __m512 s = sums4(v);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

static inline __m512 sums16_last(const float *w4) {
    const __m512 w0 = _mm512_load_ps(w4), w1 = _mm512_load_ps(w4 + 16), w2 = _mm512_load_ps(w4 + 32),
                 w3 = _mm512_load_ps(w4 + 48);
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(w2, w3, 0x88), _mm512_shuffle_f32x4(w2, w3, 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

/* A 64-column block of a key's codes (32 bytes: column 2p in byte p's low nibble, 2p + 1 in its high one) as
   floats in code order: the low nibbles' 32, then the high ones'. */
static inline void widen64(const uint8_t *c, __m512 *f) {
    const __m256i low = _mm256_set1_epi8(0x0f), bytes = _mm256_loadu_si256((const __m256i *)c);
    const __m256i l = _mm256_and_si256(bytes, low), h = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(l)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(l, 1)));
    f[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(h)));
    f[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(h, 1)));
}

#ifdef INT_SCORES
/* The integer query's byte order in a 64-column block: byte 8d + 4h + m holds column 8d + 2m + h, so that dword
   2d + h meets, in vpdpbusd, the nibbles h (low 0, high 1) of a key's code bytes 4d .. 4d + 3. Within each 16
   columns: */
static const int32_t VNNI_COLUMN[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

/* A run's integer query for the tile, per query head x: w = q * scale (qv the query, sv and mv the run's scales
   and minimums, all in VNNI order), u = max |w| / 127, wq = round(w / u) as int8 (|wq| <= 127; all zeros, u = 0,
   where w is), bias = q . minimum. Four heads' maxima and sums found together (max4_of, sums4_of). */
static inline void fold_int(const float *qv, const float *sv, const float *mv, int8_t *wq, float *u, float *bias,
                            int64_t G, int64_t D) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t x0 = 0; x0 < G; x0 += 4) {
        __m512 big[4], acc[4];
        for (int64_t k = 0; k < 4; k++) {
            const float *qx = qv + (x0 + k) * D;
            big[k] = acc[k] = _mm512_setzero_ps();
            if (x0 + k < G)
                for (int64_t i = 0; i < D; i += 16) {
                    const __m512 qi = _mm512_load_ps(qx + i);
                    big[k] = _mm512_max_ps(big[k], _mm512_andnot_ps(sign, _mm512_mul_ps(qi, _mm512_load_ps(sv + i))));
                    acc[k] = _mm512_fmadd_ps(qi, _mm512_load_ps(mv + i), acc[k]);
                }
        }
        const __m128 m = max4_of(big), pos = _mm_cmpgt_ps(m, _mm_setzero_ps());
        float inv[4], um[4], b4[4];
        _mm_storeu_ps(inv, _mm_and_ps(pos, _mm_div_ps(_mm_set1_ps(127.f), m)));
        _mm_storeu_ps(um, _mm_div_ps(m, _mm_set1_ps(127.f)));
        _mm_storeu_ps(b4, sums4_of(acc));
        for (int64_t k = 0; k < 4 && x0 + k < G; k++) {
            const int64_t x = x0 + k;
            const __m512 iv4 = _mm512_set1_ps(inv[k]);
            for (int64_t blk = 0; blk < D; blk += 64) {
                __m512i iv[4];
                for (int i = 0; i < 4; i++) {
                    const int64_t c = blk + 16 * i;
                    iv[i] = _mm512_cvtps_epi32(
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(qv + x * D + c), _mm512_load_ps(sv + c)), iv4));
                }
                _mm512_store_si512((__m512i *)(wq + x * D + blk),
                                   _mm512_packs_epi16(_mm512_packs_epi32(iv[0], iv[1]), _mm512_packs_epi32(iv[2], iv[3])));
            }
            u[x] = um[k], bias[x] = b4[k];
        }
    }
}

/* fold_int at a head_dim of 64 and at most 4 query heads, its arithmetic in the same order (the same wq, u and
   bias, bit for bit), with the run's scales converted straight into registers and each head's query (qv, held by
   the caller across the pair's runs) and w = q * scale kept there: fold_int loads and multiplies each twice and
   its scales go through memory, which at SmolLM2's shapes made the fold as many instructions as the run's 16 keys'
   products. m: the run's meta (D scales, then D minimums, fp16). */
static inline void fold_int64(const __m512 qv[4][4], const uint16_t *m, __m512i vorder, int8_t *wq, float *u,
                              float *bias, int64_t G) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 sv[4], mv[4], w[4][4], big[4], acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        sv[i] = _mm512_permutexvar_ps(vorder, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16 * i))));
        mv[i] = _mm512_permutexvar_ps(vorder, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 64 + 16 * i))));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        big[k] = acc[k] = _mm512_setzero_ps();
        if (k < G)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                w[k][i] = _mm512_mul_ps(qv[k][i], sv[i]);
                big[k] = _mm512_max_ps(big[k], _mm512_andnot_ps(sign, w[k][i]));
                acc[k] = _mm512_fmadd_ps(qv[k][i], mv[i], acc[k]);
            }
    }
    const __m128 mx = max4_of(big), pos = _mm_cmpgt_ps(mx, _mm_setzero_ps());
    float inv[4];
    _mm_storeu_ps(inv, _mm_and_ps(pos, _mm_div_ps(_mm_set1_ps(127.f), mx)));
    _mm_storeu_ps(u, _mm_div_ps(mx, _mm_set1_ps(127.f)));
    _mm_storeu_ps(bias, sums4_of(acc));
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (k >= G) break;
        const __m512 iv4 = _mm512_set1_ps(inv[k]);
        __m512i iv[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) iv[i] = _mm512_cvtps_epi32(_mm512_mul_ps(w[k][i], iv4));
        _mm512_store_si512((__m512i *)(wq + k * 64),
                           _mm512_packs_epi16(_mm512_packs_epi32(iv[0], iv[1]), _mm512_packs_epi32(iv[2], iv[3])));
    }
}

/* Where fold_int's packs (per 128 bits: four dwords of each of four vectors) leave dword j of a block's VNNI order */
#define PACKED(j) (4 * ((j) % 4) + (j) / 4)

/* s + vpdpbusd(c, the int8 dword *w in every lane), the dword broadcast by the instruction's own operand ({1to16}:
   gcc issues a separate broadcast for _mm512_set1_epi32 of a load) */
static inline __m512i dpbusd_bcast(__m512i s, __m512i c, const int32_t *w) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(c), "m"(*w));
    return s;
}

/* n (<= 16) keys of one run from `c` (a key every nb bytes) scored by integer dot products: the keys' code bytes
   transposed four at a time into dwords (lane k: key k's bytes 4d .. 4d + 3 of a 64-column block), their nibbles
   split, and vpdpbusd (64 products of an unsigned code and a signed int8 an instruction) sums them against each
   query head's dwords; score = u * sum + bias, into o's lanes t .. t + n (head x at o + x * T). Keys past n read
   as zeros, never from the pool. */
static inline void score_tile_int(const uint8_t *c, int64_t nb, int64_t n, const int8_t *wq, const float *u,
                                  const float *bias, float *o, int64_t T, int64_t G, int64_t D) {
    __m512i acc[MAX_G];
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t blk = 0; blk < D; blk += 64) {
        __m256i row[16];
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++)
            row[k] = k < n ? _mm256_loadu_si256((const __m256i *)(c + k * nb + blk / 2)) : _mm256_setzero_si256();
        __m512i z[8], col[16];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) { /* lanes: keys i, i + 4 in z[i]; 8 + i, 12 + i in z[4 + i] */
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row[i]), row[i + 4], 1);
            z[4 + i] = _mm512_inserti64x4(_mm512_castsi256_si512(row[8 + i]), row[12 + i], 1);
        }
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) { /* per 128 bits, four keys' dword d then d + 4 (u[g][d], d < 4) */
            const __m512i *zz = z + 4 * g;
            const __m512i t0 = _mm512_unpacklo_epi32(zz[0], zz[1]), t1 = _mm512_unpackhi_epi32(zz[0], zz[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(zz[2], zz[3]), t3 = _mm512_unpackhi_epi32(zz[2], zz[3]);
            z[4 * g + 0] = _mm512_unpacklo_epi64(t0, t2), z[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
            z[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3), z[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
#pragma GCC unroll 4
        for (int d = 0; d < 4; d++) { /* dword d and d + 4 of keys 0-3, 4-7, 8-11, 12-15; then their nibbles */
            const __m512i a = _mm512_shuffle_i32x4(z[d], z[4 + d], 0x88), b = _mm512_shuffle_i32x4(z[d], z[4 + d], 0xdd);
            col[4 * d] = _mm512_and_si512(a, low), col[4 * d + 1] = _mm512_and_si512(_mm512_srli_epi32(a, 4), low);
            col[4 * d + 2] = _mm512_and_si512(b, low), col[4 * d + 3] = _mm512_and_si512(_mm512_srli_epi32(b, 4), low);
        }
        for (int64_t x = 0; x < G; x++) {
            const int32_t *w = (const int32_t *)(wq + x * D + blk);
            __m512i s[4]; /* four chains: vpdpbusd's latency, not its throughput, would bound one */
#pragma GCC unroll 4
            for (int d = 0; d < 4; d++) {
                s[d] = dpbusd_bcast(d || !blk ? _mm512_setzero_si512() : acc[x], col[4 * d], w + PACKED(2 * d));
                s[d] = dpbusd_bcast(s[d], col[4 * d + 1], w + PACKED(2 * d + 1));
                s[d] = dpbusd_bcast(s[d], col[4 * d + 2], w + PACKED(2 * d + 8));
                s[d] = dpbusd_bcast(s[d], col[4 * d + 3], w + PACKED(2 * d + 9));
            }
            acc[x] = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
        }
    }
    for (int64_t x = 0; x < G; x++)
        _mm512_mask_storeu_ps(o + x * T, (__mmask16)((1u << n) - 1),
                              _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[x]), _mm512_set1_ps(u[x]), _mm512_set1_ps(bias[x])));
}
#endif

/* infinigen_score_channel's pairs lo .. hi at a head_dim of a multiple of 64, 16 floats a vector. Consecutive
   slots of one run (up to 16: a run's keys, which every form but a shortlist names in order) share one fold of the
   run's scales into the query: w = q * scale and b = q . minimum per query head, in code order (a 32-byte block's
   low nibbles, columns 64i + 2p, then its high ones); four keys at a time, their codes widened to floats once (in
   registers at a head_dim of 64) and each query head's products with them folded into partial sums (sums4), the
   run's 16 scores then summed from those (sums16_last). The fold's division by the run found once a run, not once
   a key: at SmolLM2's shapes these two made the kernel 28 % faster, its scores bit for bit the same. */
static int score_channel_512(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                             int64_t pairs, float *out, int64_t R, int64_t Hkv, int64_t G, int64_t D, int64_t run,
                             int64_t T, int64_t S, int64_t start, int integer, int64_t lo, int64_t hi) {
    const int64_t nb = D / 2, runs = S / run, V = D / 16;
    float qp[MAX_G * MAX_D] __attribute__((aligned(64)));  /* the query in code order */
    float w[MAX_G * MAX_D] __attribute__((aligned(64)));   /* qp * the run's scales */
    float bias[MAX_G];                                      /* qp . the run's minimums */
    float cf[4 * MAX_D] __attribute__((aligned(64)));       /* 4 keys' codes as floats, code order */
    float part[MAX_G * 64] __attribute__((aligned(64)));    /* per query head, sums4 of each 4 keys */
    float sc[MAX_D] __attribute__((aligned(64))), mn[MAX_D] __attribute__((aligned(64)));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#ifdef INT_SCORES
    float qv[MAX_G * MAX_D] __attribute__((aligned(64)));  /* the query in VNNI order */
    float sv[MAX_D] __attribute__((aligned(64))), mv[MAX_D] __attribute__((aligned(64)));
    int8_t wq[MAX_G * MAX_D] __attribute__((aligned(64)));
    float uq[MAX_G], ibias[MAX_G];
    const __m512i vorder = _mm512_loadu_si512(VNNI_COLUMN);
#else
    integer = 0;
#endif
    for (int64_t pair = lo; pair < hi; pair++) {
        for (int64_t x = 0; x < G && !integer; x++) /* (the float path's query: the integer one scores every key) */
            for (int64_t blk = 0; blk < D; blk += 64)
                for (int64_t p = 0; p < 32; p++) {
                    qp[x * D + blk + p] = q[(pair * G + x) * D + blk + 2 * p];
                    qp[x * D + blk + 32 + p] = q[(pair * G + x) * D + blk + 2 * p + 1];
                }
#ifdef INT_SCORES
        if (integer)
            for (int64_t x = 0; x < G; x++)
                for (int64_t i = 0; i < D; i += 16)
                    _mm512_store_ps(qv + x * D + i, _mm512_permutexvar_ps(vorder, _mm512_loadu_ps(q + (pair * G + x) * D + i)));
        int64_t have_i = -1;
        __m512 q4[4][4]; /* fold_int64's query (D = 64, G <= 4) */
        if (integer && D == 64 && G <= 4)
            for (int64_t x = 0; x < 4; x++)
                for (int i = 0; i < 4; i++) q4[x][i] = x < G ? _mm512_load_ps(qv + x * 64 + 16 * i) : _mm512_setzero_ps();
#endif
        const Rows at = rows_of(codes, meta, slots, pairs, out, pair, R, Hkv, G, T, S, nb, runs * 2 * D);
        const uint8_t *cb = at.codes;
        const uint16_t *mb = at.meta;
        const int64_t *st = at.slots;
        float *o = at.out;
        int64_t have = -1;
        for (int64_t t = 0; t < T;) {
            const int64_t first = st ? st[t] : start + t;
            if (first < 0 || first >= S) return -2;
            const int64_t r = first / run, left = (r + 1) * run - first; /* slots of run r from `first` on */
            /* the keys from t on at consecutive slots of run r, at most 16 (one division a run, not one a key) */
            int64_t n = 16 < left ? 16 : left;
            if (T - t < n) n = T - t;
            if (st)
                for (int64_t k = 1; k < n; k++)
                    if (st[t + k] != first + k) {
                        n = k;
                        break;
                    }
#ifdef INT_SCORES
            if (integer) { /* a run's keys by integer dot products (a key's score its own: whatever its neighbours) */
                if (r != have_i && D == 64 && G <= 4) {
                    fold_int64((const __m512(*)[4])q4, mb + r * 2 * D, vorder, wq, uq, ibias, G);
                    have_i = r;
                } else if (r != have_i) {
                    const uint16_t *m = mb + r * 2 * D;
                    for (int64_t i = 0; i < D; i += 16) {
                        _mm512_store_ps(sv + i, _mm512_permutexvar_ps(vorder, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + i)))));
                        _mm512_store_ps(mv + i, _mm512_permutexvar_ps(vorder, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + D + i)))));
                    }
                    fold_int(qv, sv, mv, wq, uq, ibias, G, D);
                    have_i = r;
                }
                score_tile_int(cb + first * nb, nb, n, wq, uq, ibias, o + t, T, G, D);
                t += n;
                continue;
            }
#endif
            if (r != have) { /* the fold */
                const uint16_t *m = mb + r * 2 * D;
                for (int64_t blk = 0; blk < D; blk += 64)
                    for (int h = 0; h < 2; h++) {
                        const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + blk + 32 * h)));
                        const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + blk + 32 * h + 16)));
                        const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + D + blk + 32 * h)));
                        const __m512 m1 = _mm512_cvtph_ps(
                            _mm256_loadu_si256((const __m256i *)(m + D + blk + 32 * h + 16)));
                        _mm512_store_ps(sc + blk + 16 * h, _mm512_permutex2var_ps(s0, even, s1));
                        _mm512_store_ps(sc + blk + 32 + 16 * h, _mm512_permutex2var_ps(s0, odd, s1));
                        _mm512_store_ps(mn + blk + 16 * h, _mm512_permutex2var_ps(m0, even, m1));
                        _mm512_store_ps(mn + blk + 32 + 16 * h, _mm512_permutex2var_ps(m0, odd, m1));
                    }
                for (int64_t x = 0; x < G; x++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t i = 0; i < V; i++) {
                        const __m512 qv = _mm512_load_ps(qp + x * D + 16 * i);
                        _mm512_store_ps(w + x * D + 16 * i, _mm512_mul_ps(qv, _mm512_load_ps(sc + 16 * i)));
                        acc = _mm512_fmadd_ps(qv, _mm512_load_ps(mn + 16 * i), acc);
                    }
                    bias[x] = _mm512_reduce_add_ps(acc);
                }
                have = r;
            }
            if (st && t + n + AHEAD < T) { /* scattered slots: their rows requested ahead */
                const int64_t next = st[t + n + AHEAD];
                if (next >= 0 && next < S) __builtin_prefetch(cb + next * nb), __builtin_prefetch(mb + next / run * 2 * D);
            }
            /* four keys at a time (a run's keys past n: zeros, never read), each query head's four products with
               them folded into one vector of partial sums; then the run's 16 scores from the four */
            for (int gi = 0; gi < 4; gi++) {
                if (4 * gi >= n) { /* keys past the run's n: lanes the store leaves out */
                    for (int64_t x = 0; x < G; x++) _mm512_store_ps(part + x * 64 + 16 * gi, _mm512_setzero_ps());
                    continue;
                }
                if (D == 64) { /* the four keys' codes in sixteen registers */
                    __m512 cv[4][4];
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) {
                        if (4 * gi + k >= n) { /* past the run's n: zeros, never read from the pool */
                            cv[k][0] = cv[k][1] = cv[k][2] = cv[k][3] = _mm512_setzero_ps();
                            continue;
                        }
                        widen64(cb + (first + 4 * gi + k) * nb, cv[k]);
                    }
                    for (int64_t x = 0; x < G; x++) {
                        const float *wx = w + x * 64;
                        const __m512 w0 = _mm512_load_ps(wx), w1 = _mm512_load_ps(wx + 16), w2 = _mm512_load_ps(wx + 32),
                                     w3 = _mm512_load_ps(wx + 48);
                        __m512 a[4];
#pragma GCC unroll 4
                        for (int k = 0; k < 4; k++)
                            a[k] = _mm512_fmadd_ps(w3, cv[k][3], _mm512_fmadd_ps(w2, cv[k][2],
                                   _mm512_fmadd_ps(w1, cv[k][1], _mm512_mul_ps(w0, cv[k][0]))));
                        _mm512_store_ps(part + x * 64 + 16 * gi, sums4(a));
                    }
                    continue;
                }
                for (int k = 0; k < 4; k++) {
                    float *f = cf + k * D;
                    if (4 * gi + k >= n) { /* past the run's n: zeros, never read from the pool */
                        for (int64_t i = 0; i < D; i += 16) _mm512_store_ps(f + i, _mm512_setzero_ps());
                        continue;
                    }
                    for (int64_t blk = 0; blk < D; blk += 64) widen64(cb + (first + 4 * gi + k) * nb + blk / 2, (__m512 *)(f + blk));
                }
                for (int64_t x = 0; x < G; x++) {
                    const float *wx = w + x * D;
                    __m512 a[4];
#pragma GCC unroll 4
                    for (int k = 0; k < 4; k++) a[k] = _mm512_mul_ps(_mm512_load_ps(wx), _mm512_load_ps(cf + k * D));
                    for (int64_t i = 1; i < V; i++) {
                        const __m512 wi = _mm512_load_ps(wx + 16 * i);
#pragma GCC unroll 4
                        for (int k = 0; k < 4; k++) a[k] = _mm512_fmadd_ps(wi, _mm512_load_ps(cf + k * D + 16 * i), a[k]);
                    }
                    _mm512_store_ps(part + x * 64 + 16 * gi, sums4(a));
                }
            }
            for (int64_t x = 0; x < G; x++) {
                const __m512 v = _mm512_add_ps(sums16_last(part + x * 64), _mm512_set1_ps(bias[x]));
                _mm512_mask_storeu_ps(o + x * T + t, (__mmask16)((1u << n) - 1), v);
            }
            t += n;
        }
    }
    return 0;
}
#endif

/* 1 where this build scores per-channel keys by integer dot products when asked (AVX-512 VNNI and BW), else 0. */
int infinigen_integer_scores(void) {
#ifdef INT_SCORES
    return 1;
#else
    return 0;
#endif
}

/* Per-channel 4-bit keys (policies/speculation.py's ChannelKeys): codes [R, Hkv, S, D / 2] (column 2p in byte
   p's low nibble, 2p + 1 in its high one), meta [R, Hkv, S / run, 2, D] fp16 (each run of `run` slots: a scale and
   a minimum per column). A key's column c is code * scale[c] + minimum[c] of its slot's run, formed in a buffer
   (the run's scales converted once while consecutive keys share it: the correction's scattered slots change run
   at almost every key, so forming the key costs D where folding the scales into the query would cost G x D), then
   dotted with each query head in eight partial sums (a loop the compiler vectorises without reassociating).
   Other arguments as infinigen_score_codes (no group, no bits). `integer` (where the build has INT_SCORES, at a
   head_dim of a multiple of 64): every key scores by integer dot products against its run's w = q * scale in int8
   (score_tile_int; each score then within 0.5 x max |w| / 127 x the sum of its codes of the float one, and the
   same in any slot form). Returns 0, -1 for shapes it does not take, -2 for a slot outside 0 .. S. */
int infinigen_score_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                            int64_t pairs, float *out, int64_t B, int64_t R, int64_t Hkv, int64_t G, int64_t D,
                            int64_t run, int64_t T, int64_t S, int64_t start, int64_t integer, int64_t lo, int64_t hi) {
    if (G < 1 || G > MAX_G || D < 8 || D > MAX_D || D % 8 || run < 1 || S % run || (R != 1 && R != B) || lo < 0 ||
        hi > B * Hkv)
        return -1;
#if defined(__AVX512F__) && defined(__F16C__)
    if (D % 64 == 0)
        return score_channel_512(q, codes, meta, slots, pairs, out, R, Hkv, G, D, run, T, S, start, (int)integer, lo, hi);
#endif
    const int64_t nb = D / 2, runs = S / run;
    /* every column in code order, low nibbles (even columns) then high (odd): contiguous loops that vectorise */
    float scale[MAX_D], minimum[MAX_D], kf[MAX_D], qp[MAX_G * MAX_D];
    for (int64_t pair = lo; pair < hi; pair++) {
        const float *qh = qp;
        for (int64_t x = 0; x < G; x++)
            for (int64_t p = 0; p < nb; p++)
                qp[x * D + p] = q[(pair * G + x) * D + 2 * p], qp[x * D + nb + p] = q[(pair * G + x) * D + 2 * p + 1];
        const Rows at = rows_of(codes, meta, slots, pairs, out, pair, R, Hkv, G, T, S, nb, runs * 2 * D);
        const uint8_t *cb = at.codes;
        const uint16_t *mb = at.meta;
        const int64_t *st = at.slots;
        float *o = at.out;
        int64_t have = -1; /* the run whose scales `scale` and `minimum` hold */
        for (int64_t t = 0; t < T; t++) {
            const int64_t slot = st ? st[t] : start + t;
            if (slot < 0 || slot >= S) return -2;
            const int64_t r = slot / run;
            if (r != have) {
                const uint16_t *m = mb + r * 2 * D;
                for (int64_t p = 0; p < nb; p++) {
                    scale[p] = half_to_float(m[2 * p]), minimum[p] = half_to_float(m[D + 2 * p]);
                    scale[nb + p] = half_to_float(m[2 * p + 1]), minimum[nb + p] = half_to_float(m[D + 2 * p + 1]);
                }
                have = r;
            }
            if (st && t + AHEAD < T) { /* scattered slots: their rows requested ahead */
                const int64_t next = st[t + AHEAD];
                if (next >= 0 && next < S) __builtin_prefetch(cb + next * nb), __builtin_prefetch(mb + next / run * 2 * D);
            }
            const uint8_t *c = cb + slot * nb;
            for (int64_t p = 0; p < nb; p++) kf[p] = (float)(c[p] & 0x0f) * scale[p] + minimum[p];
            for (int64_t p = 0; p < nb; p++) kf[nb + p] = (float)(c[p] >> 4) * scale[nb + p] + minimum[nb + p];
            for (int64_t x = 0; x < G; x++) {
                const float *w = qh + x * D;
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int64_t i = 0; i < D; i += 8)
                    for (int k = 0; k < 8; k++) acc[k] += w[i + k] * kf[i + k];
                o[x * T + t] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            }
        }
    }
    return 0;
}

/* New keys into their slots: x [N, D] float32, each row quantized as kv/quant.py's `quantize` does (the same
   codes, scale and minimum, bit for bit: float32 arithmetic, round half to even) into codes [rows, D * bits / 8]
   and meta [rows, 2, D / group] at its flat row rows[i] (< n_rows). Returns 0, -1 for shapes it does not take (or
   a machine without F16C: the torch path then runs), -2 for a row outside 0 .. n_rows. */
int infinigen_quantize_rows(const float *x, const int64_t *rows, uint8_t *codes, uint16_t *meta, int64_t N,
                            int64_t D, int64_t group, int64_t bits, int64_t n_rows) {
#if defined(__F16C__)
    if (D < 1 || D > MAX_D || (bits != 2 && bits != 4 && bits != 8) || group < 1 || D % group || (group * bits) % 8)
        return -1;
    const int64_t per = 8 / bits, nb = D / per, groups = D / group;
    const float top = (float)((1 << bits) - 1);
    for (int64_t i = 0; i < N; i++) {
        const int64_t row = rows[i];
        if (row < 0 || row >= n_rows) return -2;
        const float *v = x + i * D;
        uint8_t q[MAX_D];
        for (int64_t g = 0; g < groups; g++) {
            float lo = v[g * group], hi = lo;
            for (int64_t c = 1; c < group; c++) {
                const float y = v[g * group + c];
                lo = y < lo ? y : lo, hi = y > hi ? y : hi;
            }
            const float span = hi - lo; /* as torch: (hi - lo) / top, then the clamp, in float32 */
            float scale = span / top;
            if (!(scale >= 1e-8f)) scale = scale != scale ? scale : 1e-8f;
            for (int64_t c = 0; c < group; c++) {
                float code = __builtin_nearbyintf((v[g * group + c] - lo) / scale);
                code = code < 0.f ? 0.f : code > top ? top : code;
                q[g * group + c] = (uint8_t)code;
            }
            meta[row * 2 * groups + g] = _cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT);
            meta[row * 2 * groups + groups + g] = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
        }
        uint8_t *c = codes + row * nb;
        for (int64_t p = 0; p < nb; p++) {
            uint8_t byte = 0;
            for (int64_t k = 0; k < per; k++) byte |= (uint8_t)(q[p * per + k] << (bits * k));
            c[p] = byte;
        }
    }
    return 0;
#else
    (void)x, (void)rows, (void)codes, (void)meta, (void)N, (void)D, (void)group, (void)bits, (void)n_rows;
    return -1;
#endif
}

/* New keys into per-channel runs (policies/speculation.py's ChannelKeys.write, one new key per run touched): x
   [P, n_new, D] float32, key i of pair i / n_new into slot slots[i] of that pair's codes [P, S, D / 2] (column 2p
   in byte p's low nibble, 2p + 1 in its high one), meta [P, S / run, 2, D] fp16 (a run's scale and minimum per
   column) and held [P, S] (0 or 1). The run's keys dequantized, the new one put in, each column quantized again
   over the run's held slots (mode 0: as held, with the new slot; 1: and none after the new slot; 2: so where
   appends[i]) against the fp16 scale and minimum stored, as quant.quantize_channels does it in float32 (the
   torch path's codes and meta bit for bit for finite keys: the multiply and the add of dequantizing not fused).
   Returns 0, -1 for shapes it does not take (or no F16C: the torch path then runs), -2 for a slot outside 0 .. S
   (before anything is written). */
int infinigen_quantize_channel(const float *x, const int64_t *slots, const uint8_t *appends, int64_t mode,
                               uint8_t *codes, uint16_t *meta, uint8_t *held, int64_t P, int64_t n_new, int64_t S,
                               int64_t D, int64_t run, float tiny) {
#if defined(__F16C__)
    if (D < 2 || D > MAX_D || D % 2 || run < 1 || run > 64 || S % run || mode < 0 || mode > 2 || P < 0 || n_new < 0)
        return -1;
    const int64_t nb = D / 2;
    for (int64_t i = 0; i < P * n_new; i++) /* every slot checked before anything is written */
        if (slots[i] < 0 || slots[i] >= S) return -2;
    for (int64_t i = 0; i < P * n_new; i++) {
        const int64_t pair = i / n_new, slot = slots[i];
        const int64_t off = slot % run, first = pair * S + slot - off;
        uint8_t h[64];
        for (int64_t k = 0; k < run; k++) {
            h[k] = held[first + k] != 0 || k == off;
            if (mode == 1 || (mode == 2 && appends[i])) h[k] = h[k] && k <= off;
            held[first + k] = h[k];
        }
        uint8_t *c = codes + first * nb;
        uint16_t *m = meta + (first / run) * 2 * D;
        const float *v = x + i * D;
        float col[64];
        for (int64_t d = 0; d < D; d++) {
            const int64_t p = d / 2, shift = 4 * (d % 2);
            const float scale = _cvtsh_ss(m[d]), lo = _cvtsh_ss(m[D + d]);
            float mn = 0.f, mx = 0.f;
            int any = 0;
            for (int64_t k = 0; k < run; k++) {
                float y = k == off ? v[d] : (float)((c[k * nb + p] >> shift) & 15);
                if (k != off) {
                    volatile float prod = y * scale; /* rounded before the add, as torch's mul_ then add_ */
                    y = prod + lo;
                }
                col[k] = y;
                if (h[k]) {
                    mn = any && mn <= y ? mn : y, mx = any && mx >= y ? mx : y;
                    any = 1;
                }
            }
            const uint16_t mn16 = _cvtss_sh(mn, _MM_FROUND_TO_NEAREST_INT);
            const float mnf = _cvtsh_ss(mn16);
            float sc = (mx - mnf) / 15.f;
            sc = sc < tiny ? tiny : sc;
            const uint16_t sc16 = _cvtss_sh(sc, _MM_FROUND_TO_NEAREST_INT);
            const float scf = _cvtsh_ss(sc16);
            for (int64_t k = 0; k < run; k++) {
                float q = __builtin_nearbyintf((col[k] - mnf) / scf);
                q = q >= 0.f ? (q > 15.f ? 15.f : q) : 0.f; /* (a NaN key's codes: 0) */
                uint8_t *byte = c + k * nb + p;
                *byte = (uint8_t)((*byte & ~(15 << shift)) | ((int)q << shift));
            }
            m[d] = sc16, m[D + d] = mn16;
        }
    }
    return 0;
#else
    (void)x, (void)slots, (void)appends, (void)mode, (void)codes, (void)meta, (void)held, (void)P, (void)n_new;
    (void)S, (void)D, (void)run, (void)tiny;
    return -1;
#endif
}

/* ---- Selection (policies/speculation.py): a group's softmax summed, and each row's k largest ---- */

#include <stdlib.h>

/* e^x for x <= 0 in float32 (a few ulp; 0 below -87.3, and for -inf): a plain loop of it vectorises. */
static inline float exp_neg(float x) {
    const float z = x < -87.3f ? -87.3f : x;
    const float n = __builtin_rintf(z * 1.44269504f);
    const float r = (z - n * 0.693359375f) + n * 2.12194440e-4f; /* z - n ln 2, ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s = {(uint32_t)((int32_t)n + 127) << 23};
    return x < -87.3f ? 0.0f : p * s.f;
}

/* A float's order as an unsigned integer's (-inf lowest; NaN with its sign bit clear above +inf). */
static inline uint32_t order_key(float f) {
    union { float f; uint32_t u; } v = {f};
    return v.u ^ ((v.u >> 31) ? 0xffffffffu : 0x80000000u);
}

static inline float key_float(uint32_t k) {
    union { uint32_t u; float f; } v = {k ^ ((k >> 31) ? 0x80000000u : 0xffffffffu)};
    return v.f;
}

/* s [R, G, T] float32 (a KV head's query heads' scores, -inf where a slot does not count): agg [R, T] the sum over
   the G heads of each head's softmax over T, and, where alpha is finite, within [R, G] the slots whose score is
   within alpha of their head's largest. Rows lo .. hi of R. A head whose every score is -inf adds nothing. */
/* One row of infinigen_group_softmax: s_row [G, T] into a [T] (e: room for T), within_row [G] where count. */
static inline void softmax_row(const float *s_row, float *a, float *e, int64_t *within_row, int64_t G, int64_t T,
                               float alpha, int count) {
    for (int64_t g = 0; g < G; g++) {
        const float *x = s_row + g * T;
        uint32_t most = 0; /* the largest, as its order key (an integer maximum vectorises) */
        for (int64_t t = 0; t < T; t++) {
            const uint32_t k = order_key(x[t]);
            most = k > most ? k : most;
        }
        const float top = key_float(most), edge = top - alpha;
        float sum = 0.0f;
        int64_t n = 0;
        if (top == -__builtin_inff()) {
            for (int64_t t = 0; t < T; t++) e[t] = 0.0f;
        } else {
            for (int64_t t = 0; t < T; t++) {
                e[t] = exp_neg(x[t] - top);
                sum += e[t];
                n += x[t] > edge;
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < T; t++) e[t] *= inv;
        }
        if (count) within_row[g] = n;
        if (g == 0)
            for (int64_t t = 0; t < T; t++) a[t] = e[t];
        else
            for (int64_t t = 0; t < T; t++) a[t] += e[t];
    }
}

int infinigen_group_softmax(const float *s, float *agg, int64_t *within, int64_t R, int64_t G, int64_t T,
                            float alpha, int64_t lo, int64_t hi) {
    if (G < 1 || T < 1 || lo < 0 || hi > R) return -1;
    float *e = malloc(sizeof(float) * (size_t)T);
    if (!e) return -3;
    const int count = alpha < __builtin_inff();
    for (int64_t r = lo; r < hi; r++)
        softmax_row(s + r * G * T, agg + r * T, e, count ? within + r * G : 0, G, T, alpha, count);
    free(e);
    return 0;
}

/* The k-th largest (1 <= k <= n) of keys[0 .. n): a radix select, digits of the key from the top, each a pass over
   the keys: three of 11, 11 and 10 bits, or for a few thousand keys (a sampled row's candidates) four of 8, whose
   histograms cost less to clear and scan than the pass over the keys; *above: how many keys are larger. */
static uint32_t kth_largest(const uint32_t *keys, int64_t n, int64_t k, int64_t *above) {
    static const int wide[3] = {11, 11, 10}, narrow[4] = {8, 8, 8, 8};
    const int few = n <= 4096, digits = few ? 4 : 3, *width = few ? narrow : wide;
    uint32_t prefix = 0, known = 0; /* the top bits decided so far, and their mask */
    int64_t larger = 0;
    int shift = 32;
    for (int d = 0; d < digits; d++) {
        int64_t hist[2048];
        const uint32_t bins = 1u << width[d];
        shift -= width[d];
        for (uint32_t b = 0; b < bins; b++) hist[b] = 0;
        for (int64_t i = 0; i < n; i++)
            if ((keys[i] & known) == prefix) hist[(keys[i] >> shift) & (bins - 1)]++;
        uint32_t b = bins - 1;
        for (;; b--) { /* from the largest bin down, until it holds the k-th */
            if (larger + hist[b] >= k) break;
            larger += hist[b];
        }
        prefix |= b << shift;
        known |= (bins - 1) << shift;
    }
    *above = larger;
    return prefix;
}

/* keys[0 .. n) with their slots at[], largest first, equal keys kept in their order (a stable radix sort of the
   keys' complement, three digits from the bottom; tk, ta: room for n of each). */
static void sort_down(uint32_t *keys, int32_t *at, int64_t n, uint32_t *tk, int32_t *ta) {
    static const int shift[3] = {0, 11, 22};
    for (int d = 0; d < 3; d++) {
        int64_t start[2048] = {0};
        for (int64_t i = 0; i < n; i++) start[((~keys[i]) >> shift[d]) & 2047]++;
        for (int64_t b = 0, sum = 0; b < 2048; b++) {
            const int64_t c = start[b];
            start[b] = sum, sum += c;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t to = start[((~keys[i]) >> shift[d]) & 2047]++;
            tk[to] = keys[i], ta[to] = at[i];
        }
        uint32_t *k = keys; keys = tk; tk = k;
        int32_t *a = at; at = ta; ta = a;
    }
    /* three passes: the sorted rows are in the buffers the caller passed as tk, ta */
}

/* x [R, T] float32: each row's k largest (0 < k <= T), their slots into idx [R, k] and values into val [R, k]; in
   slot order, or with `sorted` largest first (equal values: the lower slot first), and of equal values at the
   edge the lower slots. A sample of the row sets a bar that the k largest clear (checked: else every slot is a
   candidate), so the select passes over a few times k candidates rather than the row. Rows lo .. hi of R. */
/* One row of infinigen_topk: v [T] into out, got [k] (keys, at: room for T each; sk, sa for k, where sorted). */
static void topk_row(const float *v, int64_t *out, float *got, int64_t T, int64_t k, int sorted, uint32_t *keys,
                     int32_t *at, uint32_t *sk, int32_t *sa) {
    enum { SAMPLE = 256 };
    int64_t n = T;
    if (T >= 8 * SAMPLE && k * 4 < T) {
        uint32_t sample[SAMPLE];
        for (int64_t i = 0; i < SAMPLE; i++) sample[i] = order_key(v[i * (T / SAMPLE)]);
        /* the rank in the sample of the k-th largest, with a margin of about four standard deviations */
        const int64_t expect = (k * SAMPLE + T - 1) / T;
        int64_t rank = expect + 4 * (int64_t)__builtin_sqrt((double)expect) + 8, above;
        if (rank < SAMPLE) {
            const uint32_t bar = kth_largest(sample, SAMPLE, rank, &above);
            n = 0;
            int64_t i = 0;
#if defined(__AVX512F__)
            { /* sixteen slots a step: their keys above the bar packed to the front of a register and stored whole
                 (n + 16 <= i + 16 <= T: what lies past the count is overwritten or never read) */
                const __m512i top = _mm512_set1_epi32((int)0x80000000u), bar16 = _mm512_set1_epi32((int)bar),
                              step = _mm512_set1_epi32(16);
                __m512i slot = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                for (; i + 16 <= T; i += 16, slot = _mm512_add_epi32(slot, step)) {
                    const __m512i u = _mm512_loadu_si512(v + i);
                    const __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), top));
                    const __mmask16 hit = _mm512_cmpge_epu32_mask(key, bar16);
                    _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi32(hit, key));
                    _mm512_storeu_si512(at + n, _mm512_maskz_compress_epi32(hit, slot));
                    n += __builtin_popcount(hit);
                }
            }
#endif
            for (; i < T; i++) { /* branchless: every slot written, the count moves on a hit */
                const uint32_t key = order_key(v[i]);
                keys[n] = key, at[n] = (int32_t)i;
                n += key >= bar;
            }
            if (n < k) n = T; /* the bar was too high: every slot */
        }
    }
    if (n == T)
        for (int64_t i = 0; i < T; i++) keys[i] = order_key(v[i]), at[i] = (int32_t)i;
    int64_t above;
    const uint32_t edge = kth_largest(keys, n, k, &above);
    int64_t ties = k - above, m = 0;
    if (!sorted) {
        for (int64_t i = 0; i < n && m < k; i++)
            if (keys[i] > edge || (keys[i] == edge && ties-- > 0)) out[m] = at[i], got[m++] = key_float(keys[i]);
        return;
    }
    for (int64_t i = 0; i < n && m < k; i++) /* the chosen, in slot order, to the front of keys and at */
        if (keys[i] > edge || (keys[i] == edge && ties-- > 0)) keys[m] = keys[i], at[m++] = at[i];
    for (int64_t i = 0; i < k; i++) sk[i] = keys[i], sa[i] = at[i];
    sort_down(sk, sa, k, keys, at); /* three passes: the result in keys, at */
    for (int64_t i = 0; i < k; i++) out[i] = at[i], got[i] = key_float(keys[i]);
}

int infinigen_topk(const float *x, int64_t *idx, float *val, int64_t R, int64_t T, int64_t k, int sorted,
                   int64_t lo, int64_t hi) {
    if (k < 1 || k > T || T > 0x7fffffff || lo < 0 || hi > R) return -1;
    uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)T);
    int32_t *at = malloc(sizeof(int32_t) * (size_t)T);
    uint32_t *sk = sorted ? malloc(sizeof(uint32_t) * (size_t)k) : 0;
    int32_t *sa = sorted ? malloc(sizeof(int32_t) * (size_t)k) : 0;
    if (!keys || !at || (sorted && (!sk || !sa))) {
        free(keys), free(at), free(sk), free(sa);
        return -3;
    }
    for (int64_t r = lo; r < hi; r++) topk_row(x + r * T, idx + r * k, val + r * k, T, k, sorted, keys, at, sk, sa);
    free(keys), free(at), free(sk), free(sa);
    return 0;
}

/* The correction's choice (policies/speculation.py, correction_rows) for rows lo .. hi of R (a sequence's KV head
   each): s [R, G, T] the true query's scores, their group softmax summed over the G query heads (as
   infinigen_group_softmax with no margin), the columns taken [R, n] (speculation's: where taken_ok [R, n] is
   non-zero, or every one with taken_ok NULL) and those not held (held [R, T] zero; NULL: every one held) set to
   -inf, then the k largest (as infinigen_topk): the same values as those steps one after another, without the
   [R, T] tensors between them. Returns 0, -1 for shapes it does not take, -2 for a taken column outside 0 .. T,
   -3 when its buffers could not be allocated. */
/* One row r of infinigen_correct_pick (a, e, keys, at: room for T each; sk, sa for k, where sorted). */
static void pick_row(const float *s, const int64_t *taken, const uint8_t *taken_ok, int64_t n, const uint8_t *held,
                     int64_t *idx, float *val, int64_t r, int64_t G, int64_t T, int64_t k, int sorted, float *a,
                     float *e, uint32_t *keys, int32_t *at, uint32_t *sk, int32_t *sa) {
    softmax_row(s + r * G * T, a, e, 0, G, T, __builtin_inff(), 0);
    if (held)
        for (int64_t t = 0; t < T; t++) a[t] = held[r * T + t] ? a[t] : -__builtin_inff();
    for (int64_t i = 0; i < n; i++)
        if (!taken_ok || taken_ok[r * n + i]) a[taken[r * n + i]] = -__builtin_inff();
    topk_row(a, idx + r * k, val + r * k, T, k, sorted, keys, at, sk, sa);
}

/* The buffers pick_row takes, for T slots and k picks: one allocation; NULL when it fails. */
typedef struct {
    float *a, *e;
    uint32_t *keys, *sk;
    int32_t *at, *sa;
} PickRoom;

static void *pick_room(PickRoom *p, int64_t T, int64_t k) {
    const size_t t = (size_t)T, kk = (size_t)k;
    char *m = malloc(t * (2 * sizeof(float) + sizeof(uint32_t) + sizeof(int32_t)) + kk * (sizeof(uint32_t) + sizeof(int32_t)));
    if (!m) return 0;
    p->a = (float *)m, p->e = p->a + t, p->keys = (uint32_t *)(p->e + t), p->at = (int32_t *)(p->keys + t);
    p->sk = (uint32_t *)(p->at + t), p->sa = (int32_t *)(p->sk + kk);
    return m;
}

int infinigen_correct_pick(const float *s, const int64_t *taken, const uint8_t *taken_ok, int64_t n,
                           const uint8_t *held, int64_t *idx, float *val, int64_t R, int64_t G, int64_t T, int64_t k,
                           int sorted, int64_t lo, int64_t hi) {
    if (G < 1 || T < 1 || k < 1 || k > T || T > 0x7fffffff || n < 0 || lo < 0 || hi > R) return -1;
    for (int64_t i = lo * n; i < hi * n; i++)
        if (taken[i] < 0 || taken[i] >= T) return -2;
    PickRoom p;
    void *m = pick_room(&p, T, k);
    if (!m) return -3;
    for (int64_t r = lo; r < hi; r++)
        pick_row(s, taken, taken_ok, n, held, idx, val, r, G, T, k, sorted, p.a, p.e, p.keys, p.at, p.sk, p.sa);
    free(m);
    return 0;
}

/* ---- The rows a selection chose, copied out of the host pool (kv/store.py's gather on a CPU) ---- */

#include <string.h>

static inline __attribute__((always_inline)) void copy_pairs(
        const uint8_t *src_k, const uint8_t *src_v, const int64_t *rows, uint8_t *dst_k, uint8_t *dst_v, int64_t n,
        int64_t width, int64_t stride, const int64_t rb, int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; p++) {
        const int64_t *r = rows + p * n;
        uint8_t *dk = dst_k + p * stride * rb, *dv = dst_v + p * stride * rb;
        for (int64_t i = 0; i < n; i++) {
            if (i + 4 < n) { /* the row four ahead: its lines on their way while this one copies */
                __builtin_prefetch(src_k + r[i + 4] * rb);
                __builtin_prefetch(src_v + r[i + 4] * rb);
            }
            memcpy(dk + i * rb, src_k + r[i] * rb, (size_t)rb);
            memcpy(dv + i * rb, src_v + r[i] * rb, (size_t)rb);
        }
        memset(dk + n * rb, 0, (size_t)((width - n) * rb)); /* the rows left for the caller: zeros, never NaN bits */
        memset(dv + n * rb, 0, (size_t)((width - n) * rb));
    }
}

/* K and V rows rows[P, n] (< n_src) of src_k, src_v [n_src, rb bytes] into dst_k, dst_v [P, width, rb bytes], the
   pairs `stride` rows apart (>= width: a window of each pair's rows, e.g. the room a speculated gather left for
   the correction): row (p, i) to (p, i), rows n .. width of each p zeros. Pairs lo .. hi of P. Returns 0, -1 for
   shapes it does not take, -2 for a row outside 0 .. n_src (nothing read from it). */
int infinigen_gather_rows(const uint8_t *src_k, const uint8_t *src_v, const int64_t *rows, uint8_t *dst_k,
                          uint8_t *dst_v, int64_t P, int64_t n, int64_t width, int64_t stride, int64_t rb,
                          int64_t n_src, int64_t lo, int64_t hi) {
    if (n < 0 || width < n || stride < width || rb < 1 || lo < 0 || hi > P) return -1;
    for (int64_t i = lo * n; i < hi * n; i++)
        if (rows[i] < 0 || rows[i] >= n_src) return -2;
    if (rb == 256) copy_pairs(src_k, src_v, rows, dst_k, dst_v, n, width, stride, 256, lo, hi);
    else if (rb == 512) copy_pairs(src_k, src_v, rows, dst_k, dst_v, n, width, stride, 512, lo, hi);
    else if (rb == 128) copy_pairs(src_k, src_v, rows, dst_k, dst_v, n, width, stride, 128, lo, hi);
    else copy_pairs(src_k, src_v, rows, dst_k, dst_v, n, width, stride, rb, lo, hi);
    return 0;
}

/* The correction step on a CPU with per-channel keys (policies/infinigen.py, InfinigenSelector.correct), pairs lo ..
   hi of R = B x Hkv in one call, each while its scores are in cache: the true query q [B, Hkv, G, D] scored as
   infinigen_score_channel does (codes, meta [1, Hkv, ..]; each row's held slots `slots` [B, T], or start .. start +
   T) into s [R, G, T], -inf where held [R, T] is zero (NULL: every slot held); the pick as infinigen_correct_pick's
   (taken [R, n], taken_ok; k, sorted) into idx [R, k] (token slots, below T) and val [R, k]; ok [R, k] where a pick
   counts (a finite value, and i below its sequence's limit[b]), got [R] how many do; and their K and V rows (row:
   the token's flat slot x Hkv + the KV head, of src_k, src_v [n_src, rb bytes]) copied as infinigen_gather_rows
   does into dst_k, dst_v [R, width, rb] (pairs `stride` rows apart, width >= k): a row that does not count and rows
   k .. width zeros. The same scores, picks and rows as those calls one after another, without the Python between
   them. With dst_k NULL nothing is copied: rows [R, k] gets each pick's pool row (-1 where it does not count), for
   attention to read where the pool holds it (infinigen_attend_rows). `next` NULL: pairs lo .. hi in order; else a counter shared by the threads that call this at once, each
   taking pair lo + (*next)++ until hi (the pairs go to whichever thread is free). Returns 0, -1 for shapes it does
   not take (nothing written), -2 for a slot or row outside its buffer, -3 when its buffers could not be allocated. */
int infinigen_correct_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                              float *s, const int64_t *taken, const uint8_t *taken_ok, int64_t n, const uint8_t *held,
                              int64_t *idx, float *val, uint8_t *ok, int64_t *got, const int64_t *limit,
                              const uint8_t *src_k, const uint8_t *src_v, uint8_t *dst_k, uint8_t *dst_v,
                              int64_t width, int64_t stride, int64_t rb, int64_t n_src, int64_t B, int64_t Hkv,
                              int64_t G, int64_t D, int64_t run, int64_t T, int64_t S, int64_t start, int64_t k,
                              int sorted, int64_t *rows, int64_t integer, int64_t *next, int64_t lo, int64_t hi) {
    if (G < 1 || T < 1 || k < 1 || k > T || T > 0x7fffffff || n < 0 || (dst_k && (width < k || stride < width)) ||
        rb < 1 || lo < 0 || hi > B * Hkv || (!dst_k && !rows))
        return -1;
    for (int64_t i = lo * n; i < hi * n; i++)
        if (taken[i] < 0 || taken[i] >= T) return -2;
    PickRoom p;
    void *m = pick_room(&p, T, k);
    if (!m) return -3;
    int rc = 0;
    for (int64_t r = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : lo; r < hi && !rc;
         r = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : r + 1) {
        rc = infinigen_score_channel(q, codes, meta, slots, 0, s, B, 1, Hkv, G, D, run, T, S, start, integer, r, r + 1);
        if (rc) break;
        if (held) /* the slots a shorter row does not hold: out of its softmax, as a masked fill before the pick */
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = 0; t < T; t++)
                    if (!held[r * T + t]) s[(r * G + g) * T + t] = -__builtin_inff();
        pick_row(s, taken, taken_ok, n, held, idx, val, r, G, T, k, sorted, p.a, p.e, p.keys, p.at, p.sk, p.sa);
        const int64_t b = r / Hkv, h = r % Hkv, *ir = idx + r * k;
        uint8_t *dk = dst_k ? dst_k + r * stride * rb : 0, *dv = dst_k ? dst_v + r * stride * rb : 0, *okr = ok + r * k;
        int64_t count = 0, *rr = rows ? rows + r * k : 0;
        for (int64_t i = 0; i < k; i++) {
            okr[i] = val[r * k + i] > -__builtin_inff() && i < limit[b];
            if (rr) rr[i] = -1;
            if (!okr[i]) {
                if (dk) memset(dk + i * rb, 0, (size_t)rb), memset(dv + i * rb, 0, (size_t)rb);
                continue;
            }
            const int64_t row = (slots ? slots[b * T + ir[i]] : start + ir[i]) * Hkv + h;
            if (row < 0 || row >= n_src) {
                rc = -2;
                break;
            }
            if (rr) rr[i] = row;
            if (dk) memcpy(dk + i * rb, src_k + row * rb, (size_t)rb), memcpy(dv + i * rb, src_v + row * rb, (size_t)rb);
            count++;
        }
        got[r] = count;
        if (dk) memset(dk + k * rb, 0, (size_t)((width - k) * rb)), memset(dv + k * rb, 0, (size_t)((width - k) * rb));
    }
    free(m);
    return rc;
}

/* Speculation's choice in one call where the keys are per-channel ones (policies/speculation.py's select with every
   slot held in position order, no margin, the group softmax summed and no shortlist): for each pair, q [B, Hkv, G, D]
   scored as infinigen_score_channel against the row's first T slots (slots [B, T] flat, or NULL: start + t) into
   s [B, Hkv, G, T], their group softmax summed over the G query heads (as infinigen_group_softmax with no margin),
   the first `sinks` and the last `recent` slots forced above any score (FORCED less their rank, as select's), then
   the k largest in slot order (as infinigen_topk, unsorted) into idx [B, Hkv, k]: the same values as those steps one
   after another, a pair's scores still in the cache when its softmax reads them. `next` as
   infinigen_correct_channel's (NULL: pairs lo .. hi in order). Returns 0, -1 for shapes it does not take, -2 for a
   slot outside 0 .. S, -3 when its buffers could not be allocated. */
int infinigen_speculate_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                                float *s, int64_t *idx, int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t run,
                                int64_t T, int64_t S, int64_t start, int64_t sinks, int64_t recent, int64_t k,
                                int64_t integer, int64_t *next, int64_t lo, int64_t hi) {
    if (G < 1 || T < 1 || k < 1 || k > T || T > 0x7fffffff || sinks < 0 || recent < 0 || lo < 0 || hi > B * Hkv)
        return -1;
    PickRoom p;
    void *m = pick_room(&p, T, k);
    float *val = malloc(sizeof(float) * (size_t)k);
    if (!m || !val) {
        free(m), free(val);
        return -3;
    }
    const float forced = 8388608.0f; /* FORCED, 2^23: these integers are exact in float32 */
    const int64_t nr = recent < T ? recent : T, ns = sinks < T ? sinks : T;
    int rc = 0;
    for (int64_t r = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : lo; r < hi && !rc;
         r = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : r + 1) {
        rc = infinigen_score_channel(q, codes, meta, slots, 0, s, B, 1, Hkv, G, D, run, T, S, start, integer, r, r + 1);
        if (rc) break;
        softmax_row(s + r * G * T, p.a, p.e, 0, G, T, __builtin_inff(), 0);
        for (int64_t i = 0; i < nr; i++) p.a[T - nr + i] = forced - (float)(sinks + nr - 1 - i); /* the newest */
        for (int64_t i = 0; i < ns; i++) p.a[i] = forced - (float)i; /* the sinks, above them */
        topk_row(p.a, idx + r * k, val, T, k, 0, p.keys, p.at, p.sk, p.sa);
    }
    free(m), free(val);
    return rc;
}

/* ---- Attention over the chosen rows where the pool holds them (a CPU's decode step, policies/infinigen.py) ---- */

#define ROWS_AHEAD 8 /* a random row's lines on their way while eight others are read */

static inline void prefetch_row(const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

/* Each of G heads' n scores s [G, n] (row max top [G]) to exp(s - top), in place, and the inverse of their sum. */
static inline void softmax_heads(float *s, const float *top, float *inv, int64_t G, int64_t n) {
    for (int64_t g = 0; g < G; g++) {
        float sum = 0.0f, *x = s + g * n;
        for (int64_t i = 0; i < n; i++) {
            x[i] = exp_neg(x[i] - top[g]);
            sum += x[i];
        }
        inv[g] = 1.0f / sum;
    }
}

#if defined(__AVX512F__)
/* attend_pair at D = 64 with G <= 4: the heads' queries and sums in registers. */
static int attend_pair_64(const float *q, const float *K, const float *V, const int64_t *ra, int64_t na,
                          const int64_t *rb, int64_t nb, const float *kn, const float *vn, float *out, int64_t n_src,
                          int64_t G, float *s) {
    const int64_t n = na + nb + 1;
    __m512 qv[4][4], o[4][4];
    float top[4], inv[4];
    for (int64_t g = 0; g < G; g++) {
        top[g] = -__builtin_inff();
        for (int c = 0; c < 4; c++) qv[g][c] = _mm512_loadu_ps(q + g * 64 + 16 * c), o[g][c] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = i < na ? ra[i] : i < na + nb ? rb[i - na] : -2;
        if (r == -1) {
            for (int64_t g = 0; g < G; g++) s[g * n + i] = -__builtin_inff();
            continue;
        }
        if (r >= n_src || r < -2) return -2;
        if (i + ROWS_AHEAD < na && ra[i + ROWS_AHEAD] >= 0) prefetch_row(K + ra[i + ROWS_AHEAD] * 64, 64);
        const float *k = r == -2 ? kn : K + r * 64;
        const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                     k3 = _mm512_loadu_ps(k + 48);
        for (int64_t g = 0; g < G; g++) {
            __m512 a = _mm512_mul_ps(qv[g][0], k0);
            a = _mm512_fmadd_ps(qv[g][1], k1, a);
            a = _mm512_fmadd_ps(qv[g][2], k2, a);
            a = _mm512_fmadd_ps(qv[g][3], k3, a);
            const float dot = _mm512_reduce_add_ps(a);
            s[g * n + i] = dot;
            top[g] = dot > top[g] ? dot : top[g];
        }
    }
    softmax_heads(s, top, inv, G, n);
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = i < na ? ra[i] : i < na + nb ? rb[i - na] : -2;
        if (r == -1) continue;
        if (i + ROWS_AHEAD < na && ra[i + ROWS_AHEAD] >= 0) prefetch_row(V + ra[i + ROWS_AHEAD] * 64, 64);
        const float *v = r == -2 ? vn : V + r * 64;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int64_t g = 0; g < G; g++) {
            const __m512 w = _mm512_set1_ps(s[g * n + i]);
            o[g][0] = _mm512_fmadd_ps(w, v0, o[g][0]), o[g][1] = _mm512_fmadd_ps(w, v1, o[g][1]);
            o[g][2] = _mm512_fmadd_ps(w, v2, o[g][2]), o[g][3] = _mm512_fmadd_ps(w, v3, o[g][3]);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + g * 64 + 16 * c, _mm512_mul_ps(o[g][c], _mm512_set1_ps(inv[g])));
    return 0;
}
#endif

/* One (sequence, KV head) pair p: its G query heads q [G, D] (scaled) against the rows of K, V [n_src, D] float32
   listed in ra [na] and rb [nb] (-1: a row that does not count), then its new token's kn, vn [D], into out [G, D]: a
   softmax over the rows of each head's scores, and the sum of the V rows it weighs. Each row's K and V read once
   for the G heads. s: room for G x (na + nb + 1) floats. -2 for a row outside the pool. */
static inline __attribute__((always_inline)) int attend_pair(const float *q, const float *K, const float *V, const int64_t *ra, int64_t na,
                       const int64_t *rb, int64_t nb, const float *kn, const float *vn, float *out, int64_t n_src,
                       int64_t G, int64_t D, float *s) {
    const int64_t n = na + nb + 1;
    float top[16];
    for (int64_t g = 0; g < G; g++) top[g] = -__builtin_inff();
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = i < na ? ra[i] : i < na + nb ? rb[i - na] : -2;
        const float *k = r == -2 ? kn : K + r * D;
        if (r == -1) {
            for (int64_t g = 0; g < G; g++) s[g * n + i] = -__builtin_inff();
            continue;
        }
        if (r >= n_src || r < -2) return -2;
        if (i + ROWS_AHEAD < na && ra[i + ROWS_AHEAD] >= 0) prefetch_row(K + ra[i + ROWS_AHEAD] * D, D);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
            s[g * n + i] = dot;
            top[g] = dot > top[g] ? dot : top[g];
        }
    }
    float inv[16];
    softmax_heads(s, top, inv, G, n);
    for (int64_t g = 0; g < G * D; g++) out[g] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = i < na ? ra[i] : i < na + nb ? rb[i - na] : -2;
        if (r == -1) continue;
        const float *v = r == -2 ? vn : V + r * D;
        if (i + ROWS_AHEAD < na && ra[i + ROWS_AHEAD] >= 0) prefetch_row(V + ra[i + ROWS_AHEAD] * D, D);
        for (int64_t g = 0; g < G; g++) {
            const float w = s[g * n + i];
            float *o = out + g * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) out[g * D + d] *= inv[g];
    return 0;
}

/* A decode step's attention for pairs lo .. hi of P = B x Hkv: q [P, G, D] (scaled), the rows ra [P, na] and rb
   [P, nb] (rb NULL: none) of K, V [n_src, D] float32 (-1: a row that does not count), the new tokens' kn, vn [P, D],
   into out [P, G, D]; `next` as infinigen_correct_channel's (NULL: pairs lo .. hi in order; else a counter the
   threads calling at once share). Returns 0, -1 for shapes it does not take, -2 for a row outside the pool, -3 when
   its buffer could not be allocated. */
int infinigen_attend_rows(const float *q, const float *K, const float *V, const int64_t *ra, int64_t na,
                          const int64_t *rb, int64_t nb, const float *kn, const float *vn, float *out, int64_t n_src,
                          int64_t P, int64_t G, int64_t D, int64_t *next, int64_t lo, int64_t hi) {
    if (G < 1 || G > 16 || D < 1 || na < 0 || nb < 0 || (nb && !rb) || lo < 0 || hi > P) return -1;
    float *s = malloc(sizeof(float) * (size_t)(G * (na + nb + 1)));
    if (!s) return -3;
    int rc = 0;
    for (int64_t p = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : lo; p < hi && !rc;
         p = next ? lo + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : p + 1)
#if defined(__AVX512F__)
        if (D == 64 && G <= 4)
            rc = attend_pair_64(q + p * G * 64, K, V, ra + p * na, na, rb ? rb + p * nb : 0, nb, kn + p * 64,
                                vn + p * 64, out + p * G * 64, n_src, G, s);
        else
#endif
        rc = D == 64 ? attend_pair(q + p * G * 64, K, V, ra + p * na, na, rb ? rb + p * nb : 0, nb, kn + p * 64,
                                   vn + p * 64, out + p * G * 64, n_src, G, 64, s)
                     : attend_pair(q + p * G * D, K, V, ra + p * na, na, rb ? rb + p * nb : 0, nb, kn + p * D,
                                   vn + p * D, out + p * G * D, n_src, G, D, s);
    free(s);
    return rc;
}

/* A decode step's linear layer: out [M, N] = x [M, K] . w [N, K]^T (x float32; w nn.Linear's weight as it is, in
   float32, or in float16 or bfloat16 as the bundle stores it, each weight widened to float32 exactly in registers),
   rows lo .. hi of w, M at most 8. Each row of w is read once, in order, and meets every row of x: eight
   accumulators of 16 lanes, the rows of x past M reading the same 16 zeros, then each summed across its lanes.
   torch's matmul at these shapes reads the weights well below the memory's speed; this loop waits on the memory,
   at batch 8 too, so a float16 weight (half the bytes of the same value in float32) takes less time, with the same
   sums bit for bit, since the widening is exact and the order of the multiply-adds is the same. An output's sum does not depend on M, the
   rows' share or the weights' width: a request's logits are the same in any batch. Returns 0, -1 for shapes or
   widths it does not take (or a machine without AVX-512: torch's then runs). `next` NULL: rows lo .. hi; else a
   counter shared by the threads that call this at once, each taking the next LINEAR_BLOCK rows from lo on until hi
   (the rows go to whichever thread is free: one waits for the other's last block at most). `wide`: 0 float32,
   1 float16, 2 bfloat16. */
#define LINEAR_BLOCK 32
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 weights from w at k as float32 (the first `m` lanes; the rest 0): the same value whatever the width */
static inline __attribute__((always_inline)) __m512 weights16(const void *w, int64_t k, int wide, __mmask16 m) {
    if (wide == 0) return _mm512_maskz_loadu_ps(m, (const float *)w + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    if (wide == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void linear_rows(const float *x, const void *w, float *out, int64_t M,
                                                             int64_t N, int64_t K, int64_t lo, int64_t hi,
                                                             int wide, int ahead) {
    const int64_t size = wide ? 2 : 4, row = K * size;
    static const float zero[16] __attribute__((aligned(64)));
    const int64_t full = K / 16 * 16;
    const __mmask16 all = (__mmask16)0xFFFF, tail = (__mmask16)((1u << (K - full)) - 1);
    const float *xr[8];
    int64_t step[8]; /* a row past M reads the same 16 zeros at every k */
    for (int j = 0; j < 8; j++) xr[j] = j < M ? x + j * K : zero, step[j] = j < M ? 16 : 0;
    for (int64_t n = lo; n < hi; n++) {
        const char *wr = (const char *)w + n * row;
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
        const float *xk[8];
        for (int j = 0; j < 8; j++) xk[j] = xr[j];
        for (int64_t k = 0; k < full; k += 16) {
            const __m512 wv = weights16(wr, k, wide, all);
            if (ahead && (k * size) % 64 == 0) __builtin_prefetch(wr + row + k * size); /* the next row's line */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(xk[j]), wv, acc[j]), xk[j] += step[j];
        }
        if (tail) {
            const __m512 wv = weights16(wr, full, wide, tail);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, xk[j]), wv, acc[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) /* (every index a constant: the accumulators stay in registers) */
            if (j < M) out[j * N + n] = _mm512_reduce_add_ps(acc[j]);
    }
}

/* one copy of the loop per width and prefetch, each compiled on its own (a test of `ahead` inside the loop slows
   batch 1 badly). Above four rows of x the loop spends long enough on a row of w that the hardware's prefetch falls
   behind, so it asks for the next row's lines a row early (`ahead`); with fewer rows that costs more than it saves */
#define LINEAR_WIDTH(name, wide)                                                                                      \
    static __attribute__((noinline)) void name(const float *x, const void *w, float *out, int64_t M, int64_t N,       \
                                               int64_t K, int64_t lo, int64_t hi) {                                   \
        if (M > 4) linear_rows(x, w, out, M, N, K, lo, hi, wide, 1);                                                  \
        else linear_rows(x, w, out, M, N, K, lo, hi, wide, 0);                                                        \
    }
LINEAR_WIDTH(linear_f32, 0)
LINEAR_WIDTH(linear_f16, 1)
LINEAR_WIDTH(linear_bf16, 2)
#endif

int infinigen_linear(const float *x, const void *w, float *out, int64_t M, int64_t N, int64_t K, int64_t *next,
                     int64_t lo, int64_t hi, int64_t wide) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (M < 1 || M > 8 || K < 1 || lo < 0 || hi > N || wide < 0 || wide > 2) return -1;
    if (next) {
        for (int64_t a = lo + __atomic_fetch_add(next, LINEAR_BLOCK, __ATOMIC_RELAXED); a < hi;
             a = lo + __atomic_fetch_add(next, LINEAR_BLOCK, __ATOMIC_RELAXED))
            infinigen_linear(x, w, out, M, N, K, 0, a, a + LINEAR_BLOCK < hi ? a + LINEAR_BLOCK : hi, wide);
        return 0;
    }
    (wide == 0 ? linear_f32 : wide == 1 ? linear_f16 : linear_bf16)(x, w, out, M, N, K, lo, hi);
    return 0;
#else
    (void)x, (void)w, (void)out, (void)M, (void)N, (void)K, (void)next, (void)lo, (void)hi, (void)wide;
    return -1;
#endif
}

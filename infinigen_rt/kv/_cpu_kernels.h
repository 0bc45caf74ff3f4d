/* The CPU kernels' signatures: kv/_cpu_kernels.c defines them (the compiler checks each definition against its line
   here), kv/_cpu_ops.cpp calls them. The C source is compiled once per instruction set (kv/cpu_build.py VARIANTS)
   with INFINIGEN_ISA naming it, and the names below become infinigen_<isa>_<name>: one library holds every
   variant. No include guard: the C++ file includes it once per variant, each time under another INFINIGEN_ISA.

   Each kernel returns 0, -1 for shapes or arguments it does not take (nothing written), -2 for a slot or row
   outside its buffer, -3 when its buffers could not be allocated. Shapes are in each definition's comment. */

#include <stdint.h>

#ifndef INFINIGEN_ISA
#error "INFINIGEN_ISA names the variant being compiled (plain, avx2 or avx512)"
#endif
#define INFINIGEN_PASTE_(isa, name) infinigen_##isa##_##name
#define INFINIGEN_PASTE(isa, name) INFINIGEN_PASTE_(isa, name)
#define INFINIGEN_KERNEL(name) INFINIGEN_PASTE(INFINIGEN_ISA, name)

/* every kernel, for a table of one variant's (kv/_cpu_ops.cpp) */
#define INFINIGEN_KERNELS(X)                                                                                        \
    X(score_codes) X(score_channel) X(quantize_rows) X(quantize_channel) X(group_softmax) X(topk) X(correct_pick)  \
    X(gather_rows) X(correct_channel) X(speculate_channel) X(attend_rows) X(linear) X(integer_scores)

#define infinigen_score_codes INFINIGEN_KERNEL(score_codes)
#define infinigen_score_channel INFINIGEN_KERNEL(score_channel)
#define infinigen_quantize_rows INFINIGEN_KERNEL(quantize_rows)
#define infinigen_quantize_channel INFINIGEN_KERNEL(quantize_channel)
#define infinigen_group_softmax INFINIGEN_KERNEL(group_softmax)
#define infinigen_topk INFINIGEN_KERNEL(topk)
#define infinigen_correct_pick INFINIGEN_KERNEL(correct_pick)
#define infinigen_gather_rows INFINIGEN_KERNEL(gather_rows)
#define infinigen_correct_channel INFINIGEN_KERNEL(correct_channel)
#define infinigen_speculate_channel INFINIGEN_KERNEL(speculate_channel)
#define infinigen_attend_rows INFINIGEN_KERNEL(attend_rows)
#define infinigen_linear INFINIGEN_KERNEL(linear)
#define infinigen_integer_scores INFINIGEN_KERNEL(integer_scores)

int infinigen_score_codes(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                          int64_t pairs, float *out, int64_t B, int64_t R, int64_t Hkv, int64_t G, int64_t D,
                          int64_t group, int64_t bits, int64_t T, int64_t S, int64_t start, int64_t lo, int64_t hi);
int infinigen_score_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                            int64_t pairs, float *out, int64_t B, int64_t R, int64_t Hkv, int64_t G, int64_t D,
                            int64_t run, int64_t T, int64_t S, int64_t start, int64_t integer, int64_t lo, int64_t hi);
int infinigen_quantize_rows(const float *x, const int64_t *rows, uint8_t *codes, uint16_t *meta, int64_t N,
                            int64_t D, int64_t group, int64_t bits, int64_t n_rows);
int infinigen_quantize_channel(const float *x, const int64_t *slots, const uint8_t *appends, int64_t mode,
                               uint8_t *codes, uint16_t *meta, uint8_t *held, int64_t P, int64_t n_new, int64_t S,
                               int64_t D, int64_t run, float tiny);
int infinigen_group_softmax(const float *s, float *agg, int64_t *within, int64_t R, int64_t G, int64_t T,
                            float alpha, int64_t lo, int64_t hi);
int infinigen_topk(const float *x, int64_t *idx, float *val, int64_t R, int64_t T, int64_t k, int sorted,
                   int64_t lo, int64_t hi);
int infinigen_correct_pick(const float *s, const int64_t *taken, const uint8_t *taken_ok, int64_t n,
                           const uint8_t *held, int64_t *idx, float *val, int64_t R, int64_t G, int64_t T, int64_t k,
                           int sorted, int64_t lo, int64_t hi);
int infinigen_gather_rows(const uint8_t *src_k, const uint8_t *src_v, const int64_t *rows, uint8_t *dst_k,
                          uint8_t *dst_v, int64_t P, int64_t n, int64_t width, int64_t stride, int64_t rb,
                          int64_t n_src, int64_t lo, int64_t hi);
int infinigen_correct_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                              float *s, const int64_t *taken, const uint8_t *taken_ok, int64_t n, const uint8_t *held,
                              int64_t *idx, float *val, uint8_t *ok, int64_t *got, const int64_t *limit,
                              const uint8_t *src_k, const uint8_t *src_v, uint8_t *dst_k, uint8_t *dst_v,
                              int64_t width, int64_t stride, int64_t rb, int64_t n_src, int64_t B, int64_t Hkv,
                              int64_t G, int64_t D, int64_t run, int64_t T, int64_t S, int64_t start, int64_t k,
                              int sorted, int64_t *rows, int64_t integer, int64_t *next, int64_t lo, int64_t hi);
int infinigen_speculate_channel(const float *q, const uint8_t *codes, const uint16_t *meta, const int64_t *slots,
                                float *s, int64_t *idx, int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t run,
                                int64_t T, int64_t S, int64_t start, int64_t sinks, int64_t recent, int64_t k,
                                int64_t integer, int64_t *next, int64_t lo, int64_t hi);
int infinigen_attend_rows(const float *q, const float *K, const float *V, const int64_t *ra, int64_t na,
                          const int64_t *rb, int64_t nb, const float *kn, const float *vn, float *out, int64_t n_src,
                          int64_t P, int64_t G, int64_t D, int64_t *next, int64_t lo, int64_t hi);
int infinigen_linear(const float *x, const void *w, float *out, int64_t M, int64_t N, int64_t K, int64_t *next,
                     int64_t lo, int64_t hi, int64_t wide);
int infinigen_integer_scores(void);

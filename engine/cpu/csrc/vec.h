/* Machine vectors of floats and the lane-wise math the kernels share (GCC vector extensions,
 * no intrinsics: the same source builds for AVX-512, AVX2 and anything -march=native allows). */
#ifndef KVR_VEC_H
#define KVR_VEC_H
#include <stdint.h>

/* One machine vector of floats: 16 with AVX-512, else 8 (AVX2's 16 ymm registers; a 16-float
 * type there is a register pair, and the attention kernels' accumulator tiles would spill). Tiles
 * are sized in machine vectors so they fit the register file either way. aligned(4) lets a
 * vector load from and store to any float address. */
#if defined(__AVX512F__)
#define VL 16
#define ACC 16 /* accumulator vectors a register tile may hold (of 32 registers) */
#else
#define VL 8
#define ACC 12 /* (of 16 registers) */
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2))); /* VL bf16 values */

static inline vf splat(float x) { return (vf){} + x; }

/* bf16 (abi.h's KVR_DTYPE_BF16) is the top half of an fp32: widened exactly by a shift (each
 * lane zero-extended to 32 bits and shifted up: vpmovzxwd + vpslld), and rounded to it as torch's
 * .to(torch.bfloat16) rounds, to nearest even, every NaN to 0xffff (its vector conversion's; so
 * a torch path and a native one store the same bits). */
static inline vf load_bf16(const uint16_t *p) {
    return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* VL floats rounded to bf16 (as f32_to_bf16, lane-wise) into p. */
static inline void store_bf16(uint16_t *p, vf x) {
    const vu u = (vu)x;
    const vi nan = (u & 0x7fffffffu) > 0x7f800000u;
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    *(vh *)p = __builtin_convertvector((vu)(((vi)r & ~nan) | (nan & 0xffff)), vh);
}

/* VL values of a KV cache row from element i of p: fp32, or bf16 with bf (a compile-time
 * constant wherever the kernels call it: each is compiled for both). */
static inline __attribute__((always_inline)) vf load_kv(const void *p, int64_t i, const int bf) {
    return bf ? load_bf16((const uint16_t *)p + i) : *(const vf *)((const float *)p + i);
}

static inline __attribute__((always_inline)) float kv_at(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline vf vmax(vf a, vf b) {
    vi gt = a > b; /* lanes of all ones where a > b */
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* e^x for x <= 0, lane-wise (Cephes' expf polynomial after x = n ln2 + r; relative error
 * ~1e-7). Lanes below -87 give ~1e-38, not 0: negligible against the row's max lane (1). */
static inline vf vexp_neg(vf x) {
    x = vmax(x, splat(-87.f));
    const vf t = x * splat(1.44269504088896341f) - splat(0.5f);
    const vi n = __builtin_convertvector(t, vi); /* truncates: rounds x log2e for x <= 0 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500E-4f);
    p = p * r + splat(1.3981999507E-3f);
    p = p * r + splat(8.3334519073E-3f);
    p = p * r + splat(4.1665795894E-2f);
    p = p * r + splat(1.6666665459E-1f);
    p = p * r + splat(5.0000001201E-1f);
    p = p * r * r + r + splat(1.f);
    return p * (vf)((n + 127) << 23);
}

/* The sum and the max of a vector's lanes, as a tree of lane swaps (log2 VL dependent steps,
 * not VL: a running scalar chain costs a latency per lane). */
#if VL == 16
#define KVR_SWAP8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define KVR_SWAP4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define KVR_SWAP2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define KVR_SWAP1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define KVR_SWAP4 4, 5, 6, 7, 0, 1, 2, 3
#define KVR_SWAP2 2, 3, 0, 1, 6, 7, 4, 5
#define KVR_SWAP1 1, 0, 3, 2, 5, 4, 7, 6
#endif

static inline float hsum_lanes(vf v) {
#if VL == 16
    v += __builtin_shufflevector(v, v, KVR_SWAP8);
#endif
    v += __builtin_shufflevector(v, v, KVR_SWAP4);
    v += __builtin_shufflevector(v, v, KVR_SWAP2);
    v += __builtin_shufflevector(v, v, KVR_SWAP1);
    return v[0];
}

static inline float hmax_lanes(vf v) {
#if VL == 16
    v = vmax(v, __builtin_shufflevector(v, v, KVR_SWAP8));
#endif
    v = vmax(v, __builtin_shufflevector(v, v, KVR_SWAP4));
    v = vmax(v, __builtin_shufflevector(v, v, KVR_SWAP2));
    v = vmax(v, __builtin_shufflevector(v, v, KVR_SWAP1));
    return v[0];
}

/* o[i0, i0 + W VL) += sum_t p[t] * rows[t][same]: W accumulator vectors held across the rows
 * (KV rows: fp32, or bf16 with bf). */
static inline __attribute__((always_inline)) void axpy_slice(
    float *restrict o, const float *restrict p, const void *const *restrict rows, int64_t n,
    int64_t i0, const int W, const int bf) {
    vf acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) acc[j] = *(const vf *)(o + i0 + j * VL);
    for (int64_t t = 0; t < n; t++) {
        const vf b = splat(p[t]);
#pragma GCC unroll 8
        for (int j = 0; j < W; j++) acc[j] += b * load_kv(rows[t], i0 + j * VL, bf);
    }
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) *(vf *)(o + i0 + j * VL) = acc[j];
}

/* o[D] += sum_t p[t] * rows[t][D]: D in slices of up to 8 vectors held in registers across
 * the rows (independent FMA chains, not one chain per vector through every row). */
static inline __attribute__((always_inline)) void axpy_rows(
    float *restrict o, const float *restrict p, const void *const *restrict rows, int64_t n,
    int64_t d, const int bf) {
    if (d % VL == 0) {
        int64_t i = 0;
        for (; i + 8 * VL <= d; i += 8 * VL) axpy_slice(o, p, rows, n, i, 8, bf);
        for (; i + 4 * VL <= d; i += 4 * VL) axpy_slice(o, p, rows, n, i, 4, bf);
        for (; i < d; i += VL) axpy_slice(o, p, rows, n, i, 1, bf);
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) o[i] += p[t] * kv_at(rows[t], i, bf);
}

#endif

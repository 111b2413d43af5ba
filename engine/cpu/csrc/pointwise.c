/* The per-token ops between the linears, fused: at decode-sized steps each of them is a few
 * microseconds of arithmetic behind several torch dispatches (RMSNorm alone is ~6 ops), which
 * on the ~150M model added up to ~15% of a batch-8 decode step. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "kernels.h"
#include "vec.h"

/* Rows per thread below which a call stays on one thread (an OpenMP fork costs more). */
#define SERIAL_ELEMS 65536

/* x += d (if d), then y = x / rms(x) * w, over one row of `dim`: the residual add and the next
 * RMSNorm of a decoder layer in one pass. */
void kvr__add_rmsnorm_row(float *x, const float *d, const float *w, float *y, int64_t dim,
                          float eps) {
    float ss = 0.f;
    if (d) {
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < dim; i++) { x[i] += d[i]; ss += x[i] * x[i]; }
    } else {
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    }
    const float s = 1.f / sqrtf(ss / (float)dim + eps);
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++) y[i] = x[i] * s * w[i];
}

int kvr_add_rmsnorm_f32(float *h, const float *delta, const float *w, float *out, int64_t rows,
                        int64_t dim, float eps, int nthreads) {
    const int nt = rows * dim < SERIAL_ELEMS ? 1 : nthreads;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        kvr__add_rmsnorm_row(h + r * dim, delta ? delta + r * dim : NULL, w, out + r * dim, dim,
                             eps);
    return 0;
}

/* Rotate-half RoPE out of place of one row's `heads` heads (contiguous, hd each), cos/sin of the
 * row's position [hd/2]. kvr_rope_f32: rows `ld` floats apart in x (a view into the fused qkv
 * output), cos/sin [rows, hd/2], out [rows, heads, hd] contiguous. */
void kvr__rope_row(const float *a, float *o, int64_t heads, int64_t hd, const float *c,
                   const float *s) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++, a += hd, o += hd) {
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = a[i + half];
            o[i] = x1 * c[i] - x2 * s[i];
            o[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

int kvr_rope_f32(const float *x, int64_t ld, float *out, int64_t rows, int64_t heads,
                 int64_t hd, const float *cos, const float *sin, int nthreads) {
    const int64_t half = hd / 2;
    const int nt = rows * heads * hd < SERIAL_ELEMS ? 1 : nthreads;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        kvr__rope_row(x + r * ld, out + r * heads * hd, heads, hd, cos + r * half, sin + r * half);
    return 0;
}

/* SwiGLU's gate: out[r] = silu(gu[r, :inter]) * gu[r, inter:2 inter], rows `ld` floats apart (the
 * fused gate/up projection's output). silu(x) = x sigmoid(x), with sigmoid from e = e^-|x| (at
 * most 1, so it cannot overflow): 1 / (1 + e) for x >= 0, e / (1 + e) below. torch's silu and
 * mul_ were ~1.2 ms of a batch-32 decode step of the ~150M model (84 us a call for 98k
 * elements); this is one pass. */
void kvr__silu_mul_row(const float *g, const float *u, float *o, int64_t inter) {
    int64_t i = 0;
    for (; i + VL <= inter; i += VL) {
        const vf x = *(const vf *)(g + i);
        const vi neg = x < splat(0.f);
        const vf ax = (vf)((vi)x & ~neg) + (vf)((vi)(-x) & neg);  /* |x| */
        const vf e = vexp_neg(-ax);
        const vf num = (vf)(((vi)splat(1.f) & ~neg) | ((vi)e & neg));
        *(vf *)(o + i) = x * num / (splat(1.f) + e) * *(const vf *)(u + i);
    }
    for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

int kvr_silu_mul_f32(const float *gu, int64_t ld, float *out, int64_t rows, int64_t inter,
                     int nthreads) {
    const int nt = rows * inter < SERIAL_ELEMS ? 1 : nthreads;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        kvr__silu_mul_row(gu + r * ld, gu + r * ld + inter, out + r * inter, inter);
    return 0;
}

/* n floats into a KV cache row: copied (fp32), or rounded to bf16 as torch rounds them
 * (kv_dtype KVR_DTYPE_BF16; see vec.h), so the per-op path's torch store and the fused layers'
 * native one leave the same bits. */
void kvr__store_kv_row(void *dst, const float *src, int64_t n, int kv_dtype) {
    if (kv_dtype != KVR_DTYPE_BF16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + VL <= n; i += VL) store_bf16(d + i, *(const vf *)(src + i));
    for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* The step's K and V rows into the flat paged caches: row i of k (v), `ldk` (`ldv`) floats after
 * row i - 1, goes to slot slots[i] of k_cache (v_cache), `row` elements of kv_dtype each. Two
 * index_copy_ calls did this before, at ~22 us each for a few rows (24 a step on the ~150M
 * model). */
static int write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv,
                    const int64_t *slots, int64_t n, void *k_cache, void *v_cache, int64_t row,
                    int kv_dtype, int nthreads) {
    const int64_t row_bytes = row * (kv_dtype == KVR_DTYPE_BF16 ? 2 : 4);
    const int nt = n * row < SERIAL_ELEMS ? 1 : nthreads;
    int bad = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:bad)
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        if (s < 0) { bad = 1; continue; }
        kvr__store_kv_row((char *)k_cache + s * row_bytes, k + i * ldk, row, kv_dtype);
        kvr__store_kv_row((char *)v_cache + s * row_bytes, v + i * ldv, row, kv_dtype);
    }
    return bad ? -1 : 0;
}

int kvr_write_kv_f32(const float *k, int64_t ldk, const float *v, int64_t ldv,
                     const int64_t *slots, int64_t n, float *k_cache, float *v_cache, int64_t row,
                     int nthreads) {
    return write_kv(k, ldk, v, ldv, slots, n, k_cache, v_cache, row, KVR_DTYPE_F32, nthreads);
}

/* kvr_write_kv_f32 into bf16 caches (the values rounded to nearest even, as .to(torch.bfloat16)
 * rounds them). */
int kvr_write_kv_bf16(const float *k, int64_t ldk, const float *v, int64_t ldv,
                      const int64_t *slots, int64_t n, uint16_t *k_cache, uint16_t *v_cache,
                      int64_t row, int nthreads) {
    return write_kv(k, ldk, v, ldv, slots, n, k_cache, v_cache, row, KVR_DTYPE_BF16, nthreads);
}

/* out[r] = the index of row r's first largest value, as torch's argmax (a NaN counts as the
 * largest: the first NaN wins), in one vector pass: each lane keeps its first largest value and
 * where it was, then the lanes and the tail are merged. torch's own took ~110 us for 8 rows of
 * a 32 000-token vocabulary and ~440 for 32 (its amax ~9 and ~28): ~1% of a batch-8 decode step
 * of the ~150M model. */
int kvr_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int nthreads) {
    if (rows < 0 || n <= 0 || n > INT32_MAX) return -1;
    const int nt = rows * n < SERIAL_ELEMS ? 1 : nthreads;
    vi lane;
    for (int l = 0; l < VL; l++) lane[l] = l;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        vf m = splat(-INFINITY);
        vi at = {}, nan = {};
        int64_t i = 0;
        for (; i + VL <= n; i += VL) {
            const vf a = *(const vf *)(v + i);
            const vi gt = a > m; /* false for a NaN lane: it keeps m */
            nan |= a != a;
            m = (vf)(((vi)a & gt) | ((vi)m & ~gt));
            at = ((lane + (int32_t)i) & gt) | (at & ~gt);
        }
        float best = -INFINITY;
        int64_t k = 0;
        int any_nan = 0;
        for (int l = 0; l < VL; l++) {
            any_nan |= nan[l] != 0;
            if (m[l] > best || (m[l] == best && at[l] < k)) best = m[l], k = at[l];
        }
        for (; i < n; i++) {
            if (v[i] != v[i]) any_nan = 1;
            else if (v[i] > best) best = v[i], k = i;
        }
        if (any_nan)
            for (k = 0; v[k] == v[k]; k++) continue;
        out[r] = k;
    }
    return 0;
}

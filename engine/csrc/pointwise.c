/* The per-token ops between the linears, fused: at decode-sized steps each of them is a few
 * microseconds of arithmetic behind several torch dispatches (RMSNorm alone is ~6 ops), which
 * on the ~150M model added up to ~15% of a batch-8 decode step. */
#include <math.h>
#include <stdint.h>

/* Rows per thread below which a call stays on one thread (an OpenMP fork costs more). */
#define SERIAL_ELEMS 65536

/* h[r] += delta[r] (if delta), then out[r] = h[r] / rms(h[r]) * w: the residual add and the
 * next RMSNorm of a decoder layer in one pass over the row. */
int kvr_add_rmsnorm_f32(float *h, const float *delta, const float *w, float *out, int64_t rows,
                        int64_t dim, float eps, int nthreads) {
    const int nt = rows * dim < SERIAL_ELEMS ? 1 : nthreads;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * dim;
        float *y = out + r * dim;
        float ss = 0.f;
        if (delta) {
            const float *d = delta + r * dim;
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
    return 0;
}

/* Rotate-half RoPE out of place: x [rows, heads, hd] with rows `ld` floats apart (a view into
 * the fused qkv output), cos/sin [rows, hd/2]; out [rows, heads, hd] contiguous. */
int kvr_rope_f32(const float *x, int64_t ld, float *out, int64_t rows, int64_t heads,
                 int64_t hd, const float *cos, const float *sin, int nthreads) {
    const int64_t half = hd / 2;
    const int nt = rows * heads * hd < SERIAL_ELEMS ? 1 : nthreads;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *a = x + r * ld + h * hd;
            float *o = out + (r * heads + h) * hd;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = a[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

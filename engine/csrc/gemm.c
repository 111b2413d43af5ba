/* fp32 GEMM y[M,N] = x[M,K] W^T (+ bias) over weights packed in panels. */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define VW 16
#define MR 8
typedef __m512 vreg;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VBCAST _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VZERO _mm512_setzero_ps
#define VADD _mm512_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define MR 6
typedef __m256 vreg;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VBCAST _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VZERO _mm256_setzero_ps
#define VADD _mm256_add_ps
#endif

#ifdef VW
#define NR (2 * VW)
#define KB 256
/* Software prefetch of the weight stream this many k-rows (of NR floats) ahead: 16 KiB on AVX2,
 * past the current K block and into the next panel. The hardware prefetchers alone leave
 * decode-sized calls (4-16 rows) short of the stream bandwidth: +8-20% measured there on a
 * Zen 3, level at 1 and 32-64 rows. Not measured on AVX-512 (two lines per k-row): off there. */
#if VW == 8
#define PF_ROWS 256
#endif

/* acc (mr rows x NR) = (first ? 0 : acc) + x[0:mr, 0:kn] @ w[0:kn, 0:NR]; x rows ldx apart */
static inline __attribute__((always_inline)) void micro(const int mr, const float *x, int64_t ldx,
    const float *w, int64_t kn, float *acc, int64_t ldacc, int first) {
    vreg a0[MR], a1[MR];
    #pragma GCC unroll 8
    for (int m = 0; m < MR; m++)
        if (m < mr) {
            a0[m] = first ? VZERO() : VLOAD(acc + m * ldacc);
            a1[m] = first ? VZERO() : VLOAD(acc + m * ldacc + VW);
        }
    for (int64_t k = 0; k < kn; k++) {
#ifdef PF_ROWS
        _mm_prefetch((const char *)(w + (k + PF_ROWS) * NR), _MM_HINT_T0);
#endif
        const vreg w0 = VLOAD(w + k * NR), w1 = VLOAD(w + k * NR + VW);
        #pragma GCC unroll 8
        for (int m = 0; m < MR; m++)
            if (m < mr) {
                const vreg xv = VBCAST(x[m * ldx + k]);
                a0[m] = VFMA(xv, w0, a0[m]);
                a1[m] = VFMA(xv, w1, a1[m]);
            }
    }
    #pragma GCC unroll 8
    for (int m = 0; m < MR; m++)
        if (m < mr) { VSTORE(acc + m * ldacc, a0[m]); VSTORE(acc + m * ldacc + VW, a1[m]); }
}

static inline void micro_any(int mr, const float *x, int64_t ldx, const float *w, int64_t kn,
                             float *acc, int64_t ldacc, int first) {
    switch (mr) {
#if MR > 6
    case 8: micro(8, x, ldx, w, kn, acc, ldacc, first); break;
    case 7: micro(7, x, ldx, w, kn, acc, ldacc, first); break;
#endif
    case 6: micro(6, x, ldx, w, kn, acc, ldacc, first); break;
    case 5: micro(5, x, ldx, w, kn, acc, ldacc, first); break;
    case 4: micro(4, x, ldx, w, kn, acc, ldacc, first); break;
    case 3: micro(3, x, ldx, w, kn, acc, ldacc, first); break;
    case 2: micro(2, x, ldx, w, kn, acc, ldacc, first); break;
    default: micro(1, x, ldx, w, kn, acc, ldacc, first); break;
    }
}

/* Rows [m0, m1) against panel p: results into y (ldy = N), bias added, partial last panel. */
static void panel_rows(const float *x, const float *wpan, const float *bias, float *y,
                       int64_t m0, int64_t m1, int64_t K, int64_t N, int64_t p) {
    float acc[MR * NR] __attribute__((aligned(64)));
    const int64_t rows = m1 - m0, chunks = (rows + MR - 1) / MR;
    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
    int64_t m = m0;
    for (int64_t c = 0; c < chunks; c++) {  /* balanced chunks: 8 rows as 4 + 4, not 6 + 2 */
        int mr = (int)((rows - (m - m0) + (chunks - c) - 1) / (chunks - c));
        if (mr < MR - 1) mr = (int)(m1 - m < MR ? m1 - m : MR);  /* 4-row chunks run slower */
        const float *xm = x + m * K;
        if (chunks == 1) {
            micro_any(mr, xm, K, wpan, K, acc, NR, 1);
        } else {
            for (int64_t k0 = 0; k0 < K; k0 += KB)
                micro_any(mr, xm + k0, K, wpan + k0 * NR, K - k0 < KB ? K - k0 : KB, acc, NR,
                          k0 == 0);
        }
        for (int r = 0; r < mr; r++) {
            float *dst = y + (m + r) * N + p * NR;
            if (bias) for (int64_t j = 0; j < ncols; j++) dst[j] = acc[r * NR + j] + bias[p * NR + j];
            else memcpy(dst, acc + r * NR, ncols * sizeof(float));
        }
        m += mr;
    }
}
#endif

int kvr_gemm_panel_width(void) {
#ifdef VW
    return NR;
#else
    return 0;
#endif
}

int kvr_gemm_panels_f32(const float *x, const float *wp, const float *bias, float *y,
                        int64_t M, int64_t K, int64_t N, int64_t mblock, int nthreads) {
#ifdef VW
    const int64_t P = (N + NR - 1) / NR;
    if (mblock <= 0 || mblock >= M) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t p = 0; p < P; p++)
            panel_rows(x, wp + p * K * NR, bias, y, 0, M, K, N, p);
    } else {
        const int64_t MB = (M + mblock - 1) / mblock;
        #pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
        for (int64_t b = 0; b < MB; b++)
            for (int64_t p = 0; p < P; p++) {
                const int64_t m0 = b * mblock, m1 = m0 + mblock < M ? m0 + mblock : M;
                panel_rows(x, wp + p * K * NR, bias, y, m0, m1, K, N, p);
            }
    }
    return 0;
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)mblock; (void)nthreads;
    return -1;
#endif
}

/* fp32 GEMM y[M,N] = x[M,K] W^T (+ bias) over weights packed in panels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VW 16
/* 12 rows x 2 vectors: 24 of the 32 zmm registers accumulate, so each k-row's two weight
 * loads and 12 broadcasts feed 24 FMAs (8 rows: 16 FMAs for 10 loads), and a 32-64-row call
 * re-reads each panel from L2 three to six times instead of four to eight. Paired against 8
 * rows (both builds in one process, alternated per call, the ~150M model's projections on
 * the 2-vCPU Cascade Lake): 1.03-1.10x at 16-64 rows for K = 768, level at 8 rows and for
 * K = 3072. */
#define MR 12
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
/* On AVX-512, the next panel's prefetch instead (panel_rows); not measured on AVX2. */
#define NEXT_PANEL_PF (VW == 16)

/* acc (mr rows x NR) = (first ? 0 : acc) + x[0:mr, 0:kn] @ w[0:kn, 0:NR]; x rows ldx apart, or
 * with km, x k-major (element (m, k) at x[k * mr + m]). nxt, where not NULL: the same k-rows of
 * the thread's next panel, pulled into L2 meanwhile. */
static inline __attribute__((always_inline)) void micro(const int mr, const float *x, int64_t ldx,
    const float *w, int64_t kn, float *acc, int64_t ldacc, int first, const int pf,
    const float *nxt, const int km) {
    vreg a0[MR], a1[MR];
    #pragma GCC unroll 16
    for (int m = 0; m < MR; m++)
        if (m < mr) {
            a0[m] = first ? VZERO() : VLOAD(acc + m * ldacc);
            a1[m] = first ? VZERO() : VLOAD(acc + m * ldacc + VW);
        }
    for (int64_t k = 0; k < kn; k++) {
#ifdef PF_ROWS
        if (pf) _mm_prefetch((const char *)(w + (k + PF_ROWS) * NR), _MM_HINT_T0);
#else
        (void)pf;
#endif
        if (nxt) {
            _mm_prefetch((const char *)(nxt + k * NR), _MM_HINT_T1);
            _mm_prefetch((const char *)(nxt + k * NR + NR / 2), _MM_HINT_T1);
        }
        const vreg w0 = VLOAD(w + k * NR), w1 = VLOAD(w + k * NR + VW);
        #pragma GCC unroll 16
        for (int m = 0; m < MR; m++)
            if (m < mr) {
                const vreg xv = VBCAST(km ? x[k * mr + m] : x[m * ldx + k]);
                a0[m] = VFMA(xv, w0, a0[m]);
                a1[m] = VFMA(xv, w1, a1[m]);
            }
    }
    #pragma GCC unroll 16
    for (int m = 0; m < MR; m++)
        if (m < mr) { VSTORE(acc + m * ldacc, a0[m]); VSTORE(acc + m * ldacc + VW, a1[m]); }
}

static inline void micro_any(int mr, const float *x, int64_t ldx, const float *w, int64_t kn,
                             float *acc, int64_t ldacc, int first, int pf, const float *nxt,
                             int km) {
#define MICRO_CASE(R) case R: \
        if (km) micro(R, x, ldx, w, kn, acc, ldacc, first, 0, nxt, 1); \
        else if (nxt) micro(R, x, ldx, w, kn, acc, ldacc, first, 0, nxt, 0); \
        else if (pf) micro(R, x, ldx, w, kn, acc, ldacc, first, 1, NULL, 0); \
        else micro(R, x, ldx, w, kn, acc, ldacc, first, 0, NULL, 0); \
        break;
    switch (mr) {
#if MR > 8
    MICRO_CASE(12)
    MICRO_CASE(11)
    MICRO_CASE(10)
    MICRO_CASE(9)
#endif
#if MR > 6
    MICRO_CASE(8)
    MICRO_CASE(7)
#endif
    MICRO_CASE(6)
    MICRO_CASE(5)
    MICRO_CASE(4)
    MICRO_CASE(3)
    MICRO_CASE(2)
    default: micro(1, x, ldx, w, kn, acc, ldacc, first, 1, nxt, 0); break;
    }
#undef MICRO_CASE
}

/* Choices that measured differently on different cores (AVX-512 only; AVX2 keeps the first):
 * fuse_rows, the largest call that takes panel_rows_fused (0: none); balance, whether chunks are
 * always balanced; pf_min_rows, the fewest rows that pull the next panel in beside their own.
 * On a 2-vCPU Zen 4, paired against the Cascade Lake choices over the ~150M model's
 * projections (12 layers of weights, from memory): the fused order 1.2-1.5x slower at 13-20
 * rows, balanced chunks 1.09-1.2x faster at 13-20 and 40 rows (12 + 4 leaves a 4-row chunk
 * re-reading the panel), and the next panel's prefetch slower up to 9 rows (1.12-1.18x at 1-4
 * over the projections alone, where the stream is already at the memory's rate; 1.04-1.07x at
 * 6-9 in whole decode steps), level at 10, 1.03-1.07x faster from 11 (decode steps).
 * pack_min_k, the smallest K whose calls of 2 to MR rows read x from a k-major copy (0: never;
 * see pack_kmajor): on the Zen 4, 8 rows through 12 copies of a 3072 -> 768 projection from
 * memory 1.10-1.17x faster, level at K = 1024 and 768; whole ~150M decode steps at batch 8
 * 0.99x the time on small pages, 0.98x on huge pages. Not measured elsewhere: off. */
#define FUSE_ROWS 20 /* see panel_rows_fused */
static struct {
    int fuse_rows, balance, pf_min_rows, pack_min_k;
} tuning = {FUSE_ROWS, 0, 1, 0};

__attribute__((constructor)) static void pick_tuning(void) {
#if VW == 16
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) {
        tuning.fuse_rows = 0;
        tuning.balance = 1;
        tuning.pf_min_rows = 10;
        tuning.pack_min_k = 1024;
    }
#endif
}

/* The next row chunk's size with `left` rows in `chunks` chunks still to go: balanced (8 rows
 * as 4 + 4, not 6 + 2), except that, unless tuning.balance, chunks shorter than MR - 1 run
 * slower than an MR chunk and a short tail. */
static inline int chunk_size(int64_t left, int64_t chunks) {
    const int mr = (int)((left + chunks - 1) / chunks);
    return mr < MR - 1 && !tuning.balance ? (int)(left < MR ? left : MR) : mr;
}

/* The chunk sizes of `rows` rows into mrs; returns the chunk count. */
static int chunk_rows(int64_t rows, int *mrs) {
    const int64_t chunks = (rows + MR - 1) / MR;
    int64_t done = 0;
    int n = 0;
    for (int64_t c = 0; c < chunks && done < rows; c++) {
        mrs[n] = chunk_size(rows - done, chunks - c);
        done += mrs[n++];
    }
    return n;
}

static void store_rows(const float *acc, const float *bias, float *y, int64_t m, int mr,
                       int64_t N, int64_t p) {
    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
    for (int r = 0; r < mr; r++) {
        float *dst = y + (m + r) * N + p * NR;
        const float *src = acc + r * NR;
        if (bias) for (int64_t j = 0; j < ncols; j++) dst[j] = src[j] + bias[p * NR + j];
        else memcpy(dst, src, ncols * sizeof(float));
    }
}

/* A decode-sized call (MR < rows <= FUSE_ROWS) in one pass over the panel: each block of KBF
 * k-rows of the weights (2 KiB, in L1) serves every row chunk before the next block streams
 * in. Chunk by chunk over the whole panel instead, the weights come from memory for the first
 * chunk and again from L2 for each later one, with the memory stream idle meanwhile. Small
 * blocks keep the prefetches (issued by the first chunk only) spread evenly over the time.
 * Measured on a 2-core Zen 3, the ~150M demo model's projections: 1.08-1.15x at 7-16 rows,
 * 1.04x at 20, level at 24 and slower beyond (there the chunk-by-chunk order runs near the
 * matmul ceiling), hence FUSE_ROWS (above). Packing the rows KBF floats apart (against L1 set
 * conflicts of rows K floats apart) measured no better. */
#define KBF 32
static void panel_rows_fused(const float *x, const float *wpan, const float *bias, float *y,
                             int64_t m0, int64_t m1, int64_t K, int64_t N, int64_t p) {
    float acc[FUSE_ROWS * NR] __attribute__((aligned(64)));
    int mrs[FUSE_ROWS];
    const int n = chunk_rows(m1 - m0, mrs);
    for (int64_t k0 = 0; k0 < K; k0 += KBF) {
        const int64_t kn = K - k0 < KBF ? K - k0 : KBF;
        int64_t m = 0;
        for (int c = 0; c < n; c++) {
            micro_any(mrs[c], x + (m0 + m) * K + k0, K, wpan + k0 * NR, kn, acc + m * NR, NR,
                      k0 == 0, c == 0, NULL, 0);
            m += mrs[c];
        }
    }
    int64_t m = 0;
    for (int c = 0; c < n; c++) {
        store_rows(acc + m * NR, bias, y, m0 + m, mrs[c], N, p);
        m += mrs[c];
    }
}

/* Rows [m0, m1) against panel p: results into y (ldy = N), bias added, partial last panel.
 * next: the thread goes on to panel p + 1. Its weights then stream into L2 while this panel's
 * rows compute: beside the only chunk of a call of up to MR rows, or beside the second of a
 * longer one (whose later chunks read this panel from L2 and would leave the memory idle). With
 * the ~150M model's projections as 12 layers' worth of weights (from memory, not L3), paired
 * against no prefetch on the 2-vCPU Cascade Lake: 1.08-1.17x at 6-12 rows, 1.05-1.12x at
 * 24-40, level at 1-4 rows; beside the fused order (13-20 rows) it measured level or worse. */
static void panel_rows(const float *x, const float *xk, const float *wpan, const float *bias,
                       float *y, int64_t m0, int64_t m1, int64_t K, int64_t N, int64_t p,
                       int next) {
    if (m1 - m0 > MR && m1 - m0 <= tuning.fuse_rows) {
        panel_rows_fused(x, wpan, bias, y, m0, m1, K, N, p);
        return;
    }
    float acc[MR * NR] __attribute__((aligned(64)));
    const int64_t rows = m1 - m0, chunks = (rows + MR - 1) / MR;
    const float *nxt = NEXT_PANEL_PF && next && rows >= tuning.pf_min_rows ? wpan + K * NR : NULL;
    int64_t m = m0;
    for (int64_t c = 0; c < chunks; c++) {
        const int mr = chunk_size(m1 - m, chunks - c);
        const float *xm = x + m * K;
        if (chunks == 1) {
            micro_any(mr, xk ? xk : xm, K, wpan, K, acc, NR, 1, 1, nxt, xk != NULL);
        } else {
            const float *pf = c == 1 ? nxt : NULL;
            for (int64_t k0 = 0; k0 < K; k0 += KB)
                micro_any(mr, xm + k0, K, wpan + k0 * NR, K - k0 < KB ? K - k0 : KB, acc, NR,
                          k0 == 0, 1, pf ? pf + k0 * NR : NULL, 0);
        }
        store_rows(acc, bias, y, m, mr, N, p);
        m += mr;
    }
}

/* A copy of x's M rows k-major (element (m, k) at [k * M + m]) in the calling thread's buffer,
 * or NULL when it cannot grow. Read in place by a call of a few rows, x's rows stream from L2
 * beside every panel's weights once they outgrow L1 (K >= 1024 at 8 rows), as M streams
 * K floats apart, which for K a multiple of 1024 map onto the same L1 sets: k-major they are
 * one contiguous stream. Each thread copies all of x: a few microseconds, once per call. */
static const float *pack_kmajor(const float *x, int64_t M, int64_t K) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (M * K > cap) {
        free(buf);
        cap = 0;
        if (posix_memalign((void **)&buf, 64, M * K * sizeof(float))) return buf = NULL;
        cap = M * K;
    }
    for (int64_t k = 0; k < K; k++)
        for (int64_t m = 0; m < M; m++) buf[k * M + m] = x[m * K + k];
    return buf;
}
#endif

/* y = x W^T (+ bias) with the panels shared among the threads of the enclosing parallel region
 * (a worksharing loop: every thread calls it, and it ends in a barrier). */
void kvr__gemm_for(const float *x, const float *wp, const float *bias, float *y, int64_t M,
                   int64_t K, int64_t N) {
#ifdef VW
    const int64_t P = (N + NR - 1) / NR;
    /* Prefill-sized calls hand panels out one at a time: where the engine shares its cores
     * with a router or other processes, a thread the OS preempts mid-call would otherwise
     * hold the whole region up at the barrier with half the panels still its own (served
     * saturation +3% in paired runs, level offline). Decode-sized calls are too short to
     * pay for the shared counter. */
    if (M > 64) {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < P; p++)
            panel_rows(x, NULL, wp + p * K * NR, bias, y, 0, M, K, N, p, 0);
    } else {
        const float *xk = M >= 2 && M <= MR && tuning.pack_min_k > 0 && K >= tuning.pack_min_k
            ? pack_kmajor(x, M, K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++)
            panel_rows(x, xk, wp + p * K * NR, bias, y, 0, M, K, N, p, p + 1 < P);
    }
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)K; (void)N;
#endif
}

/* The tuning's four fields, read into out[4] (then set from set[4] where set is not NULL), so a
 * test can cover every branch on any machine and a benchmark can pair the choices. */
void kvr_gemm_tuning(int *out, const int *set) {
    out[0] = tuning.fuse_rows;
    out[1] = tuning.balance;
    out[2] = tuning.pf_min_rows;
    out[3] = tuning.pack_min_k;
    if (set) {
        tuning.fuse_rows = set[0];
        tuning.balance = set[1];
        tuning.pf_min_rows = set[2];
        tuning.pack_min_k = set[3];
    }
}

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
        #pragma omp parallel num_threads(nthreads)
        kvr__gemm_for(x, wp, bias, y, M, K, N);
    } else {
        const int64_t MB = (M + mblock - 1) / mblock;
        #pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
        for (int64_t b = 0; b < MB; b++)
            for (int64_t p = 0; p < P; p++) {
                const int64_t m0 = b * mblock, m1 = m0 + mblock < M ? m0 + mblock : M;
                panel_rows(x, NULL, wp + p * K * NR, bias, y, m0, m1, K, N, p, 0);
            }
    }
    return 0;
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)mblock; (void)nthreads;
    return -1;
#endif
}

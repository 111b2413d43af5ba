/* GEMM y[M,N] = x[M,K] W^T (+ bias) over weights packed in panels: x, y and the bias fp32, the
 * weights fp32 or bf16 (wdt: KVR_DTYPE_F32 or KVR_DTYPE_BF16, the same layout). A bf16 weight is
 * the top half of an fp32 one: the microkernel widens it in registers (see micro) and
 * accumulates in fp32, so both dtypes run the same FMAs in the same order, giving the same bits
 * for the same values, and a bf16 weight streams at half the bytes (what decode-sized calls are
 * bound by). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#include "abi.h"
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
typedef __m512i vint;
#define VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define VEVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)) /* see micro */
#define VODD(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)))
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
typedef __m256i vint;
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define VEVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define VODD(v) _mm256_and_ps(_mm256_castsi256_ps(v), \
                              _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)))
#endif

#ifdef VW
#define NR (2 * VW)
#define KB 256
/* Software prefetch of the weight stream this many k-rows (of NR floats) ahead: 16 KiB on AVX2,
 * past the current K block and into the next panel. The hardware prefetchers alone leave
 * decode-sized calls (4-16 rows) short of the stream bandwidth: +8-20% measured there on a
 * Zen 3, level at 1 and 32-64 rows. Not measured on AVX-512 (two lines per k-row): off there.
 * bf16 weights are prefetched the same number of bytes ahead (twice the k-rows): not measured
 * apart (the shared host was too loaded to tell 8, 16 and 32 KiB apart). */
#if VW == 8
#define PF_ROWS 256
#endif

/* On AVX-512, the next panel's prefetch instead (panel_rows); not measured on AVX2. */
#define NEXT_PANEL_PF (VW == 16)

/* acc (mr rows x NR) = (first ? 0 : acc) + x[0:mr, 0:kn] @ w[0:kn, 0:NR]; x rows ldx apart, or
 * with km, x k-major (element (m, k) at x[k * mr + m]); w fp32, or bf16 with bf (a compile-time
 * constant in every caller: micro is inlined into micro_dt's cases). nxt, where not NULL: the
 * same k-rows of the thread's next panel, pulled into L2 meanwhile.
 *
 * A k-row of bf16 weights is one vector load of NR / 2 32-bit words, word j holding columns 2j
 * (low half) and 2j + 1 (high half): shifted up 16 bits it is the even columns as fp32, masked
 * to its high half the odd ones. So acc holds a bf16 tile's columns even-first (store_rows puts
 * them back in order): one load and two logic ops a k-row, where widening each half on its own
 * (zero-extend 16 -> 32 bits, then shift) takes two loads, two shuffles and two shifts, beside
 * the 2 x MR FMAs on the same vector ports. */
static inline __attribute__((always_inline)) void micro(const int mr, const float *x, int64_t ldx,
    const void *w, int64_t kn, float *acc, int64_t ldacc, int first, const int pf,
    const void *nxt, const int km, const int bf) {
    const int64_t rowb = NR * (bf ? 2 : 4); /* bytes per k-row of w */
    vreg a0[MR], a1[MR];
    #pragma GCC unroll 16
    for (int m = 0; m < MR; m++)
        if (m < mr) {
            a0[m] = first ? VZERO() : VLOAD(acc + m * ldacc);
            a1[m] = first ? VZERO() : VLOAD(acc + m * ldacc + VW);
        }
    for (int64_t k = 0; k < kn; k++) {
#ifdef PF_ROWS
        if (pf) _mm_prefetch((const char *)w + k * rowb + PF_ROWS * NR * 4, _MM_HINT_T0);
#else
        (void)pf;
#endif
        if (nxt) { /* a k-row's lines: two of fp32 on AVX-512, one of bf16 */
            _mm_prefetch((const char *)nxt + k * rowb, _MM_HINT_T1);
            if (rowb > 64) _mm_prefetch((const char *)nxt + k * rowb + 64, _MM_HINT_T1);
        }
        vreg w0, w1;
        if (bf) {
            const vint v = VLOADI((const uint16_t *)w + k * NR);
            w0 = VEVEN(v);
            w1 = VODD(v);
        } else {
            w0 = VLOAD((const float *)w + k * NR);
            w1 = VLOAD((const float *)w + k * NR + VW);
        }
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

static inline __attribute__((always_inline)) void micro_dt(int mr, const float *x, int64_t ldx,
    const void *w, int64_t kn, float *acc, int64_t ldacc, int first, int pf, const void *nxt,
    int km, const int bf) {
#define MICRO_CASE(R) case R: \
        if (km) micro(R, x, ldx, w, kn, acc, ldacc, first, 0, nxt, 1, bf); \
        else if (nxt) micro(R, x, ldx, w, kn, acc, ldacc, first, 0, nxt, 0, bf); \
        else if (pf) micro(R, x, ldx, w, kn, acc, ldacc, first, 1, NULL, 0, bf); \
        else micro(R, x, ldx, w, kn, acc, ldacc, first, 0, NULL, 0, bf); \
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
    default: micro(1, x, ldx, w, kn, acc, ldacc, first, 1, nxt, 0, bf); break;
    }
#undef MICRO_CASE
}

/* micro for any mr <= MR, each case compiled for both weight dtypes (wdt). */
static void micro_any(int mr, const float *x, int64_t ldx, const void *w, int64_t kn, float *acc,
                      int64_t ldacc, int first, int pf, const void *nxt, int km, int wdt) {
    if (wdt == KVR_DTYPE_BF16) micro_dt(mr, x, ldx, w, kn, acc, ldacc, first, pf, nxt, km, 1);
    else micro_dt(mr, x, ldx, w, kn, acc, ldacc, first, pf, nxt, km, 0);
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
 * 0.99x the time on small pages, 0.98x on huge pages. Not measured elsewhere: off. Weights in
 * K blocks (the Zen 4's, see kblock) take blocked_rows instead. */
#define FUSE_ROWS 20 /* see panel_rows_fused */
static struct {
    int fuse_rows, balance, pf_min_rows, pack_min_k;
} tuning = {FUSE_ROWS, 0, 1, 0};
/* 768 rows on the Zen 4 (see blocked_rows), one block elsewhere (not measured there). */
static int kblock = 0;

__attribute__((constructor)) static void pick_tuning(void) {
#if VW == 16
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) {
        tuning.fuse_rows = 0;
        tuning.balance = 1;
        tuning.pf_min_rows = 10;
        tuning.pack_min_k = 1024;
        kblock = 768;
    }
#endif
}

/* The next row chunk's size with `left` rows in `chunks` chunks still to go: balanced (8 rows
 * as 4 + 4, not 6 + 2), except that, unless tuning.balance, chunks shorter than MR - 1 run
 * slower than an MR chunk and a short tail. Over bf16 weights (wdt) always balanced: half the
 * bytes leave those calls bound by the FMAs rather than the stream, and a short tail chunk
 * (2 rows: 4 accumulator chains, half the FMA rate) then costs its time. Paired on the 2-core
 * Zen 3 at 8 rows (a shared, loaded host; the ~150M model's projections, 12 layers from
 * memory; 1 and 2 threads): 4 + 4 1.07-1.15x faster than 6 + 2 over bf16 weights, 0.90-0.96x
 * over fp32 ones. */
static inline int chunk_size(int64_t left, int64_t chunks, int wdt) {
    const int mr = (int)((left + chunks - 1) / chunks);
    const int balance = tuning.balance || wdt == KVR_DTYPE_BF16;
    return mr < MR - 1 && !balance ? (int)(left < MR ? left : MR) : mr;
}

/* The chunk sizes of `rows` rows into mrs; returns the chunk count. */
static int chunk_rows(int64_t rows, int *mrs, int wdt) {
    const int64_t chunks = (rows + MR - 1) / MR;
    int64_t done = 0;
    int n = 0;
    for (int64_t c = 0; c < chunks && done < rows; c++) {
        mrs[n] = chunk_size(rows - done, chunks - c, wdt);
        done += mrs[n++];
    }
    return n;
}

/* The packed layout: K rows in blocks of kb (kb <= 0 or kb >= K: one block), each block's rows
 * of every panel together, [P, kn, NR] (kn = kb, less in the last block); one block is the
 * plain [P, K, NR]; elements of wdt. The k-rows [k0, k0 + n) of panel p, n within one block: */
static inline const void *panel_at(const void *wp, int64_t p, int64_t k0, int64_t K, int64_t P,
                                   int64_t kb, int wdt) {
    const int64_t esz = wdt == KVR_DTYPE_BF16 ? 2 : 4;
    if (kb <= 0 || kb >= K) return (const char *)wp + (p * K + k0) * NR * esz;
    const int64_t b0 = k0 / kb * kb, kn = K - b0 < kb ? K - b0 : kb;
    return (const char *)wp + (b0 * P * NR + (p * kn + k0 - b0) * NR) * esz;
}

static inline int64_t block_end(int64_t k0, int64_t K, int64_t kb) { /* past k0's block */
    return kb <= 0 || (k0 / kb + 1) * kb > K ? K : (k0 / kb + 1) * kb;
}

/* A buffer of at least n floats, the calling thread's own (slot i of a few), or NULL. */
static float *thread_buf(int i, int64_t n) {
    static __thread float *buf[3];
    static __thread int64_t cap[3];
    if (n > cap[i]) {
        free(buf[i]);
        cap[i] = 0;
        if (posix_memalign((void **)&buf[i], 64, n * sizeof(float))) return buf[i] = NULL;
        cap[i] = n;
    }
    return buf[i];
}

/* The accumulator tile's rows (NR apart; over bf16 weights even columns first, see micro) into
 * y's rows [m, m + mr), panel p's columns, the bias added. */
static void store_rows(const float *acc, const float *bias, float *y, int64_t m, int mr,
                       int64_t N, int64_t p, int wdt) {
    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
    for (int r = 0; r < mr; r++) {
        float *dst = y + (m + r) * N + p * NR;
        const float *src = acc + r * NR;
        if (wdt == KVR_DTYPE_BF16)
            for (int64_t j = 0; j < ncols; j++)
                dst[j] = src[(j & 1) * VW + j / 2] + (bias ? bias[p * NR + j] : 0.f);
        else if (bias) for (int64_t j = 0; j < ncols; j++) dst[j] = src[j] + bias[p * NR + j];
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
static void panel_rows_fused(const float *x, const void *wp, const float *bias, float *y,
                             int64_t m0, int64_t m1, int64_t K, int64_t N, int64_t p, int64_t kb,
                             int wdt) {
    float acc[FUSE_ROWS * NR] __attribute__((aligned(64)));
    int mrs[FUSE_ROWS];
    const int n = chunk_rows(m1 - m0, mrs, wdt);
    const int64_t P = (N + NR - 1) / NR;
    for (int64_t k0 = 0, kn; k0 < K; k0 += kn) {
        kn = block_end(k0, K, kb) - k0 < KBF ? block_end(k0, K, kb) - k0 : KBF;
        const void *w = panel_at(wp, p, k0, K, P, kb, wdt);
        int64_t m = 0;
        for (int c = 0; c < n; c++) {
            micro_any(mrs[c], x + (m0 + m) * K + k0, K, w, kn, acc + m * NR, NR, k0 == 0, c == 0,
                      NULL, 0, wdt);
            m += mrs[c];
        }
    }
    int64_t m = 0;
    for (int c = 0; c < n; c++) {
        store_rows(acc + m * NR, bias, y, m0 + m, mrs[c], N, p, wdt);
        m += mrs[c];
    }
}

/* Rows [m0, m1) against panel p: results into y (ldy = N), bias added, partial last panel.
 * widen: bf16 weights are widened into an fp32 copy of the panel first, which every row chunk
 * then reads, instead of each chunk widening them again (two vector ops a k-row beside its 2 MR
 * FMAs). Prefill-sized calls take it: paired on the 2-core Zen 3 (a shared host, the ~150M
 * model's projections), 1.07-1.18x at 512-1024 rows, where the per-chunk widening ran 0.86x
 * the fp32 weights' speed and the copy runs level with it; level at 128 rows, and 0.96-1.0x at
 * 24-64 rows (hence not below). The same FMAs in the same order: the same bits.
 * next: the thread goes on to panel p + 1. Its weights then stream into L2 while this panel's
 * rows compute: beside the only chunk of a call of up to MR rows, or beside the second of a
 * longer one (whose later chunks read this panel from L2 and would leave the memory idle). With
 * the ~150M model's projections as 12 layers' worth of weights (from memory, not L3), paired
 * against no prefetch on the 2-vCPU Cascade Lake: 1.08-1.17x at 6-12 rows, 1.05-1.12x at
 * 24-40, level at 1-4 rows; beside the fused order (13-20 rows) it measured level or worse. */
static void panel_rows(const float *x, const float *xk, const void *wp, const float *bias,
                       float *y, int64_t m0, int64_t m1, int64_t K, int64_t N, int64_t p,
                       int next, int64_t kb, int wdt, int widen) {
    if (m1 - m0 > MR && m1 - m0 <= tuning.fuse_rows) {
        panel_rows_fused(x, wp, bias, y, m0, m1, K, N, p, kb, wdt);
        return;
    }
    float acc[MR * NR] __attribute__((aligned(64)));
    const int64_t rows = m1 - m0, chunks = (rows + MR - 1) / MR;
    const int64_t P = (N + NR - 1) / NR;
    const void *wsrc = wp; /* the weights the micro calls read: wp, or panel p widened */
    int64_t pw = p, Pw = P, kbw = kb;
    int wd = wdt;
    float *wf = widen && wdt == KVR_DTYPE_BF16 ? thread_buf(2, K * NR) : NULL;
    if (wf) { /* (else, out of memory: the bf16 micro calls, the same bits) */
        for (int64_t k0 = 0, kn; k0 < K; k0 += kn) {
            kn = block_end(k0, K, kb) - k0;
            const uint16_t *src = panel_at(wp, p, k0, K, P, kb, wdt);
            for (int64_t i = 0; i < kn * NR; i++) {
                const uint32_t u = (uint32_t)src[i] << 16;
                memcpy(wf + k0 * NR + i, &u, sizeof(u));
            }
        }
        wsrc = wf, pw = 0, Pw = 1, kbw = 0, wd = KVR_DTYPE_F32;
    }
    const int pf = NEXT_PANEL_PF && next && rows >= tuning.pf_min_rows && !wf;
    const int64_t step = chunks == 1 ? K : KB; /* k-rows a micro call runs, within a block */
    int64_t m = m0;
    for (int64_t c = 0; c < chunks; c++) {
        const int mr = chunk_size(m1 - m, chunks - c, wd);
        const float *xm = x + m * K;
        for (int64_t k0 = 0, kn; k0 < K; k0 += kn) {
            kn = block_end(k0, K, kb) - k0 < step ? block_end(k0, K, kb) - k0 : step;
            const void *nxt = pf && (chunks == 1 || c == 1)
                ? panel_at(wp, p + 1, k0, K, P, kb, wdt) : NULL;
            const void *w = panel_at(wsrc, pw, k0, K, Pw, kbw, wd);
            if (xk)
                micro_any(mr, xk + k0 * mr, K, w, kn, acc, NR, k0 == 0, 1, nxt, 1, wd);
            else
                micro_any(mr, xm + k0, K, w, kn, acc, NR, k0 == 0, 1, nxt, 0, wd);
        }
        store_rows(acc, bias, y, m, mr, N, p, wd);
        m += mr;
    }
}

/* A copy of x's M rows k-major (element (m, k) at [k * M + m]) in the calling thread's buffer,
 * or NULL: read in place by a few rows, x's rows, K floats apart, map onto the same L1 sets for
 * K a multiple of 1024; k-major they are one stream. A few microseconds, once per call. */
static const float *pack_kmajor(const float *x, int64_t M, int64_t K) {
    float *buf = thread_buf(0, M * K);
    if (buf)
        for (int64_t k = 0; k < K; k++)
            for (int64_t m = 0; m < M; m++) buf[k * M + m] = x[m * K + k];
    return buf;
}

/* A call of up to MR rows over a K-blocked layout, block by block: each thread runs its panels'
 * first block, then their second, and so on, keeping their accumulators in its own buffer
 * between blocks (the same FMAs in the same order as in one pass), with the block's columns of
 * x copied together ([M, kn], rows kn floats apart). Panel by panel instead, each thread reads
 * three streams, and x's rows (K floats apart, the same L1 sets for K a multiple of 1024) go
 * through L1 beside the weights. Measured on the 2-vCPU Zen 4, 24 copies of the ~150M model's
 * 3072 -> 768 projection at 8 rows from memory, paired against one block read k-major: 1.19x
 * faster in the fast memory phase (a plain read at ~62 GB/s), 1.10x in the slow one (~36); the
 * same order over the plain layout 1.09x, and 768-row blocks 1.17x faster than 1024-row ones
 * (whose x rows share L1 sets again). The next panel's prefetch measured slower here in both
 * phases (0.94x, 0.89x): none. Whole decode steps at batch 8, paired over the blocked and the
 * plain layout: 0.98x the time in the slow phase, level in the fast one. Returns nonzero on
 * this thread when a buffer could not grow. */
static int blocked_rows(const float *x, const void *wp, const float *bias, float *y, int64_t M,
                        int64_t K, int64_t N, int64_t kb, int wdt) {
    const int64_t P = (N + NR - 1) / NR;
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = P * t / nt, hi = P * (t + 1) / nt;
    if (lo == hi) return 0; /* more threads than panels */
    float *acc = thread_buf(0, (hi - lo) * MR * NR), *xb = thread_buf(1, M * kb);
    if (!acc || !xb) return 1;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t kn = K - k0 < kb ? K - k0 : kb;
        for (int64_t m = 0; m < M; m++) memcpy(xb + m * kn, x + m * K + k0, kn * sizeof(float));
        for (int64_t p = lo; p < hi; p++) {
            float *a = acc + (p - lo) * MR * NR;
            micro_any((int)M, xb, kn, panel_at(wp, p, k0, K, P, kb, wdt), kn, a, NR, k0 == 0, 1,
                      NULL, 0, wdt);
            if (k0 + kn == K) store_rows(a, bias, y, 0, (int)M, N, p, wdt);
        }
    }
    return 0;
}
#else
/* No kernel at this ISA level (below AVX2 + FMA): the library still builds, for the attention
 * kernels and the pointwise ops, and kvr_gemm_panel_width reports 0. */
static struct {
    int fuse_rows, balance, pf_min_rows, pack_min_k;
} tuning;
static const int kblock = 0;
#endif

/* y = x W^T (+ bias) with the panels (K-blocked by kb, see panel_at; elements of wdt) shared
 * among the threads of the enclosing parallel region (a worksharing loop: every thread calls
 * it, and it ends in a barrier). Returns nonzero on a thread whose scratch could not be
 * allocated. */
int kvr__gemm_for(const float *x, const void *wp, const float *bias, float *y, int64_t M,
                  int64_t K, int64_t N, int64_t kb, int wdt) {
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
            panel_rows(x, NULL, wp, bias, y, 0, M, K, N, p, 0, kb, wdt, 1);
    } else if (M >= 1 && M <= MR && kb > 0 && kb < K) { /* (no rows: nothing to run) */
        const int failed = blocked_rows(x, wp, bias, y, M, K, N, kb, wdt);
        #pragma omp barrier
        return failed;
    } else {
        const float *xk = M >= 2 && M <= MR && tuning.pack_min_k > 0 && K >= tuning.pack_min_k
            ? pack_kmajor(x, M, K) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++)
            panel_rows(x, xk, wp, bias, y, 0, M, K, N, p, p + 1 < P, kb, wdt, 0);
    }
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)kb; (void)wdt;
#endif
    return 0;
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

/* The K block of the layout this CPU's weights are packed in (panel_at; 0: one block). */
int kvr_gemm_kblock(void) { return kblock; }

static int gemm_panels(const float *x, const void *wp, const float *bias, float *y, int64_t M,
                       int64_t K, int64_t N, int nthreads, int64_t kb, int wdt) {
#ifdef VW
    int failed = kb < 0;
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) reduction(|:failed)
        failed |= kvr__gemm_for(x, wp, bias, y, M, K, N, kb, wdt);
    }
    return kb < 0 ? -1 : failed ? -3 : 0;
#else
    (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)nthreads;
    (void)kb; (void)wdt;
    return -1;
#endif
}

/* y = x W^T (+ bias), x and y fp32 [M, K] and [M, N], the bias fp32 [N] or NULL, W packed as
 * gemm.pack_panels packs it with kb, fp32 (_f32) or bf16 (_bf16). Returns 0; -1 on bad
 * arguments or without a kernel, -3 out of memory. */
int kvr_gemm_panels_f32(const float *x, const float *wp, const float *bias, float *y,
                        int64_t M, int64_t K, int64_t N, int nthreads, int64_t kb) {
    return gemm_panels(x, wp, bias, y, M, K, N, nthreads, kb, KVR_DTYPE_F32);
}

int kvr_gemm_panels_bf16(const float *x, const uint16_t *wp, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int nthreads, int64_t kb) {
    return gemm_panels(x, wp, bias, y, M, K, N, nthreads, kb, KVR_DTYPE_BF16);
}

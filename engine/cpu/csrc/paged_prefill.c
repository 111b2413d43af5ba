/* Paged prefill attention for the CPU (fp32 queries and outputs; an fp32 or bf16 KV cache, widened
 * to fp32 as it is read: the keys once, into their transposed tiles, the values in the PV
 * kernels' loads), built on first use by kvrelay.engine.cpu.native.
 *
 * Prefill: spans of new query rows, each attending causally over its sequence's cached prefix
 * and its own new keys (already written to the cache), read through the block table: no gather,
 * no mask tensor. Flash-attention's tiling: per work item (span, KV head, tile of QT query
 * positions x the G query heads of that KV head) a tile of KT keys at a time, S = Q K^T by a
 * register-blocked kernel over K transposed to [D][keys] (broadcast FMAs, no horizontal sums),
 * an online softmax, and O += P V by a second register-blocked kernel.
 *
 *   q        [T, H, D]       span j's rows are [q_start[j], q_start[j] + q_len[j])
 *   tables   int32 [S, W]    span j's block table
 *   ctx_len  int32 [S]       keys visible to span j's last row (cached prefix + new tokens)
 *   out      [T, H, D]       written for the spans' rows only
 * Row i of span j sits at position ctx_len - q_len + i and sees keys [lo, pos], lo = 0 or, with
 * a window, pos - window + 1. sinks (fp32 [H], or NULL): a logit per query head in its softmax's
 * denominator (gpt-oss's attention sinks), added as e^(sink - max) to each row's final sum.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "kernels.h"
#include "vec.h"

#define QT 32 /* query positions per item */

/* KT keys per tile; the QK tile is QR query rows x NV vectors of keys (QR x NV accumulators).
 * AVX-512: 64 keys, 6 x 4 (24 of 32 registers: four key loads and six broadcasts feed 24
 * FMAs); with PV's 6-row tiles below, paired against 32 keys / 8 x 2 / 4 rows on the 2-vCPU
 * Cascade Lake (the ~150M model's heads, 12 x 64 over 4 KV heads): one 2048-token prompt
 * 1.22x, eight 256-token prompts 1.07x (the ~7M model's 8 x 32 over 4: 1.09-1.20x). The
 * tile's softmax (max, rescale, sums: per row, not per key) is paid half as often. AVX2 (16
 * registers): 32 keys, 6 x 2, as before. */
#if VL == 16
#define KT 64
#define QR 6
#define NV 4
#else
#define KT 32
#define QR 6
#define NV 2
#endif

#define ROWS_PADDED(n) (((n) + QR - 1) / QR * QR)

/* S[r][0..KT) = sum_d Q[r][d] Kt[d][0..KT) for QR rows (rows `ldq` apart), scaled; NV VL
 * keys at a time. */
static inline void qk_tile(const float *restrict qr, int64_t ldq, const float *restrict kt,
                           int64_t D, float scale, float *restrict s) {
    for (int64_t c0 = 0; c0 < KT; c0 += NV * VL) {
        vf acc[QR][NV];
#pragma GCC unroll 8
        for (int r = 0; r < QR; r++)
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[r][j] = splat(0.f);
        for (int64_t d = 0; d < D; d++) {
            vf k[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) k[j] = *(const vf *)(kt + d * KT + c0 + j * VL);
#pragma GCC unroll 8
            for (int r = 0; r < QR; r++) {
                const vf b = splat(qr[r * ldq + d]);
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++) acc[r][j] += b * k[j];
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < QR; r++)
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++)
                *(vf *)(s + r * KT + c0 + j * VL) = acc[r][j] * splat(scale);
    }
}

/* O[r][0..D) += sum_c P[r][c] V[c][0..D) over nk keys, R rows at a time with R x DV <= ACC
 * accumulators (DV = D / VL vectors per row); V rows fp32, or bf16 with bf. */
#define PV_KERNEL(DV, R)                                                                         \
    static inline __attribute__((always_inline)) void pv_##DV(                                 \
        const float *restrict p, const void *const *restrict vrows, int64_t nk,                 \
        float *restrict o, int64_t D, const int bf) {                                           \
        vf acc[R][DV];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++)                                \
                acc[r][j] = *(const vf *)(o + r * D + j * VL);                                   \
        for (int64_t c = 0; c < nk; c++) {                                                       \
            vf v[DV];                                                                            \
            _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++)                                \
                v[j] = load_kv(vrows[c], j * VL, bf);                                            \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                               \
                const vf b = splat(p[r * KT + c]);                                               \
                _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++) acc[r][j] += b * v[j];     \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++)                                \
                *(vf *)(o + r * D + j * VL) = acc[r][j];                                         \
    }
#if VL == 16
PV_KERNEL(1, 16)
PV_KERNEL(2, 8)
PV_KERNEL(4, 6)
PV_KERNEL(8, 2)
PV_KERNEL(16, 1)
#else
PV_KERNEL(1, 12)
PV_KERNEL(2, 6)
PV_KERNEL(4, 3)
PV_KERNEL(8, 1)
#endif

/* One row at a time, any D multiple of VL (rows left over by the blocked kernels). */
static inline __attribute__((always_inline)) void pv_row(
    const float *restrict p, const void *const *restrict vrows, int64_t nk, float *restrict o,
    int64_t D, const int bf) {
    axpy_rows(o, p, vrows, nk, D, bf);
}

/* The keys of tile [k0, k0 + nk) that item row r (at position pos) sees: [*a, *b). */
static inline void row_keys(int64_t pos, int64_t k0, int64_t nk, int64_t window, int64_t *a,
                            int64_t *b) {
    *a = window > 0 ? pos - window + 1 - k0 : 0;
    *b = pos + 1 - k0;
    if (*a < 0) *a = 0;
    if (*b > nk) *b = nk;
}

/* The online softmax of one tile's scores (rows of KT in sbuf) in three passes, each over all
 * rows, so that the per-row work is vector work and rows overlap: (A) each row's running max
 * over the keys it sees (other keys set to -FLT_MAX; a row that sees none zeroed), (B) the
 * rescale factors e^(m_old - m_new), VL rows at a time, (C) the numerators, their sums and the
 * rescaled outputs. ms holds four arrays of rowsv floats: m, l, the new m, the factors. Returns
 * whether any row sees a key of the tile. */
static int tile_softmax(float *restrict sbuf, float *restrict obuf, float *restrict ms,
                        int64_t rowsv, int64_t rows, int64_t nq, int64_t pos_lo, int64_t k0,
                        int64_t nk, int64_t window, int64_t D) {
    float *m = ms, *l = ms + rowsv, *mn = ms + 2 * rowsv, *al = ms + 3 * rowsv;
    int any = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t a, b;
        row_keys(pos_lo + r % nq, k0, nk, window, &a, &b);
        float *s = sbuf + r * KT;
        if (a >= b) {
            memset(s, 0, sizeof(float) * KT);
            mn[r] = m[r];
            continue;
        }
        any = 1;
        for (int64_t c = 0; c < a; c++) s[c] = -FLT_MAX;
        for (int64_t c = b; c < KT; c++) s[c] = -FLT_MAX;
        vf mv = *(const vf *)s;
        for (int64_t c = VL; c < KT; c += VL) mv = vmax(mv, *(const vf *)(s + c));
        const float mx = hmax_lanes(mv);
        mn[r] = mx > m[r] ? mx : m[r];
    }
    if (!any) return 0;
    for (int64_t r = 0; r < rowsv; r += VL)
        *(vf *)(al + r) = vexp_neg(*(const vf *)(m + r) - *(const vf *)(mn + r));
    for (int64_t r = 0; r < rows; r++) {
        int64_t a, b;
        row_keys(pos_lo + r % nq, k0, nk, window, &a, &b);
        if (a >= b) continue;
        float *s = sbuf + r * KT;
        const vf mx = splat(mn[r]);
        for (int64_t c = 0; c < KT; c += VL) *(vf *)(s + c) = vexp_neg(*(const vf *)(s + c) - mx);
        for (int64_t c = 0; c < a; c++) s[c] = 0.f; /* the keys it does not see: exactly 0, */
        for (int64_t c = b; c < KT; c++) s[c] = 0.f; /* not e^-87 */
        vf sum = splat(0.f);
        for (int64_t c = 0; c < KT; c += VL) sum += *(const vf *)(s + c);
        const float alpha = al[r];
        l[r] = l[r] * alpha + hsum_lanes(sum);
        if (alpha != 1.f) {
            float *o = obuf + r * D;
            for (int64_t d = 0; d < D; d += VL) *(vf *)(o + d) *= splat(alpha);
        }
    }
    memcpy(m, mn, sizeof(float) * rows);
    return 1;
}

/* One item; v_cache fp32, or bf16 with bf (prefill_any compiles both). */
static inline __attribute__((always_inline)) void prefill_item(
    const float *restrict q, const float *restrict kt_all, const void *v_cache,
    const int32_t *restrict table, int64_t q_start, int64_t q_len, int64_t ctx,
    const kvr_pitem_t *w, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
    int64_t window, float *restrict out, float *restrict sbuf, float *restrict obuf,
    float *restrict ms, int64_t rowsv, float *restrict qbuf, const float *restrict sinks,
    const int bf) {
    const int64_t G = H / KVH, row = KVH * D, nq = w->nq;
    const int64_t rows = G * nq;              /* item rows: r = g * nq + i */
    const int64_t rowsp = ROWS_PADDED(rows); /* padded for the QK tile */
    const int64_t offset = ctx - q_len;       /* position of the span's row 0 */
    const int64_t pos_lo = offset + w->q0, pos_hi = pos_lo + nq - 1;
    /* The item's query rows, contiguous (and zero padding rows for the QK tile). */
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++)
            memcpy(qbuf + (g * nq + i) * D, q + ((q_start + w->q0 + i) * H + w->kvh * G + g) * D,
                   sizeof(float) * D);
    memset(qbuf + rows * D, 0, sizeof(float) * (rowsp - rows) * D);
    memset(obuf, 0, sizeof(float) * rowsp * D);
    float *m = ms, *l = ms + rowsv, *mn = ms + 2 * rowsv;
    for (int64_t r = 0; r < rowsv; r++) m[r] = mn[r] = -FLT_MAX, l[r] = 0.f;
    const int64_t k_first = window > 0 && pos_lo - window + 1 > 0 ? pos_lo - window + 1 : 0;
    const void *vrows[KT];
    for (int64_t k0 = k_first / KT * KT; k0 <= pos_hi; k0 += KT) {
        const int64_t nk = k0 + KT <= ctx ? KT : ctx - k0;
        const float *kt = kt_all + k0 * D; /* [D][KT] tile of this KV head's transposed keys */
        for (int64_t r = 0; r < rowsp; r += QR) qk_tile(qbuf + r * D, D, kt, D, scale, sbuf + r * KT);
        if (!tile_softmax(sbuf, obuf, ms, rowsv, rows, nq, pos_lo, k0, nk, window, D)) continue;
        for (int64_t c = 0; c < nk; c++) {
            const int64_t pos = k0 + c;
            const int64_t at = ((int64_t)table[pos / bs] * bs + pos % bs) * row + w->kvh * D;
            vrows[c] = (const char *)v_cache + at * (bf ? 2 : 4);
        }
        const int64_t dv = D / VL;
        int64_t r = 0;
#define PV_CASE(DV, R)                                                                           \
    case DV:                                                                                     \
        for (; r + R <= rows; r += R) pv_##DV(sbuf + r * KT, vrows, nk, obuf + r * D, D, bf);    \
        break;
        switch (dv) {
#if VL == 16
            PV_CASE(1, 16)
            PV_CASE(2, 8)
            PV_CASE(4, 6)
            PV_CASE(8, 2)
            PV_CASE(16, 1)
#else
            PV_CASE(1, 12)
            PV_CASE(2, 6)
            PV_CASE(4, 3)
            PV_CASE(8, 1)
#endif
        default:
            break;
        }
        for (; r < rows; r++) pv_row(sbuf + r * KT, vrows, nk, obuf + r * D, D, bf);
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i;
            const float lr = sinks ? l[r] + expf(sinks[w->kvh * G + g] - m[r]) : l[r];
            const float inv = lr > 0.f ? 1.f / lr : 0.f;
            float *dst = out + ((q_start + w->q0 + i) * H + w->kvh * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = obuf[r * D + d] * inv;
        }
}

static void prefill_any(const float *restrict q, const float *restrict kt_all,
                        const void *v_cache, const int32_t *restrict table, int64_t q_start,
                        int64_t q_len, int64_t ctx, const kvr_pitem_t *w, int64_t H, int64_t KVH,
                        int64_t D, int64_t bs, float scale, int64_t window, float *restrict out,
                        float *restrict sbuf, float *restrict obuf, float *restrict ms,
                        int64_t rowsv, float *restrict qbuf, const float *restrict sinks,
                        int kv_dtype) {
    if (kv_dtype == KVR_DTYPE_BF16)
        prefill_item(q, kt_all, v_cache, table, q_start, q_len, ctx, w, H, KVH, D, bs, scale,
                     window, out, sbuf, obuf, ms, rowsv, qbuf, sinks, 1);
    else
        prefill_item(q, kt_all, v_cache, table, q_start, q_len, ctx, w, H, KVH, D, bs, scale,
                     window, out, sbuf, obuf, ms, rowsv, qbuf, sinks, 0);
}

/* The work of one call: its items and where each (span, KV head)'s transposed keys go. */
int kvr__prefill_plan(const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                      int64_t S, int64_t KVH, int64_t D, int64_t bs, int64_t W,
                      kvr_prefill_plan_t *pl) {
    memset(pl, 0, sizeof(*pl));
    int64_t n_items = 0, kt_floats = 0;
    int64_t *kt_off = malloc(sizeof(int64_t) * S * KVH);
    if (!kt_off) return -3;
    for (int64_t j = 0; j < S; j++) {
        if (q_len[j] <= 0 || ctx_len[j] < q_len[j] || ctx_len[j] > W * bs) {
            free(kt_off);
            return -2;
        }
        n_items += (q_len[j] + QT - 1) / QT * KVH;
        const int64_t padded = (ctx_len[j] + KT - 1) / KT * KT;
        for (int64_t h = 0; h < KVH; h++) kt_off[j * KVH + h] = kt_floats, kt_floats += padded * D;
    }
    kvr_pitem_t *items = malloc(sizeof(kvr_pitem_t) * n_items);
    float *kt = malloc(sizeof(float) * kt_floats);
    if (!items || !kt) {
        free(kt_off), free(items), free(kt);
        return -3;
    }
    /* Items, the costliest (last query tiles: most keys) first for dynamic scheduling. */
    int64_t it = 0;
    for (int64_t j = 0; j < S; j++)
        for (int64_t q0 = (q_len[j] - 1) / QT * QT; q0 >= 0; q0 -= QT)
            for (int64_t h = 0; h < KVH; h++)
                items[it++] = (kvr_pitem_t){(int32_t)j, (int32_t)h, (int32_t)q0,
                                            (int32_t)(q0 + QT <= q_len[j] ? QT : q_len[j] - q0)};
    *pl = (kvr_prefill_plan_t){items, n_items, kt_off, kt, q_start, q_len, ctx_len, S};
    return 0;
}

void kvr__prefill_plan_free(kvr_prefill_plan_t *pl) {
    free(pl->items), free(pl->kt_off), free(pl->kt);
    memset(pl, 0, sizeof(*pl));
}

/* Every thread of the enclosing parallel region calls this; nonzero where this thread ran out
 * of memory (its share of the items then undone). */
int kvr__prefill_run(const kvr_prefill_plan_t *pl, const float *q, const void *k_cache,
                     const void *v_cache, const int32_t *tables, float *out, int64_t H,
                     int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale, int64_t window,
                     int kv_dtype, const float *sinks) {
    const int64_t G = H / KVH, row = KVH * D, S = pl->S;
    const int32_t *ctx_len = pl->ctx_len;
    /* Phase 1: every span's keys, per KV head, transposed into [D][KT] tiles. */
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t j = 0; j < S; j++)
        for (int64_t h = 0; h < KVH; h++) {
            float *dst = pl->kt + pl->kt_off[j * KVH + h];
            const int64_t n = ctx_len[j], padded = (n + KT - 1) / KT * KT;
            const int32_t *table = tables + j * W;
            for (int64_t k0 = 0; k0 < padded; k0 += KT) {
                float *tile = dst + k0 * D;
                for (int64_t c = 0; c < KT; c++) {
                    const int64_t pos = k0 + c;
                    if (pos >= n) {
                        for (int64_t d = 0; d < D; d++) tile[d * KT + c] = 0.f;
                        continue;
                    }
                    const int64_t at = ((int64_t)table[pos / bs] * bs + pos % bs) * row + h * D;
                    if (kv_dtype == KVR_DTYPE_BF16) {
                        const uint16_t *kr = (const uint16_t *)k_cache + at;
                        for (int64_t d = 0; d < D; d++) tile[d * KT + c] = bf16_to_f32(kr[d]);
                    } else {
                        const float *kr = (const float *)k_cache + at;
                        for (int64_t d = 0; d < D; d++) tile[d * KT + c] = kr[d];
                    }
                }
            }
        }
    /* Phase 2: the attention tiles. */
    const int64_t rowsp = ROWS_PADDED(G * QT);
    float *sbuf = malloc(sizeof(float) * rowsp * KT);
    float *obuf = malloc(sizeof(float) * rowsp * D);
    float *qbuf = malloc(sizeof(float) * rowsp * D);
    const int64_t rowsv = (rowsp + VL - 1) / VL * VL;
    float *ml = malloc(sizeof(float) * rowsv * 4);
    const int ok = sbuf && obuf && qbuf && ml;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < pl->n_items; i++) {
        if (!ok) continue;
        const kvr_pitem_t *w = &pl->items[i];
        const int64_t j = w->span;
        prefill_any(q, pl->kt + pl->kt_off[j * KVH + w->kvh], v_cache, tables + j * W,
                    pl->q_start[j], pl->q_len[j], ctx_len[j], w, H, KVH, D, bs, scale, window,
                    out, sbuf, obuf, ml, rowsv, qbuf, sinks, kv_dtype);
    }
    free(sbuf), free(obuf), free(qbuf), free(ml);
    return !ok;
}

/* The caches fp32 or bf16 (kv_dtype: KVR_DTYPE_F32 or KVR_DTYPE_BF16); sinks [H] or NULL.
 * Returns 0, or a negative number on bad arguments / out of memory. */
int kvr_paged_prefill(const float *q, const void *k_cache, const void *v_cache,
                      const int32_t *tables, const int32_t *q_start, const int32_t *q_len,
                      const int32_t *ctx_len, float *out, int64_t S, int64_t H, int64_t KVH,
                      int64_t D, int64_t bs, int64_t W, float scale, int64_t window,
                      int num_threads, int kv_dtype, const float *sinks) {
    if (S <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || D % VL || bs <= 0 || num_threads < 1 ||
        (kv_dtype != KVR_DTYPE_F32 && kv_dtype != KVR_DTYPE_BF16))
        return -1;
    kvr_prefill_plan_t pl;
    int rc = kvr__prefill_plan(q_start, q_len, ctx_len, S, KVH, D, bs, W, &pl);
    if (rc) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(|:failed)
    failed |= kvr__prefill_run(&pl, q, k_cache, v_cache, tables, out, H, KVH, D, bs, W, scale,
                               window, kv_dtype, sinks);
    kvr__prefill_plan_free(&pl);
    return failed ? -3 : 0;
}

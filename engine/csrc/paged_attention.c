/* Paged attention kernels for the CPU (fp32), built on first use by kvrelay.engine.native.
 *
 * Decode: every decoding sequence's single query row attends over its cached K/V, read straight
 * out of the paged cache through its block table, without gathering it anywhere first. Work is
 * split into (sequence, context partition) items covering every head, so a cached slot's K row
 * (all KV heads, contiguous) and V row are each read from memory once per step and layer, as one
 * sequential stream per block. A sequence longer than the partition size is cut into several
 * items (work for every thread when the batch is small and the context long); their partial
 * softmax results merge exactly afterwards (log-sum-exp).
 *
 * Layouts (contiguous, row-major):
 *   q        [N, H, D]                  one query row per decoding sequence
 *   k_cache  [num_blocks * bs, KVH, D]  (v_cache the same)
 *   tables   int32 [N, W]               block ids of each sequence
 *   lens     int32 [N]                  keys visible to each sequence (new token included)
 *   out      [N, H, D]
 * Query head h reads KV head h / (H / KVH). window > 0 keeps only the last `window` keys.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVR_ABI_VERSION 7

int kvr_abi_version(void) { return KVR_ABI_VERSION; }

#include "kernels.h"
#include "vec.h"


/* r[i] = sum of the lanes of a[i], i < VL: a transpose-and-add tree (30 shuffles for 16 sums,
 * 14 for 8) where separate horizontal sums would take ~4x as many. */
#if VL == 16
static inline vf reduce_vl(const vf a[16]) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}
#else
static inline vf reduce_vl(const vf a[8]) {
    vf b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* o[D] += sum_t p[t] * rows[t][D]: D in slices of up to 8 vectors held in registers across
 * the rows (independent FMA chains, not one chain per vector through every row). */
static inline void axpy_rows(float *restrict o, const float *restrict p,
                             const float *const *restrict rows, int64_t n, int64_t d) {
    if (d % VL == 0) {
        int64_t i = 0;
        for (; i + 8 * VL <= d; i += 8 * VL) {
            vf acc[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = *(const vf *)(o + i + j * VL);
            for (int64_t t = 0; t < n; t++) {
                const vf b = splat(p[t]);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) acc[j] += b * *(const vf *)(rows[t] + i + j * VL);
            }
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) *(vf *)(o + i + j * VL) = acc[j];
        }
        for (; i + 4 * VL <= d; i += 4 * VL) {
            vf acc[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[j] = *(const vf *)(o + i + j * VL);
            for (int64_t t = 0; t < n; t++) {
                const vf b = splat(p[t]);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[j] += b * *(const vf *)(rows[t] + i + j * VL);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) *(vf *)(o + i + j * VL) = acc[j];
        }
        for (; i < d; i += VL) {
            vf acc = *(vf *)(o + i);
            for (int64_t t = 0; t < n; t++) acc += p[t] * *(const vf *)(rows[t] + i);
            *(vf *)(o + i) = acc;
        }
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) o[i] += p[t] * rows[t][i];
}

/* Scores of up to VL consecutive keys (rows `row` floats apart from k0, this head's slice) for
 * query head q (D floats, D a multiple of VL), scaled, into s[0..cnt). */
static inline void scores_vl(const float *restrict q, const float *restrict k0, int64_t row,
                             int64_t D, int64_t cnt, float scale, float *restrict s) {
    vf a[VL];
#pragma GCC unroll 16
    for (int t = 0; t < VL; t++) a[t] = splat(0.f);
    if (cnt == VL) { /* the common case, unrolled so the VL sums live in registers */
        for (int64_t i = 0; i < D; i += VL) {
            const vf qv = *(const vf *)(q + i);
#pragma GCC unroll 16
            for (int t = 0; t < VL; t++) a[t] += qv * *(const vf *)(k0 + t * row + i);
        }
    } else {
        for (int64_t i = 0; i < D; i += VL) {
            const vf qv = *(const vf *)(q + i);
            for (int64_t t = 0; t < cnt; t++) a[t] += qv * *(const vf *)(k0 + t * row + i);
        }
    }
    const vf r = reduce_vl(a) * splat(scale);
    if (cnt == VL) {
        *(vf *)s = r;
    } else {
        for (int64_t t = 0; t < cnt; t++) s[t] = r[t];
    }
}

/* Scores of up to 16 consecutive keys (a run within one block), VL at a time. */
static inline void scores16(const float *restrict q, const float *restrict k0, int64_t row,
                            int64_t D, int64_t cnt, float scale, float *restrict s) {
    for (int64_t g = 0; g < cnt; g += VL)
        scores_vl(q, k0 + g * row, row, D, cnt - g < VL ? cnt - g : VL, scale, s + g);
}

/* Asks for the next run of rows (up to 16 keys from `pos`) while this one computes: runs
 * that cross into another block jump in memory, where the hardware prefetcher has to
 * start over. */
static inline void prefetch_run(const float *cache, const int32_t *table, int64_t pos,
                                int64_t end, int64_t bs, int64_t row) {
    if (pos >= end) return;
    int64_t cnt = bs - pos % bs;
    if (cnt > end - pos) cnt = end - pos;
    if (cnt > 16) cnt = 16;
    const char *p = (const char *)(cache + ((int64_t)table[pos / bs] * bs + pos % bs) * row);
    const int64_t bytes = cnt * row * (int64_t)sizeof(float);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* One item: for every head, softmax(q K^T * scale) V over keys [begin, end). Writes the
 * unnormalised output rows to o (H x D) and each head's max and sum to m and l. `scores` holds
 * H x (end - begin) floats, rounded up to a multiple of VL. */
static void attend(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int32_t *restrict table, int64_t H,
                   int64_t KVH, int64_t D, int64_t bs, int32_t begin, int32_t end, float scale,
                   float *restrict scores, float *restrict o, float *restrict m,
                   float *restrict l) {
    const int64_t n = end - begin, G = H / KVH, row = KVH * D;
    const int64_t stride = (n + VL - 1) / VL * VL; /* scores row of one head */
    const int vec = D % VL == 0;
    /* Pass 1, K: runs of up to 16 keys that lie in one block (contiguous rows). */
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t pos0 = begin + t0;
        int64_t cnt = bs - pos0 % bs;
        if (cnt > n - t0) cnt = n - t0;
        if (cnt > 16) cnt = 16;
        const float *kb = k_cache + ((int64_t)table[pos0 / bs] * bs + pos0 % bs) * row;
        prefetch_run(k_cache, table, pos0 + cnt, end, bs, row);
        for (int64_t h = 0; h < H; h++) {
            const float *qh = q + h * D, *k0 = kb + (h / G) * D;
            float *s = scores + h * stride + t0;
            if (vec) {
                scores16(qh, k0, row, D, cnt, scale, s);
            } else {
                for (int64_t t = 0; t < cnt; t++) s[t] = dot(qh, k0 + t * row, D) * scale;
            }
        }
        t0 += cnt;
    }
    /* Softmax numerators and sums, VL lanes at a time (the tail lanes padded with -inf-like
     * values contribute ~0 and are never read by pass 2). */
    const int64_t full = n / VL * VL;
    for (int64_t h = 0; h < H; h++) {
        float *sh = scores + h * stride;
        for (int64_t t = n; t < stride; t++) sh[t] = -FLT_MAX;
        vf mv = splat(-FLT_MAX);
        for (int64_t t = 0; t < stride; t += VL) mv = vmax(mv, *(const vf *)(sh + t));
        float mx = -FLT_MAX;
        for (int i = 0; i < VL; i++) mx = mv[i] > mx ? mv[i] : mx;
        vf sum = splat(0.f);
        for (int64_t t = 0; t < stride; t += VL) {
            vf e = vexp_neg(*(const vf *)(sh + t) - splat(mx));
            if (t >= full) { /* zero the padded lanes */
                for (int64_t i = n - t; i < VL; i++) e[i] = 0.f;
            }
            *(vf *)(sh + t) = e;
            sum += e;
        }
        m[h] = mx;
        l[h] = hsum(sum);
    }
    /* Pass 2, V: a run's rows at a time (they stay in L1 while every head uses them). */
    memset(o, 0, sizeof(float) * H * D);
    const float *rows[16];
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t pos0 = begin + t0;
        int64_t cnt = bs - pos0 % bs;
        if (cnt > n - t0) cnt = n - t0;
        if (cnt > 16) cnt = 16;
        prefetch_run(v_cache, table, pos0 + cnt, end, bs, row);
        const float *vb = v_cache + ((int64_t)table[pos0 / bs] * bs + pos0 % bs) * row;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = 0; t < cnt; t++) rows[t] = vb + t * row + (h / G) * D;
            axpy_rows(o + h * D, scores + h * stride + t0, rows, cnt, D);
        }
        t0 += cnt;
    }
}

/* Cuts the sequences into items: partitions of `part` keys, enough for ~4 items per thread and
 * never below min_part keys. 0, -2 for a length outside its block table, -3 out of memory. */
int kvr__decode_plan(const int32_t *lens, int64_t N, int64_t H, int64_t D, int64_t bs,
                     int64_t W, int64_t window, int64_t min_part, int num_threads,
                     kvr_decode_plan_t *pl) {
    memset(pl, 0, sizeof(*pl));
    int64_t total = 0;
    for (int64_t s = 0; s < N; s++) {
        const int64_t len = lens[s];
        if (len <= 0 || len > W * bs) return -2;
        total += (window > 0 && len > window) ? window : len;
    }
    int64_t part = total / (4 * (int64_t)num_threads);
    if (part < min_part) part = min_part;
    part = (part + bs - 1) / bs * bs;
    int64_t n_items = 0, n_slots = 0;
    for (int64_t s = 0; s < N; s++) {
        const int64_t len = lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t parts = (len - first + part - 1) / part;
        n_items += parts;
        if (parts > 1) n_slots += parts;
    }
    item_t *items = malloc(sizeof(item_t) * (n_items ? n_items : 1));
    float *partial = n_slots ? malloc(sizeof(float) * n_slots * H * (D + 2)) : NULL;
    if (!items || (n_slots && !partial)) {
        free(items);
        free(partial);
        return -3;
    }
    int64_t it = 0, slot = 0;
    for (int64_t s = 0; s < N; s++) {
        const int64_t len = lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t parts = (len - first + part - 1) / part;
        for (int64_t p = 0; p < parts; p++) {
            const int64_t b = first + p * part;
            const int64_t e = b + part < len ? b + part : len;
            items[it++] = (item_t){(int32_t)s, (int32_t)b, (int32_t)e,
                                   parts > 1 ? (int32_t)slot++ : -1};
        }
    }
    *pl = (kvr_decode_plan_t){items, n_items, part, partial, n_slots};
    return 0;
}

void kvr__decode_plan_free(kvr_decode_plan_t *pl) {
    free(pl->items);
    free(pl->partial);
    pl->items = NULL;
    pl->partial = NULL;
}

/* The plan's items and then the merge of cut sequences, shared among the threads of the
 * enclosing parallel region (every thread calls this; worksharing loops inside, each ending in
 * a barrier). Returns nonzero on this thread when its scratch could not be allocated. */
int kvr__decode_run(const kvr_decode_plan_t *pl, const float *q, const float *k_cache,
                    const float *v_cache, const int32_t *tables, float *out, int64_t H,
                    int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale) {
    const item_t *items = pl->items;
    const int64_t n_items = pl->n_items;
    float *scores = malloc(sizeof(float) * H * (pl->part + VL));
    float *tmp = malloc(sizeof(float) * H * 2);
    const int ok = scores && tmp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; i++) {
        if (!ok) continue;
        const item_t w = items[i];
        float *m, *l, *o;
        if (w.slot < 0) {
            m = tmp, l = tmp + H, o = out + (int64_t)w.seq * H * D;
        } else {
            float *base = pl->partial + (int64_t)w.slot * H * (D + 2);
            m = base, l = base + H, o = base + 2 * H;
        }
        attend(q + (int64_t)w.seq * H * D, k_cache, v_cache, tables + (int64_t)w.seq * W, H, KVH,
               D, bs, w.begin, w.end, scale, scores, o, m, l);
        if (w.slot < 0) {
            for (int64_t h = 0; h < H; h++) {
                const float inv = 1.f / l[h];
                for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
            }
        }
    }
    free(scores);
    free(tmp);
    if (!pl->n_slots) return !ok;
    /* Merge the partitions of long sequences (a sequence's items are adjacent). */
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; i++) {
        const item_t w = items[i];
        if (w.slot < 0 || (i > 0 && items[i - 1].seq == w.seq)) continue;
        int64_t nparts = 1;
        while (i + nparts < n_items && items[i + nparts].seq == w.seq) nparts++;
        float *o = out + (int64_t)w.seq * H * D;
        for (int64_t h = 0; h < H; h++) {
            float mx = -FLT_MAX;
            for (int64_t p = 0; p < nparts; p++) {
                const float *base = pl->partial + (int64_t)(w.slot + p) * H * (D + 2);
                if (base[h] > mx) mx = base[h];
            }
            float total_l = 0.f;
            float *oh = o + h * D;
            memset(oh, 0, sizeof(float) * D);
            for (int64_t p = 0; p < nparts; p++) {
                const float *base = pl->partial + (int64_t)(w.slot + p) * H * (D + 2);
                const float c = expf(base[h] - mx);
                total_l += c * base[H + h];
                const float *op = base + 2 * H + h * D;
                for (int64_t d = 0; d < D; d++) oh[d] += c * op[d];
            }
            const float inv = 1.f / total_l;
            for (int64_t d = 0; d < D; d++) oh[d] *= inv;
        }
    }
    return !ok;
}

/* Returns 0, or a negative number on bad arguments / out of memory. */
int kvr_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *tables, const int32_t *lens, float *out, int64_t N,
                         int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale,
                         int64_t window, int64_t min_part, int num_threads) {
    if (N <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || min_part <= 0 || num_threads < 1)
        return -1;
    kvr_decode_plan_t pl;
    const int rc = kvr__decode_plan(lens, N, H, D, bs, W, window, min_part, num_threads, &pl);
    if (rc) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(|:failed)
    failed |= kvr__decode_run(&pl, q, k_cache, v_cache, tables, out, H, KVH, D, bs, W, scale);
    kvr__decode_plan_free(&pl);
    return failed ? -3 : 0;
}

/* ---------------------------------------------------------------------------------------------
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
 * a window, pos - window + 1.
 */
#define QT 32 /* query positions per item */
#define KT 32 /* keys per tile */

typedef struct {
    int32_t span;
    int32_t kvh;
    int32_t q0; /* first query row of the tile, within the span */
    int32_t nq; /* rows in the tile */
} pitem_t;

/* Query rows per QK tile: QR rows x 2 vectors of keys = 2 QR accumulators (16 of AVX-512's 32
 * registers, 12 of AVX2's 16). */
#if VL == 16
#define QR 8
#else
#define QR 6
#endif
#define ROWS_PADDED(n) (((n) + QR - 1) / QR * QR)

/* S[r][0..KT) = sum_d Q[r][d] Kt[d][0..KT) for QR rows (rows `ldq` apart), scaled; 2 VL keys
 * at a time. */
static inline void qk_tile(const float *restrict qr, int64_t ldq, const float *restrict kt,
                           int64_t D, float scale, float *restrict s) {
    for (int64_t c0 = 0; c0 < KT; c0 += 2 * VL) {
        vf acc[QR][2];
#pragma GCC unroll 8
        for (int r = 0; r < QR; r++) acc[r][0] = acc[r][1] = splat(0.f);
        for (int64_t d = 0; d < D; d++) {
            const vf k0 = *(const vf *)(kt + d * KT + c0);
            const vf k1 = *(const vf *)(kt + d * KT + c0 + VL);
#pragma GCC unroll 8
            for (int r = 0; r < QR; r++) {
                const vf b = splat(qr[r * ldq + d]);
                acc[r][0] += b * k0;
                acc[r][1] += b * k1;
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < QR; r++) {
            *(vf *)(s + r * KT + c0) = acc[r][0] * splat(scale);
            *(vf *)(s + r * KT + c0 + VL) = acc[r][1] * splat(scale);
        }
    }
}

/* O[r][0..D) += sum_c P[r][c] V[c][0..D) over nk keys, R rows at a time with R x DV <= ACC
 * accumulators (DV = D / VL vectors per row). */
#define PV_KERNEL(DV, R)                                                                         \
    static inline void pv_##DV(const float *restrict p, const float *const *restrict vrows,     \
                               int64_t nk, float *restrict o, int64_t D) {                      \
        vf acc[R][DV];                                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                     \
            _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++)                                \
                acc[r][j] = *(const vf *)(o + r * D + j * VL);                                   \
        for (int64_t c = 0; c < nk; c++) {                                                       \
            vf v[DV];                                                                            \
            _Pragma("GCC unroll 16") for (int j = 0; j < DV; j++)                                \
                v[j] = *(const vf *)(vrows[c] + j * VL);                                         \
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
PV_KERNEL(4, 4)
PV_KERNEL(8, 2)
PV_KERNEL(16, 1)
#else
PV_KERNEL(1, 12)
PV_KERNEL(2, 6)
PV_KERNEL(4, 3)
PV_KERNEL(8, 1)
#endif

/* One row at a time, any D multiple of VL (rows left over by the blocked kernels). */
static inline void pv_row(const float *restrict p, const float *const *restrict vrows, int64_t nk,
                          float *restrict o, int64_t D) {
    axpy_rows(o, p, vrows, nk, D);
}

static void prefill_item(const float *restrict q, const float *restrict kt_all,
                         const float *restrict v_cache, const int32_t *restrict table,
                         int64_t q_start, int64_t q_len, int64_t ctx, const pitem_t *w, int64_t H,
                         int64_t KVH, int64_t D, int64_t bs, float scale, int64_t window,
                         float *restrict out, float *restrict sbuf, float *restrict obuf,
                         float *restrict m, float *restrict l, float *restrict qbuf) {
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
    for (int64_t r = 0; r < rowsp; r++) m[r] = -FLT_MAX, l[r] = 0.f;
    const int64_t k_first = window > 0 && pos_lo - window + 1 > 0 ? pos_lo - window + 1 : 0;
    const float *vrows[KT];
    for (int64_t k0 = k_first / KT * KT; k0 <= pos_hi; k0 += KT) {
        const int64_t nk = k0 + KT <= ctx ? KT : ctx - k0;
        const float *kt = kt_all + k0 * D; /* [D][KT] tile of this KV head's transposed keys */
        for (int64_t r = 0; r < rowsp; r += QR) qk_tile(qbuf + r * D, D, kt, D, scale, sbuf + r * KT);
        int any = 0;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t pos = pos_lo + r % nq;
            /* valid keys of this row in the tile: [a, b) */
            int64_t a = window > 0 ? pos - window + 1 - k0 : 0, b = pos + 1 - k0;
            if (a < 0) a = 0;
            if (b > nk) b = nk;
            float *s = sbuf + r * KT;
            if (a >= b) {
                memset(s, 0, sizeof(float) * KT);
                continue;
            }
            any = 1;
            float mx = m[r];
            for (int64_t c = a; c < b; c++) mx = s[c] > mx ? s[c] : mx;
            const float alpha = m[r] == -FLT_MAX ? 0.f : expf(m[r] - mx);
            m[r] = mx;
            for (int64_t c = 0; c < KT; c += VL) *(vf *)(s + c) = vexp_neg(*(vf *)(s + c) - splat(mx));
            for (int64_t c = 0; c < a; c++) s[c] = 0.f;
            for (int64_t c = b; c < KT; c++) s[c] = 0.f;
            float sum = 0.f;
            for (int64_t c = a; c < b; c++) sum += s[c];
            l[r] = l[r] * alpha + sum;
            if (alpha != 1.f) {
                float *o = obuf + r * D;
                for (int64_t d = 0; d < D; d += VL) *(vf *)(o + d) *= splat(alpha);
            }
        }
        if (!any) continue;
        for (int64_t c = 0; c < nk; c++) {
            const int64_t pos = k0 + c;
            vrows[c] = v_cache + ((int64_t)table[pos / bs] * bs + pos % bs) * row + w->kvh * D;
        }
        const int64_t dv = D / VL;
        int64_t r = 0;
#define PV_CASE(DV, R)                                                                           \
    case DV:                                                                                     \
        for (; r + R <= rows; r += R) pv_##DV(sbuf + r * KT, vrows, nk, obuf + r * D, D);        \
        break;
        switch (dv) {
#if VL == 16
            PV_CASE(1, 16)
            PV_CASE(2, 8)
            PV_CASE(4, 4)
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
        for (; r < rows; r++) pv_row(sbuf + r * KT, vrows, nk, obuf + r * D, D);
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            float *dst = out + ((q_start + w->q0 + i) * H + w->kvh * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = obuf[r * D + d] * inv;
        }
}

/* Returns 0, or a negative number on bad arguments / out of memory. */
int kvr_paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache,
                          const int32_t *tables, const int32_t *q_start, const int32_t *q_len,
                          const int32_t *ctx_len, float *out, int64_t S, int64_t H, int64_t KVH,
                          int64_t D, int64_t bs, int64_t W, float scale, int64_t window,
                          int num_threads) {
    if (S <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || D % VL || bs <= 0 || num_threads < 1)
        return -1;
    const int64_t G = H / KVH, row = KVH * D;
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
    pitem_t *items = malloc(sizeof(pitem_t) * n_items);
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
                items[it++] = (pitem_t){(int32_t)j, (int32_t)h, (int32_t)q0,
                                        (int32_t)(q0 + QT <= q_len[j] ? QT : q_len[j] - q0)};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Phase 1: every span's keys, per KV head, transposed into [D][KT] tiles. */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t j = 0; j < S; j++)
            for (int64_t h = 0; h < KVH; h++) {
                float *dst = kt + kt_off[j * KVH + h];
                const int64_t n = ctx_len[j], padded = (n + KT - 1) / KT * KT;
                const int32_t *table = tables + j * W;
                for (int64_t k0 = 0; k0 < padded; k0 += KT) {
                    float *tile = dst + k0 * D;
                    for (int64_t c = 0; c < KT; c++) {
                        const int64_t pos = k0 + c;
                        if (pos < n) {
                            const float *kr = k_cache +
                                              ((int64_t)table[pos / bs] * bs + pos % bs) * row +
                                              h * D;
                            for (int64_t d = 0; d < D; d++) tile[d * KT + c] = kr[d];
                        } else {
                            for (int64_t d = 0; d < D; d++) tile[d * KT + c] = 0.f;
                        }
                    }
                }
            }
        /* Phase 2: the attention tiles. */
        const int64_t rowsp = ROWS_PADDED(G * QT);
        float *sbuf = malloc(sizeof(float) * rowsp * KT);
        float *obuf = malloc(sizeof(float) * rowsp * D);
        float *qbuf = malloc(sizeof(float) * rowsp * D);
        float *ml = malloc(sizeof(float) * rowsp * 2);
        if (!sbuf || !obuf || !qbuf || !ml) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (!sbuf || !obuf || !qbuf || !ml) continue;
            const pitem_t *w = &items[i];
            const int64_t j = w->span;
            prefill_item(q, kt + kt_off[j * KVH + w->kvh], v_cache, tables + j * W, q_start[j],
                         q_len[j], ctx_len[j], w, H, KVH, D, bs, scale, window, out, sbuf, obuf,
                         ml, ml + rowsp, qbuf);
        }
        free(sbuf), free(obuf), free(qbuf), free(ml);
    }
    free(kt_off), free(items), free(kt);
    return failed ? -3 : 0;
}

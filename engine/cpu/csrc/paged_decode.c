/* Paged decode attention for the CPU (fp32 queries and outputs; an fp32 or bf16 KV cache, widened
 * to fp32 as it is read), built on first use by kvrelay.engine.cpu.native.
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
 *   k_cache  [num_blocks * bs, KVH, D]  (v_cache the same), fp32 or bf16 (kv_dtype)
 *   tables   int32 [N, W]               block ids of each sequence
 *   lens     int32 [N]                  keys visible to each sequence (new token included)
 *   out      [N, H, D]
 * Query head h reads KV head h / (H / KVH). window > 0 keeps only the last `window` keys.
 * sinks (fp32 [H], or NULL): attention sinks (gpt-oss), a logit per query head that joins its
 * softmax's denominator and attends to nothing: each head's sum gains e^(sink - max) before the
 * output is divided by it (after the partitions' merge).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "abi.h"

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

static inline __attribute__((always_inline)) float dot(const float *restrict a, const void *b,
                                                        int64_t d, const int bf) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * kv_at(b, i, bf);
    return s;
}

/* A cache row's address: element i of a cache of fp32 or (bf) bf16 values. */
static inline __attribute__((always_inline)) const void *kv_ptr(const void *cache, int64_t i,
                                                               const int bf) {
    return (const char *)cache + i * (bf ? 2 : 4);
}

/* Scores of up to VL consecutive keys (rows `row` values apart from k0, this head's slice) for
 * query head q (D floats, D a multiple of VL), scaled, into s[0..cnt). */
static inline __attribute__((always_inline)) void scores_vl(
    const float *restrict q, const void *k0, int64_t row, int64_t D, int64_t cnt, float scale,
    float *restrict s, const int bf) {
    vf a[VL];
#pragma GCC unroll 16
    for (int t = 0; t < VL; t++) a[t] = splat(0.f);
    if (cnt == VL) { /* the common case, unrolled so the VL sums live in registers */
        for (int64_t i = 0; i < D; i += VL) {
            const vf qv = *(const vf *)(q + i);
#pragma GCC unroll 16
            for (int t = 0; t < VL; t++) a[t] += qv * load_kv(k0, t * row + i, bf);
        }
    } else {
        for (int64_t i = 0; i < D; i += VL) {
            const vf qv = *(const vf *)(q + i);
            for (int64_t t = 0; t < cnt; t++) a[t] += qv * load_kv(k0, t * row + i, bf);
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
static inline __attribute__((always_inline)) void scores16(
    const float *restrict q, const void *k0, int64_t row, int64_t D, int64_t cnt, float scale,
    float *restrict s, const int bf) {
    for (int64_t g = 0; g < cnt; g += VL)
        scores_vl(q, kv_ptr(k0, g * row, bf), row, D, cnt - g < VL ? cnt - g : VL, scale, s + g,
                  bf);
}

/* The rows the kernel asks for while it computes: those PF_RUNS runs of 16 keys ahead, into L2
 * (T1: into L1, a 16 KiB run evicts the one in hand), a few lines beside each head's work. A
 * run's blocks lie anywhere in the cache, so the hardware prefetchers restart at each one. Paired
 * against one burst per run into L1 (the ~150M model's shapes, 12 layers of K/V from memory,
 * blocks of 16 shuffled, 2 threads on a Zen 4): 1.7-2.1x at batch 1-64 and contexts 128-2048
 * (15-17 -> 26-31 GB/s; a plain read of the same blocks in the same order reaches 22-28), 1.5-1.9x
 * on the ~7M model's, 1.8-2.0x built for AVX2 on the same host; 2 or 4 runs ahead measured level
 * or slower. */
#define PF_RUNS 1
#define PF_HINT _MM_HINT_T1

/* Asks for part `part` of `parts` of the cache lines of the 16 keys from `pos` (within
 * [0, end), across blocks): every parts-th line. Spread over the heads' work, the run's 256
 * lines (128 of bf16) go out a few at a time instead of in one burst that fills the miss buffers
 * and stalls the arithmetic behind it. */
static inline void prefetch_part(const void *cache, const int32_t *table, int64_t pos,
                                 int64_t end, int64_t bs, int64_t row, int64_t part,
                                 int64_t parts, int64_t esz) {
    int64_t line0 = 0; /* the run's line index at this block's first line */
    for (int64_t left = 16; left > 0 && pos < end;) {
        int64_t cnt = bs - pos % bs;
        if (cnt > end - pos) cnt = end - pos;
        if (cnt > left) cnt = left;
        const char *p =
            (const char *)cache + ((int64_t)table[pos / bs] * bs + pos % bs) * row * esz;
        const int64_t lines = (cnt * row * esz + 63) / 64;
        for (int64_t i = line0 + (part - line0 % parts + parts) % parts; i < line0 + lines;
             i += parts)
            _mm_prefetch(p + (i - line0) * 64, PF_HINT);
        line0 += lines;
        pos += cnt;
        left -= cnt;
    }
}

/* An item reads K rows [begin, end) and then V rows [begin, end): one stream of 2n keys, of which
 * `at` is the one PF_RUNS runs ahead of the run in hand (K's tail runs into V's head). */
static inline void prefetch_ahead(const void *k_cache, const void *v_cache,
                                  const int32_t *table, int64_t begin, int64_t end, int64_t at,
                                  int64_t bs, int64_t row, int64_t part, int64_t parts,
                                  int64_t esz) {
    const int64_t n = end - begin;
    if (at < n) prefetch_part(k_cache, table, begin + at, end, bs, row, part, parts, esz);
    else if (at < 2 * n)
        prefetch_part(v_cache, table, begin + at - n, end, bs, row, part, parts, esz);
}

/* One item: for every head, softmax(q K^T * scale) V over keys [begin, end). Writes the
 * unnormalised output rows to o (H x D) and each head's max and sum to m and l. `scores` holds
 * H x (end - begin) floats, rounded up to a multiple of VL. The caches fp32, or bf16 with bf
 * (attend_any compiles both). */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const void *k_cache, const void *v_cache,
    const int32_t *restrict table, int64_t H, int64_t KVH, int64_t D, int64_t bs, int32_t begin,
    int32_t end, float scale, float *restrict scores, float *restrict o, float *restrict m,
    float *restrict l, const int bf) {
    const int64_t n = end - begin, G = H / KVH, row = KVH * D, esz = bf ? 2 : 4;
    const int64_t stride = (n + VL - 1) / VL * VL; /* scores row of one head */
    const int vec = D % VL == 0;
    /* Pass 1, K: runs of up to 16 keys that lie in one block (contiguous rows). */
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t pos0 = begin + t0;
        int64_t cnt = bs - pos0 % bs;
        if (cnt > n - t0) cnt = n - t0;
        if (cnt > 16) cnt = 16;
        const void *kb =
            kv_ptr(k_cache, ((int64_t)table[pos0 / bs] * bs + pos0 % bs) * row, bf);
        for (int64_t h = 0; h < H; h++) {
            prefetch_ahead(k_cache, v_cache, table, begin, end, t0 + PF_RUNS * 16, bs, row, h, H,
                           esz);
            const float *qh = q + h * D;
            const void *k0 = kv_ptr(kb, (h / G) * D, bf);
            float *s = scores + h * stride + t0;
            if (vec) {
                scores16(qh, k0, row, D, cnt, scale, s, bf);
            } else {
                for (int64_t t = 0; t < cnt; t++)
                    s[t] = dot(qh, kv_ptr(k0, t * row, bf), D, bf) * scale;
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
        const float mx = hmax_lanes(mv);
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
        l[h] = hsum_lanes(sum);
    }
    /* Pass 2, V: a run's rows at a time (they stay in L1 while every head uses them). */
    memset(o, 0, sizeof(float) * H * D);
    const void *rows[16];
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t pos0 = begin + t0;
        int64_t cnt = bs - pos0 % bs;
        if (cnt > n - t0) cnt = n - t0;
        if (cnt > 16) cnt = 16;
        const int64_t vb = ((int64_t)table[pos0 / bs] * bs + pos0 % bs) * row;
        for (int64_t h = 0; h < H; h++) {
            prefetch_ahead(k_cache, v_cache, table, begin, end, n + t0 + PF_RUNS * 16, bs, row, h,
                           H, esz);
            for (int64_t t = 0; t < cnt; t++)
                rows[t] = kv_ptr(v_cache, vb + t * row + (h / G) * D, bf);
            axpy_rows(o + h * D, scores + h * stride + t0, rows, cnt, D, bf);
        }
        t0 += cnt;
    }
}

static void attend_any(const float *restrict q, const void *k_cache, const void *v_cache,
                       const int32_t *restrict table, int64_t H, int64_t KVH, int64_t D,
                       int64_t bs, int32_t begin, int32_t end, float scale,
                       float *restrict scores, float *restrict o, float *restrict m,
                       float *restrict l, int kv_dtype) {
    if (kv_dtype == KVR_DTYPE_BF16)
        attend(q, k_cache, v_cache, table, H, KVH, D, bs, begin, end, scale, scores, o, m, l, 1);
    else
        attend(q, k_cache, v_cache, table, H, KVH, D, bs, begin, end, scale, scores, o, m, l, 0);
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

/* A head's softmax denominator: its keys' sum l at max m, plus the sink's e^(sink - m). */
static inline float with_sink(float l, float m, const float *sinks, int64_t h) {
    return sinks ? l + expf(sinks[h] - m) : l;
}

/* The plan's items and then the merge of cut sequences, shared among the threads of the
 * enclosing parallel region (every thread calls this; worksharing loops inside, each ending in
 * a barrier). Returns nonzero on this thread when its scratch could not be allocated. */
int kvr__decode_run(const kvr_decode_plan_t *pl, const float *q, const void *k_cache,
                    const void *v_cache, const int32_t *tables, float *out, int64_t H,
                    int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale, int kv_dtype,
                    const float *sinks) {
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
        attend_any(q + (int64_t)w.seq * H * D, k_cache, v_cache, tables + (int64_t)w.seq * W, H,
                   KVH, D, bs, w.begin, w.end, scale, scores, o, m, l, kv_dtype);
        if (w.slot < 0) {
            for (int64_t h = 0; h < H; h++) {
                const float inv = 1.f / with_sink(l[h], m[h], sinks, h);
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
            const float inv = 1.f / with_sink(total_l, mx, sinks, h);
            for (int64_t d = 0; d < D; d++) oh[d] *= inv;
        }
    }
    return !ok;
}

/* The caches fp32 or bf16 (kv_dtype: KVR_DTYPE_F32 or KVR_DTYPE_BF16); sinks [H] or NULL.
 * Returns 0, or a negative number on bad arguments / out of memory. */
int kvr_paged_decode(const float *q, const void *k_cache, const void *v_cache,
                     const int32_t *tables, const int32_t *lens, float *out, int64_t N, int64_t H,
                     int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale, int64_t window,
                     int64_t min_part, int num_threads, int kv_dtype, const float *sinks) {
    if (N <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || min_part <= 0 || num_threads < 1 ||
        (kv_dtype != KVR_DTYPE_F32 && kv_dtype != KVR_DTYPE_BF16))
        return -1;
    kvr_decode_plan_t pl;
    const int rc = kvr__decode_plan(lens, N, H, D, bs, W, window, min_part, num_threads, &pl);
    if (rc) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(|:failed)
    failed |= kvr__decode_run(&pl, q, k_cache, v_cache, tables, out, H, KVH, D, bs, W, scale,
                              kv_dtype, sinks);
    kvr__decode_plan_free(&pl);
    return failed ? -3 : 0;
}

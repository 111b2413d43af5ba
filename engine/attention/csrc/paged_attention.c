/* Paged attention kernels for the CPU (fp32), built on first use by kvrelay.engine.attention.native.
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

#define KVR_ABI_VERSION 2

int kvr_abi_version(void) { return KVR_ABI_VERSION; }

/* 16 floats; aligned(4) lets it load from and store to any float address. */
typedef float vf __attribute__((vector_size(64), aligned(4)));
#define VL 16

typedef struct {
    int32_t seq;
    int32_t begin; /* first key */
    int32_t end;   /* one past the last key */
    int32_t slot;  /* partial-result slot, or -1 when this is its sequence's only item */
} item_t;

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    if (d % VL == 0) {
        vf acc = {0};
        for (int64_t i = 0; i < d; i += VL) acc += *(const vf *)(a + i) * *(const vf *)(b + i);
        return hsum(acc);
    }
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* o[D] += sum_t p[t] * rows[t][D]; rows are `stride` floats apart. */
static inline void axpy_rows(float *restrict o, const float *restrict p,
                             const float *const *restrict rows, int64_t n, int64_t d) {
    if (d % VL == 0) {
        for (int64_t i = 0; i < d; i += VL) {
            vf acc = *(vf *)(o + i);
            for (int64_t t = 0; t < n; t++) acc += p[t] * *(const vf *)(rows[t] + i);
            *(vf *)(o + i) = acc;
        }
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) o[i] += p[t] * rows[t][i];
}

/* One item: for every head, softmax(q K^T * scale) V over keys [begin, end). Writes the
 * unnormalised output rows to o (H x D) and each head's max and sum to m and l. `scores` holds
 * H x (end - begin) floats. */
static void attend(const float *restrict q, const float *restrict k_cache,
                   const float *restrict v_cache, const int32_t *restrict table, int64_t H,
                   int64_t KVH, int64_t D, int64_t bs, int32_t begin, int32_t end, float scale,
                   float *restrict scores, float *restrict o, float *restrict m,
                   float *restrict l) {
    const int64_t n = end - begin, G = H / KVH, row = KVH * D;
    for (int64_t h = 0; h < H; h++) m[h] = -FLT_MAX;
    /* Pass 1, K: one slot row (every KV head) at a time. */
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = begin + t;
        const float *kr = k_cache + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
        for (int64_t h = 0; h < H; h++) {
            const float s = dot(q + h * D, kr + (h / G) * D, D) * scale;
            scores[h * n + t] = s;
            if (s > m[h]) m[h] = s;
        }
    }
    for (int64_t h = 0; h < H; h++) {
        float sum = 0.f;
        float *sh = scores + h * n;
        for (int64_t t = 0; t < n; t++) {
            sh[t] = expf(sh[t] - m[h]);
            sum += sh[t];
        }
        l[h] = sum;
    }
    /* Pass 2, V: a block's rows at a time (they stay in L1 while every head uses them). */
    memset(o, 0, sizeof(float) * H * D);
    const float *rows[64];
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t pos0 = begin + t0;
        int64_t cnt = bs - pos0 % bs;
        if (cnt > n - t0) cnt = n - t0;
        if (cnt > 64) cnt = 64;
        const float *vb = v_cache + ((int64_t)table[pos0 / bs] * bs + pos0 % bs) * row;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = 0; t < cnt; t++) rows[t] = vb + t * row + (h / G) * D;
            axpy_rows(o + h * D, scores + h * n + t0, rows, cnt, D);
        }
        t0 += cnt;
    }
}

/* Returns 0, or a negative number on bad arguments / out of memory. */
int kvr_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *tables, const int32_t *lens, float *out, int64_t N,
                         int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale,
                         int64_t window, int64_t min_part, int num_threads) {
    if (N <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || min_part <= 0 || num_threads < 1)
        return -1;
    /* Partition size: enough items for ~4 per thread, never below min_part keys. */
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
    item_t *items = malloc(sizeof(item_t) * n_items);
    /* Partial results: per slot m[H], l[H], o[H * D]. */
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
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * H * part);
        float *tmp = malloc(sizeof(float) * H * 2);
        if (!scores || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (!scores || !tmp) continue;
            const item_t w = items[i];
            float *m, *l, *o;
            if (w.slot < 0) {
                m = tmp, l = tmp + H, o = out + (int64_t)w.seq * H * D;
            } else {
                float *base = partial + (int64_t)w.slot * H * (D + 2);
                m = base, l = base + H, o = base + 2 * H;
            }
            attend(q + (int64_t)w.seq * H * D, k_cache, v_cache, tables + (int64_t)w.seq * W, H,
                   KVH, D, bs, w.begin, w.end, scale, scores, o, m, l);
            if (w.slot < 0) {
                for (int64_t h = 0; h < H; h++) {
                    const float inv = 1.f / l[h];
                    for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
                }
            }
        }
        free(scores);
        free(tmp);
    }
    if (failed) {
        free(items);
        free(partial);
        return -3;
    }
    /* Merge the partitions of long sequences (a sequence's items are adjacent). */
    if (n_slots) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t i = 0; i < n_items; i++) {
            const item_t w = items[i];
            if (w.slot < 0 || (i > 0 && items[i - 1].seq == w.seq)) continue;
            int64_t nparts = 1;
            while (i + nparts < n_items && items[i + nparts].seq == w.seq) nparts++;
            float *o = out + (int64_t)w.seq * H * D;
            for (int64_t h = 0; h < H; h++) {
                float mx = -FLT_MAX;
                for (int64_t p = 0; p < nparts; p++) {
                    const float *base = partial + (int64_t)(w.slot + p) * H * (D + 2);
                    if (base[h] > mx) mx = base[h];
                }
                float total_l = 0.f;
                float *oh = o + h * D;
                memset(oh, 0, sizeof(float) * D);
                for (int64_t p = 0; p < nparts; p++) {
                    const float *base = partial + (int64_t)(w.slot + p) * H * (D + 2);
                    const float c = expf(base[h] - mx);
                    total_l += c * base[H + h];
                    const float *op = base + 2 * H + h * D;
                    for (int64_t d = 0; d < D; d++) oh[d] += c * op[d];
                }
                const float inv = 1.f / total_l;
                for (int64_t d = 0; d < D; d++) oh[d] *= inv;
            }
        }
    }
    free(items);
    free(partial);
    return 0;
}

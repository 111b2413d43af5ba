/* A Llama-family decoder layer for a step of decodes and small prefill chunks, in one call and
 * one parallel region.
 *
 * Called from Python, a layer is ~10 native calls and as many torch ops: each a ctypes call, an
 * OpenMP fork and join, a fresh output tensor. At decode sizes that glue, not the arithmetic,
 * was ~3.5 ms of a 24 ms batch-1 step of the ~150M model and over half a step of the ~7M one.
 * Here the stages run back to back inside one region, separated by the barriers that end their
 * worksharing loops, over scratch allocated once per call:
 *
 *   (x = in_norm(h), first layer only)      qkv = x Wqkv^T
 *   q, k roped; k and v into the caches at the rows' slots
 *   att = paged decode attention of q       delta = att Wo^T
 *   h += delta, x = post_norm(h)            gu = x Wgu^T, act = silu(gate) * up
 *   delta = act Wdown^T                     h += delta, x = next_norm(h) (if there is one;
 *                                           after the last layer, the final norm's if asked)
 *
 * The kernels are the same ones the per-op path calls (kernels.h), so both give identical
 * results. Rows are the step's prefill chunks' tokens (the first prefill_rows, spans of them,
 * each chunk's attention causal over its cached prefix and itself: the paged prefill kernel)
 * and then its decodes, one each: h and x [rows, hidden] are updated in place. A step of
 * decodes alone has no spans.
 *
 * bf16 weights and a bf16 KV cache (wdtype, kv_dtype): the kernels widen them as they load them
 * and compute in fp32, as the per-op path does; K and V go into a bf16 cache rounded to nearest
 * even, as the per-op path's torch store rounds them (kvr__store_kv_row), so both paths leave the
 * same cache and give the same results.
 *
 * KV head groups (kv_groups > 1): the cache keeps each group of kv_heads / kv_groups heads in a
 * tensor of its own, group_stride values after the previous one (the layout of a rank of that
 * many tensor-parallel ranks, so KV moves between TP sizes rank to rank). K and V go to their
 * group's rows, q is roped group-major (each group's heads of every row together), attention
 * runs per group over its cache, and its output is put back in row-major order for Wo.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "kernels.h"


/* Returns 0; -1 on bad arguments, -2 for a context outside its block table, -3 out of memory. */
int kvr_decode_layer_f32(const kvr_layer_t *L, const kvr_step_t *S) {
    const int64_t M = S->rows, hid = L->hidden, H = L->heads, KVH = L->kv_heads;
    const int64_t D = L->head_dim, I = L->inter, qs = H * D, kvs = KVH * D, nqkv = qs + 2 * kvs;
    const int64_t G = L->kv_groups, gs = L->group_stride;
    const int64_t P = S->prefill_rows, N = M - P; /* prefill rows, then N decodes */
    if (M <= 0) return 0;
    if (H <= 0 || KVH <= 0 || H % KVH || D <= 0 || D % 2 || S->block_size <= 0 ||
        S->min_part <= 0 || S->nthreads < 1 || G < 1 || KVH % G || (G > 1 && gs <= 0) ||
        P < 0 || P > M || (P > 0) != (S->spans > 0) || L->kblock < 0 ||
        (L->wdtype != KVR_DTYPE_F32 && L->wdtype != KVR_DTYPE_BF16) ||
        (L->kv_dtype != KVR_DTYPE_F32 && L->kv_dtype != KVR_DTYPE_BF16))
        return -1;
    const int wdt = (int)L->wdtype, kvd = (int)L->kv_dtype;
    const int64_t esz = kvd == KVR_DTYPE_BF16 ? 2 : 4; /* bytes per cache value */
    const int64_t hq = H / G, hk = KVH / G, gq = hq * D, gk = hk * D; /* per group */
    for (int64_t r = 0; r < M; r++)
        if (S->slots[r] < 0 || S->positions[r] < 0 || S->positions[r] >= S->max_pos) return -1;
    int64_t covered = 0;
    for (int64_t j = 0; j < S->spans; j++) {
        if (S->span_start[j] != covered) return -1; /* the spans tile the prefill rows */
        covered += S->span_len[j];
    }
    if (covered != P) return -1;
    kvr_decode_plan_t pl = {0};
    kvr_prefill_plan_t pp = {0};
    int rc = N ? kvr__decode_plan(S->lens, N, H, D, S->block_size, S->width, L->window,
                                  S->min_part, S->nthreads, &pl)
               : 0;
    if (!rc && P)
        rc = kvr__prefill_plan(S->span_start, S->span_len, S->span_ctx, S->spans, hk, D,
                               S->block_size, S->span_width, &pp);
    /* (and with a bf16 cache, the roped K rows before they are rounded into it) */
    const int64_t floats = M * (nqkv + (G > 1 ? 3 : 2) * qs + hid + 2 * I + I +
                                (kvd == KVR_DTYPE_BF16 ? kvs : 0));
    float *buf = rc ? NULL : malloc(sizeof(float) * floats);
    if (!buf) {
        if (N) kvr__decode_plan_free(&pl);
        if (P) kvr__prefill_plan_free(&pp);
        return rc ? rc : -3;
    }
    float *qkv = buf, *q = qkv + M * nqkv, *att = q + M * qs, *delta = att + M * qs;
    float *gu = delta + M * hid, *act = gu + M * 2 * I;
    float *att_g = G > 1 ? act + M * I : att; /* attention's output, group-major */
    float *kr = act + M * I + (G > 1 ? M * qs : 0); /* [M, kvs]: bf16 caches only */
    const int64_t half = D / 2;
    int failed = 0;
#pragma omp parallel num_threads(S->nthreads) reduction(|:failed)
    {
        if (L->in_w) { /* the norm kvr_add_rmsnorm_f32 runs on h alone: the same bits */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                kvr__add_rmsnorm_row(S->h + r * hid, NULL, L->in_w, S->x + r * hid, hid, L->in_eps);
        }
        failed |= kvr__gemm_for(S->x, L->qkv, L->qkv_b, qkv, M, hid, nqkv, L->kblock, wdt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            const float *row = qkv + r * nqkv, *c = S->cos + S->positions[r] * half,
                        *s = S->sin + S->positions[r] * half;
            for (int64_t g = 0; g < G; g++) { /* G == 1: q [rows, H, D], one cache row */
                const int64_t at = (g * gs + S->slots[r] * gk) * esz; /* bytes into a cache */
                kvr__rope_row(row + g * gq, q + (g * M + r) * gq, hq, D, c, s);
                if (kvd == KVR_DTYPE_BF16) {
                    kvr__rope_row(row + qs + g * gk, kr + r * kvs + g * gk, hk, D, c, s);
                    kvr__store_kv_row((char *)L->k_cache + at, kr + r * kvs + g * gk, gk, kvd);
                } else {
                    kvr__rope_row(row + qs + g * gk, (float *)((char *)L->k_cache + at), hk, D,
                                  c, s);
                }
                kvr__store_kv_row((char *)L->v_cache + at, row + qs + kvs + g * gk, gk, kvd);
            }
        }
        for (int64_t g = 0; g < G; g++) { /* group g's rows: prefill, then decodes */
            const float *qg = q + g * M * gq;
            const void *kc = (const char *)L->k_cache + g * gs * esz,
                       *vc = (const char *)L->v_cache + g * gs * esz;
            float *og = att_g + g * M * gq;
            if (P)
                failed |= kvr__prefill_run(&pp, qg, kc, vc, S->span_tables, og, hq, hk, D,
                                           S->block_size, S->span_width, L->scale, L->window,
                                           kvd, NULL);
            if (N)
                failed |= kvr__decode_run(&pl, qg + P * gq, kc, vc, S->tables, og + P * gq, hq,
                                          hk, D, S->block_size, S->width, L->scale, kvd, NULL);
        }
        if (G > 1) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                for (int64_t g = 0; g < G; g++)
                    memcpy(att + r * qs + g * gq, att_g + (g * M + r) * gq, sizeof(float) * gq);
        }
        failed |= kvr__gemm_for(att, L->o, L->o_b, delta, M, qs, hid, L->kblock, wdt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            kvr__add_rmsnorm_row(S->h + r * hid, delta + r * hid, L->post_w, S->x + r * hid, hid,
                                 L->eps);
        failed |= kvr__gemm_for(S->x, L->gu, L->gu_b, gu, M, hid, 2 * I, L->kblock, wdt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++)
            kvr__silu_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
        failed |= kvr__gemm_for(act, L->down, L->down_b, delta, M, I, hid, L->kblock, wdt);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            float *hr = S->h + r * hid;
            const float *dr = delta + r * hid;
            if (L->next_w) {
                kvr__add_rmsnorm_row(hr, dr, L->next_w, S->x + r * hid, hid, L->next_eps);
            } else {
                for (int64_t i = 0; i < hid; i++) hr[i] += dr[i];
                if (L->final_w) /* the norm kvr_add_rmsnorm_f32 runs on h alone: the same bits */
                    kvr__add_rmsnorm_row(hr, NULL, L->final_w, S->x + r * hid, hid, L->final_eps);
            }
        }
    }
    free(buf);
    if (N) kvr__decode_plan_free(&pl);
    if (P) kvr__prefill_plan_free(&pp);
    return failed ? -3 : 0;
}

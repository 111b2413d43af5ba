/* The kernels' internal entry points shared across the library's files (not part of its ABI:
 * Python calls only the kvr_* functions without a double underscore). */
#ifndef KVR_KERNELS_H
#define KVR_KERNELS_H
#include <stdint.h>

/* gemm.c: y = x W^T (+ bias) over packed panels (K-blocked by kb; fp32 or bf16 elements, wdt:
 * abi.h's KVR_DTYPE_*), a worksharing loop of the enclosing region; nonzero on a thread whose
 * scratch could not be allocated. */
int kvr__gemm_for(const float *x, const void *wp, const float *bias, float *y, int64_t M,
                  int64_t K, int64_t N, int64_t kb, int wdt);

/* pointwise.c: one row each. */
void kvr__add_rmsnorm_row(float *x, const float *d, const float *w, float *y, int64_t dim,
                          float eps);
void kvr__rope_row(const float *a, float *o, int64_t heads, int64_t hd, const float *c,
                   const float *s);
void kvr__silu_mul_row(const float *g, const float *u, float *o, int64_t inter);
void kvr__store_kv_row(void *dst, const float *src, int64_t n, int kv_dtype);

/* paged_decode.c: decode attention as a plan (made before the parallel region) and its run
 * (every thread of the region calls it); q and out fp32, the caches fp32 or bf16 (kv_dtype). */
typedef struct {
    int32_t seq;
    int32_t begin; /* first key */
    int32_t end;   /* one past the last key */
    int32_t slot;  /* partial-result slot, or -1 when this is its sequence's only item */
} item_t;

typedef struct {
    item_t *items;
    int64_t n_items, part; /* part: keys per partition */
    float *partial;        /* per slot m[H], l[H], o[H * D]; NULL when no sequence is cut */
    int64_t n_slots;
} kvr_decode_plan_t;

int kvr__decode_plan(const int32_t *lens, int64_t N, int64_t H, int64_t D, int64_t bs,
                     int64_t W, int64_t window, int64_t min_part, int num_threads,
                     kvr_decode_plan_t *pl);
void kvr__decode_plan_free(kvr_decode_plan_t *pl);
int kvr__decode_run(const kvr_decode_plan_t *pl, const float *q, const void *k_cache,
                    const void *v_cache, const int32_t *tables, float *out, int64_t H,
                    int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale, int kv_dtype,
                    const float *sinks);
/* paged_prefill.c: prefill attention as a plan and its run, the same way. */
typedef struct {
    int32_t span;
    int32_t kvh;
    int32_t q0; /* first query row of the tile, within the span */
    int32_t nq; /* rows in the tile */
} kvr_pitem_t;

typedef struct {
    kvr_pitem_t *items;
    int64_t n_items;
    int64_t *kt_off; /* per (span, KV head): its transposed keys' offset in kt */
    float *kt;
    const int32_t *q_start, *q_len, *ctx_len; /* the spans, [S] each (the caller's arrays) */
    int64_t S;
} kvr_prefill_plan_t;

int kvr__prefill_plan(const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                      int64_t S, int64_t KVH, int64_t D, int64_t bs, int64_t W,
                      kvr_prefill_plan_t *pl);
void kvr__prefill_plan_free(kvr_prefill_plan_t *pl);
int kvr__prefill_run(const kvr_prefill_plan_t *pl, const float *q, const void *k_cache,
                     const void *v_cache, const int32_t *tables, float *out, int64_t H,
                     int64_t KVH, int64_t D, int64_t bs, int64_t W, float scale, int64_t window,
                     int kv_dtype, const float *sinks);
#endif

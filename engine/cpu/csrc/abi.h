/* The library's ABI as Python sees it: its version and the structs engine/cpu/fused_decode.py
 * mirrors with ctypes. One source for both sides: engine/cpu/native.py reads KVR_ABI_VERSION from this
 * file and refuses a library that reports another, and tests/test_native_abi.py checks the ctypes
 * structs against these declarations and their compiled offsets. Change a struct: bump the
 * version. */
#ifndef KVR_ABI_H
#define KVR_ABI_H
#include <stdint.h>

#define KVR_ABI_VERSION 19

/* Element types of weights and KV caches (the kv_dtype / wdtype arguments and fields): bf16 is
 * stored as the top 16 bits of an fp32, widened on load, rounded to nearest even on store. */
#define KVR_DTYPE_F32 0
#define KVR_DTYPE_BF16 1

/* decode_layer.c: one decoder layer's weights and KV cache, and one step's rows. The activations,
 * biases and norm weights are fp32; the panels are of wdtype and the caches of kv_dtype. */
typedef struct {
    const void *qkv;  /* panels (wdtype), each followed by its fp32 bias or NULL */
    const float *qkv_b;
    const void *o;
    const float *o_b;
    const void *gu;
    const float *gu_b;
    const void *down;
    const float *down_b;
    const float *post_w, *next_w; /* RMSNorm weights; next_w NULL after the last layer */
    void *k_cache, *v_cache;      /* flat [slots, kv_heads / kv_groups, head_dim]: group 0's */
    int64_t hidden, heads, kv_heads, head_dim, inter, window;
    float eps, next_eps, scale;
    int64_t kv_groups, group_stride; /* head groups (1: none); values from one group to the next */
    int64_t kblock;                  /* the weights' K blocks (gemm.c's panel_at) */
    const float *final_w;            /* last layer only, or NULL: the final norm's weight */
    float final_eps;
    const float *in_w;               /* first layer only, or NULL: x = in_norm(h) comes first */
    float in_eps;
    int64_t wdtype, kv_dtype;        /* KVR_DTYPE_F32 or KVR_DTYPE_BF16 each */
} kvr_layer_t;

typedef struct {
    int64_t rows;
    const float *cos, *sin;       /* the RoPE tables, [max_pos, head_dim / 2] */
    const int64_t *positions;     /* [rows], each row's position: its row of the tables */
    int64_t max_pos;
    const int64_t *slots;         /* [rows] */
    const int32_t *tables, *lens; /* the decodes': [rows - prefill_rows, width], [..] */
    int64_t width, block_size, min_part;
    float *h, *x; /* the residual stream and input_norm(h), [rows, hidden] */
    int nthreads;
    /* Prefill chunks: spans of the first prefill_rows rows (first row, rows, keys visible to
     * the last row, [spans] each), their block tables [spans, span_width]. */
    int64_t prefill_rows, spans, span_width;
    const int32_t *span_start, *span_len, *span_ctx, *span_tables;
} kvr_step_t;

#endif

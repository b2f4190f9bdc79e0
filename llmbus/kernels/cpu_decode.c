/* CPU kernels: paged decode attention, fused (one query token per sequence reads its K/V blocks in
   place); at the end, the bf16 model's RMSNorm and SwiGLU in one pass each, prefill attention,
   rotary embedding and the bf16 linear layers' product.

   The torch path gathers every sequence's blocks into a workspace and runs two batched matmuls over
   the copy, so each K/V byte crosses memory three times and every sequence is padded to the longest
   of its group. Here a task is one sequence (or, when the batch is too small to keep the threads
   busy, one of its KV heads): for each KV head, its G query rows (GQA) score a block's keys, fold
   them into a running softmax (max, sum, fp32 accumulator), and add the block's values, reading
   only the sequence's own tokens, once. Built by llmbus/kernels/cpu_native.py with -O3 -march=native so
   the loops over head_dim vectorize (bf16 scores use the CPU's bf16 dot instruction where it has
   one); threads come from the OpenMP runtime torch already loaded (same libgomp soname), sized by
   the caller.

   Cache layout (llmbus/kernels/cpu.py): [2, num_blocks, block_size, Hkv, D], keys then values, contiguous.
   Element types: float32, or bfloat16 as uint16_t (widened by a shift; stored round-to-nearest-even). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
/* bf16 x bf16 dot product accumulated in fp32 by the CPU's bf16 dot instruction, straight from the
   cache (no widening); d a multiple of 32 */
static inline float dot_raw_bf16(const uint16_t *a, const uint16_t *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    return _mm512_reduce_add_ps(acc);
}
#else
#define HAVE_DPBF16 0
static inline float dot_raw_bf16(const uint16_t *a, const uint16_t *b, int64_t d) { (void)a; (void)b; (void)d; return 0.0f; }
#endif

#define MAX_ROWS 32 /* query rows (heads) one task holds: at least one KV head's group */
#define MAX_D 256
#define MAX_BS 64
/* NOTE: a task's buffers (query rows, accumulators, a block) take ~140 KB of stack: fine for glibc
   threads (8 MB), too much for musl's 128 KB defaults or a small OMP_STACKSIZE. */

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float x) { return x; }

/* x rounded to bf16 and back: an intermediate torch's bf16 ops would have stored */
static inline float bf16_round(float x) { return bf16_load(bf16_store(x)); }

/* IEEE half (int8 caches' default scale type) to fp32 by hand: no _Float16 needed (gcc < 12). */
static inline float f16_load(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h); /* one instruction, the same value (NaN payloads aside) */
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal (or zero): man x 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float f32_store(float x) { return x; }

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r); pure arithmetic, so the
   loops that call it vectorize. Relative error < 4e-6 as built (-fassociative-math lets the
   compiler merge the two-part ln 2 reduction; 8e-8 without it), far below bf16's rounding. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.98756912e-4f;
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((n == n ? (int32_t)n : 0) + 127) << 23; /* NaN in, NaN out (p), no UB cast */
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* acc[0:d] += sum_t w[t] * rows[t][0:d]. With AVX-512 the accumulator stays in registers over
   the rows (plain C kept it in memory: a store-to-load chain per row and vector); acc and rows
   64-byte aligned. */
static inline __attribute__((always_inline)) void add_weighted(float *acc, const float *w, float (*rows)[MAX_D],
                                                               int64_t n, const int64_t d) {
#ifdef __AVX512F__
    if (d % 16 == 0) {
        __m512 o[MAX_D / 16];
        for (int64_t v = 0; v < d / 16; v++) o[v] = _mm512_load_ps(acc + 16 * v);
        for (int64_t t = 0; t < n; t++) {
            const __m512 x = _mm512_set1_ps(w[t]);
            for (int64_t v = 0; v < d / 16; v++) o[v] = _mm512_fmadd_ps(x, _mm512_load_ps(rows[t] + 16 * v), o[v]);
        }
        for (int64_t v = 0; v < d / 16; v++) _mm512_store_ps(acc + 16 * v, o[v]);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) acc[i] += w[t] * rows[t][i];
}

/* int4 caches (llmbus.kv.formats), as llmbus.kernels.reference.dequantize_blocks reads them (same
   operations in the same order). data: uint8 [2, N, bs, Hkv, D/2], low nibble the even channel;
   k_meta [N, Hkv, key_slots]: for a full block, per channel codes m | M << 8 and the head's (lo, hi)
   at slots D, D + 1; for a partial one, per token (scale, min) pairs in groups of gk channels;
   v_meta fp16 [N, bs, Hkv, D/gv, 2]: per token (scale, min) in groups of gv. An INT4 sequence's
   partial last block may instead sit exact in a tail row (k_tail, v_tail: the model dtype,
   [rows * bs, Hkv, D]; row[b] per sequence, -1: none). */
typedef struct {
    const uint8_t *data;
    const uint16_t *k_meta, *v_meta;
    const void *k_tail, *v_tail;
    const int32_t *rows;
    int64_t num_blocks, bs, hkv, d, key_slots, gk, gv;
    int per_token; /* INT4R: every block's keys per token */
} int4_src;

/* Whether the int4 entries take this shape: even groups dividing head_dim (a byte's two nibbles
   share a group) and k_meta rows long enough for either key encoding. */
/* An INT4 layout whose keys are per token only (INT4R's: no block holds per-channel ranges). */
static inline int int4_token_shape_ok(int64_t d, int64_t bs, int64_t key_slots, int64_t gk, int64_t gv) {
    return d <= MAX_D && d % 2 == 0 && gk >= 2 && gv >= 2 && d % gk == 0 && d % gv == 0 && gk % 2 == 0
           && gv % 2 == 0 && key_slots >= 2 * bs * (d / gk);
}

static inline int int4_shape_ok(int64_t d, int64_t bs, int64_t key_slots, int64_t gk, int64_t gv) {
    return int4_token_shape_ok(d, bs, key_slots, gk, gv) && key_slots >= d + 2;
}

/* Where channel i goes in a widened row: its own place, or (parity) the even channels first, then
   the odd ones: the packed bytes' two nibbles then widen into two contiguous runs. */
static inline int64_t i4_col(int64_t i, int64_t half, int parity) { return parity ? (i & 1) * half + (i >> 1) : i; }

/* Bytes [j0, j1) of a row (channels 2 j0 ... 2 j1 - 1) to fp32 in r, min + code * scale: per column
   (MIN, SCALE index arrays by column) or one pair for all (MIN, SCALE scalars). */
#define INT4_BYTES(p, j0, j1, half, parity, r, MIN, SCALE)                                              \
    if (parity) {                                                                                       \
        _Pragma("omp simd")                                                                             \
        for (int64_t j = j0; j < j1; j++) {                                                             \
            r[j] = MIN(j) + (float)(p[j] & 15u) * SCALE(j);                                             \
            r[half + j] = MIN(half + j) + (float)(p[j] >> 4) * SCALE(half + j);                         \
        }                                                                                               \
    } else                                                                                              \
        for (int64_t j = j0; j < j1; j++) {                                                             \
            r[2 * j] = MIN(2 * j) + (float)(p[j] & 15u) * SCALE(2 * j);                                 \
            r[2 * j + 1] = MIN(2 * j + 1) + (float)(p[j] >> 4) * SCALE(2 * j + 1);                      \
        }

/* A row whose (scale, min) pairs come per group of g channels (g even: a byte's two nibbles share
   a group), as fp16 pairs at src[0], src[1], src[2], ... */
static inline __attribute__((always_inline)) void int4_row_groups(const uint8_t *restrict p, int64_t half, int parity,
                                                                  const uint16_t *src, int64_t g, float *restrict r) {
    for (int64_t k = 0; k < 2 * half / g; k++) {
        const float sc = f16_load(src[2 * k]), mn = f16_load(src[2 * k + 1]);
#define PAIR_MIN(i) mn
#define PAIR_SCALE(i) sc
        INT4_BYTES(p, k * g / 2, (k + 1) * g / 2, half, parity, r, PAIR_MIN, PAIR_SCALE)
#undef PAIR_MIN
#undef PAIR_SCALE
    }
}

/* Keys of tokens [0, n) of block b, KV head h, widened to fp32 rows out + t * stride (columns in
   channel order, or by parity: i4_col). */
static inline __attribute__((always_inline)) void int4_keys(const int4_src *c, int64_t b, int64_t h, int full,
                                                            int64_t n, float *out, int64_t stride, int parity) {
    const int64_t d = c->d, half = d / 2, row = c->hkv * half;
    const uint16_t *km = c->k_meta + (b * c->hkv + h) * c->key_slots;
    if (!full) {
        for (int64_t o = 0; o < n; o++)
            int4_row_groups(c->data + (b * c->bs + o) * row + h * half, half, parity, km + 2 * o * (d / c->gk), c->gk,
                            out + o * stride);
        return;
    }
    float cmin[MAX_D], cscale[MAX_D];
    const float lo = f16_load(km[d]), hi = f16_load(km[d + 1]), step = (hi - lo) / 255.0f;
    for (int64_t i = 0; i < d; i++) {
        const float m = (float)(km[i] & 0xffu), big = (float)(km[i] >> 8);
        cmin[i4_col(i, half, parity)] = lo + m * step;
        cscale[i4_col(i, half, parity)] = (big - m) * step / 15.0f;
    }
#define COL_MIN(i) cmin[i]
#define COL_SCALE(i) cscale[i]
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *restrict p = c->data + (b * c->bs + o) * row + h * half;
        float *restrict r = out + o * stride;
        INT4_BYTES(p, 0, half, half, parity, r, COL_MIN, COL_SCALE)
    }
#undef COL_MIN
#undef COL_SCALE
}

/* Values of tokens [0, n) of block b, KV head h, as int4_keys. */
static inline __attribute__((always_inline)) void int4_values(const int4_src *c, int64_t b, int64_t h, int64_t n,
                                                              float *out, int64_t stride, int parity) {
    const int64_t d = c->d, half = d / 2, row = c->hkv * half;
    const uint8_t *vdata = c->data + c->num_blocks * c->bs * row;
    for (int64_t o = 0; o < n; o++)
        int4_row_groups(vdata + (b * c->bs + o) * row + h * half, half, parity,
                        c->v_meta + ((b * c->bs + o) * c->hkv + h) * (d / c->gv) * 2, c->gv, out + o * stride);
}

/* One task: a sequence's KV heads [h0, h1), block by block, every head of a block before the next
   block (the block's rows are contiguous across heads, so each cache line fetched is used at once).
   Inlined into callers with a constant head dim (64, 128) so the loops over it unroll and a query
   row's accumulator stays in registers across a block's tokens; a block's keys and values are
   widened to fp32 once per head, into a buffer that stays in L1. QT: the queries' and output's
   element type; KT: the cache's; SCALED: int8 entries times a per (token, head) scale of type ST
   (``llmbus/kernels/kv_cache.py``'s int8 format: scales [2, N, bs, Hkv] beside the data). I4: int4 blocks
   (``i4``; KT uint8_t, D/2 bytes a head's row), widened by int4_keys / int4_values, or from the
   sequence's tail row ``trow`` (-1: none) for its partial last block; with the channels by parity
   (i4_col) in the query rows, the buffer and the accumulator alike (a dot and a weighted sum take
   any order), unshuffled at the end. */
#define DEFINE_TASK(NAME, QT, LOADQ, STOREQ, KT, LOADK, ST, LOADS, SCALED, RAW_DOT, USE_RAW, I4)        \
    static inline __attribute__((always_inline)) void NAME(                                             \
        const KT *kc, const KT *vc, const ST *ksc, const ST *vsc, const QT *q, QT *out,                 \
        const int32_t *table, int64_t len, int64_t h0, int64_t h1, int64_t hkv, int64_t g_rows,         \
        const int64_t d, int64_t bs, int64_t num_blocks, float scale, int64_t *bad,                     \
        const int4_src *i4, int64_t trow) {                                                             \
        float qf[MAX_ROWS][MAX_D] __attribute__((aligned(64)));                                         \
        float acc[MAX_ROWS][MAX_D] __attribute__((aligned(64)));                                        \
        float buf[MAX_BS][MAX_D] __attribute__((aligned(64)));                                          \
        float s[MAX_ROWS][MAX_BS], m[MAX_ROWS], l[MAX_ROWS];                                            \
        const int64_t drow = I4 ? d / 2 : d; /* elements of one head's row in the cache */             \
        const int64_t tok = hkv * drow; /* elements from one token to the next within a block */     \
        const int64_t rows = (h1 - h0) * g_rows;                                                        \
        const QT *q0 = q + h0 * g_rows * d;                                                             \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            for (int64_t i = 0; i < d; i++) {                                                           \
                qf[r][i4_col(i, d / 2, I4)] = LOADQ(q0[r * d + i]) * scale;                             \
                acc[r][i] = 0.0f;                                                                       \
            }                                                                                           \
            m[r] = 0.0f;                                                                                \
            l[r] = 0.0f;                                                                                \
        }                                                                                               \
        const int64_t nblk = (len + bs - 1) / bs;                                                       \
        const int64_t span = (h1 - h0) * drow * (int64_t)sizeof(KT); /* bytes of one token's heads */   \
        for (int64_t j = 0; j < nblk; j++) {                                                            \
            const int64_t blk = table[j];                                                               \
            if (blk < 0 || blk >= num_blocks) {                                                         \
                *bad = 1;                                                                               \
                return;                                                                                 \
            }                                                                                           \
            const int64_t n = len - j * bs < bs ? len - j * bs : bs;                                    \
            /* loads wait on memory: the next block is prefetched into L2 while this one computes,  \
               spread over the work (each head fetches a share of the next block's tokens: their  \
               keys before its scores, their values one token at a time as it widens its own).     \
               One burst of the whole block's lines at the start, as before, filled the core's     \
               miss queue and stalled there instead of overlapping: 12-layer attention at batch    \
               32, cold caches, 11.0-11.2 -> 8.9-9.1 ms (scripts/bench_cpu_attention.py). */        \
            const int64_t nxt = j + 1 < nblk ? table[j + 1] : -1;                                       \
            const int ahead = nxt >= 0 && nxt < num_blocks;                                             \
            const char *kn = ahead ? (const char *)(kc + (nxt * bs * hkv + h0) * drow) : 0;             \
            const char *vn = ahead ? (const char *)(vc + (nxt * bs * hkv + h0) * drow) : 0;             \
            if (SCALED && ahead) /* int8's scales: the next block's (all its heads') lines, once */     \
                for (int64_t o = 0; o < bs * hkv * (int64_t)sizeof(ST); o += 64) {                         \
                    __builtin_prefetch((const char *)(ksc + nxt * bs * hkv) + o, 0, 2);                     \
                    __builtin_prefetch((const char *)(vsc + nxt * bs * hkv) + o, 0, 2);                     \
                }                                                                                       \
            if (I4 && ahead) { /* int4's key ranges and value (scale, min) pairs: likewise */           \
                const int64_t kspan = hkv * i4->key_slots * 2, vspan = bs * hkv * (d / i4->gv) * 4;      \
                for (int64_t o = 0; o < kspan; o += 64)                                                 \
                    __builtin_prefetch((const char *)(i4->k_meta + nxt * hkv * i4->key_slots) + o, 0, 2); \
                for (int64_t o = 0; o < vspan; o += 64)                                                 \
                    __builtin_prefetch((const char *)(i4->v_meta + nxt * bs * hkv * (d / i4->gv) * 2) + o, 0, 2); \
            }                                                                                           \
            const int tail = I4 && (j + 1) * bs > len && trow >= 0; /* partial block, exact in a row */ \
            const int64_t share = (bs + (h1 - h0) - 1) / (h1 - h0);                                     \
            for (int64_t h = h0; h < h1; h++) {                                                         \
                const int64_t p0 = (h - h0) * share, p1 = p0 + share < bs ? p0 + share : bs;            \
                if (ahead)                                                                              \
                    for (int64_t t = p0; t < p1; t++)                                                   \
                        for (int64_t o = 0; o < span; o += 64)                                          \
                            __builtin_prefetch(kn + t * tok * (int64_t)sizeof(KT) + o, 0, 2);          \
                const int64_t r0 = (h - h0) * g_rows;                                                   \
                const KT *kb = kc + (blk * bs * hkv + h) * drow;                                        \
                const KT *vb = vc + (blk * bs * hkv + h) * drow;                                        \
                const QT *kt = tail ? (const QT *)i4->k_tail + (trow * bs * hkv + h) * d : 0;           \
                const QT *vt = tail ? (const QT *)i4->v_tail + (trow * bs * hkv + h) * d : 0;           \
                const ST *kst = SCALED ? ksc + blk * bs * hkv + h : 0; /* token t: kst[t * hkv] */    \
                const ST *vst = SCALED ? vsc + blk * bs * hkv + h : 0;                                  \
                const int raw = USE_RAW && d % 32 == 0;                                                 \
                if (tail)                                                                               \
                    for (int64_t t = 0; t < n; t++)                                                     \
                        for (int64_t i = 0; i < d; i++) buf[t][i4_col(i, d / 2, 1)] = LOADQ(kt[t * hkv * d + i]); \
                else if (I4)                                                                            \
                    int4_keys(i4, blk, h, !i4->per_token && (j + 1) * bs <= len, n, buf[0], MAX_D, 1);  \
                else if (!raw)                                                                          \
                    for (int64_t t = 0; t < n; t++)                                                     \
                        for (int64_t i = 0; i < d; i++) buf[t][i] = LOADK(kb[t * tok + i]);             \
                for (int64_t r = r0; r < r0 + g_rows; r++) {                                            \
                    if (raw)                                                                            \
                        for (int64_t t = 0; t < n; t++)                                                 \
                            s[r][t] = RAW_DOT(q0 + r * d, kb + t * tok, d) * scale;                     \
                    else                                                                                \
                        for (int64_t t = 0; t < n; t++) {                                               \
                            float dot = 0.0f;                                                           \
                            for (int64_t i = 0; i < d; i++) dot += qf[r][i] * buf[t][i];                \
                            s[r][t] = SCALED ? dot * LOADS(kst[t * hkv]) : dot;                         \
                        }                                                                               \
                    float mb = s[r][0];                                                                 \
                    for (int64_t t = 1; t < n; t++) mb = s[r][t] > mb ? s[r][t] : mb;                  \
                    const float mn = (j == 0 || mb > m[r]) ? mb : m[r];                                 \
                    const float corr = j == 0 ? 0.0f : exp_nonpos(m[r] - mn);                          \
                    float sum = 0.0f;                                                                   \
                    for (int64_t t = 0; t < n; t++) {                                                   \
                        s[r][t] = exp_nonpos(s[r][t] - mn);                                             \
                        sum += s[r][t];                                                                 \
                    }                                                                                   \
                    l[r] = l[r] * corr + sum;                                                           \
                    m[r] = mn;                                                                          \
                    for (int64_t i = 0; i < d; i++) acc[r][i] *= corr;                                  \
                }                                                                                       \
                for (int64_t t = 0; t < n; t++) {                                                       \
                    if (ahead && p0 + t < p1)                                                           \
                        for (int64_t o = 0; o < span; o += 64)                                          \
                            __builtin_prefetch(vn + (p0 + t) * tok * (int64_t)sizeof(KT) + o, 0, 2);   \
                    if (tail)                                                                           \
                        for (int64_t i = 0; i < d; i++) buf[t][i4_col(i, d / 2, 1)] = LOADQ(vt[t * hkv * d + i]); \
                    else if (!I4)                                                                       \
                        for (int64_t i = 0; i < d; i++) buf[t][i] = LOADK(vb[t * tok + i]);             \
                }                                                                                       \
                if (I4 && !tail) int4_values(i4, blk, h, n, buf[0], MAX_D, 1);                          \
                for (int64_t r = r0; r < r0 + g_rows; r++) {                                            \
                    if (SCALED)                                                                         \
                        for (int64_t t = 0; t < n; t++) s[r][t] *= LOADS(vst[t * hkv]);                \
                    add_weighted(acc[r], s[r], buf, n, d);                                              \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        QT *o0 = out + h0 * g_rows * d;                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const float inv = len > 0 ? 1.0f / l[r] : 0.0f;                                             \
            for (int64_t i = 0; i < d; i++) o0[r * d + i] = STOREQ(acc[r][i4_col(i, d / 2, I4)] * inv); \
        }                                                                                               \
    }

/* The parallel loop over tasks, shared by every entry point. */
#define RUN_TASKS(TASK, QT, KC, VC, KS, VS, I4SRC)                                                      \
    if (hq < 1 || hkv < 1 || d < 1 || bs < 1 || hq % hkv || hq / hkv > MAX_ROWS || d > MAX_D            \
        || bs > MAX_BS)                                                                                 \
        return -1;                                                                                      \
    const int64_t g_rows = hq / hkv;                                                                    \
    /* heads per task: all of a sequence's (as many as MAX_ROWS query rows hold) when the batch        \
       alone keeps every thread busy, else one, so a few long sequences still spread */               \
    int64_t per = batch >= 4 * (int64_t)threads ? MAX_ROWS / g_rows : 1;                                \
    per = per > hkv ? hkv : per;                                                                        \
    const int64_t groups = (hkv + per - 1) / per;                                                       \
    int64_t bad = 0;                                                                                    \
    const int4_src *const i4s = (I4SRC);                                                                \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : bad)")          \
    for (int64_t task = 0; task < batch * groups; task++) {                                             \
        const int64_t b = task / groups, h0 = task % groups * per;                                      \
        const int64_t h1 = h0 + per < hkv ? h0 + per : hkv;                                             \
        const QT *qb = q + b * hq * d;                                                                  \
        QT *ob = out + b * hq * d;                                                                      \
        const int32_t *tb = tables + b * table_stride;                                                  \
        const int64_t trow = i4s && i4s->rows ? i4s->rows[b] : -1;                                      \
        if (d == 64)                                                                                    \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, 64, bs, num_blocks, scale, &bad, i4s, trow);  \
        else if (d == 128)                                                                              \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, 128, bs, num_blocks, scale, &bad, i4s, trow); \
        else                                                                                            \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, d, bs, num_blocks, scale, &bad, i4s, trow);   \
    }                                                                                                   \
    return bad ? 1 : 0;

/* Model-dtype caches. q, out [B, Hq, D]; cache [2, N, bs, Hkv, D]; tables [B, table_stride] int32;
   lens [B] int32. Returns 0, -1 for an unsupported shape, or 1 when a table names a block outside
   the cache. */
#define DEFINE_DECODE(NAME, T, TASK)                                                                    \
    int NAME(const T *cache, const T *q, T *out, const int32_t *tables, int64_t table_stride,         \
             const int32_t *lens, int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t bs,        \
             int64_t num_blocks, float scale, int threads) {                                            \
        const float *none = 0;                                                                          \
        RUN_TASKS(TASK, T, cache, cache + num_blocks * bs * hkv * d, none, none, (const int4_src *)0)  \
    }

/* int8 caches: data int8 [2, N, bs, Hkv, D], scales [2, N, bs, Hkv] of type ST; q, out as above. */
#define DEFINE_DECODE_INT8(NAME, QT, ST, TASK)                                                          \
    int NAME(const int8_t *cache, const ST *scales, const QT *q, QT *out, const int32_t *tables,      \
             int64_t table_stride, const int32_t *lens, int64_t batch, int64_t hq, int64_t hkv,         \
             int64_t d, int64_t bs, int64_t num_blocks, float scale, int threads) {                     \
        RUN_TASKS(TASK, QT, cache, cache + num_blocks * bs * hkv * d, scales, scales + num_blocks * bs * hkv, \
                  (const int4_src *)0)                                                                  \
    }

#define NO_RAW_DOT(a, b, d) ((void)(a), (void)(b), (void)(d), 0.0f)
static inline float i8_load(int8_t x) { return (float)x; }

DEFINE_TASK(task_f32, float, f32_load, f32_store, float, f32_load, float, f32_load, 0, NO_RAW_DOT, 0, 0)
DEFINE_TASK(task_bf16, uint16_t, bf16_load, bf16_store, uint16_t, bf16_load, float, f32_load, 0, dot_raw_bf16, HAVE_DPBF16, 0)
DEFINE_TASK(task_i8_f32_h, float, f32_load, f32_store, int8_t, i8_load, uint16_t, f16_load, 1, NO_RAW_DOT, 0, 0)
DEFINE_TASK(task_i8_f32_f, float, f32_load, f32_store, int8_t, i8_load, float, f32_load, 1, NO_RAW_DOT, 0, 0)
DEFINE_TASK(task_i8_bf16_h, uint16_t, bf16_load, bf16_store, int8_t, i8_load, uint16_t, f16_load, 1, NO_RAW_DOT, 0, 0)
DEFINE_TASK(task_i8_bf16_f, uint16_t, bf16_load, bf16_store, int8_t, i8_load, float, f32_load, 1, NO_RAW_DOT, 0, 0)
DEFINE_TASK(task_i4_f32, float, f32_load, f32_store, uint8_t, i8_load, float, f32_load, 0, NO_RAW_DOT, 0, 1)
DEFINE_TASK(task_i4_bf16, uint16_t, bf16_load, bf16_store, uint8_t, i8_load, float, f32_load, 0, NO_RAW_DOT, 0, 1)
DEFINE_DECODE(paged_decode_f32, float, task_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, task_bf16)
DEFINE_DECODE_INT8(paged_decode_int8_f32_f16, float, uint16_t, task_i8_f32_h)
DEFINE_DECODE_INT8(paged_decode_int8_f32_f32, float, float, task_i8_f32_f)
DEFINE_DECODE_INT8(paged_decode_int8_bf16_f16, uint16_t, uint16_t, task_i8_bf16_h)
DEFINE_DECODE_INT8(paged_decode_int8_bf16_f32, uint16_t, float, task_i8_bf16_f)

/* int4 caches (int4_src): data uint8 [2, N, bs, Hkv, D/2] with k_meta, v_meta; k_tail, v_tail of
   q's type [rows * bs, Hkv, D] and tail_rows [B] (or all null: no tail rows). The blocks are
   widened in the task, head by head, into the buffer that stays in L1: no fp32 copy of the context
   goes through memory. per_token (INT4R): every block's keys per token (q as the caller rotated
   and rounded it). */
#define DEFINE_DECODE_INT4(NAME, QT, TASK)                                                              \
    int NAME(const uint8_t *data, const uint16_t *k_meta, const uint16_t *v_meta, const QT *k_tail,    \
             const QT *v_tail, const int32_t *tail_rows, int64_t key_slots, int64_t gk, int64_t gv,     \
             const QT *q, QT *out, const int32_t *tables, int64_t table_stride, const int32_t *lens,    \
             int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t num_blocks,         \
             float scale, int threads, int per_token) {                                                 \
        if (!(per_token ? int4_token_shape_ok : int4_shape_ok)(d, bs, key_slots, gk, gv)) return -1;    \
        const int4_src src = {data, k_meta, v_meta, k_tail, v_tail, tail_rows, num_blocks, bs, hkv, d,  \
                              key_slots, gk, gv, per_token};                                            \
        const float *none = 0;                                                                          \
        RUN_TASKS(TASK, QT, data, data + num_blocks * bs * hkv * (d / 2), none, none, &src)             \
    }

DEFINE_DECODE_INT4(paged_decode_int4_f32, float, task_i4_f32)
DEFINE_DECODE_INT4(paged_decode_int4_bf16, uint16_t, task_i4_bf16)

/* int4 blocks ids[0..n) to fp32 out [2, n, bs, Hkv, D] (int4_keys, int4_values): a block with
   full[i] has its keys per channel, else per token. One pass, no temporaries: the torch version's
   unpack, stack and broadcast passes cost more than the attention that reads the result. Returns 1
   if an id lies outside the cache. */
int dequant_int4(const uint8_t *data, const uint16_t *k_meta, const uint16_t *v_meta, const int64_t *ids,
                 const uint8_t *full, int64_t n, int64_t num_blocks, int64_t bs, int64_t hkv, int64_t d,
                 int64_t key_slots, int64_t gk, int64_t gv, float *out, int threads) {
    int any_full = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_blocks) return 1;
        any_full |= full[i];
    }
    if (!(any_full ? int4_shape_ok : int4_token_shape_ok)(d, bs, key_slots, gk, gv)) return 2;
    const int4_src c = {data, k_meta, v_meta, 0, 0, 0, num_blocks, bs, hkv, d, key_slots, gk, gv, 0};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < hkv; h++) {
            int4_keys(&c, ids[i], h, full[i], bs, out + (i * bs * hkv + h) * d, hkv * d, 0);
            int4_values(&c, ids[i], h, bs, out + ((n + i) * bs * hkv + h) * d, hkv * d, 0);
        }
    return 0;
}

/* ---- The quantizing KV writes (llmbus.kernels.reference.write_kv_cache, bit for bit) --------------------
   llmbus.kernels.quant_reference defines the encoding in fp32 torch ops, each rounded on its own: the
   code below does the same operations in the same order, with contraction into fused
   multiply-adds off (torch runs a * b + c as two ops), fp16 rounded to nearest even as .half()
   does, floor(x + 0.5) for rounding, NaN winning a min or max as in torch. The one difference: a
   minimum or maximum over both +0 and -0 may keep the other zero than torch's reduction order does
   (the bytes of the sign, same values). The torch version spent ~1 ms a layer and step on
   dispatching some hundred small ops for a batch's 32 tokens. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

/* fp32 -> fp16 bits, round to nearest even (overflow to inf, subnormals kept). */
static inline uint16_t f16_store(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u); /* inf, NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;                                   /* >= 65520: inf */
    if (a < 0x38800000u) {                                                          /* below 2^-14 */
        float v;
        memcpy(&v, &a, 4);
        return sign | (uint16_t)nearbyintf(v * 16777216.0f); /* units of 2^-24, exact scaling */
    }
    const uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
    return sign | (uint16_t)((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}

static inline float safe_div(float x, float s) { return s > 0.0f ? x / s : 0.0f; }
/* NaN -> 0: torch's clamp keeps NaN, and its integer cast then gives 0 on x86 (a C cast of NaN is
   undefined) */
static inline float clampf(float x, float lo, float hi) { return x != x ? 0.0f : (x < lo ? lo : (x > hi ? hi : x)); }
/* torch's amin / amax: a NaN wins, as the positive quiet NaN */
static inline float min_nan(float a, float b) { return b != b ? NAN : (b < a ? b : a); }
static inline float max_nan(float a, float b) { return b != b ? NAN : (b > a ? b : a); }

/* The minimum and maximum of x[0:n] into *lo, *hi (a NaN wins both, as in torch's amin / amax). NOTE: written to vectorize (a NaN flag beside plain reductions):
   min_nan / max_nan's NaN test in the chain kept these loops scalar, a quarter of an INT4 write. */
static inline void min_max(const float *x, int64_t n, float *lo, float *hi) {
    float a = INFINITY, b = -INFINITY;
    int nan = 0;
    _Pragma("omp simd reduction(min : a) reduction(max : b) reduction(| : nan)")
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        nan |= v != v;
        a = v < a ? v : a;
        b = v > b ? v : b;
    }
    if (nan) a = b = NAN;
    *lo = a;
    *hi = b;
}

/* Codes q[0:n] (0..15, one a byte) packed two a byte into p[0:n/2], the even channel in the low nibble. */
static inline void pack_nibbles(const uint8_t *q, int64_t n, uint8_t *p) {
    _Pragma("omp simd")
    for (int64_t j = 0; j < n / 2; j++) p[j] = (uint8_t)(q[2 * j] | q[2 * j + 1] << 4);
}

/* clampf(floorf(x + 0.5f), 0, 15) as a code (NaN -> 0): round half up, as quant_reference does. */
static inline uint8_t nibble_code(float x) {
    const float r = floorf(x + 0.5f);
    return (uint8_t)(r != r ? 0.0f : (r < 0.0f ? 0.0f : (r > 15.0f ? 15.0f : r)));
}

/* quant_reference.int4_group_quantize of one row x[0:d]: codes packed into p[0:d/2], (scale, min)
   fp16 bits per group of g at meta[0], meta[1], meta[2], ... */
static void int4_quantize_row(const float *x, int64_t d, int64_t g, uint8_t *p, uint16_t *meta) {
    for (int64_t k = 0; k < d / g; k++) {
        const float *xg = x + k * g;
        float lo, hi;
        min_max(xg, g, &lo, &hi);
        const uint16_t mn16 = f16_store(lo);
        const float mn = f16_load(mn16);
        const uint16_t sc16 = f16_store((hi - mn) / 15.0f);
        const float sc = f16_load(sc16);
        meta[2 * k] = sc16;
        meta[2 * k + 1] = mn16;
        if (!(sc > 0.0f)) { /* safe_div: 0, so every code 0 */
            memset(p + k * g / 2, 0, (size_t)(g / 2));
            continue;
        }
        uint8_t q[MAX_D];
        _Pragma("omp simd")
        for (int64_t i = 0; i < g; i++) q[i] = nibble_code((xg[i] - mn) / sc);
        pack_nibbles(q, g, p + k * g / 2);
    }
}

/* quant_reference.int4_key_block_quantize of one full block's keys x [bs, hkv, d]: codes packed into
   p [bs, hkv, d/2], per head k_meta rows km [hkv, key_slots] (codes m | M << 8, then lo, hi). The
   channels' ranges gather a token row at a time (NaN flags beside them), so every loop runs along
   contiguous channels. */
static void int4_quantize_key_block(const float *x, int64_t bs, int64_t hkv, int64_t d, uint8_t *p, uint16_t *km,
                                    int64_t key_slots) {
    const float pad = 1.0f / 512.0f; /* quant_reference.RANGE_PAD */
    for (int64_t h = 0; h < hkv; h++) {
        float cmn[MAX_D], cmx[MAX_D], cmin[MAX_D], cscale[MAX_D];
        int nan[MAX_D];
        for (int64_t i = 0; i < d; i++) cmn[i] = INFINITY, cmx[i] = -INFINITY, nan[i] = 0;
        for (int64_t t = 0; t < bs; t++) {
            const float *xt = x + (t * hkv + h) * d;
            _Pragma("omp simd")
            for (int64_t i = 0; i < d; i++) {
                const float v = xt[i];
                nan[i] |= v != v;
                cmn[i] = v < cmn[i] ? v : cmn[i];
                cmx[i] = v > cmx[i] ? v : cmx[i];
            }
        }
        float lo = INFINITY, hi = -INFINITY; /* the head's range: its channels' */
        for (int64_t i = 0; i < d; i++) {
            if (nan[i]) cmn[i] = cmx[i] = NAN;
            lo = min_nan(lo, cmn[i]);
            hi = max_nan(hi, cmx[i]);
        }
        const uint16_t lo16 = f16_store(lo - fabsf(lo) * pad), hi16 = f16_store(hi + fabsf(hi) * pad);
        const float lo_f = f16_load(lo16), step = (f16_load(hi16) - lo_f) / 255.0f;
        uint16_t *row = km + h * key_slots;
        const int ranged = step > 0.0f; /* safe_div's case, the same for every channel */
        _Pragma("omp simd")
        for (int64_t i = 0; i < d; i++) {
            const float m = ranged ? clampf(floorf((cmn[i] - lo_f) / step), 0.0f, 255.0f) : 0.0f;
            const float big = ranged ? clampf(ceilf((cmx[i] - lo_f) / step), 0.0f, 255.0f) : 0.0f;
            cmin[i] = lo_f + m * step;
            cscale[i] = (big - m) * step / 15.0f;
            row[i] = (uint16_t)((int32_t)m | (int32_t)big << 8);
        }
        row[d] = lo16;
        row[d + 1] = hi16;
        for (int64_t t = 0; t < bs; t++) {
            const float *xt = x + (t * hkv + h) * d;
            uint8_t q[MAX_D];
            _Pragma("omp simd")
            for (int64_t i = 0; i < d; i++) {
                const float s = cscale[i], y = (xt[i] - cmin[i]) / (s > 0.0f ? s : 1.0f);
                q[i] = nibble_code(s > 0.0f ? y : 0.0f);
            }
            pack_nibbles(q, d, p + (t * hkv + h) * (d / 2));
        }
    }
}

/* The INT4 write of T tokens (reference.write_kv_cache): key, value [T, hkv, d] of type QT; slots
   [T] into the cache's N * bs slots; tail_slots [T] (row * bs + offset in k_tail / v_tail, -1:
   none) or null. Values, then the keys of blocks left filling (per token), then every block sealed
   by this call (per channel, from this call's keys and, for its other tokens, the sealing token's
   tail row or else their per-token codes), then the filling blocks' tail rows. per_token (INT4R):
   every key per token, no block sealed (the tail rows as before). Returns 1 for a slot outside the
   cache (nothing written), 2 for a shape it does not take, 3 if out of memory. */
#define DEFINE_WRITE_INT4(NAME, QT, LOADQ)                                                              \
    int NAME(const QT *key, const QT *value, int64_t t_count, const int64_t *slots, const int64_t *tail_slots, \
             uint8_t *data, uint16_t *k_meta, uint16_t *v_meta, QT *k_tail, QT *v_tail, int64_t num_blocks, \
             int64_t bs, int64_t hkv, int64_t d, int64_t key_slots, int64_t gk, int64_t gv, int per_token) { \
        if (bs > MAX_BS || !(per_token ? int4_token_shape_ok : int4_shape_ok)(d, bs, key_slots, gk, gv)) return 2; \
        for (int64_t i = 0; i < t_count; i++)                                                           \
            if (slots[i] < 0 || slots[i] >= num_blocks * bs) return 1;                                  \
        const int64_t half = d / 2, row = hkv * half;                                                   \
        uint8_t *vdata = data + num_blocks * bs * row;                                                  \
        /* sealed blocks, each with the list of this call's tokens in it, latest first: head[b] 0 for a  \
           block not sealed by this call, else 1 + its latest token (negated once done), nxt[i] the  \
           token before i in the same block (-1: none) */                                              \
        int32_t *head = calloc((size_t)num_blocks, sizeof(int32_t));                                    \
        int32_t *nxt = malloc((size_t)(t_count > 0 ? t_count : 1) * sizeof(int32_t));                   \
        const int64_t blk_n = bs * hkv * d; /* a sealed block's keys, widened: one per thread */       \
        float *blk = malloc((size_t)(omp_get_max_threads() * blk_n) * sizeof(float));                   \
        if (!head || !nxt || !blk || t_count > INT32_MAX - 1) {                                         \
            free(head);                                                                                 \
            free(nxt);                                                                                  \
            free(blk);                                                                                  \
            return 3;                                                                                   \
        }                                                                                               \
        /* NOTE: a prefill's values split over the threads by slot (a slot given twice is written by \
           one thread in order: the last write wins), its sealed blocks by block (a step of 4,096  \
           tokens spent ~10 ms a layer here on one thread) */                                          \
        _Pragma("omp parallel if (t_count * hkv * d >= 32768)")                                        \
        for (int64_t i = 0, nt = omp_get_num_threads(), tid = omp_get_thread_num(); i < t_count; i++)  \
            for (int64_t h = 0; h < hkv && slots[i] % nt == tid; h++) {                                 \
                float xv[MAX_D];                                                                        \
                for (int64_t c = 0; c < d; c++) xv[c] = LOADQ(value[(i * hkv + h) * d + c]);           \
                int4_quantize_row(xv, d, gv, vdata + slots[i] * row + h * half,                         \
                                  v_meta + (slots[i] * hkv + h) * (d / gv) * 2);                        \
            }                                                                                           \
        for (int64_t i = 0; i < t_count; i++)                                                           \
            if (slots[i] % bs == bs - 1) head[slots[i] / bs] = -1;                                      \
        for (int64_t i = 0; i < t_count && !per_token; i++) { /* list each sealed block's tokens */    \
            const int64_t b = slots[i] / bs;                                                            \
            if (!head[b]) continue;                                                                     \
            nxt[i] = head[b] > 0 ? head[b] - 1 : -1;                                                    \
            head[b] = (int32_t)i + 1;                                                                   \
        }                                                                                               \
        /* the other keys per token (INT4R: all), split over the threads by slot as the values */       \
        _Pragma("omp parallel if (t_count * hkv * d >= 32768)")                                        \
        for (int64_t i = 0, nt = omp_get_num_threads(), tid = omp_get_thread_num(); i < t_count; i++) {  \
            const int64_t b = slots[i] / bs;                                                            \
            if ((head[b] && !per_token) || slots[i] % nt != tid) continue;                              \
            for (int64_t h = 0; h < hkv; h++) {                                                         \
                float x[MAX_D];                                                                         \
                for (int64_t c = 0; c < d; c++) x[c] = LOADQ(key[(i * hkv + h) * d + c]);               \
                int4_quantize_row(x, d, gk, data + slots[i] * row + h * half,                           \
                                  k_meta + (b * hkv + h) * key_slots + slots[i] % bs * 2 * (d / gk));   \
            }                                                                                           \
        }                                                                                               \
        int64_t n_sealed = 0; /* the sealed blocks, each once (in nxt's place: its links are read below) */ \
        int64_t *sealed = malloc((size_t)(t_count > 0 ? t_count : 1) * sizeof(int64_t));               \
        if (!sealed) {                                                                                  \
            free(head);                                                                                 \
            free(nxt);                                                                                  \
            free(blk);                                                                                  \
            return 3;                                                                                   \
        }                                                                                               \
        for (int64_t i = 0; i < t_count && !per_token; i++) {                                           \
            const int64_t b = slots[i] / bs;                                                            \
            if (head[b] <= 0) continue; /* not sealed, or listed */                                     \
            sealed[n_sealed++] = b;                                                                     \
            head[b] = -head[b];                                                                         \
        }                                                                                               \
        _Pragma("omp parallel if (n_sealed * bs * hkv * d >= 32768)")                                  \
        {                                                                                               \
        float *blk_t = blk + omp_get_thread_num() * blk_n;                                              \
        _Pragma("omp for schedule(static)")                                                            \
        for (int64_t si = 0; si < n_sealed; si++) {                                                     \
            const int64_t b = sealed[si];                                                               \
            float *blk = blk_t;                                                                         \
            int64_t last_at[MAX_BS]; /* the last write of each slot in this call, -1: none */           \
            for (int64_t o = 0; o < bs; o++) last_at[o] = -1;                                           \
            for (int64_t j = -head[b] - 1; j >= 0; j = nxt[j])                                          \
                if (last_at[slots[j] % bs] < 0) last_at[slots[j] % bs] = j;                             \
            /* the token sealing it is the last write of its last slot */                               \
            const int64_t base = tail_slots ? tail_slots[last_at[bs - 1]] - (bs - 1) : -1;              \
            for (int64_t o = 0; o < bs; o++)                                                            \
                for (int64_t h = 0; h < hkv; h++) {                                                     \
                    float *xr = blk + (o * hkv + h) * d;                                                \
                    if (last_at[o] >= 0) { /* this call's key */                                        \
                        for (int64_t c = 0; c < d; c++) xr[c] = LOADQ(key[(last_at[o] * hkv + h) * d + c]); \
                        continue;                                                                       \
                    }                                                                                   \
                    if (base >= 0) {                                                                    \
                        for (int64_t c = 0; c < d; c++) xr[c] = LOADQ(k_tail[((base + o) * hkv + h) * d + c]); \
                        continue;                                                                       \
                    }                                                                                   \
                    /* NOTE: int4_keys' per-token decode, written out: here, with contraction off, \
                       it rounds as the reference's (int4_keys may fuse its multiply-add) */         \
                    const uint8_t *pk = data + (b * bs + o) * row + h * half;                           \
                    const uint16_t *g = k_meta + (b * hkv + h) * key_slots + o * 2 * (d / gk);          \
                    for (int64_t c = 0; c < d; c++) {                                                   \
                        const float q = (float)(c % 2 ? pk[c / 2] >> 4 : pk[c / 2] & 15u);              \
                        xr[c] = f16_load(g[2 * (c / gk) + 1]) + q * f16_load(g[2 * (c / gk)]);          \
                    }                                                                                   \
                }                                                                                       \
            int4_quantize_key_block(blk, bs, hkv, d, data + b * bs * row, k_meta + b * hkv * key_slots, key_slots); \
        }                                                                                               \
        }                                                                                               \
        free(sealed);                                                                                   \
        if (tail_slots)                                                                                 \
            for (int64_t i = 0; i < t_count; i++) {                                                     \
                if (head[slots[i] / bs] || tail_slots[i] < 0) continue;                                 \
                memcpy(k_tail + tail_slots[i] * hkv * d, key + i * hkv * d, (size_t)(hkv * d) * sizeof(QT)); \
                memcpy(v_tail + tail_slots[i] * hkv * d, value + i * hkv * d, (size_t)(hkv * d) * sizeof(QT)); \
            }                                                                                           \
        free(head);                                                                                     \
        free(nxt);                                                                                      \
        free(blk);                                                                                      \
        return 0;                                                                                       \
    }

/* The int8 write of T tokens (quant_reference.int8_quantize per token and head): key, value
   [T, hkv, d] of type QT into data int8 [2, N, bs, hkv, d] and scales [2, N, bs, hkv] of type ST.
   Returns 1 for a slot outside the cache, 2 for d past MAX_D (nothing written). */
#define DEFINE_WRITE_INT8(NAME, QT, LOADQ, ST, STORES, LOADS)                                            \
    int NAME(const QT *key, const QT *value, int64_t t_count, const int64_t *slots, int8_t *data, ST *scales, \
             int64_t num_blocks, int64_t bs, int64_t hkv, int64_t d) {                                  \
        if (d > MAX_D) return 2;                                                                        \
        for (int64_t i = 0; i < t_count; i++)                                                           \
            if (slots[i] < 0 || slots[i] >= num_blocks * bs) return 1;                                  \
        /* NOTE: a prefill's rows split over the threads by slot (a step of 4,096 tokens spent ~8 ms a \
           layer here on one thread), so a slot given twice is written by one thread in order (the   \
           last write wins, as before); loops written to vectorize: a NaN flag beside the maximum,   \
           the division hoisted out of its zero-scale case */                                         \
        _Pragma("omp parallel if (t_count * hkv * d >= 32768)")                                        \
        for (int64_t kv = 0, nt = omp_get_num_threads(), tid = omp_get_thread_num(); kv < 2; kv++)     \
            for (int64_t i = 0; i < t_count; i++)                                                       \
                for (int64_t h = 0; h < hkv && slots[i] % nt == tid; h++) {                             \
                    const QT *x = (kv ? value : key) + (i * hkv + h) * d;                               \
                    float xf[MAX_D], absmax = 0.0f;                                                     \
                    int nan = 0;                                                                        \
                    _Pragma("omp simd reduction(max : absmax) reduction(| : nan)")                     \
                    for (int64_t c = 0; c < d; c++) {                                                   \
                        const float a = fabsf(xf[c] = LOADQ(x[c]));                                     \
                        nan |= a != a;                                                                  \
                        absmax = a > absmax ? a : absmax;                                               \
                    }                                                                                   \
                    const int64_t at = kv * num_blocks * bs * hkv + slots[i] * hkv + h;                 \
                    scales[at] = STORES((nan ? NAN : absmax) / 127.0f); /* torch's amax: a NaN wins */  \
                    const float sc = LOADS(scales[at]);                                                 \
                    int8_t *q = data + at * d;                                                          \
                    if (!(sc > 0.0f)) { /* safe_div: 0, so every code 0 */                              \
                        memset(q, 0, (size_t)d);                                                        \
                        continue;                                                                       \
                    }                                                                                   \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t c = 0; c < d; c++) {                                                   \
                        const float r = floorf(xf[c] / sc + 0.5f);                                      \
                        q[c] = (int8_t)(r != r ? 0.0f : (r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r))); \
                    }                                                                                   \
                }                                                                                       \
        return 0;                                                                                       \
    }

DEFINE_WRITE_INT8(write_int8_f32_f16, float, f32_load, uint16_t, f16_store, f16_load)
DEFINE_WRITE_INT8(write_int8_f32_f32, float, f32_load, float, f32_store, f32_load)
DEFINE_WRITE_INT8(write_int8_bf16_f16, uint16_t, bf16_load, uint16_t, f16_store, f16_load)
DEFINE_WRITE_INT8(write_int8_bf16_f32, uint16_t, bf16_load, float, f32_store, f32_load)
DEFINE_WRITE_INT4(write_int4_f32, float, f32_load)
DEFINE_WRITE_INT4(write_int4_bf16, uint16_t, bf16_load)

/* quant_reference.round_query of rows x [rows, d] (QT) into y (OT: fp32, or bf16 rounded as torch's
   .to() rounds): each row's codes floor(x * 127 / amax + 0.5) times amax / 127, amax its largest
   magnitude (at least 127e-30; a NaN wins it, so the row comes out NaN). The same fp32 operations
   in the same order as the reference's torch ops, so the same values; one pass where torch makes
   seven over INT4R's prefill queries (~10% of its prefill on the large demo model). */
#define DEFINE_ROUND_QUERY(NAME, QT, LOADQ, OT, STOREO)                                                 \
    void NAME(const QT *x, int64_t rows, int64_t d, OT *y, int threads) {                               \
        const float tiny = (float)(127.0 * 1e-30); /* torch casts the double bound to fp32 */          \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * d >= 32768)")        \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const QT *xr = x + r * d;                                                                   \
            float amax = 0.0f;                                                                          \
            int nan = 0;                                                                                \
            _Pragma("omp simd reduction(max : amax) reduction(| : nan)")                               \
            for (int64_t c = 0; c < d; c++) {                                                           \
                const float a = fabsf(LOADQ(xr[c]));                                                    \
                nan |= a != a;                                                                          \
                amax = a > amax ? a : amax;                                                             \
            }                                                                                           \
            amax = nan ? NAN : (amax < tiny ? tiny : amax);                                             \
            const float step = amax / 127.0f;                                                           \
            OT *yr = y + r * d;                                                                         \
            _Pragma("omp simd")                                                                         \
            for (int64_t c = 0; c < d; c++) yr[c] = STOREO(floorf(LOADQ(xr[c]) * 127.0f / amax + 0.5f) * step); \
        }                                                                                               \
    }

DEFINE_ROUND_QUERY(round_query_f32_f32, float, f32_load, float, f32_store)
DEFINE_ROUND_QUERY(round_query_f32_bf16, float, f32_load, uint16_t, bf16_store)
DEFINE_ROUND_QUERY(round_query_bf16_f32, uint16_t, bf16_load, float, f32_store)
DEFINE_ROUND_QUERY(round_query_bf16_bf16, uint16_t, bf16_load, uint16_t, bf16_store)

/* quant_reference.rotate of rows x [rows, d] (d a power of two, at most MAX_D) into y (may be x):
   the fast Walsh-Hadamard transform's butterflies in the reference's order (h = 1, 2, .. d/2), in
   fp32, times the fp32 1 / sqrt(d) (quant_reference.rotation_scale), stored as T. Returns -1 for a
   d it does not take. NOTE: ROT_ROWS rows at a time, transposed, so every butterfly is one vector
   op across the rows: run along a row, the first stages' pairs (h = 1, 2, 4) left it scalar, slower
   than torch's matrix product. */
#define ROT_ROWS 16
#define DEFINE_ROTATE(NAME, T, LOAD, STORE)                                                             \
    int NAME(const T *x, int64_t rows, int64_t d, T *y, int threads) {                                  \
        if (d < 1 || d > MAX_D || (d & (d - 1))) return -1;                                             \
        const float scale = (float)(1.0 / sqrt((double)d));                                             \
        const int64_t tiles = (rows + ROT_ROWS - 1) / ROT_ROWS;                                         \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * d >= 32768)")        \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                  \
            const int64_t r0 = tile * ROT_ROWS, nr = rows - r0 < ROT_ROWS ? rows - r0 : ROT_ROWS;       \
            float a[MAX_D][ROT_ROWS] __attribute__((aligned(64)));                                      \
            for (int64_t r = 0; r < ROT_ROWS; r++)                                                      \
                for (int64_t c = 0; c < d; c++) a[c][r] = r < nr ? LOAD(x[(r0 + r) * d + c]) : 0.0f;    \
            for (int64_t h = 1; h < d; h *= 2)                                                          \
                for (int64_t i = 0; i < d; i += 2 * h)                                                  \
                    for (int64_t j = i; j < i + h; j++) {                                               \
                        _Pragma("omp simd")                                                             \
                        for (int64_t r = 0; r < ROT_ROWS; r++) {                                        \
                            const float u = a[j][r], v = a[j + h][r];                                   \
                            a[j][r] = u + v;                                                            \
                            a[j + h][r] = u - v;                                                        \
                        }                                                                               \
                    }                                                                                   \
            for (int64_t r = 0; r < nr; r++)                                                            \
                for (int64_t c = 0; c < d; c++) y[(r0 + r) * d + c] = STORE(a[c][r] * scale);           \
        }                                                                                               \
        return 0;                                                                                       \
    }

DEFINE_ROTATE(rotate_f32, float, f32_load, f32_store)
DEFINE_ROTATE(rotate_bf16, uint16_t, bf16_load, bf16_store)
#ifdef __clang__
#pragma STDC FP_CONTRACT ON
#endif
#pragma GCC pop_options

/* ---- Element-wise fusions the CPU model runs around its GEMMs (bf16 only) -------------------
   torch runs each as 3-6 passes over the activations (widen, square, mean, scale, narrow, scale;
   silu, then multiply), each a parallel region; here one pass, rounding where torch rounds. */

/* HF's RMSNorm: y = w * round(x * rsqrt(mean(x^2) + eps)) rounded; rows of n, x rows x_stride apart.
   ROUND rounds to the element type where torch's ops do (identity for float32). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                    \
    void NAME(const T *x, int64_t x_stride, const T *w, T *y, int64_t rows, int64_t n, float eps, int threads) { \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= 32768)")        \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const T *xr = x + r * x_stride;                                                             \
            T *yr = y + r * n;                                                                          \
            float ss = 0.0f;                                                                            \
            _Pragma("omp simd reduction(+ : ss)")                                                       \
            for (int64_t i = 0; i < n; i++) {                                                           \
                const float v = LOAD(xr[i]);                                                            \
                ss += v * v;                                                                            \
            }                                                                                           \
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);                                        \
            _Pragma("omp simd")                                                                         \
            for (int64_t i = 0; i < n; i++) yr[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xr[i]) * inv));       \
        }                                                                                               \
    }

/* SwiGLU on a fused gate_up projection: gu rows are [gate (n) | up (n)];
   out = round(round(silu(gate)) * up), as F.silu(gate, inplace=True).mul_(up) rounds. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                    \
    void NAME(const T *gu, T *out, int64_t rows, int64_t n, int threads) {                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= 32768)")        \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const T *g = gu + r * 2 * n, *u = g + n;                                                    \
            T *o = out + r * n;                                                                         \
            _Pragma("omp simd")                                                                         \
            for (int64_t i = 0; i < n; i++) {                                                           \
                const float v = LOAD(g[i]);                                                             \
                const float e = exp_nonpos(-fabsf(v)); /* exp(-|v|): sigmoid without overflow */       \
                const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);                       \
                o[i] = STORE(ROUND(v * sig) * LOAD(u[i]));                                              \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_RMS_NORM(rms_norm_f32, float, f32_load, f32_store, f32_load)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_SILU_MUL(silu_mul_f32, float, f32_load, f32_store, f32_load)

/* ---- Prefill attention over the paged cache (bf16, CPUs with the bf16 dot instruction) ---------
   A step's prefill chunks: chunk c's queries are token rows [row[c], row[c] + len[c]) of q at
   positions ctx[c] - len[c] ... ctx[c] - 1, attending causally to keys 0 .. own position, read from
   the cache through the chunk's block table (its new keys/values are written there first), so a
   chunk after a cached prefix and a whole prompt are the same case. torch's SDPA for CPU ran a
   256-token prompt at ~60 GFLOP/s counting the masked half it computes; here a task is one
   (chunk, KV head, tile of query tokens): the tile's G*TQ query rows (<= PF_ROWS) score 16 keys
   at a time with one bf16 dot instruction per pair of dims (keys transposed into pairs), skip key
   groups wholly in their future, and fold each group into a running softmax and an fp32 output. */
/* AMX's tiles take whole prefill steps where the process may use them (below, after the tiles'
   setup; amx_off: LLMBUS_CPU_AMX=0, set by set_amx). */
static int amx_off = 0;
void set_amx(int on) { amx_off = !on; }
static int prefill_attn_amx(const uint16_t *kc, const uint16_t *vc, const uint16_t *q, int64_t q_stride, uint16_t *out,
                            const int32_t *tables, int64_t table_stride, const int32_t *row, const int32_t *len,
                            const int32_t *ctx, int64_t n_chunks, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                            float scale, int threads);
#if HAVE_DPBF16
#define PF_ROWS 64

/* exp_nonpos on 16 lanes: the same reduction and polynomial, 2^n applied by scalef. */
static inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.98756912e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819994e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657962e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666657e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) void prefill_tile(
    const uint16_t *kc, const uint16_t *vc, const uint16_t *q, int64_t q_stride, uint16_t *out,
    const int32_t *table, int64_t row0, int64_t prefix, int64_t t0, int64_t nt, int64_t kvh, int64_t g,
    int64_t hq, int64_t hkv, const int64_t d, int64_t bs, float scale) {
    uint32_t qp[PF_ROWS + 3][MAX_D / 2] __attribute__((aligned(64))); /* + rows of zeros: 4-row steps */
    float acc[PF_ROWS][MAX_D] __attribute__((aligned(64)));
    uint32_t kt[MAX_D / 2][16] __attribute__((aligned(64)));
    uint32_t vt[8][MAX_D] __attribute__((aligned(64))); /* values: pairs of keys, per dim */
    float m[PF_ROWS], l[PF_ROWS];
    int64_t pos[PF_ROWS];
    const int64_t rows = nt * g, tok = hkv * d, half = d / 2;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t j = 0; j < g; j++) {
            const int64_t r = t * g + j;
            memcpy(qp[r], q + (row0 + t0 + t) * q_stride + (kvh * g + j) * d, (size_t)d * 2);
            pos[r] = prefix + t0 + t;
            m[r] = -INFINITY;
            l[r] = 0.0f;
            for (int64_t i = 0; i < d; i++) acc[r][i] = 0.0f;
        }
    for (int64_t r = rows; r < rows + 3; r++) memset(qp[r], 0, (size_t)d * 2);
    const int64_t kend = prefix + t0 + nt; /* keys [0, kend) are visible to some row of the tile */
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const int64_t nk = kend - k0 < 16 ? kend - k0 : 16;
        const int64_t base = ((int64_t)table[k0 / bs] * bs + k0 % bs) * tok + kvh * d;
        const uint16_t *kb = kc + base, *vv = vc + base;
        for (int64_t j = 0; j < 16; j++) {
            const uint32_t *k32 = (const uint32_t *)(kb + j * tok);
            for (int64_t p = 0; p < half; p++) kt[p][j] = j < nk ? k32[p] : 0u;
        }
        for (int64_t u = 0; u < 8; u++) { /* keys past the context may hold anything: zeros */
            const uint16_t *v0 = vv + 2 * u * tok, *v1 = v0 + tok;
            const int ok0 = 2 * u < nk, ok1 = 2 * u + 1 < nk;
            for (int64_t i = 0; i < d; i++)
                vt[u][i] = (ok0 ? (uint32_t)v0[i] : 0u) | ((ok1 ? (uint32_t)v1[i] : 0u) << 16);
        }
        for (int64_t r4 = 0; r4 < rows; r4 += 4) {
            /* four rows' scores at once: four independent chains of the dot instruction */
            __m512 sc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            if (k0 <= pos[rows - r4 < 4 ? rows - 1 : r4 + 3]) /* rows ascend by position */
                for (int64_t p = 0; p < half; p++) {
                    const __m512bh kv = (__m512bh)_mm512_load_si512((const void *)kt[p]);
                    for (int u = 0; u < 4; u++)
                        sc[u] = _mm512_dpbf16_ps(sc[u], (__m512bh)_mm512_set1_epi32((int)qp[r4 + u][p]), kv);
                }
            for (int64_t r = r4; r < r4 + 4 && r < rows; r++) {
            if (k0 > pos[r]) continue; /* the whole group lies in this row's future */
            __m512 s = _mm512_mul_ps(sc[r - r4], _mm512_set1_ps(scale));
            const int64_t lim = pos[r] - k0 + 1, valid = lim < nk ? lim : nk;
            const __mmask16 keep = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
            const float mx = _mm512_mask_reduce_max_ps(keep, s), mn = mx > m[r] ? mx : m[r];
            const float corr = exp_nonpos(m[r] - mn);
            const __m512 pv = _mm512_maskz_mov_ps(keep, exp_nonpos16(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
            l[r] = l[r] * corr + _mm512_reduce_add_ps(pv);
            m[r] = mn;
            /* weights times values by the dot instruction too: the weights rounded to bf16, as
               flash attention's second product rounds them; the sum l stays in fp32 */
            uint32_t pp[8] __attribute__((aligned(32)));
            _mm256_store_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(pv));
            const int64_t npairs = (valid + 1) / 2;
            __m512 o[MAX_D / 16]; /* the row's output stays in registers over the group's keys */
            float *a = acc[r];
            for (int64_t v = 0; v < d / 16; v++) o[v] = _mm512_mul_ps(_mm512_load_ps(a + 16 * v), _mm512_set1_ps(corr));
            for (int64_t u = 0; u < npairs; u++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[u]);
                for (int64_t v = 0; v < d / 16; v++)
                    o[v] = _mm512_dpbf16_ps(o[v], w, (__m512bh)_mm512_load_si512((const void *)(vt[u] + 16 * v)));
            }
            for (int64_t v = 0; v < d / 16; v++) _mm512_store_ps(a + 16 * v, o[v]);
            }
        }
    }
    for (int64_t t = 0; t < nt; t++)
        for (int64_t j = 0; j < g; j++) {
            const int64_t r = t * g + j;
            const float inv = 1.0f / l[r];
            uint16_t *o = out + ((row0 + t0 + t) * hq + kvh * g + j) * d;
            for (int64_t i = 0; i < d; i++) o[i] = bf16_store(acc[r][i] * inv);
        }
}
#endif

/* 0: done; -1: unsupported shape or no bf16 dot instruction; 1: a block id outside the cache or a
   chunk whose lengths do not fit its table. out: [T, hq, d] contiguous; q: rows q_stride apart,
   heads d apart. */
int prefill_attn_bf16(const uint16_t *cache, const uint16_t *q, int64_t q_stride, uint16_t *out,
                      const int32_t *tables, int64_t table_stride, const int32_t *row, const int32_t *len,
                      const int32_t *ctx, int64_t n_chunks, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                      int64_t num_blocks, float scale, int threads) {
#if HAVE_DPBF16
    if (hkv <= 0 || hq % hkv || d % 32 || d > MAX_D || bs % 16 || bs > MAX_BS) return -1;
    const int64_t g = hq / hkv, tq = g >= PF_ROWS ? 1 : PF_ROWS / g;
    if (g > PF_ROWS) return -1;
    int64_t tiles = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        if (len[c] < 0 || ctx[c] < len[c] || (ctx[c] + bs - 1) / bs > table_stride) return 1;
        for (int64_t j = 0; j < (ctx[c] + bs - 1) / bs; j++) {
            const int32_t b = tables[c * table_stride + j];
            if (b < 0 || b >= num_blocks) return 1;
        }
        tiles += (len[c] + tq - 1) / tq;
    }
    const uint16_t *kc = cache, *vc = cache + num_blocks * bs * hkv * d;
    if (!amx_off && prefill_attn_amx(kc, vc, q, q_stride, out, tables, table_stride, row, len, ctx, n_chunks, hq, hkv,
                                     d, bs, scale, threads) == 0)
        return 0;
    /* NOTE: later tiles see more keys; dynamic scheduling evens the threads out */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < tiles * hkv; task++) {
        int64_t tile = task / hkv, c = 0;
        const int64_t kvh = task % hkv;
        while (tile >= (len[c] + tq - 1) / tq) tile -= (len[c++] + tq - 1) / tq;
        const int64_t t0 = tile * tq, nt = len[c] - t0 < tq ? len[c] - t0 : tq;
        const int32_t *table = tables + c * table_stride;
        if (d == 64)
            prefill_tile(kc, vc, q, q_stride, out, table, row[c], ctx[c] - len[c], t0, nt, kvh, g, hq, hkv, 64, bs, scale);
        else if (d == 128)
            prefill_tile(kc, vc, q, q_stride, out, table, row[c], ctx[c] - len[c], t0, nt, kvh, g, hq, hkv, 128, bs, scale);
        else
            prefill_tile(kc, vc, q, q_stride, out, table, row[c], ctx[c] - len[c], t0, nt, kvh, g, hq, hkv, d, bs, scale);
    }
    return 0;
#else
    (void)cache; (void)q; (void)q_stride; (void)out; (void)tables; (void)table_stride; (void)row; (void)len;
    (void)ctx; (void)n_chunks; (void)hq; (void)hkv; (void)d; (void)bs; (void)num_blocks; (void)scale; (void)threads;
    return -1;
#endif
}

int have_bf16_dot(void) { return HAVE_DPBF16 + 0; }

/* Rotary embedding, rotate-half convention: out[t, h] = (x1*c - x2*s, x2*c + x1*s) with each
   product and each sum rounded as torch's ops round them (bf16: bit-identical). x rows x_stride
   elements apart, heads d apart; cos/sin [T, d/2]; out [T, H, d] contiguous. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE, ROUND)                                                        \
    void NAME(const T *x, int64_t x_stride, const T *cos_, const T *sin_, T *out, int64_t t, int64_t h,  \
              int64_t d, int threads) {                                                                 \
        const int64_t half = d / 2;                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (t * h * d >= 65536)")       \
        for (int64_t r = 0; r < t; r++) {                                                               \
            const T *c = cos_ + r * half, *s = sin_ + r * half;                                         \
            for (int64_t j = 0; j < h; j++) {                                                           \
                const T *xr = x + r * x_stride + j * d;                                                 \
                T *o = out + (r * h + j) * d;                                                           \
                _Pragma("omp simd")                                                                     \
                for (int64_t i = 0; i < half; i++) {                                                   \
                    const float a = LOAD(xr[i]), b = LOAD(xr[i + half]);                                \
                    const float ci = LOAD(c[i]), si = LOAD(s[i]);                                       \
                    o[i] = STORE(ROUND(a * ci) - ROUND(b * si));                                        \
                    o[i + half] = STORE(ROUND(b * ci) + ROUND(a * si));                                 \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_ROPE(rope_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_ROPE(rope_f32, float, f32_load, f32_store, f32_load)

/* ---- bf16 linear over a blocked weight (CPUs with the bf16 dot instruction) -------------------
   y[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]). The weight is stored once, blocked as
   [N/16][K/2][16][2]: for each block of 16 output rows, each pair of inputs in turn, the 16 rows'
   two values side by side, which is the operand of the bf16 dot instruction (16 lanes, each the dot
   of a pair). So a block is one forward stream of 64-byte vectors, each multiplied by the same
   pair of x broadcast to every lane, into 16 output rows' fp32 sums at once: no horizontal sums,
   and up to 8 rows of x share each weight vector from a register. Prefetched LIN_PREFETCH bytes
   ahead (past a block's end into the next one, which the same thread reads next). Threads take
   contiguous runs of blocks; many rows of x (prefill) go in tiles of LIN_TILE_BYTES, which stay
   in L2 while the thread's blocks stream past.

   Why not oneDNN's packed GEMM (llmbus/model/cpu_linear.py): a decode step at low batch is bound
   by reading the weights once, and oneDNN reads the large demo model's projections at 11-15 GB/s
   on one core for 1-8 rows, this at 17-23 (a plain sequential read reaches ~24). All of them
   (scripts/bench_cpu_linear.py), one thread: 1 row 13.9 -> 7.8 ms, 4 rows 11.8 -> 8.8, 32 rows
   31.9 -> 30.6; two threads, 1 row 8.4 -> 5.5, 1,024 rows (prefill) on par. Sums are fp32 in the
   instruction's order; each output is rounded to bf16 once, with the bias.

   float32 weights take the same scheme with one input per step: blocked [N/16][K][16], each
   64-byte vector of 16 rows' weights multiplied by one x broadcast (FMA), on any AVX-512 CPU.
   CPUs with AVX2 and FMA but not these instructions run both layouts too (linear_block_f32's
   and linear_block's AVX2 versions below), so the fused decode layers serve them as well.
   Against oneDNN's packed fp32 GEMM (scripts/bench_cpu_linear.py --dtype float32, all of a demo
   model's projections, one thread): large 1 row 22.96 -> 13.72 ms, 4 rows 18.42 -> 15.28, 32 rows
   and 1,024 rows on par; small 1 row 0.34 -> 0.18 ms. */
#define LIN_N 16 /* output rows per block: the 16 fp32 lanes */
#define LIN_MB 8 /* rows of x per pass over a block */
#define LIN_PREFETCH 1024
#ifndef LIN_TILE_BYTES
#define LIN_TILE_BYTES (256 << 10)
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* the hint must be a compile-time constant, hence a macro */
#define PREFETCH_4_LINES(p, hint)                                                                   \
    do {                                                                                            \
        _mm_prefetch((p), hint);                                                                    \
        _mm_prefetch((p) + 64, hint);                                                               \
        _mm_prefetch((p) + 128, hint);                                                              \
        _mm_prefetch((p) + 192, hint);                                                              \
    } while (0)
#endif

#if HAVE_DPBF16

static inline __attribute__((always_inline)) void linear_block(const uint16_t *x, int64_t x_stride, int64_t k_len,
                                                               const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                               int64_t y_stride, const int mb) {
    __m512 acc[LIN_MB];
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16))
                          : _mm512_setzero_ps();
    for (int m = 0; m < mb; m++) acc[m] = b;
    for (int64_t k = 0; k < k_len; k += 2, w += 2 * LIN_N) {
        if ((k & 7) == 0) { /* every 256 bytes of weight, the 4 lines LIN_PREFETCH ahead */
            const char *pf = (const char *)w + LIN_PREFETCH;
            /* 1-2 rows stream the weight faster when it lands in L2 only (1 row ~10%), 4-8 slower */
            if (mb <= 2)
                PREFETCH_4_LINES(pf, _MM_HINT_T1);
            else
                PREFETCH_4_LINES(pf, _MM_HINT_T0);
        }
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w);
        for (int m = 0; m < mb; m++) {
            int32_t pair;
            memcpy(&pair, x + m * x_stride + k, 4);
            acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int m = 0; m < mb; m++) _mm256_storeu_si256((__m256i *)(y + m * y_stride), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}
#endif

#ifdef __AVX512F__
#define HAVE_LINEAR_F32 1
#define LIN_F32_CHUNK 128 /* inputs per partial sum of the float32 kernel */
static inline __attribute__((always_inline)) void linear_block_f32(const float *x, int64_t x_stride, int64_t k_len,
                                                                   const float *w, const float *bias, float *y,
                                                                   int64_t y_stride, const int mb) {
    /* sums in chunks of LIN_F32_CHUNK inputs, each added to the total when done: one running sum
       over all of K let its rounding error grow with K (3e-6 relative at K = 14,336 against
       oneDNN's 6e-7); chunked, it stays near oneDNN's at one add per chunk */
    __m512 acc[LIN_MB], part[LIN_MB];
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int m = 0; m < mb; m++) acc[m] = b;
    for (int64_t k0 = 0; k0 < k_len; k0 += LIN_F32_CHUNK) {
        const int64_t k1 = k0 + LIN_F32_CHUNK < k_len ? k0 + LIN_F32_CHUNK : k_len;
        for (int m = 0; m < mb; m++) part[m] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++, w += LIN_N) {
            if ((k & 3) == 0) /* every 256 bytes of weight, the 4 lines LIN_PREFETCH ahead */
                PREFETCH_4_LINES((const char *)w + LIN_PREFETCH, _MM_HINT_T0);
            const __m512 wv = _mm512_loadu_ps(w);
            for (int m = 0; m < mb; m++) part[m] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * x_stride + k]), part[m]);
        }
        for (int m = 0; m < mb; m++) acc[m] = _mm512_add_ps(acc[m], part[m]);
    }
    for (int m = 0; m < mb; m++) _mm512_storeu_ps(y + m * y_stride, acc[m]);
}
#endif

/* The same blocked layouts on AVX2 with FMA (8 lanes, 16 registers): a block's 16 output rows are
   two vectors, bf16 weights widened by a shift (even inputs) and a mask (odd ones) instead of the
   bf16 dot instruction. The block's weights go in chunks of LIN_AVX2_K inputs (8 KB float32, 4 KB
   bf16: they stay in L1), over which the rows of x pass up to LIN_AVX2_ROWS at a time (their 8
   partial sums, the weight vectors and the broadcasts fill the registers); each chunk's partial
   sums are added to the total, as the AVX-512 float32 kernel's are. */
#if defined(__AVX2__) && defined(__FMA__)
#define LIN_AVX2 1
#define LIN_AVX2_K 128
#define LIN_AVX2_ROWS 4

/* acc[m] (two vectors: the block's rows 0-7 and 8-15) += the chunk [k0, k1) of rows m of x */
static inline __attribute__((always_inline)) void lin_avx2_pass_f32(const float *x, int64_t x_stride, const float *w,
                                                                    int64_t k0, int64_t k1, __m256 (*acc)[2],
                                                                    const int mr, const int prefetch) {
    __m256 part[LIN_AVX2_ROWS][2];
    for (int m = 0; m < mr; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
    const float *wk = w + k0 * LIN_N;
    for (int64_t k = k0; k < k1; k++, wk += LIN_N) {
        if (prefetch && (k & 3) == 0) PREFETCH_4_LINES((const char *)wk + LIN_PREFETCH, _MM_HINT_T0);
        const __m256 lo = _mm256_loadu_ps(wk), hi = _mm256_loadu_ps(wk + 8);
        for (int m = 0; m < mr; m++) {
            const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
            part[m][0] = _mm256_fmadd_ps(lo, xv, part[m][0]);
            part[m][1] = _mm256_fmadd_ps(hi, xv, part[m][1]);
        }
    }
    for (int m = 0; m < mr; m++) {
        acc[m][0] = _mm256_add_ps(acc[m][0], part[m][0]);
        acc[m][1] = _mm256_add_ps(acc[m][1], part[m][1]);
    }
}

static inline __attribute__((always_inline)) void lin_avx2_pass_bf16(const uint16_t *x, int64_t x_stride,
                                                                     const uint16_t *w, int64_t k0, int64_t k1,
                                                                     __m256 (*acc)[2], const int mr, const int prefetch) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 part[LIN_AVX2_ROWS][2];
    for (int m = 0; m < mr; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
    const uint16_t *wk = w + k0 * LIN_N; /* [K/2][16][2]: inputs k, k + 1 of the 16 rows, side by side */
    for (int64_t k = k0; k < k1; k += 2, wk += 2 * LIN_N) {
        if (prefetch && (k & 7) == 0) PREFETCH_4_LINES((const char *)wk + LIN_PREFETCH, _MM_HINT_T0);
        const __m256i a = _mm256_loadu_si256((const __m256i *)wk), b = _mm256_loadu_si256((const __m256i *)(wk + 16));
        const __m256 lo_even = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
        const __m256 lo_odd = _mm256_castsi256_ps(_mm256_and_si256(a, high));
        const __m256 hi_even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        const __m256 hi_odd = _mm256_castsi256_ps(_mm256_and_si256(b, high));
        for (int m = 0; m < mr; m++) {
            int32_t pair; /* x's inputs k, k + 1 in one broadcast, widened as the weights are */
            memcpy(&pair, x + m * x_stride + k, 4);
            const __m256i xp = _mm256_set1_epi32(pair);
            const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
            const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xp, high));
            part[m][0] = _mm256_fmadd_ps(lo_odd, xo, _mm256_fmadd_ps(lo_even, xe, part[m][0]));
            part[m][1] = _mm256_fmadd_ps(hi_odd, xo, _mm256_fmadd_ps(hi_even, xe, part[m][1]));
        }
    }
    for (int m = 0; m < mr; m++) {
        acc[m][0] = _mm256_add_ps(acc[m][0], part[m][0]);
        acc[m][1] = _mm256_add_ps(acc[m][1], part[m][1]);
    }
}

/* the chunks of K, each passed over by rows 0-3 of x, then 4-7 (PASS: the element type's pass;
   row counts spelled out, so they stay constants and the partial sums registers); the first pass
   prefetches the weights ahead */
#define LIN_AVX2_CHUNKS(PASS)                                                                           \
    for (int64_t k0 = 0; k0 < k_len; k0 += LIN_AVX2_K) {                                                \
        const int64_t k1 = k0 + LIN_AVX2_K < k_len ? k0 + LIN_AVX2_K : k_len;                           \
        PASS(x, x_stride, w, k0, k1, acc, mb < LIN_AVX2_ROWS ? mb : LIN_AVX2_ROWS, 1);                  \
        if (mb > LIN_AVX2_ROWS)                                                                         \
            PASS(x + LIN_AVX2_ROWS * x_stride, x_stride, w, k0, k1, acc + LIN_AVX2_ROWS, mb - LIN_AVX2_ROWS, 0); \
    }

#ifndef __AVX512F__
#define HAVE_LINEAR_F32 1
static inline __attribute__((always_inline)) void linear_block_f32(const float *x, int64_t x_stride, int64_t k_len,
                                                                   const float *w, const float *bias, float *y,
                                                                   int64_t y_stride, const int mb) {
    __m256 acc[LIN_MB][2];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int m = 0; m < mb; m++) acc[m][0] = b0, acc[m][1] = b1;
    LIN_AVX2_CHUNKS(lin_avx2_pass_f32)
    for (int m = 0; m < mb; m++) {
        _mm256_storeu_ps(y + m * y_stride, acc[m][0]);
        _mm256_storeu_ps(y + m * y_stride + 8, acc[m][1]);
    }
}
#endif

#if !HAVE_DPBF16
static inline __attribute__((always_inline)) void linear_block(const uint16_t *x, int64_t x_stride, int64_t k_len,
                                                               const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                               int64_t y_stride, const int mb) {
    __m256 acc[LIN_MB][2];
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias) {
        b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bias)), 16));
        b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(bias + 8))), 16));
    }
    for (int m = 0; m < mb; m++) acc[m][0] = b0, acc[m][1] = b1;
    LIN_AVX2_CHUNKS(lin_avx2_pass_bf16)
    for (int m = 0; m < mb; m++) {
        float out[LIN_N];
        _mm256_storeu_ps(out, acc[m][0]);
        _mm256_storeu_ps(out + 8, acc[m][1]);
        for (int i = 0; i < LIN_N; i++) y[m * y_stride + i] = bf16_store(out[i]);
    }
}
#endif
#endif

#if HAVE_DPBF16 || defined(LIN_AVX2)
#define HAVE_LINEAR_BF16 1
#else
#define HAVE_LINEAR_BF16 0
#endif
#ifndef HAVE_LINEAR_F32
#define HAVE_LINEAR_F32 0
#endif

/* Threads take contiguous runs of blocks; rows of x go in tiles that stay in L2 (BLOCK: the
   block function, T the element type). When there are fewer blocks than two per thread and rows
   enough (prefill of a narrow projection), threads split the rows instead and each reads the
   whole weight: otherwise some would sit idle. Each output's sum is the same either way. */
#define LINEAR_DRIVER(BLOCK, T)                                                                         \
    const int64_t blocks = n_len / LIN_N;                                                               \
    const int64_t fit = LIN_TILE_BYTES / ((int64_t)sizeof(T) * k_len) / LIN_MB * LIN_MB;                \
    const int64_t tile = fit > LIN_MB ? fit : LIN_MB;                                                   \
    _Pragma("omp parallel num_threads(threads)")                                                        \
    {                                                                                                   \
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();                             \
        const int by_rows = nt > 1 && blocks < 2 * nt && m_len >= 2 * LIN_MB * nt;                      \
        const int64_t g0 = by_rows ? 0 : blocks * t / nt, g1 = by_rows ? blocks : blocks * (t + 1) / nt; \
        const int64_t r0 = by_rows ? m_len * t / nt : 0, r1 = by_rows ? m_len * (t + 1) / nt : m_len;   \
        for (int64_t t0 = r0; t0 < r1; t0 += tile) {                                                    \
            const int64_t t1 = t0 + tile < r1 ? t0 + tile : r1;                                         \
            for (int64_t g = g0; g < g1; g++) {                                                         \
                const T *wg = w + g * LIN_N * k_len, *bg = bias ? bias + g * LIN_N : NULL;              \
                for (int64_t m0 = t0; m0 < t1; m0 += LIN_MB) {                                          \
                    const T *xm = x + m0 * x_stride;                                                    \
                    T *ym = y + m0 * n_len + g * LIN_N;                                                 \
                    switch (t1 - m0) { /* constant row counts: the accumulators stay in registers */    \
                    case 1: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 1); break;                    \
                    case 2: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 2); break;                    \
                    case 3: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 3); break;                    \
                    case 4: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 4); break;                    \
                    case 5: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 5); break;                    \
                    case 6: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 6); break;                    \
                    case 7: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 7); break;                    \
                    default: BLOCK(xm, x_stride, k_len, wg, bg, ym, n_len, 8); break;                   \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    return 0;

/* x [M, K] rows x_stride apart, w blocked [N/16][K/2][16][2], bias [N] or NULL, y [M, N] contiguous;
   N a multiple of 16, K of 2. Returns -1 where the CPU has neither the bf16 dot instruction nor
   AVX2 with FMA. */
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
#if HAVE_LINEAR_BF16
    LINEAR_DRIVER(linear_block, uint16_t)
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)m_len; (void)n_len; (void)k_len; (void)threads;
    return -1;
#endif
}

/* ---- bf16 linear on AMX tiles over the same blocked weight --------------------------------------
   The blocked layout [N/16][K/2][16][2] is already AMX's B operand: 16 consecutive input pairs of a
   block (32 inputs) are 16 rows of 64 bytes, each the 16 outputs' two values side by side, one
   tile loaded with a 64-byte stride, no copy. A tile of 16 rows of x by 32 inputs is the A operand
   (rows x_stride apart), and TDPBF16PS adds A.B into 16 x 16 fp32 sums. Each thread takes a run of
   pairs of blocks; for a pair it walks all rows of x 16 at a time (the pair's weights, 64 KiB at
   K = 1,024, stay in L2 while x streams), two accumulator tiles sharing each A tile. Rows past a
   multiple of 16 go through a zero-padded copy. Sums are fp32 (in the tiles' order); each output
   is rounded to bf16 once, with the bias. K must be a multiple of 32. Linux grants a process the
   tiles on request (arch_prctl ARCH_REQ_XCOMP_PERM), once, in have_amx_bf16. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_BF16 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

int have_amx_bf16(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* the 16 x 16 fp32 sums of tile c (in buf), plus bias, as bf16 into `rows` rows of y */
static inline void amx_store(const float *buf, const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t rows) {
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16))
                          : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + r * y_stride),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(buf + r * 16), b)));
}

int linear_amx_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
    if (!have_amx_bf16() || k_len % 32 || n_len % LIN_N || m_len < 1) return -1;
    const int64_t blocks = n_len / LIN_N, pairs = (blocks + 1) / 2, ksteps = k_len / 32;
    const int64_t full = m_len / 16 * 16, rest = m_len - full;
    /* rows a pass over the weights takes: ~384 KiB of x, which stays in L2 while the weights stream
       (all rows at once re-read x from memory for every pair of blocks: at 2,048 rows of K = 768,
       half the speed of 512), over ~512 KiB of weights at a time, a tile of rows after another
       (their outputs then written a run of columns at a time, not one column block down all rows) */
    const int64_t m_block = (384 * 1024 / (2 * k_len)) / 32 * 32 > 32 ? (384 * 1024 / (2 * k_len)) / 32 * 32 : 32;
    const int64_t p_block = 512 * 1024 / (4 * LIN_N * k_len) > 1 ? 512 * 1024 / (4 * LIN_N * k_len) : 1;
    uint16_t *pad = NULL; /* the last rows, zero-padded to 16 */
    if (rest) {
        pad = calloc((size_t)(16 * k_len), sizeof(uint16_t));
        if (!pad) return 3;
        for (int64_t r = 0; r < rest; r++) memcpy(pad + r * k_len, x + (full + r) * x_stride, (size_t)k_len * 2);
    }
    _Pragma("omp parallel num_threads(threads)")
    {
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* C00 C01 C10 C11 A0 A1 B0 B1 */
        _tile_loadconfig(&cfg);
        float buf[256];
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p_lo = pairs * t / nt, p_hi = pairs * (t + 1) / nt;
#define AMX_OUT(T, M0, G)                                                                                  \
    do {                                                                                                   \
        _tile_stored(T, buf, 64);                                                                          \
        amx_store(buf, bias ? bias + (G) * LIN_N : NULL, y + (M0) * n_len + (G) * LIN_N, n_len,            \
                  (M0) < full ? 16 : rest);                                                                \
    } while (0)
        for (int64_t mb = 0; mb < m_len; mb += m_block)
        for (int64_t pb = p_lo; pb < p_hi; pb += p_block)
        for (int64_t m0 = mb; m0 < m_len && m0 < mb + m_block; m0 += 32)
        for (int64_t p = pb; p < p_hi && p < pb + p_block; p++) {
            const int64_t g = 2 * p, two = g + 1 < blocks;
            const uint16_t *w0 = w + g * LIN_N * k_len, *w1 = w0 + LIN_N * k_len;
            if (two && m0 + 32 <= full) {
                /* two tiles of rows by the pair's two blocks: four sums, each A and B tile loaded
                   once for two products (one row tile by two blocks loaded three tiles for two) */
                const uint16_t *x0 = x + m0 * x_stride, *x1 = x0 + 16 * x_stride;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < ksteps; kb++) {
                    _tile_loadd(4, x0 + kb * 32, x_stride * 2);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_loadd(7, w1 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, x1 + kb * 32, x_stride * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                AMX_OUT(0, m0, g);
                AMX_OUT(1, m0, g + 1);
                AMX_OUT(2, m0 + 16, g);
                AMX_OUT(3, m0 + 16, g + 1);
                continue;
            }
            for (int64_t mm = m0; mm < m0 + 32 && mm < m_len; mm += 16) { /* the last rows, a lone block */
                const uint16_t *xm = mm < full ? x + mm * x_stride : pad;
                const int64_t xs = (mm < full ? x_stride : k_len) * 2;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t kb = 0; kb < ksteps; kb++) {
                    _tile_loadd(4, xm + kb * 32, xs);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, w1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                AMX_OUT(0, mm, g);
                if (two) AMX_OUT(1, mm, g + 1);
            }
        }
#undef AMX_OUT
        _tile_release();
    }
    free(pad);
    return 0;
}
#else
#define HAVE_AMX_BF16 0
int have_amx_bf16(void) { return 0; }
int linear_amx_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)m_len; (void)n_len; (void)k_len; (void)threads;
    return -1;
}
#endif

/* ---- Prefill attention on AMX tiles ------------------------------------------------------------
   The same chunks as prefill_attn_bf16, in the transposed orientation: a task is (chunk, KV head,
   up to 32 query rows in two halves of 16 "lanes"), and the scores of 32 keys are S^T = K . Q^T:
   the keys are the A operand straight from the cache (16 rows of a block, a row stride apart),
   each half's queries a B operand, packed into pairs once per task. Each score row is then 16
   lanes, so the running softmax is vertical: maxima, sums and rescaling are lane-wise vector ops,
   with no horizontal reduction per row (the AVX-512 kernel's cost). The outputs accumulate as
   O^T += V^T . P^T: the values transposed once per chunk and KV head in a first pass (keys past
   the context zeroed), the weights rounded to bf16 and packed into pairs of keys, O^T's 16 x 16
   tiles added into an fp32 accumulator after each step's rescale. Numerics as the AVX-512
   kernel's: bf16 products summed in fp32, weights rounded to bf16 for the second product, their
   sum kept in fp32. (Per 2,048-token layer: the softmax ~40% of the time, the tiles and the
   accumulators the rest.) */
#if HAVE_AMX_BF16 && HAVE_DPBF16
#define AK 32 /* keys per step */

/* chunk's values for one KV head, transposed: vt[step][dim][32 keys] (keys past ctx zero) */
static void amx_pack_vt(const uint16_t *vc, const int32_t *table, int64_t ctx, int64_t kvh, int64_t tok, int64_t d,
                        int64_t bs, int64_t step, uint16_t *vt) {
    uint16_t *dst = vt + step * d * AK;
    for (int64_t kk = 0; kk < AK; kk++) {
        const int64_t k = step * AK + kk;
        if (k >= ctx) {
            for (int64_t i = 0; i < d; i++) dst[i * AK + kk] = 0;
            continue;
        }
        const uint16_t *src = vc + ((int64_t)table[k / bs] * bs + k % bs) * tok + kvh * d;
        for (int64_t i = 0; i < d; i++) dst[i * AK + kk] = src[i];
    }
}

/* One half's (16 lanes') running softmax over a step's scores (sb: AK keys' rows of 16 lanes):
   scale, causal mask where some key lies in some lane's future, the new maxima, the weights
   packed into pairs of keys (pb, the second product's B operand) and added into the sums l.
   Returns the factor the half's outputs so far are rescaled by. */
static inline __m512 amx_softmax_step(float (*sb)[16], uint32_t (*pb)[16], __m512i posv, int64_t k0, int64_t nk,
                                      int diag, __m512 sc, __m512 *m, __m512 *l) {
    const __m512i pair = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                          21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __mmask16 keep[AK];
    __m512 mx = *m;
    for (int64_t i = 0; i < nk; i++) {
        keep[i] = diag ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + i)), _MM_CMPINT_NLT)
                       : (__mmask16)0xffff;
        const __m512 s = _mm512_mask_blend_ps(keep[i], _mm512_set1_ps(-INFINITY), _mm512_mul_ps(_mm512_load_ps(sb[i]), sc));
        _mm512_store_ps(sb[i], s);
        mx = _mm512_max_ps(mx, s);
    }
    /* every lane sees key 0 in the first step, so mx is finite from there on */
    const __m512 corr = exp_nonpos16(_mm512_sub_ps(*m, mx));
    *m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < AK; i += 2) {
        __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
        if (i < nk) p0 = _mm512_maskz_mov_ps(keep[i], exp_nonpos16(_mm512_sub_ps(_mm512_load_ps(sb[i]), mx)));
        if (i + 1 < nk) p1 = _mm512_maskz_mov_ps(keep[i + 1], exp_nonpos16(_mm512_sub_ps(_mm512_load_ps(sb[i + 1]), mx)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_store_si512((void *)pb[i / 2], _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    *l = _mm512_fmadd_ps(*l, corr, sum);
    return corr;
}

/* acc (16 dims' rows of 16 lanes) = acc * corr + the step's products (ob) */
static inline void amx_accumulate(float (*acc)[16], const float (*ob)[16], __m512 corr) {
    for (int64_t i = 0; i < 16; i++)
        _mm512_store_ps(acc[i], _mm512_fmadd_ps(_mm512_load_ps(acc[i]), corr, _mm512_load_ps(ob[i])));
}

/* A task: up to 32 query rows (two halves of 16 lanes) of one chunk and KV head. Each tile of
   keys and of transposed values is loaded once for both halves (tiles: 0 and 7 keys or values,
   1 and 2 the halves' queries or weights, 3-6 their sums); one half's softmax runs while the
   other's products are under way. */
static void amx_prefill_task(const uint16_t *kc, const uint16_t *vt, const uint16_t *q, int64_t q_stride, uint16_t *out,
                             const int32_t *table, int64_t row0, int64_t prefix, int64_t r0, int64_t total,
                             int64_t kvh, int64_t g, int64_t hq, int64_t tok, int64_t d, int64_t bs, float scale) {
    uint32_t qt[2][MAX_D / 2][16] __attribute__((aligned(64)));
    float sb[2][AK][16] __attribute__((aligned(64)));
    uint32_t pb[2][AK / 2][16] __attribute__((aligned(64)));
    float ob[4][16][16] __attribute__((aligned(64)));
    float acc[2][MAX_D][16] __attribute__((aligned(64)));
    int32_t pos[2][16] __attribute__((aligned(64)));
    const int64_t lanes = total - r0 < 32 ? total - r0 : 32, halves = lanes > 16 ? 2 : 1, half = d / 2;
    for (int64_t h = 0; h < halves; h++)
        for (int64_t lane = 0; lane < 16; lane++) {
            /* lanes past the rows: zero queries at the last row's position (finite, never written) */
            const int64_t at = 16 * h + lane, r = r0 + (at < lanes ? at : lanes - 1), t = r / g, j = r % g;
            const uint32_t *src = (const uint32_t *)(q + (row0 + t) * q_stride + (kvh * g + j) * d);
            pos[h][lane] = (int32_t)(prefix + t);
            for (int64_t p = 0; p < half; p++) qt[h][p][lane] = at < lanes ? src[p] : 0u;
        }
    memset(acc, 0, (size_t)halves * sizeof acc[0]);
    const __m512i pos0 = _mm512_load_si512((const void *)pos[0]), pos1 = _mm512_load_si512((const void *)pos[halves - 1]);
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 m[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t kend = (int64_t)pos[halves - 1][15] + 1; /* lanes ascend by position */
    for (int64_t k0 = 0; k0 < kend; k0 += AK) {
        const int64_t nk = kend - k0 < AK ? kend - k0 : AK, two = nk > 16;
        const uint16_t *ka = kc + ((int64_t)table[k0 / bs] * bs + k0 % bs) * tok + kvh * d;
        const uint16_t *kb = two ? kc + ((int64_t)table[(k0 + 16) / bs] * bs + (k0 + 16) % bs) * tok + kvh * d : ka;
        _tile_zero(3);
        _tile_zero(4);
        if (halves == 2) {
            _tile_zero(5);
            _tile_zero(6);
        }
        for (int64_t dc = 0; dc < d / 32; dc++) {
            _tile_loadd(0, ka + dc * 32, tok * 2);
            _tile_loadd(1, qt[0][dc * 16], 64);
            _tile_dpbf16ps(3, 0, 1);
            if (two) {
                _tile_loadd(7, kb + dc * 32, tok * 2);
                _tile_dpbf16ps(4, 7, 1);
            }
            if (halves == 2) {
                _tile_loadd(2, qt[1][dc * 16], 64);
                _tile_dpbf16ps(5, 0, 2);
                if (two) _tile_dpbf16ps(6, 7, 2);
            }
        }
        _tile_stored(3, sb[0][0], 64);
        _tile_stored(4, sb[0][16], 64);
        const __m512 corr0 = amx_softmax_step(sb[0], pb[0], pos0, k0, nk, k0 + nk - 1 > pos[0][0], sc, &m[0], &l[0]);
        __m512 corr1 = corr0;
        if (halves == 2) {
            _tile_stored(5, sb[1][0], 64);
            _tile_stored(6, sb[1][16], 64);
            corr1 = amx_softmax_step(sb[1], pb[1], pos1, k0, nk, k0 + nk - 1 > pos[1][0], sc, &m[1], &l[1]);
        }
        _tile_loadd(1, pb[0], 64);
        if (halves == 2) _tile_loadd(2, pb[1], 64);
        const uint16_t *vs = vt + k0 / AK * d * AK;
        for (int64_t db = 0; db < d / 16; db += 2) { /* d a multiple of 32: blocks of 16 dims in pairs */
            _tile_loadd(0, vs + db * 16 * AK, AK * 2);
            _tile_loadd(7, vs + (db + 1) * 16 * AK, AK * 2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_dpbf16ps(3, 0, 1);
            _tile_dpbf16ps(4, 7, 1);
            if (halves == 2) {
                _tile_zero(5);
                _tile_zero(6);
                _tile_dpbf16ps(5, 0, 2);
                _tile_dpbf16ps(6, 7, 2);
            }
            _tile_stored(3, ob[0], 64);
            _tile_stored(4, ob[1], 64);
            amx_accumulate(acc[0] + db * 16, (const float (*)[16])ob[0], corr0);
            amx_accumulate(acc[0] + (db + 1) * 16, (const float (*)[16])ob[1], corr0);
            if (halves == 2) {
                _tile_stored(5, ob[2], 64);
                _tile_stored(6, ob[3], 64);
                amx_accumulate(acc[1] + db * 16, (const float (*)[16])ob[2], corr1);
                amx_accumulate(acc[1] + (db + 1) * 16, (const float (*)[16])ob[3], corr1);
            }
        }
    }
    for (int64_t h = 0; h < halves; h++) {
        float inv[16] __attribute__((aligned(64)));
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l[h]));
        for (int64_t lane = 0; lane < 16 && 16 * h + lane < lanes; lane++) {
            const int64_t r = r0 + 16 * h + lane, t = r / g, j = r % g;
            uint16_t *o = out + ((row0 + t) * hq + kvh * g + j) * d;
            for (int64_t i = 0; i < d; i++) o[i] = bf16_store(acc[h][i][lane] * inv[lane]);
        }
    }
}

static int prefill_attn_amx(const uint16_t *kc, const uint16_t *vc, const uint16_t *q, int64_t q_stride, uint16_t *out,
                            const int32_t *tables, int64_t table_stride, const int32_t *row, const int32_t *len,
                            const int32_t *ctx, int64_t n_chunks, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                            float scale, int threads) {
    if (!have_amx_bf16()) return -1;
    const int64_t g = hq / hkv, tok = hkv * d;
    int64_t *voff = malloc((size_t)(n_chunks + 1) * sizeof *voff), *toff = malloc((size_t)(n_chunks + 1) * sizeof *toff);
    if (!voff || !toff) {
        free(voff);
        free(toff);
        return 3;
    }
    voff[0] = toff[0] = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        voff[c + 1] = voff[c] + (ctx[c] + AK - 1) / AK * AK * d * hkv; /* values, transposed, per KV head */
        toff[c + 1] = toff[c] + (len[c] * g + 31) / 32 * hkv;        /* tasks: 32 query rows of a KV head */
    }
    uint16_t *vt = malloc((size_t)(voff[n_chunks] ? voff[n_chunks] : 1) * sizeof *vt);
    if (!vt) {
        free(voff);
        free(toff);
        return 3;
    }
    const int64_t tasks = toff[n_chunks];
    _Pragma("omp parallel num_threads(threads)")
    {
        for (int64_t c = 0; c < n_chunks; c++) {
            const int64_t steps = (ctx[c] + AK - 1) / AK;
            if (!len[c]) continue;
            _Pragma("omp for schedule(static) nowait")
            for (int64_t it = 0; it < steps * hkv; it++)
                amx_pack_vt(vc, tables + c * table_stride, ctx[c], it / steps, tok, d, bs, it % steps,
                            vt + voff[c] + it / steps * steps * AK * d);
        }
        _Pragma("omp barrier")
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        /* NOTE: later query rows see more keys; dynamic scheduling evens the threads out */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < tasks; task++) {
            int64_t c = 0;
            while (task >= toff[c + 1]) c++;
            const int64_t per_head = (toff[c + 1] - toff[c]) / hkv, i = task - toff[c];
            const int64_t kvh = i / per_head, steps = (ctx[c] + AK - 1) / AK;
            amx_prefill_task(kc, vt + voff[c] + kvh * steps * AK * d, q, q_stride, out, tables + c * table_stride,
                             row[c], ctx[c] - len[c], i % per_head * 32, len[c] * g, kvh, g, hq, tok, d, bs, scale);
        }
        _tile_release();
    }
    free(vt);
    free(voff);
    free(toff);
    return 0;
}
#else
static int prefill_attn_amx(const uint16_t *kc, const uint16_t *vc, const uint16_t *q, int64_t q_stride, uint16_t *out,
                            const int32_t *tables, int64_t table_stride, const int32_t *row, const int32_t *len,
                            const int32_t *ctx, int64_t n_chunks, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                            float scale, int threads) {
    (void)kc; (void)vc; (void)q; (void)q_stride; (void)out; (void)tables; (void)table_stride; (void)row; (void)len;
    (void)ctx; (void)n_chunks; (void)hq; (void)hkv; (void)d; (void)bs; (void)scale; (void)threads;
    return -1;
}
#endif

/* x [M, K] float32 rows x_stride apart, w blocked [N/16][K][16], bias [N] or NULL, y [M, N]
   contiguous; N a multiple of 16. Returns -1 where the CPU has neither AVX-512 nor AVX2 with FMA. */
int linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t m_len,
               int64_t n_len, int64_t k_len, int threads) {
#if HAVE_LINEAR_F32
    LINEAR_DRIVER(linear_block_f32, float)
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)m_len; (void)n_len; (void)k_len; (void)threads;
    return -1;
#endif
}

int have_linear_f32(void) { return HAVE_LINEAR_F32 + 0; }
int have_linear_bf16(void) { return HAVE_LINEAR_BF16 + 0; }

/* ---- A whole decode step's decoder layers in one call (bf16 or float32, blocked weights) -------
   The model's Python runs ~10 small ops per layer around these kernels (views, allocations, the
   KV scatter, a ctypes call each): ~2.4 ms of a 10 ms decode step of the large demo model at batch
   1 on one core, where the kernels themselves are bound by reading the weights. For a step whose
   every token is a decode, llmbus/model/llama.py hands the layers here instead: the same kernels in
   the same order with the same roundings (bf16: bit-identical hidden states; float32: the same
   up to the order of sums in the norms and products), the glue in C.

   h [B, H] (bf16 or float32, as every weight and cache): the embedded tokens in, the last layer's
   output out (in place). cos/sin [B, d/2]. layers [L][DL_PTRS]: per layer, as uint64 addresses:
   input norm weight, qkv blocked weight, qkv bias, o blocked weight, o bias, post-attention norm
   weight, gate_up blocked weight, gate_up bias, down blocked weight, down bias (biases may be 0).
   caches [L][DC_PTRS]: each layer's cache, as uint64 addresses by its kind (DC_*): the model
   dtype's [2, N, bs, Hkv, D] tensor; int8's data and scales (fp16 or fp32); int4's data, k_meta,
   v_meta, k_tail, v_tail (the tails 0 where the cache keeps none). Quantized caches are written
   and read by the same kernels as one layer at a time (write_int8_*, write_int4_*,
   paged_decode_int8_*, paged_decode_int4_*), so the results are the same bytes. tail_slots [B]
   (int4 writes) and tail_rows [B] (int4 reads) or null; key_slots, gk, gv: int4's metadata
   shape. slots [B] int64: each token's cache slot. tables/lens as for paged_decode_bf16.
   Returns 0; -1: unsupported (the type's linear kernel missing on this CPU, shapes the kernels do
   not take); 1: a table names a block outside the cache; 2: a slot outside the cache; 3: out of
   memory. */
#define DL_PTRS 10
#define DC_PTRS 5
enum { DC_MODEL = 0, DC_INT8_F16 = 1, DC_INT8_F32 = 2, DC_INT4 = 3, DC_INT4R = 4 };

#define DEFINE_ADD_INTO(NAME, T, LOAD, STORE)                                                          \
    static void NAME(T *h, const T *x, int64_t n) {                                                     \
        _Pragma("omp simd")                                                                             \
        for (int64_t i = 0; i < n; i++) h[i] = STORE(LOAD(h[i]) + LOAD(x[i]));                          \
    }
DEFINE_ADD_INTO(add_into_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ADD_INTO(add_into_f32, float, f32_load, f32_store)

/* One layer's quantizing write of the step's keys and values (k, v: [B, Hkv, D], contiguous) into
   a quantized cache c (DC_PTRS addresses of kind DC_INT8_*, DC_INT4 or DC_INT4R: k and q come
   rotated, and q is rounded here as paged_decode_int4's caller rounds it), then its decode into attn.
   Returns as decode_layers: 0, 1 (a table names a block outside the cache), 2 (a slot outside
   it), 3 (out of memory), -1 (a shape the kernels do not take). */
#define DEFINE_DECODE_LAYER_QUANTIZED(SFX, T)                                                           \
    static int decode_layer_quantized_##SFX(const uint64_t *c, int kind, const T *k, const T *v, T *q,     \
                                            T *attn, const int64_t *tail_slots, const int32_t *tail_rows, \
                                            int64_t key_slots, int64_t gk, int64_t gv, const int64_t *slots, \
                                            const int32_t *tables, int64_t table_stride, const int32_t *lens, \
                                            int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t bs, \
                                            int64_t num_blocks, float scale, int threads) {              \
        if (kind == DC_INT8_F16) {                                                                      \
            if (write_int8_##SFX##_f16(k, v, batch, slots, (int8_t *)c[0], (uint16_t *)c[1], num_blocks, bs, hkv, d)) \
                return 2;                                                                               \
            return paged_decode_int8_##SFX##_f16((const int8_t *)c[0], (const uint16_t *)c[1], q, attn, tables, \
                                                table_stride, lens, batch, hq, hkv, d, bs, num_blocks, scale, threads); \
        }                                                                                               \
        if (kind == DC_INT8_F32) {                                                                      \
            if (write_int8_##SFX##_f32(k, v, batch, slots, (int8_t *)c[0], (float *)c[1], num_blocks, bs, hkv, d)) \
                return 2;                                                                               \
            return paged_decode_int8_##SFX##_f32((const int8_t *)c[0], (const float *)c[1], q, attn, tables, \
                                                table_stride, lens, batch, hq, hkv, d, bs, num_blocks, scale, threads); \
        }                                                                                               \
        const int per_token = kind == DC_INT4R;                                                         \
        const int rc = write_int4_##SFX(k, v, batch, slots, tail_slots, (uint8_t *)c[0], (uint16_t *)c[1],     \
                                        (uint16_t *)c[2], (T *)c[3], (T *)c[4], num_blocks, bs, hkv, d, key_slots, gk, gv, \
                                        per_token);                                                     \
        if (rc != 0) return rc == 1 ? 2 : rc == 2 ? -1 : 3;                                             \
        if (per_token) round_query_##SFX##_##SFX(q, batch * hq, d, q, threads);                        \
        const int tails = tail_rows != 0;                                                               \
        return paged_decode_int4_##SFX((const uint8_t *)c[0], (const uint16_t *)c[1], (const uint16_t *)c[2], \
                                       tails ? (const T *)c[3] : 0, tails ? (const T *)c[4] : 0, tail_rows, key_slots, \
                                       gk, gv, q, attn, tables, table_stride, lens, batch, hq, hkv, d, bs, num_blocks, \
                                       scale, threads, per_token);                                      \
    }
DEFINE_DECODE_LAYER_QUANTIZED(bf16, uint16_t)
DEFINE_DECODE_LAYER_QUANTIZED(f32, float)

/* The decode layers' bf16 products go on AMX's tiles where the process may use them (as
   llmbus/model/cpu_linear.py's do). */
static int linear_bf16_best(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                            int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
    if (!amx_off && linear_amx_bf16(x, x_stride, w, bias, y, m_len, n_len, k_len, threads) == 0) return 0;
    return linear_bf16(x, x_stride, w, bias, y, m_len, n_len, k_len, threads);
}
#define linear_bf16 linear_bf16_best

/* SFX names the element type's kernels (bf16: uint16_t, f32: float); HAVE: whether its linear
   kernel exists on this CPU. */
#define DEFINE_DECODE_LAYERS(SFX, T, HAVE)                                                              \
    int decode_layers_##SFX(T *h, const T *cos_, const T *sin_, const uint64_t *layers, const uint64_t *caches, \
                            int kind, const int64_t *tail_slots, const int32_t *tail_rows, int64_t key_slots,      \
                            int64_t gk, int64_t gv,                                                      \
                            int64_t num_layers, const int64_t *slots, const int32_t *tables, int64_t table_stride, \
                            const int32_t *lens, int64_t batch, int64_t hidden, int64_t hq, int64_t hkv, int64_t d, \
                            int64_t inter, int64_t bs, int64_t num_blocks, float eps, float scale, int threads) { \
        const int64_t q_n = hq * d, kv_n = hkv * d, qkv_n = q_n + 2 * kv_n;                             \
        if (!(HAVE) || batch < 1 || d % 2 || hidden % LIN_N || qkv_n % LIN_N || (2 * inter) % LIN_N     \
            || q_n % 2 || inter % 2 || hkv < 1 || hq % hkv || hq / hkv > MAX_ROWS || d > MAX_D || bs > MAX_BS \
            || kind < DC_MODEL || kind > DC_INT4R || (kind == DC_INT4 && !int4_shape_ok(d, bs, key_slots, gk, gv)) \
            || (kind == DC_INT4R && (!int4_token_shape_ok(d, bs, key_slots, gk, gv) || (d & (d - 1)))))   \
            return -1;                                                                                  \
        for (int64_t b = 0; b < batch; b++)                                                             \
            if (slots[b] < 0 || slots[b] >= num_blocks * bs) return 2;                                  \
        /* one scratch allocation for the step: x, qkv, q, k, attention output, projection output,     \
           gate_up, activation, the new values (contiguous, for the quantizing writes) */              \
        const int64_t per_row = hidden + qkv_n + q_n + kv_n + q_n + hidden + 2 * inter + inter + kv_n;  \
        T *work = malloc((size_t)(batch * per_row) * sizeof(T));                                        \
        if (!work) return 3;                                                                            \
        T *x = work, *qkv = x + batch * hidden, *q = qkv + batch * qkv_n, *k = q + batch * q_n;         \
        T *attn = k + batch * kv_n, *proj = attn + batch * q_n, *gu = proj + batch * hidden;            \
        T *act = gu + batch * 2 * inter, *v = act + batch * inter;                                      \
        const int64_t n_tok = batch * hidden;                                                           \
        int rc = 0;                                                                                     \
        for (int64_t l = 0; l < num_layers && rc == 0; l++) {                                           \
            const uint64_t *p = layers + l * DL_PTRS;                                                   \
            const T *in_norm = (const T *)p[0], *qkv_w = (const T *)p[1], *qkv_b = (const T *)p[2];     \
            const T *o_w = (const T *)p[3], *o_b = (const T *)p[4], *post_norm = (const T *)p[5];       \
            const T *gu_w = (const T *)p[6], *gu_b = (const T *)p[7], *down_w = (const T *)p[8];        \
            const T *down_b = (const T *)p[9];                                                          \
            const uint64_t *c = caches + l * DC_PTRS;                                                   \
            rms_norm_##SFX(h, hidden, in_norm, x, batch, hidden, eps, threads);                         \
            linear_##SFX(x, hidden, qkv_w, qkv_b, qkv, batch, qkv_n, hidden, threads);                  \
            rope_##SFX(qkv, qkv_n, cos_, sin_, q, batch, hq, d, threads);                               \
            rope_##SFX(qkv + q_n, qkv_n, cos_, sin_, k, batch, hkv, d, threads);                        \
            if (kind == DC_INT4R) { /* as the backend's forward: queries and keys rotated */           \
                rotate_##SFX(q, batch * hq, d, q, threads);                                             \
                rotate_##SFX(k, batch * hkv, d, k, threads);                                            \
            }                                                                                           \
            if (kind == DC_MODEL) {                                                                     \
                T *kc = (T *)c[0], *vc = kc + num_blocks * bs * kv_n;                                   \
                for (int64_t b = 0; b < batch; b++) { /* the new keys and values into their slots */   \
                    memcpy(kc + slots[b] * kv_n, k + b * kv_n, (size_t)kv_n * sizeof(T));               \
                    memcpy(vc + slots[b] * kv_n, qkv + b * qkv_n + q_n + kv_n, (size_t)kv_n * sizeof(T)); \
                }                                                                                       \
                rc = paged_decode_##SFX(kc, q, attn, tables, table_stride, lens, batch, hq, hkv, d, bs, num_blocks, \
                                        scale, threads);                                                \
            } else {                                                                                    \
                for (int64_t b = 0; b < batch; b++)                                                     \
                    memcpy(v + b * kv_n, qkv + b * qkv_n + q_n + kv_n, (size_t)kv_n * sizeof(T));       \
                rc = decode_layer_quantized_##SFX(c, kind, k, v, q, attn, tail_slots, tail_rows, key_slots, gk, gv, \
                                                  slots, tables, table_stride, lens, batch, hq, hkv, d, bs, \
                                                  num_blocks, scale, threads);                          \
            }                                                                                           \
            if (rc != 0) break;                                                                         \
            linear_##SFX(attn, q_n, o_w, o_b, proj, batch, hidden, q_n, threads);                       \
            add_into_##SFX(h, proj, n_tok);                                                             \
            rms_norm_##SFX(h, hidden, post_norm, x, batch, hidden, eps, threads);                       \
            linear_##SFX(x, hidden, gu_w, gu_b, gu, batch, 2 * inter, hidden, threads);                 \
            silu_mul_##SFX(gu, act, batch, inter, threads);                                             \
            linear_##SFX(act, inter, down_w, down_b, proj, batch, hidden, inter, threads);              \
            add_into_##SFX(h, proj, n_tok);                                                             \
        }                                                                                               \
        free(work);                                                                                     \
        return rc;                                                                                      \
    }

DEFINE_DECODE_LAYERS(bf16, uint16_t, HAVE_LINEAR_BF16)
DEFINE_DECODE_LAYERS(f32, float, HAVE_LINEAR_F32)
#undef linear_bf16

/* ---- The sampler's warp and draw (float32 logits) -------------------------------------------
   Per row, llmbus/engine/sampler.py's warp_logits then its race: temperature, top-k, top-p, min-p
   (the transformers warpers' rules), then one draw. torch's path sorts every row for the filters
   (19 ms for 32 x 16,384 on two cores, ~50 on one) and makes its uniforms with a scalar Mersenne
   twister (1.5 ms). Here the filters find their thresholds by radix selection over the values'
   order-preserving bit patterns (a histogram of 8 bits per pass, each later pass counting only
   the entries of the bucket that holds the threshold) and the draw is the Gumbel-max race, argmax_i(x_i + G_i) with
   G_i = -log(-log U_i): the same race as argmax(p_i / E_i), E_i = -log U_i, in logs. U_i is a
   counter-based hash of (row key, i): SplitMix64's output i of the stream that starts at the key,
   23 bits (torch.rand's float32 has 24), so a row's draw depends on its key alone and the loops
   vectorize. Ties at a top-p boundary are all kept (torch keeps those its sort put last); the
   thresholds are summed in double where torch sums in float: only a token within rounding of a
   boundary can fall the other way. Entries of -inf never win; a row with none finite yields -1. */

/* log(x) for x > 0 finite: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m-1)/(m+1)) by
   its series to s^9 (|s| <= 0.172: truncation < 1e-9); pure arithmetic, so loops vectorize. */
static inline float log_pos(float x) {
    int32_t bits;
    memcpy(&bits, &x, 4);
    int32_t e = ((bits >> 23) & 0xff) - 127;
    int32_t mb = (bits & 0x007fffff) | 0x3f800000; /* m in [1, 2) */
    float m;
    memcpy(&m, &mb, 4);
    const int big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e += big;
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    const float p = s * (2.0f + s2 * (0.666666667f + s2 * (0.4f + s2 * (0.285714286f + s2 * 0.222222222f))));
    return (float)e * 0.693147181f + p;
}

/* float -> uint32 in the same order (NaN aside) */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (u == 0x80000000u) u = 0; /* -0 is +0 (x + 0.0f would not do: -fno-signed-zeros) */
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* The key at which, walking x's values from the largest down, the weight w (NULL: 1 per entry)
   first reaches `target`; the smallest entry's key when it never does. Entries of -inf are skipped. */
static uint32_t select_from_top(const float *x, const float *w, int64_t n, double target) {
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        double hist[256] = {0};
        for (int64_t i = 0; i < n; i++) {
            const uint32_t k = order_key(x[i]);
            if ((k & mask) == prefix && x[i] > -INFINITY) hist[(k >> shift) & 255] += w ? w[i] : 1.0;
        }
        int b = 255, last = -1;
        for (; b >= 0; b--) {
            if (hist[b] > 0) last = b;
            if (hist[b] > 0 && hist[b] >= target) break;
            target -= hist[b];
        }
        if (b < 0) { /* the target is past every entry (top_k over the finite count, or rounding): the */
            b = last < 0 ? 0 : last; /* smallest bucket, and within it, at the next digits, its smallest */
            target = last < 0 ? 0.0 : hist[last];
        }
        prefix |= (uint32_t)b << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

#define SAMPLE_CHUNK 64

/* logits [rows, n] rows x_stride apart; per row: temperature temps[r] (> 0), top_k[r] (kept when in
   (0, n)), top_p[r] (kept when < 1), min_p[r] (kept when > 0), keys[r]. out[r]: the drawn token;
   filtered (may be NULL) [rows, n]: the warped row, -inf where removed (what warp_logits returns).
   Returns 0, or 3 when out of memory. */
int sample_f32(const float *logits, int64_t x_stride, int64_t rows, int64_t n, const float *temps,
               const int64_t *top_k, const float *top_p, const float *min_p, const uint64_t *keys, int64_t *out,
               float *filtered, int threads) {
    int bad = 0;
#pragma omp parallel num_threads(threads) if (rows * n >= 65536) reduction(| : bad)
    {
        float *s = malloc((size_t)n * 2 * sizeof(float));
        if (!s) bad = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!s) continue;
            float *e = s + n;
            const float *xr = logits + r * x_stride;
            const float t = temps[r];
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < n; i++) {
                s[i] = xr[i] / t;
                m = s[i] > m ? s[i] : m;
            }
            if (top_k[r] > 0 && top_k[r] < n) {
                const uint32_t kth = select_from_top(s, NULL, n, (double)top_k[r]);
                for (int64_t i = 0; i < n; i++)
                    if (order_key(s[i]) < kth) s[i] = -INFINITY;
            }
            const int finite_max = m > -INFINITY && m < INFINITY;
            if (finite_max && (top_p[r] < 1.0f || min_p[r] > 0.0f)) {
                double z = 0.0;
#pragma omp simd reduction(+ : z)
                for (int64_t i = 0; i < n; i++) {
                    e[i] = s[i] > -INFINITY ? exp_nonpos(s[i] - m) : 0.0f;
                    z += e[i];
                }
                if (top_p[r] < 1.0f) {
                    const uint32_t cut = select_from_top(s, e, n, (double)top_p[r] * z);
                    for (int64_t i = 0; i < n; i++)
                        if (order_key(s[i]) < cut) s[i] = -INFINITY, e[i] = 0.0f;
                }
                if (min_p[r] > 0.0f) /* p_i < min_p * p_max, p_i / p_max = exp(s_i - max) */
                    for (int64_t i = 0; i < n; i++)
                        if (e[i] < min_p[r] && s[i] < m) s[i] = -INFINITY;
            }
            if (filtered) memcpy(filtered + r * n, s, (size_t)n * sizeof(float));
            const uint64_t key = keys[r];
            float best = -INFINITY;
            int64_t arg = -1;
            for (int64_t i0 = 0; i0 < n; i0 += SAMPLE_CHUNK) {
                const int64_t len = n - i0 < SAMPLE_CHUNK ? n - i0 : SAMPLE_CHUNK;
                float score[SAMPLE_CHUNK];
#pragma omp simd
                for (int64_t j = 0; j < len; j++) {
                    uint64_t z = key + (uint64_t)(i0 + j + 1) * 0x9E3779B97F4A7C15ull;
                    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
                    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
                    z ^= z >> 31;
                    /* (k + 1/2) / 2^23, exact in float and strictly inside (0, 1) (24 bits would round
                       the largest k up to 1: log(1) = 0, and that token would win) */
                    const float u = ((float)(z >> 41) + 0.5f) * 1.1920929e-07f;
                    score[j] = s[i0 + j] - log_pos(-log_pos(u));
                }
                for (int64_t j = 0; j < len; j++)
                    if (score[j] > best) best = score[j], arg = i0 + j;
            }
            out[r] = arg;
        }
        free(s);
    }
    return bad ? 3 : 0;
}

/* ---- Greedy rows (float32 logits) -----------------------------------------------------------
   out[r]: the first index of row r's maximum, -1 where the row holds a NaN or its maximum is not
   finite (what the sampler refuses). torch's argmax over a row is a scalar loop (64 x 16,384
   float32: ~450 us on two cores, where amax takes ~30); here one vectorized pass finds the maximum
   and whether a NaN is present, and a second tests 64 entries at a time for it and stops at the
   first chunk that holds it (~50 us on two cores). */
void greedy_f32(const float *logits, int64_t x_stride, int64_t rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 262144)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = logits + r * x_stride;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            m = xr[i] > m ? xr[i] : m;
            nan |= xr[i] != xr[i];
        }
        int64_t arg = -1;
        if (!nan && m > -INFINITY && m < INFINITY)
            for (int64_t i0 = 0; i0 < n && arg < 0; i0 += 64) { /* a vector test a chunk, then its index */
                const int64_t len = n - i0 < 64 ? n - i0 : 64;
                int hit = 0;
#pragma omp simd reduction(| : hit)
                for (int64_t j = 0; j < len; j++) hit |= xr[i0 + j] == m;
                for (int64_t j = 0; hit && j < len; j++)
                    if (xr[i0 + j] == m) {
                        arg = i0 + j;
                        break;
                    }
            }
        out[r] = arg;
    }
}

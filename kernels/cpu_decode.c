/* CPU kernels: paged decode attention, fused (one query token per sequence reads its K/V blocks in
   place); at the end, the bf16 model's RMSNorm and SwiGLU in one pass each.

   The torch path gathers every sequence's blocks into a workspace and runs two batched matmuls over
   the copy, so each K/V byte crosses memory three times and every sequence is padded to the longest
   of its group. Here a task is one sequence (or, when the batch is too small to keep the threads
   busy, one of its KV heads): for each KV head, its G query rows (GQA) score a block's keys, fold
   them into a running softmax (max, sum, fp32 accumulator), and add the block's values, reading
   only the sequence's own tokens, once. Built by kernels/cpu_native.py with -O3 -march=native so
   the loops over head_dim vectorize (bf16 scores use the CPU's bf16 dot instruction where it has
   one); threads come from the OpenMP runtime torch already loaded (same libgomp soname), sized by
   the caller.

   Cache layout (kernels/cpu.py): [2, num_blocks, block_size, Hkv, D], keys then values, contiguous.
   Element types: float32, or bfloat16 as uint16_t (widened by a shift; stored round-to-nearest-even). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
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

/* IEEE half (int8 caches' default scale type) to fp32 by hand: no _Float16 needed (gcc < 12). */
static inline float f16_load(uint16_t h) {
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

/* One task: a sequence's KV heads [h0, h1), block by block, every head of a block before the next
   block (the block's rows are contiguous across heads, so each cache line fetched is used at once).
   Inlined into callers with a constant head dim (64, 128) so the loops over it unroll and a query
   row's accumulator stays in registers across a block's tokens; a block's keys and values are
   widened to fp32 once per head, into a buffer that stays in L1. QT: the queries' and output's
   element type; KT: the cache's; SCALED: int8 entries times a per (token, head) scale of type ST
   (``kernels/kv_cache.py``'s int8 format: scales [2, N, bs, Hkv] beside the data). */
#define DEFINE_TASK(NAME, QT, LOADQ, STOREQ, KT, LOADK, ST, LOADS, SCALED, RAW_DOT, USE_RAW)            \
    static inline __attribute__((always_inline)) void NAME(                                             \
        const KT *kc, const KT *vc, const ST *ksc, const ST *vsc, const QT *q, QT *out,                 \
        const int32_t *table, int64_t len, int64_t h0, int64_t h1, int64_t hkv, int64_t g_rows,         \
        const int64_t d, int64_t bs, int64_t num_blocks, float scale, int64_t *bad) {                   \
        float qf[MAX_ROWS][MAX_D] __attribute__((aligned(64)));                                         \
        float acc[MAX_ROWS][MAX_D] __attribute__((aligned(64)));                                        \
        float buf[MAX_BS][MAX_D] __attribute__((aligned(64)));                                          \
        float s[MAX_ROWS][MAX_BS], m[MAX_ROWS], l[MAX_ROWS];                                            \
        const int64_t tok = hkv * d; /* elements from one token to the next within a block */        \
        const int64_t rows = (h1 - h0) * g_rows;                                                        \
        const QT *q0 = q + h0 * g_rows * d;                                                             \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            for (int64_t i = 0; i < d; i++) {                                                           \
                qf[r][i] = LOADQ(q0[r * d + i]) * scale;                                                \
                acc[r][i] = 0.0f;                                                                       \
            }                                                                                           \
            m[r] = 0.0f;                                                                                \
            l[r] = 0.0f;                                                                                \
        }                                                                                               \
        const int64_t nblk = (len + bs - 1) / bs;                                                       \
        const int64_t span = (h1 - h0) * d * (int64_t)sizeof(KT); /* bytes of one token's heads */      \
        for (int64_t j = 0; j < nblk; j++) {                                                            \
            const int64_t blk = table[j];                                                               \
            if (blk < 0 || blk >= num_blocks) {                                                         \
                *bad = 1;                                                                               \
                return;                                                                                 \
            }                                                                                           \
            const int64_t n = len - j * bs < bs ? len - j * bs : bs;                                    \
            if (j + 1 < nblk) { /* loads wait on memory: prefetch the next block into L2 (more misses in flight) */ \
                const int64_t nxt = table[j + 1];                                                       \
                if (nxt >= 0 && nxt < num_blocks) {                                                     \
                    const char *kn = (const char *)(kc + (nxt * bs * hkv + h0) * d);                    \
                    const char *vn = (const char *)(vc + (nxt * bs * hkv + h0) * d);                    \
                    for (int64_t t = 0; t < bs; t++)                                                    \
                        for (int64_t o = 0; o < span; o += 64) {                                        \
                            __builtin_prefetch(kn + t * tok * (int64_t)sizeof(KT) + o, 0, 2);                  \
                            __builtin_prefetch(vn + t * tok * (int64_t)sizeof(KT) + o, 0, 2);                  \
                        }                                                                               \
                }                                                                                       \
            }                                                                                           \
            for (int64_t h = h0; h < h1; h++) {                                                         \
                const int64_t r0 = (h - h0) * g_rows;                                                   \
                const KT *kb = kc + (blk * bs * hkv + h) * d;                                           \
                const KT *vb = vc + (blk * bs * hkv + h) * d;                                           \
                const ST *kst = SCALED ? ksc + blk * bs * hkv + h : 0; /* token t: kst[t * hkv] */    \
                const ST *vst = SCALED ? vsc + blk * bs * hkv + h : 0;                                  \
                const int raw = USE_RAW && d % 32 == 0;                                                 \
                if (!raw)                                                                               \
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
                for (int64_t t = 0; t < n; t++)                                                         \
                    for (int64_t i = 0; i < d; i++) buf[t][i] = LOADK(vb[t * tok + i]);                 \
                for (int64_t r = r0; r < r0 + g_rows; r++) {                                            \
                    float a[MAX_D] __attribute__((aligned(64)));                                        \
                    for (int64_t i = 0; i < d; i++) a[i] = acc[r][i];                                   \
                    for (int64_t t = 0; t < n; t++) {                                                   \
                        const float p = SCALED ? s[r][t] * LOADS(vst[t * hkv]) : s[r][t];               \
                        for (int64_t i = 0; i < d; i++) a[i] += p * buf[t][i];                          \
                    }                                                                                   \
                    for (int64_t i = 0; i < d; i++) acc[r][i] = a[i];                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        QT *o0 = out + h0 * g_rows * d;                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const float inv = len > 0 ? 1.0f / l[r] : 0.0f;                                             \
            for (int64_t i = 0; i < d; i++) o0[r * d + i] = STOREQ(acc[r][i] * inv);                    \
        }                                                                                               \
    }

/* The parallel loop over tasks, shared by every entry point. */
#define RUN_TASKS(TASK, QT, KC, VC, KS, VS)                                                             \
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
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : bad)")          \
    for (int64_t task = 0; task < batch * groups; task++) {                                             \
        const int64_t b = task / groups, h0 = task % groups * per;                                      \
        const int64_t h1 = h0 + per < hkv ? h0 + per : hkv;                                             \
        const QT *qb = q + b * hq * d;                                                                  \
        QT *ob = out + b * hq * d;                                                                      \
        const int32_t *tb = tables + b * table_stride;                                                  \
        if (d == 64)                                                                                    \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, 64, bs, num_blocks, scale, &bad);  \
        else if (d == 128)                                                                              \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, 128, bs, num_blocks, scale, &bad); \
        else                                                                                            \
            TASK(KC, VC, KS, VS, qb, ob, tb, lens[b], h0, h1, hkv, g_rows, d, bs, num_blocks, scale, &bad);   \
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
        RUN_TASKS(TASK, T, cache, cache + num_blocks * bs * hkv * d, none, none)                        \
    }

/* int8 caches: data int8 [2, N, bs, Hkv, D], scales [2, N, bs, Hkv] of type ST; q, out as above. */
#define DEFINE_DECODE_INT8(NAME, QT, ST, TASK)                                                          \
    int NAME(const int8_t *cache, const ST *scales, const QT *q, QT *out, const int32_t *tables,      \
             int64_t table_stride, const int32_t *lens, int64_t batch, int64_t hq, int64_t hkv,         \
             int64_t d, int64_t bs, int64_t num_blocks, float scale, int threads) {                     \
        RUN_TASKS(TASK, QT, cache, cache + num_blocks * bs * hkv * d, scales, scales + num_blocks * bs * hkv) \
    }

#define NO_RAW_DOT(a, b, d) ((void)(a), (void)(b), (void)(d), 0.0f)
static inline float i8_load(int8_t x) { return (float)x; }

DEFINE_TASK(task_f32, float, f32_load, f32_store, float, f32_load, float, f32_load, 0, NO_RAW_DOT, 0)
DEFINE_TASK(task_bf16, uint16_t, bf16_load, bf16_store, uint16_t, bf16_load, float, f32_load, 0, dot_raw_bf16, HAVE_DPBF16)
DEFINE_TASK(task_i8_f32_h, float, f32_load, f32_store, int8_t, i8_load, uint16_t, f16_load, 1, NO_RAW_DOT, 0)
DEFINE_TASK(task_i8_f32_f, float, f32_load, f32_store, int8_t, i8_load, float, f32_load, 1, NO_RAW_DOT, 0)
DEFINE_TASK(task_i8_bf16_h, uint16_t, bf16_load, bf16_store, int8_t, i8_load, uint16_t, f16_load, 1, NO_RAW_DOT, 0)
DEFINE_TASK(task_i8_bf16_f, uint16_t, bf16_load, bf16_store, int8_t, i8_load, float, f32_load, 1, NO_RAW_DOT, 0)
DEFINE_DECODE(paged_decode_f32, float, task_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, task_bf16)
DEFINE_DECODE_INT8(paged_decode_int8_f32_f16, float, uint16_t, task_i8_f32_h)
DEFINE_DECODE_INT8(paged_decode_int8_f32_f32, float, float, task_i8_f32_f)
DEFINE_DECODE_INT8(paged_decode_int8_bf16_f16, uint16_t, uint16_t, task_i8_bf16_h)
DEFINE_DECODE_INT8(paged_decode_int8_bf16_f32, uint16_t, float, task_i8_bf16_f)

/* ---- Element-wise fusions the CPU model runs around its GEMMs (bf16 only) -------------------
   torch runs each as 3-6 passes over the activations (widen, square, mean, scale, narrow, scale;
   silu, then multiply), each a parallel region; here one pass, rounding where torch rounds. */

/* HF's RMSNorm: y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))); rows of n, x rows x_stride apart. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n,
                   float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = y + r * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_load(xr[i]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            yr[i] = bf16_store(bf16_load(w[i]) * bf16_load(bf16_store(bf16_load(xr[i]) * inv)));
    }
}

/* SwiGLU on a fused gate_up projection: gu rows are [gate (n) | up (n)];
   out = bf16(bf16(silu(gate)) * up), as F.silu(gate, inplace=True).mul_(up) rounds. */
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_load(g[i]);
            const float e = exp_nonpos(-fabsf(v)); /* exp(-|v|): sigmoid without overflow */
            const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = bf16_store(bf16_load(bf16_store(v * sig)) * bf16_load(u[i]));
        }
    }
}

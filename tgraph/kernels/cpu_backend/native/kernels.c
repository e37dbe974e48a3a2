/* tgraph's compiled CPU kernels of the decode hot path: fp32, a few rows at a time.
 *
 * - tg_linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) (+ residual); every weight row is read
 *   once for all M rows, the rows of w split over the threads in contiguous chunks.
 * - tg_norm_linear: the RMSNorm of the M rows, then the linear; with swiglu the weight is
 *   [gate | up] ([2I, K], gate rows first) and out[M, I] = silu(gate) * up is written directly.
 * - tg_linear_q: tg_linear on a quantized weight (int4 / int8 codes with fp32 group scales and
 *   offsets), each weight dequantized as it is read, as torch's dequantization computes it: the
 *   dense kernel's bits on the dequantized weight, from a quarter (int4) of its bytes.
 * - tg_rms_norm (with a residual added first or not) and tg_swiglu: the same norm and SwiGLU on
 *   their own, so that a norm or SwiGLU gives the same bits fused into a linear or not. The norm
 *   adds its squares in the order torch's CPU sum does: it has the reference's bits.
 * - tg_rope_cache_attention: decode (one query per sequence): rope of q and the new k, the new k
 *   and v written at their cache slots, then each sequence's query heads attend to its keys,
 *   the block table walked in place; parallel over (sequence, kv head).
 *
 * The hot loops use AVX-512 where the compiler targets it and portable C otherwise (16-lane
 * arrays the compiler vectorizes for the machine it builds for). Built as C11: no contraction of
 * a * b + c into an FMA outside the explicit intrinsics, so rope rounds each product as torch
 * does (the reference's bits). An output's arithmetic depends only on its own row and the
 * weights (never on the tile, the row count or the threads), so every path gives it the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16
#define TILE_M 4 /* rows of x per tile */
#define TILE_N 8 /* weight rows per tile; TILE_M x (weight rows) <= 16 accumulators */

/* ---- 16-lane vectors ------------------------------------------------------------------------ */
#if defined(__AVX512F__)
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_n(const float *p, long n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#else
typedef struct { float l[LANES]; } vec;
static inline vec vzero(void) {
    vec r;
    for (int i = 0; i < LANES; i++) r.l[i] = 0.0f;
    return r;
}
static inline vec vload(const float *p) {
    vec r;
    memcpy(r.l, p, sizeof r.l);
    return r;
}
static inline vec vload_n(const float *p, long n) {
    vec r = vzero();
    memcpy(r.l, p, (size_t)n * sizeof(float));
    return r;
}
static inline vec vfma(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.l[i] += a.l[i] * b.l[i];
    return c;
}
static inline float vsum(vec a) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += a.l[i];
    return s;
}
#endif

#define INLINE static inline __attribute__((always_inline))

static float dot(const float *restrict a, const float *restrict b, long n) {
    vec acc = vzero();
    long k = 0;
    for (; k + LANES <= n; k += LANES) acc = vfma(vload(a + k), vload(b + k), acc);
    if (k < n) acc = vfma(vload_n(a + k, n - k), vload_n(b + k, n - k), acc);
    return vsum(acc);
}

/* sums[i][j] = x[i, :] . w_j for mm rows of x and the nn weight rows wr[j] (mm, nn are
 * constants where this is inlined, so the accumulators live in registers); each weight row is
 * prefetched pf floats ahead of its loads (more misses in flight than the hardware keeps). */
INLINE void tile(const float *restrict x, long ldx, const float *const *wr, long k, long pf,
                 int mm, int nn, float sums[][TILE_N]) {
    vec acc[TILE_M][TILE_N];
    for (int i = 0; i < mm; i++)
        for (int j = 0; j < nn; j++) acc[i][j] = vzero();
    long p = 0;
    for (; p + LANES <= k; p += LANES) {
        vec wv[TILE_N];
        for (int j = 0; j < nn; j++) {
            wv[j] = vload(wr[j] + p);
            __builtin_prefetch(wr[j] + p + pf, 0, 3);
        }
        for (int i = 0; i < mm; i++) {
            vec xv = vload(x + i * ldx + p);
            for (int j = 0; j < nn; j++) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
        }
    }
    if (p < k) {
        long rest = k - p;
        vec wv[TILE_N];
        for (int j = 0; j < nn; j++) wv[j] = vload_n(wr[j] + p, rest);
        for (int i = 0; i < mm; i++) {
            vec xv = vload_n(x + i * ldx + p, rest);
            for (int j = 0; j < nn; j++) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < mm; i++)
        for (int j = 0; j < nn; j++) sums[i][j] = vsum(acc[i][j]);
}

/* Weight rows per tile for m rows of x: 8 for one or two rows (more streams in flight), else 4. */
static inline int tile_width(long m) { return m <= 2 ? 8 : 4; }

/* tile() over all m rows of x with the nn (tile_width(m) or 1) weight rows wr, its constants
 * spelled out: 16 / nn rows of x at a time. */
static void tiles(const float *restrict x, long ldx, long m, const float *const *wr, long k,
                  long pf, int nn, float sums[][TILE_N]) {
    int step = nn == 8 ? 2 : TILE_M;
    for (long m0 = 0; m0 < m; m0 += step) {
        const float *xm = x + m0 * ldx;
        float (*s)[TILE_N] = sums + m0;
        long mm = m - m0 < step ? m - m0 : step;
        if (nn == 8) {
            if (mm == 1) tile(xm, ldx, wr, k, pf, 1, 8, s);
            else tile(xm, ldx, wr, k, pf, 2, 8, s);
        } else if (nn == 4) {
            switch (mm) {
            case 1: tile(xm, ldx, wr, k, pf, 1, 4, s); break;
            case 2: tile(xm, ldx, wr, k, pf, 2, 4, s); break;
            case 3: tile(xm, ldx, wr, k, pf, 3, 4, s); break;
            default: tile(xm, ldx, wr, k, pf, 4, 4, s); break;
            }
        } else {
            switch (mm) {
            case 1: tile(xm, ldx, wr, k, pf, 1, 1, s); break;
            case 2: tile(xm, ldx, wr, k, pf, 2, 1, s); break;
            case 3: tile(xm, ldx, wr, k, pf, 3, 1, s); break;
            default: tile(xm, ldx, wr, k, pf, 4, 1, s); break;
            }
        }
    }
}

/* [lo, hi) of `blocks` for thread t of nt, in contiguous chunks. */
static void chunk(long blocks, int t, int nt, long *lo, long *hi) {
    long per = blocks / nt, extra = blocks % nt;
    *lo = t * per + (t < extra ? t : extra);
    *hi = *lo + per + (t < extra ? 1 : 0);
}

#define MAX_ROWS 64 /* rows of x per pass over the weights (more rows: another pass) */

/* out rows [n0, n1) of the linear, for all m rows. */
static void linear_rows(const float *restrict x, long ldx, long m, long k,
                        const float *restrict w, long ldw, long n0, long n1, const float *bias,
                        const float *res, long ldr, float *out, long ldo, long pf) {
    float sums[MAX_ROWS][TILE_N];
    int width = tile_width(m);
    for (long n = n0; n < n1;) {
        int nn = n1 - n >= width ? width : 1;
        const float *wr[TILE_N];
        for (int j = 0; j < nn; j++) wr[j] = w + (n + j) * ldw;
        tiles(x, ldx, m, wr, k, pf, nn, sums);
        for (long i = 0; i < m; i++)
            for (int j = 0; j < nn; j++) {
                float y = sums[i][j];
                if (bias) y += bias[n + j];
                if (res) y += res[i * ldr + n + j];
                out[i * ldo + n + j] = y;
            }
        n += nn;
    }
}

static void linear(const float *x, long ldx, long m, long k, const float *w, long ldw, long n,
                   const float *bias, const float *res, long ldr, float *out, long ldo,
                   long pf, int threads) {
    long width = tile_width(m), blocks = (n + width - 1) / width;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        long lo, hi;
        chunk(blocks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        lo *= width;
        hi = hi * width < n ? hi * width : n;
        if (lo < hi) linear_rows(x, ldx, m, k, w, ldw, lo, hi, bias, res, ldr, out, ldo, pf);
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* out[:, i] = silu(gate_i) * up_i for i in [i0, i1), gate|up rows of w ([2 half, k]): a tile
 * holds `pairs` gate rows then their up rows. */
static void swiglu_rows(const float *restrict x, long ldx, long m, long k,
                        const float *restrict w, long ldw, long half, long i0, long i1,
                        const float *bias,
                        float *out, long ldo, long pf) {
    float sums[MAX_ROWS][TILE_N];
    int width = tile_width(m);
    for (long i = i0; i < i1;) {
        int pairs = i1 - i >= width / 2 ? width / 2 : 1;
        const float *wr[TILE_N];
        for (int j = 0; j < pairs; j++) {
            wr[j] = w + (i + j) * ldw;
            wr[pairs + j] = w + (half + i + j) * ldw;
        }
        if (pairs > 1) {
            tiles(x, ldx, m, wr, k, pf, 2 * pairs, sums);
        } else {  /* one pair: the gate row then the up row, one weight row at a time */
            float up[MAX_ROWS][TILE_N];
            tiles(x, ldx, m, wr, k, pf, 1, sums);
            tiles(x, ldx, m, wr + 1, k, pf, 1, up);
            for (long r = 0; r < m; r++) sums[r][1] = up[r][0];
        }
        for (long r = 0; r < m; r++)
            for (int j = 0; j < pairs; j++) {
                float g = sums[r][j], u = sums[r][pairs + j];
                if (bias) {
                    g += bias[i + j];
                    u += bias[half + i + j];
                }
                out[r * ldo + i + j] = silu(g) * u;
            }
        i += pairs;
    }
}

/* ---- quantized weights ---------------------------------------------------------------------- */

/* One quantized weight row: codes (int4: two per byte, even k in the low nibble; int8), and its
 * groups' fp32 scales (and offsets). */
typedef struct {
    const uint8_t *codes;
    const float *scale, *offset;
} qrow;

/* A group's scale and offset, in every lane. */
#if defined(__AVX512F__)
static inline vec vset(float v) { return _mm512_set1_ps(v); }
#else
static inline vec vset(float v) {
    vec r;
    for (int i = 0; i < LANES; i++) r.l[i] = v;
    return r;
}
#endif

/* The 16 weights from column p of a row, as torch's dequantization computes them (each product
 * and sum rounded): s * q + b with offsets, s * (q - 8) for symmetric int4, s * q for int8. */
INLINE vec qvalues(const uint8_t *codes, long p, int bits, int offsets, vec s, vec b) {
#if defined(__AVX512F__)
    __m512 q;
    if (bits == 4) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(codes + p / 2));
        __m128i nib = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    } else {
        q = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + p))));
    }
    if (offsets) return _mm512_add_ps(_mm512_mul_ps(s, q), b);
    if (bits == 4) return _mm512_mul_ps(s, _mm512_sub_ps(q, _mm512_set1_ps(8.0f)));
    return _mm512_mul_ps(s, q);
#else
    vec w;
    for (int i = 0; i < LANES; i++) {
        long c = p + i;
        float q = bits == 4 ? (float)((codes[c / 2] >> (4 * (c & 1))) & 0x0F)
                            : (float)((const int8_t *)codes)[c];
        w.l[i] = offsets ? s.l[i] * q + b.l[i] : bits == 4 ? s.l[i] * (q - 8.0f) : s.l[i] * q;
    }
    return w;
#endif
}

/* As tile(), the weights dequantized as they are read: each output's products and sums in the
 * order tile() makes them on the dequantized weight (the same bits as the dense kernel on it).
 * A group's scale and offset are read once per group, never per vector. */
INLINE void qtile(const float *restrict x, long ldx, const qrow *wr, long k, long group, int bits,
                  long pf, int mm, int nn, float sums[][TILE_N]) {
    vec acc[TILE_M][TILE_N];
    for (int i = 0; i < mm; i++)
        for (int j = 0; j < nn; j++) acc[i][j] = vzero();
    long pf_bytes = pf * bits / 32; /* pf floats of weights as code bytes */
    int offsets = wr[0].offset != NULL;
    for (long p0 = 0, gi = 0; p0 < k; p0 += group, gi++) {
        vec sv[TILE_N], bv[TILE_N];
        for (int j = 0; j < nn; j++) {
            sv[j] = vset(wr[j].scale[gi]);
            bv[j] = offsets ? vset(wr[j].offset[gi]) : vzero();
        }
        for (long p = p0; p < p0 + group; p += LANES) {
            vec xv[TILE_M];
            for (int i = 0; i < mm; i++) xv[i] = vload(x + i * ldx + p);
            for (int j = 0; j < nn; j++) {  /* one weight vector live at a time: no spills */
                vec w = qvalues(wr[j].codes, p, bits, offsets, sv[j], bv[j]);
                __builtin_prefetch(wr[j].codes + p * bits / 8 + pf_bytes, 0, 3);
                for (int i = 0; i < mm; i++) acc[i][j] = vfma(w, xv[i], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mm; i++)
        for (int j = 0; j < nn; j++) sums[i][j] = vsum(acc[i][j]);
}

/* qtile() over all m rows of x, TILE_M at a time, with nn (4 or 1) weight rows: each call's
 * row counts spelled out as constants, so its accumulators stay in registers. */
#define QTILE(MM, NN) qtile(xm, ldx, wr, k, group, bits, pf, MM, NN, s)
static void qtiles(const float *restrict x, long ldx, long m, const qrow *wr, long k,
                   long group, int bits, long pf, int nn, float sums[][TILE_N]) {
    for (long m0 = 0; m0 < m; m0 += TILE_M) {
        const float *xm = x + m0 * ldx;
        float (*s)[TILE_N] = sums + m0;
        long mm = m - m0 < TILE_M ? m - m0 : TILE_M;
        if (nn == 4)
            mm == 1 ? QTILE(1, 4) : mm == 2 ? QTILE(2, 4) : mm == 3 ? QTILE(3, 4) : QTILE(4, 4);
        else
            mm == 1 ? QTILE(1, 1) : mm == 2 ? QTILE(2, 1) : mm == 3 ? QTILE(3, 1) : QTILE(4, 1);
    }
}
#undef QTILE

/* out[m, n] = x[m, k] @ dequant(w)^T (+ bias) (+ res) for a quantized w: codes [n, ldq bytes],
 * scales (and offsets) [n, k / group]; k and group multiples of 16. */
void tg_linear_q(const float *x, long ldx, long m, long k, const uint8_t *codes, long ldq,
                 int bits, const float *scale, const float *offset, long group, long n,
                 const float *bias, const float *res, long ldr, float *out, long ldo,
                 long prefetch, int threads) {
    long groups = k / group;
    for (long m0 = 0; m0 < m; m0 += MAX_ROWS) {
        long mm = m - m0 < MAX_ROWS ? m - m0 : MAX_ROWS;
        const float *xm = x + m0 * ldx;
        long width = 4, blocks = (n + width - 1) / width; /* scales + weights + sums fit */
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            long lo, hi;
            chunk(blocks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            lo *= width;
            hi = hi * width < n ? hi * width : n;
            float sums[MAX_ROWS][TILE_N];
            for (long j0 = lo; j0 < hi;) {
                int nn = hi - j0 >= width ? (int)width : 1;
                qrow wr[TILE_N];
                for (int j = 0; j < nn; j++) {
                    long row = j0 + j;
                    wr[j].codes = codes + row * ldq;
                    wr[j].scale = scale + row * groups;
                    wr[j].offset = offset ? offset + row * groups : NULL;
                }
                qtiles(xm, ldx, mm, wr, k, group, bits, prefetch, nn, sums);
                for (long i = 0; i < mm; i++)
                    for (int j = 0; j < nn; j++) {
                        float y = sums[i][j];
                        if (bias) y += bias[j0 + j];
                        if (res) y += res[(m0 + i) * ldr + j0 + j];
                        out[(m0 + i) * ldo + j0 + j] = y;
                    }
                j0 += nn;
            }
        }
    }
}

/* ---- the entry points ----------------------------------------------------------------------- */

/* out[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) (+ res[m, n]), w's rows ldw apart; bias and res
 * may be NULL; res may
 * be out itself. Row strides ldx, ldr, ldo; weights prefetched `prefetch` floats ahead. */
void tg_linear(const float *x, long ldx, long m, long k, const float *w, long ldw, long n,
               const float *bias, const float *res, long ldr, float *out, long ldo,
               long prefetch, int threads) {
    for (long m0 = 0; m0 < m; m0 += MAX_ROWS)
        linear(x + m0 * ldx, ldx, m - m0 < MAX_ROWS ? m - m0 : MAX_ROWS, k, w, ldw, n, bias,
               res ? res + m0 * ldr : NULL, ldr, out + m0 * ldo, ldo, prefetch, threads);
}

#define MAX_LANES 32 /* the widest torch vector of floats a norm's sum may mirror */

static long ceil_log2(long x) { /* ATen's utils::CeilLog2 */
    if (x <= 2) return 1;
    long bits = 0;
    for (unsigned long v = (unsigned long)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* acc[0..lanes) += the squares of x[0..lanes) (each rounded, then added, lane by lane) */
INLINE void add_squares(float *acc, const float *x, int lanes) {
    for (int l = 0; l < lanes; l++) acc[l] += x[l] * x[l];
}

/* The sum of x[0..k) squared, added in the order of torch's CPU sum of a contiguous fp32 row
 * (ATen SumKernel.cpp: vectorized_inner_sum, row_sum and multi_row_sum over `lanes`-wide vectors:
 * four interleaved vector rows summed in cascaded chunks, the leftover vectors into the first,
 * the scalar tail, then the lanes), so that a norm has the bits of torch's fp32 RMSNorm; a lane
 * of a vector add is one fp32 add, whatever the machine. Rows of at least 2^15 elements (where
 * torch splits a single row's sum over threads) are not mirrored: callers keep torch then. */
INLINE float sum_squares_as_torch(const float *x, long k, int lanes) {
    float acc[4][4][MAX_LANES] = {{{0.0f}}};
    long vectors = k / lanes, size = vectors / 4;
    long power = ceil_log2(size) / 4 < 4 ? 4 : ceil_log2(size) / 4;
    long step = 1L << power, mask = step - 1, i = 0;
    while (i + step <= size) {
        for (long j = 0; j < step; j++, i++)
            for (int r = 0; r < 4; r++) add_squares(acc[0][r], x + (i * 4 + r) * lanes, lanes);
        for (int lv = 1; lv < 4; lv++) {
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < lanes; l++) {
                    acc[lv][r][l] += acc[lv - 1][r][l];
                    acc[lv - 1][r][l] = 0.0f;
                }
            if ((i & (mask << (lv * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int r = 0; r < 4; r++) add_squares(acc[0][r], x + (i * 4 + r) * lanes, lanes);
    for (int lv = 1; lv < 4; lv++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < lanes; l++) acc[0][r][l] += acc[lv][r][l];
    for (long v = size * 4; v < vectors; v++) add_squares(acc[0][0], x + v * lanes, lanes);
    for (int r = 1; r < 4; r++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][r][l];
    float total = 0.0f;
    for (long e = vectors * lanes; e < k; e++) total += x[e] * x[e];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* A row shorter than one vector: ATen's scalar_inner_sum, row_sum of four interleaved partial
 * sums (too few elements for a cascade level), the leftovers into the first. */
static float sum_squares_short(const float *x, long k) {
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    long size = k / 4;
    for (long i = 0; i < size; i++)
        for (int r = 0; r < 4; r++) p[r] += x[i * 4 + r] * x[i * 4 + r];
    for (long e = size * 4; e < k; e++) p[0] += x[e] * x[e];
    return ((p[0] + p[1]) + p[2]) + p[3];
}

static float sum_squares(const float *x, long k, int lanes) {
    if (k < lanes) return sum_squares_short(x, k);
    switch (lanes) { /* the widths spelled out: loops the compiler vectorizes */
    case 4: return sum_squares_as_torch(x, k, 4);
    case 8: return sum_squares_as_torch(x, k, 8);
    case 16: return sum_squares_as_torch(x, k, 16);
    default: return sum_squares_as_torch(x, k, 32);
    }
}

/* For the loader's check of which vector width torch sums with on this machine. */
float tg_sum_squares(const float *x, long k, int lanes) { return sum_squares(x, k, lanes); }

/* out = rms_norm(x) * w for one row of k (w may be NULL; out may be x), in the reference's
 * order and roundings: x * (1 / sqrt(sum(x * x) / k + eps)), then * w. With r, x + r is
 * written to summed first (which may be x or r) and normalized. */
static void norm_row(const float *x, const float *r, float *summed, long k, const float *w,
                     float eps, int lanes, float *out) {
    if (r) {
        for (long j = 0; j < k; j++) summed[j] = x[j] + r[j];
        x = summed;
    }
    float inv = 1.0f / sqrtf(sum_squares(x, k, lanes) / (float)k + eps);
    if (w)
        for (long j = 0; j < k; j++) out[j] = x[j] * inv * w[j];
    else
        for (long j = 0; j < k; j++) out[j] = x[j] * inv;
}

/* out[m, k] = rms_norm(x (+ res, written to summed first)) * w, rows split over the threads;
 * res, summed and w may be NULL; out may be x, summed may be x or res; `lanes`: the width of
 * torch's float vectors (see sum_squares_as_torch). */
void tg_rms_norm(const float *x, long ldx, const float *res, long ldr, float *summed, long lds,
                 long m, long k, const float *w, float eps, int lanes, float *out, long ldo,
                 int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && m > 1) schedule(static)
    for (long i = 0; i < m; i++)
        norm_row(x + i * ldx, res ? res + i * ldr : NULL, summed ? summed + i * lds : NULL, k, w,
                 eps, lanes, out + i * ldo);
}

/* out[m, half] = silu(gate) * up of gu[m, 2 half] = [gate | up] (out may be gu's memory). */
void tg_swiglu(const float *gu, long ldg, long m, long half, float *out, long ldo, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && m > 1) schedule(static)
    for (long i = 0; i < m; i++) {
        const float *g = gu + i * ldg;
        float *o = out + i * ldo;
        for (long j = 0; j < half; j++) o[j] = silu(g[j]) * g[half + j];
    }
}

/* normed = rms_norm(x) * norm_w (norm_w may be NULL; as tg_rms_norm), then out = normed @ w^T
 * (+ bias); with swiglu w is [gate | up] ([n, k], n even) and out[m, n / 2] = silu(gate) * up. */
void tg_norm_linear(const float *x, long ldx, long m, long k, const float *norm_w, float eps,
                    int lanes, float *normed, const float *w, long ldw, long n,
                    const float *bias, int swiglu, float *out, long ldo, long prefetch,
                    int threads) {
    for (long r = 0; r < m; r++)
        norm_row(x + r * ldx, NULL, NULL, k, norm_w, eps, lanes, normed + r * k);
    if (!swiglu) {
        tg_linear(normed, k, m, k, w, ldw, n, bias, NULL, 0, out, ldo, prefetch, threads);
        return;
    }
    long half = n / 2;
    for (long m0 = 0; m0 < m; m0 += MAX_ROWS) {
        long mm = m - m0 < MAX_ROWS ? m - m0 : MAX_ROWS, pairs = tile_width(mm) / 2;
        long blocks = (half + pairs - 1) / pairs;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            long lo, hi;
            chunk(blocks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            lo *= pairs;
            hi = hi * pairs < half ? hi * pairs : half;
            if (lo < hi)
                swiglu_rows(normed + m0 * k, k, mm, k, w, ldw, half, lo, hi, bias,
                            out + m0 * ldo, ldo, prefetch);
        }
    }
}

/* rope of one head (d floats, the first 2 half rotated) from src into dst (dst may be src). */
static void rotate(float *dst, const float *src, const float *c, const float *s, long half,
                   long d, int interleaved) {
    if (interleaved) {
        for (long i = 0; i < half; i++) {
            float x1 = src[2 * i], x2 = src[2 * i + 1];
            dst[2 * i] = x1 * c[i] - x2 * s[i];
            dst[2 * i + 1] = x2 * c[i] + x1 * s[i];
        }
    } else {
        for (long i = 0; i < half; i++) {
            float x1 = src[i], x2 = src[half + i];
            dst[i] = x1 * c[i] - x2 * s[i];
            dst[half + i] = x2 * c[i] + x1 * s[i];
        }
    }
    if (dst != src)
        for (long i = 2 * half; i < d; i++) dst[i] = src[i];
}

#define KEY_CHUNK 64     /* keys scored at a time (online softmax between chunks) */
#define MAX_GROUP 128    /* query heads per kv head the kernel takes */

/* out[group, d] = the attention of one sequence's query heads q[group, d] (those of kv head h)
 * over its keys [first, n_keys), read through its block table where they lie in the cache: the
 * scores of KEY_CHUNK keys at a time, merged by a running max and sum (online softmax). */
static void attend(const float *q, float *out, const float *k_cache, const float *v_cache,
                   const int32_t *table, long block_size, long hk, long h, long d, long group,
                   long first, long n_keys, float scale) {
    float sc[MAX_GROUP * KEY_CHUNK], top[MAX_GROUP], total[MAX_GROUP];
    long at[KEY_CHUNK], row = hk * d;
    for (long g = 0; g < group; g++) {
        top[g] = -INFINITY;
        total[g] = 0.0f;
    }
    memset(out, 0, (size_t)(group * d) * sizeof(float));
    for (long j0 = first; j0 < n_keys; j0 += KEY_CHUNK) {
        long count = n_keys - j0 < KEY_CHUNK ? n_keys - j0 : KEY_CHUNK;
        for (long c = 0; c < count; c++) {  /* where each key lies: cache row block * size + offset */
            long j = j0 + c;
            at[c] = ((long)table[j / block_size] * block_size + j % block_size) * row + h * d;
        }
        for (long c = 0; c < count; c++)
            for (long g = 0; g < group; g++)
                sc[g * KEY_CHUNK + c] = dot(q + g * d, k_cache + at[c], d) * scale;
        for (long g = 0; g < group; g++) {
            float *s = sc + g * KEY_CHUNK, *o = out + g * d, m = top[g];
            for (long c = 0; c < count; c++) m = s[c] > m ? s[c] : m;
            float alpha = expf(top[g] - m), sum = 0.0f;
            for (long c = 0; c < count; c++) {
                s[c] = expf(s[c] - m);
                sum += s[c];
            }
            total[g] = total[g] * alpha + sum;
            top[g] = m;
            if (alpha != 1.0f)
                for (long e = 0; e < d; e++) o[e] *= alpha;
            for (long c = 0; c < count; c++) {
                const float *vp = v_cache + at[c];
                float p = s[c];
                for (long e = 0; e < d; e++) o[e] += p * vp[e];
            }
        }
    }
    for (long g = 0; g < group; g++) {
        float inv = 1.0f / total[g], *o = out + g * d;
        for (long e = 0; e < d; e++) o[e] *= inv;
    }
}

/* Decode: for each of t sequences (row b of q, k, v, cos, sin, slots, table, seq_len): rope of
 * its query heads into q_rot[t, hq, d] and of its new key, the new key and value written at
 * cache row slots[b] (skipped when negative), then out[b] = softmax(q k^T scale) v over its
 * seq_len[b] keys (at most max_keys, the table's; the last `window` of them when window > 0;
 * zeros without keys). Every new key is stored before any sequence attends. The attention runs
 * in parallel over (sequence, kv head) unless its scores (query heads x keys, summed over the
 * sequences) are at most serial_scores: then on the calling thread alone. hq / hk <= MAX_GROUP. */
void tg_rope_cache_attention(
    const float *q, long ldq, const float *k, long ldk, const float *v, long ldv,
    const float *cos, const float *sin, long ldcs, long half, int interleaved,
    float *k_cache, float *v_cache, long block_size, const int32_t *slots,
    const int32_t *table, long ldt, const int32_t *seq_len, long max_keys, float *q_rot,
    float *out, long t, long hq, long hk, long d, float scale, long window,
    long serial_scores, int threads) {
    long row = hk * d, group = hq / hk, work = 0;
    for (long b = 0; b < t; b++) {
        const float *c = cos + b * ldcs, *s = sin + b * ldcs;
        for (long h = 0; h < hq; h++)
            rotate(q_rot + (b * hq + h) * d, q + b * ldq + h * d, c, s, half, d, interleaved);
        long slot = slots[b];
        if (slot >= 0)
            for (long h = 0; h < hk; h++) {
                rotate(k_cache + slot * row + h * d, k + b * ldk + h * d, c, s, half, d,
                       interleaved);
                memcpy(v_cache + slot * row + h * d, v + b * ldv + h * d,
                       (size_t)d * sizeof(float));
            }
        long n = seq_len[b] < max_keys ? seq_len[b] : max_keys;
        work += n > 0 ? (window > 0 && window < n ? window : n) : 0;
    }
    int nt = work * hq <= serial_scores ? 1 : threads;
    long tasks = t * hk;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        long lo, hi;
        chunk(tasks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (long task = lo; task < hi; task++) {
            long b = task / hk, h = task % hk;
            long n = seq_len[b] < max_keys ? seq_len[b] : max_keys;
            float *o = out + (b * hq + h * group) * d;
            if (n <= 0) {
                memset(o, 0, (size_t)(group * d) * sizeof(float));
                continue;
            }
            long first = window > 0 && window < n ? n - window : 0;
            attend(q_rot + (b * hq + h * group) * d, o, k_cache, v_cache, table + b * ldt,
                   block_size, hk, h, d, group, first, n, scale);
        }
    }
}

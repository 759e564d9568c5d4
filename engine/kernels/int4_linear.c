/* A Linear with 4-bit weights (group scale and offset) times int8 activations (one scale per row), any rows.
 *
 * Weights: out features in tiles of 32 channels. A tile is one contiguous stream of its groups; a group of G inputs
 * is a 128-byte head (32 float16 scales, then 32 float16 offsets: w = scale * q + offset, q in 0..15) and G / 8
 * blocks of 128 bytes, each two halves of 16 channels x 8 inputs: byte 4c+j of a half holds input j of channel c in
 * its low nibble and input j+4 in its high one. So one 64-byte load, masked and shifted, gives the two operands of
 * an int8 dot product instruction (16 lanes of 4 inputs each), and each thread reads one stream. Each row's
 * activations are rounded to int8 with one scale; a group's dot product is then
 *     sum w a = row scale * (scale * sum q ia + offset * sum ia),
 * exact in 32-bit integers (15 x 127 x G fits), with the sum of ia per group computed once per row.
 *
 * AVX-512 VNNI: vpdpbusd. AVX2: vpmaddubsw, whose 16-bit pair sums cannot saturate on 4-bit weights
 * (2 x 15 x 127 < 32767), then vpmaddwd. Threads take tiles; each tile meets every row while its weights are in
 * cache, so prefill reads the weights once, as decode does. Built by native.py with OpenMP from the libgomp PyTorch
 * has already loaded, so its threads are PyTorch's.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
#define HEAD 128 /* bytes of a group's scales and offsets */
#define PREFETCH 1024 /* bytes ahead of the stream a block asks the cache for */

static inline float widen_bf16(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof(value));
    return value;
}

/* Row r of x (float32 or bfloat16) rounded to int8 with scale max|x| / 127; sums of each group of G levels. */
static void quantize_row(const void *x, int bf16, int64_t r, int64_t k, int64_t group, int8_t *levels,
                         int32_t *sums, float *scale) {
    float *row = (float *)malloc((size_t)k * sizeof(float)), top = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        row[i] = bf16 ? widen_bf16(((const uint16_t *)x)[r * k + i]) : ((const float *)x)[r * k + i];
        top = fmaxf(top, fabsf(row[i]));
    }
    float step = top > 1e-30f ? top / 127.0f : 1.0f, inverse = 1.0f / step;
    *scale = step;
    for (int64_t g = 0; g < k / group; g++) {
        int32_t total = 0;
        for (int64_t i = g * group; i < (g + 1) * group; i++) {
            int32_t level = (int32_t)nearbyintf(row[i] * inverse);
            level = level > 127 ? 127 : (level < -127 ? -127 : level);
            levels[i] = (int8_t)level;
            total += level;
        }
        sums[g] = total;
    }
    free(row);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define KERNEL_ISA "avx512_vnni"
#define ROWS 4 /* rows of one pass over a tile: the accumulators stay in registers */
/* ROWS_ rows of one tile: out[r][channel]. ROWS_ is a constant at each call (pass below), so the accumulators are
 * registers and the loops unroll. */
static inline __attribute__((always_inline)) void tile_pass(const uint8_t *tile, int64_t k, int64_t group,
                                                             const int8_t *levels, const int32_t *sums,
                                                             const float *row_scales, const int ROWS_, float *out,
                                                             int64_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 total[ROWS][2];
    for (int r = 0; r < ROWS_; r++) total[r][0] = total[r][1] = _mm512_setzero_ps();
    const int64_t groups = k / group, blocks = group / 8, group_bytes = HEAD + blocks * 128;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = tile + g * group_bytes, *w = head + HEAD;
        __m512i acc[ROWS][2];
        for (int r = 0; r < ROWS_; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = g * group + b * 8;
            _mm_prefetch((const char *)(w + b * 128 + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + b * 128 + PREFETCH + 64), _MM_HINT_T0);
            __m512i lo[2], hi[2];
            for (int t = 0; t < 2; t++) {
                __m512i packed = _mm512_loadu_si512((const void *)(w + b * 128 + t * 64));
                lo[t] = _mm512_and_si512(packed, low);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
            for (int r = 0; r < ROWS_; r++) {
                int32_t a0, a1;
                memcpy(&a0, levels + r * k + at, 4);
                memcpy(&a1, levels + r * k + at + 4, 4);
                __m512i first = _mm512_set1_epi32(a0), second = _mm512_set1_epi32(a1);
                for (int t = 0; t < 2; t++) {
                    acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo[t], first);
                    acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi[t], second);
                }
            }
        }
        for (int t = 0; t < 2; t++) {
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + t * 32)));
            __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 64 + t * 32)));
            for (int r = 0; r < ROWS_; r++) {
                total[r][t] = _mm512_fmadd_ps(offset, _mm512_set1_ps((float)sums[r * groups + g]), total[r][t]);
                total[r][t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc[r][t]), total[r][t]);
            }
        }
    }
    for (int r = 0; r < ROWS_; r++)
        for (int t = 0; t < 2; t++)
            _mm512_storeu_ps(out + r * out_stride + t * 16, _mm512_mul_ps(total[r][t], _mm512_set1_ps(row_scales[r])));
}
#elif defined(__AVX2__)
#define KERNEL_ISA "avx2"
#define ROWS 2 /* sixteen registers: two rows' accumulators for a tile's four quarters */
static inline __m256i dot4(__m256i weights, __m256i activations) { /* u8 x s8, four at a time, into 32 bits */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(weights, activations), _mm256_set1_epi16(1));
}

/* As the AVX-512 one, each tile as four quarters of 8 channels. */
static inline __attribute__((always_inline)) void tile_pass(const uint8_t *tile, int64_t k, int64_t group,
                                                             const int8_t *levels, const int32_t *sums,
                                                             const float *row_scales, const int ROWS_, float *out,
                                                             int64_t out_stride) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 total[ROWS][4];
    for (int r = 0; r < ROWS_; r++)
        for (int q = 0; q < 4; q++) total[r][q] = _mm256_setzero_ps();
    const int64_t groups = k / group, blocks = group / 8, group_bytes = HEAD + blocks * 128;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *head = tile + g * group_bytes, *w = head + HEAD;
        __m256i acc[ROWS][4];
        for (int r = 0; r < ROWS_; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_si256();
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = g * group + b * 8;
            _mm_prefetch((const char *)(w + b * 128 + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + b * 128 + PREFETCH + 64), _MM_HINT_T0);
            for (int q = 0; q < 4; q++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(w + b * 128 + q * 32));
                __m256i lo = _mm256_and_si256(packed, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                for (int r = 0; r < ROWS_; r++) {
                    int32_t a0, a1;
                    memcpy(&a0, levels + r * k + at, 4);
                    memcpy(&a1, levels + r * k + at + 4, 4);
                    acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_add_epi32(dot4(lo, _mm256_set1_epi32(a0)),
                                                                             dot4(hi, _mm256_set1_epi32(a1))));
                }
            }
        }
        for (int q = 0; q < 4; q++) {
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + q * 16)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 64 + q * 16)));
            for (int r = 0; r < ROWS_; r++) {
                total[r][q] = _mm256_fmadd_ps(offset, _mm256_set1_ps((float)sums[r * groups + g]), total[r][q]);
                total[r][q] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc[r][q]), total[r][q]);
            }
        }
    }
    for (int r = 0; r < ROWS_; r++)
        for (int q = 0; q < 4; q++)
            _mm256_storeu_ps(out + r * out_stride + q * 8, _mm256_mul_ps(total[r][q], _mm256_set1_ps(row_scales[r])));
}
#else
#error "int4_linear.c needs AVX2 or AVX-512 VNNI"
#endif

const char *int4_kernel_isa(void) { return KERNEL_ISA; }

/* One pass of `rows` (1..ROWS) rows over a tile, with the count a constant for tile_pass. */
static void pass(const uint8_t *tile, int64_t k, int64_t group, const int8_t *levels, const int32_t *sums,
                 const float *row_scales, int rows, float *out, int64_t out_stride) {
    switch (rows) {
    case 1: tile_pass(tile, k, group, levels, sums, row_scales, 1, out, out_stride); break;
#if ROWS >= 4
    case 2: tile_pass(tile, k, group, levels, sums, row_scales, 2, out, out_stride); break;
    case 3: tile_pass(tile, k, group, levels, sums, row_scales, 3, out, out_stride); break;
    default: tile_pass(tile, k, group, levels, sums, row_scales, 4, out, out_stride); break;
#else
    default: tile_pass(tile, k, group, levels, sums, row_scales, 2, out, out_stride); break;
#endif
    }
}

/* out (m, n) float32 = x (m, k) float32 or bfloat16 times the packed weight's transpose, plus bias (n) if given.
 * n is a multiple of 32, k of the group size, the group size of 8. Returns 0, or 1 where scratch memory could not
 * be had. */
int int4_linear(int64_t m, int64_t n, int64_t k, int64_t group, const void *x, int x_bf16, const uint8_t *weights,
                const float *bias, float *out) {
    const int64_t groups = k / group;
    int8_t *levels = (int8_t *)malloc((size_t)(m * k));
    int32_t *sums = (int32_t *)malloc((size_t)(m * groups) * sizeof(int32_t));
    float *row_scales = (float *)malloc((size_t)m * sizeof(float));
    if (!levels || !sums || !row_scales) {
        free(levels), free(sums), free(row_scales);
        return 1;
    }
#pragma omp parallel for schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x, x_bf16, r, k, group, levels + r * k, sums + r * groups, row_scales + r);
    const int64_t tiles = n / TILE, tile_bytes = groups * (HEAD + group * 16);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t r = 0; r < m; r += ROWS) {
            int rows = (int)(m - r < ROWS ? m - r : ROWS);
            pass(weights + t * tile_bytes, k, group, levels + r * k, sums + r * groups, row_scales + r, rows,
                 out + r * n + t * TILE, n);
        }
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int c = 0; c < TILE; c++) out[r * n + t * TILE + c] += bias[t * TILE + c];
    }
    free(levels), free(sums), free(row_scales);
    return 0;
}

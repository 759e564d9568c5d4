/* One decode step's attention for a batch of sequences, each over its own cached length.
 *
 * Each sequence keeps its keys and values per layer as (kv heads, capacity, head dim) buffers of float32 or
 * bfloat16 (the dtype the model's own cache keeps). For every (sequence, key head) this writes the new token's key
 * and value at the sequence's length, then reads the keys once for the scores of the head's query rows and the
 * values once for their weighted sum, in float32. PyTorch's batched matmuls read the values at about half the rate
 * memory allows at these shapes (two query rows); see docs/decisions.md, "Decode attention kernel". Built by
 * decode_attention.py with OpenMP from the libgomp PyTorch has already loaded, so its threads are PyTorch's.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float widen(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof(value));
    return value;
}

static inline uint16_t narrow(float value) { /* round to nearest even, as PyTorch rounds float32 to bfloat16 */
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static void softmax_rows(float *scores, int64_t groups, int64_t length) {
    for (int64_t g = 0; g < groups; g++) {
        float *row = scores + g * length;
        float top = row[0];
        for (int64_t t = 1; t < length; t++) top = row[t] > top ? row[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; t++) {
            row[t] = expf(row[t] - top);
            total += row[t];
        }
        float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < length; t++) row[t] *= inverse;
    }
}

/* scores: (groups, length) scratch; query and out: (groups, dim). LOAD reads element d of a stored row. Two query
 * rows per key head (grouped-query attention's common case) share each element's load and widening. */
#define ATTEND(NAME, TYPE, LOAD)                                                                                     \
    static void NAME(const float *query, int64_t groups, int64_t dim, const TYPE *keys, const TYPE *values,          \
                     int64_t length, float scaling, float *scores, float *out) {                                     \
        memset(out, 0, (size_t)(groups * dim) * sizeof(float));                                                      \
        if (groups == 2) {                                                                                           \
            const float *q0 = query, *q1 = query + dim;                                                              \
            for (int64_t t = 0; t < length; t++) {                                                                   \
                const TYPE *row = keys + t * dim;                                                                    \
                float sum0 = 0.0f, sum1 = 0.0f;                                                                      \
                _Pragma("omp simd reduction(+ : sum0, sum1)") for (int64_t d = 0; d < dim; d++) {                    \
                    float k = LOAD(row, d);                                                                          \
                    sum0 += q0[d] * k;                                                                               \
                    sum1 += q1[d] * k;                                                                               \
                }                                                                                                    \
                scores[t] = sum0 * scaling;                                                                          \
                scores[length + t] = sum1 * scaling;                                                                 \
            }                                                                                                        \
            softmax_rows(scores, groups, length);                                                                    \
            float *o0 = out, *o1 = out + dim;                                                                        \
            for (int64_t t = 0; t < length; t++) {                                                                   \
                const TYPE *row = values + t * dim;                                                                  \
                float w0 = scores[t], w1 = scores[length + t];                                                       \
                _Pragma("omp simd") for (int64_t d = 0; d < dim; d++) {                                              \
                    float v = LOAD(row, d);                                                                          \
                    o0[d] += w0 * v;                                                                                 \
                    o1[d] += w1 * v;                                                                                 \
                }                                                                                                    \
            }                                                                                                        \
            return;                                                                                                  \
        }                                                                                                            \
        for (int64_t t = 0; t < length; t++) {                                                                       \
            const TYPE *row = keys + t * dim;                                                                        \
            for (int64_t g = 0; g < groups; g++) {                                                                   \
                const float *q = query + g * dim;                                                                    \
                float sum = 0.0f;                                                                                    \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t d = 0; d < dim; d++) sum += q[d] * LOAD(row, d); \
                scores[g * length + t] = sum * scaling;                                                              \
            }                                                                                                        \
        }                                                                                                            \
        softmax_rows(scores, groups, length);                                                                        \
        for (int64_t t = 0; t < length; t++) {                                                                       \
            const TYPE *row = values + t * dim;                                                                      \
            for (int64_t g = 0; g < groups; g++) {                                                                   \
                float weight = scores[g * length + t];                                                               \
                float *o = out + g * dim;                                                                            \
                _Pragma("omp simd") for (int64_t d = 0; d < dim; d++) o[d] += weight * LOAD(row, d);                 \
            }                                                                                                        \
        }                                                                                                            \
    }

#define LOAD_FLOAT(row, d) ((row)[d])
#define LOAD_BFLOAT16(row, d) widen((row)[d])
ATTEND(attend_float32, float, LOAD_FLOAT)
ATTEND(attend_bfloat16, uint16_t, LOAD_BFLOAT16)

/* queries (sequences, kv heads, groups, dim) float32; new_keys, new_values (sequences, kv heads, dim) float32, or
 * NULL where the buffers already hold the new token; key_buffers, value_buffers: each sequence's buffer address for
 * this layer, bfloat16 if `bfloat16` else float32; capacities and lengths per sequence (length: positions filled
 * before this token); out (sequences, kv heads, groups, dim) float32. Returns 0, or 1 when a sequence's buffer has
 * no room for the new token or scratch memory could not be had. */
int decode_attention(int64_t sequences, int64_t kv_heads, int64_t groups, int64_t dim, const float *queries,
                     const float *new_keys, const float *new_values, const int64_t *key_buffers,
                     const int64_t *value_buffers, const int64_t *capacities, const int64_t *lengths, int bfloat16,
                     float scaling, float *out) {
    int64_t longest = 0;
    for (int64_t s = 0; s < sequences; s++) {
        if (lengths[s] >= capacities[s]) return 1;
        if (lengths[s] + 1 > longest) longest = lengths[s] + 1;
    }
    int threads = omp_get_max_threads();
    float *scratch = malloc((size_t)(threads * groups * longest) * sizeof(float));
    if (scratch == NULL) return 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t s = 0; s < sequences; s++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t length = lengths[s], offset = h * capacities[s] * dim, fresh = (s * kv_heads + h) * dim;
            int64_t row = (s * kv_heads + h) * groups * dim;
            float *scores = scratch + (int64_t)omp_get_thread_num() * groups * longest;
            if (bfloat16) {
                uint16_t *keys = (uint16_t *)(intptr_t)key_buffers[s] + offset;
                uint16_t *values = (uint16_t *)(intptr_t)value_buffers[s] + offset;
                if (new_keys != NULL) {
                    for (int64_t d = 0; d < dim; d++) {
                        keys[length * dim + d] = narrow(new_keys[fresh + d]);
                        values[length * dim + d] = narrow(new_values[fresh + d]);
                    }
                }
                attend_bfloat16(queries + row, groups, dim, keys, values, length + 1, scaling, scores, out + row);
            } else {
                float *keys = (float *)(intptr_t)key_buffers[s] + offset;
                float *values = (float *)(intptr_t)value_buffers[s] + offset;
                if (new_keys != NULL) {
                    memcpy(keys + length * dim, new_keys + fresh, (size_t)dim * sizeof(float));
                    memcpy(values + length * dim, new_values + fresh, (size_t)dim * sizeof(float));
                }
                attend_float32(queries + row, groups, dim, keys, values, length + 1, scaling, scores, out + row);
            }
        }
    }
    free(scratch);
    return 0;
}

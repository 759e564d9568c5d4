/* How fast this machine's threads stream memory: each thread reads its share of a buffer with the widest vector
 * loads the build has, into four independent accumulators, so that no dependency or narrow load holds the rate
 * below what the memory gives. Built by native.py with OpenMP from the libgomp PyTorch has already loaded. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
typedef __m512i vector;
#define LOAD(at) _mm512_loadu_si512((const void *)(at))
#define ADD _mm512_add_epi64
#define ZERO _mm512_setzero_si512()
#else
typedef __m256i vector;
#define LOAD(at) _mm256_loadu_si256((const __m256i *)(at))
#define ADD _mm256_add_epi64
#define ZERO _mm256_setzero_si256()
#endif
#define WIDTH (sizeof(vector) / sizeof(uint64_t))

/* Returns a sum of the buffer's 64-bit words (count a multiple of 4 vectors), so the reads cannot be dropped. */
uint64_t stream_read(const uint64_t *words, int64_t count, int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t steps = count / (4 * WIDTH), share = (steps + omp_get_num_threads() - 1) / omp_get_num_threads();
        const int64_t first = share * omp_get_thread_num(), last = first + share < steps ? first + share : steps;
        vector a = ZERO, b = ZERO, c = ZERO, d = ZERO;
        for (int64_t step = first; step < last; step++) {
            const uint64_t *at = words + step * 4 * WIDTH;
            a = ADD(a, LOAD(at));
            b = ADD(b, LOAD(at + WIDTH));
            c = ADD(c, LOAD(at + 2 * WIDTH));
            d = ADD(d, LOAD(at + 3 * WIDTH));
        }
        uint64_t lanes[WIDTH];
        vector sum = ADD(ADD(a, b), ADD(c, d));
        __builtin_memcpy(lanes, &sum, sizeof(lanes));
        for (unsigned i = 0; i < WIDTH; i++) total += lanes[i];
    }
    return total;
}

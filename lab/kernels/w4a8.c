/* y = x W^T for 4-bit weights and activations quantized to int8 per group of 64 inputs (W4A8).
 *
 * The scheme of llama.cpp's q4_0 x q8_0 dot product, on lab.quantize's asymmetric int4 codes:
 *   w = (code - 8) * scale + zero          per output row and group of 64 inputs (code in 0..15)
 *   a ~= q * a_scale, q in -127..127        per input row and group of 64 (a_scale = max |a| / 127)
 * so a group's contribution to y[m, n] is
 *   scale * a_scale * (sum code * q  -  8 * sum q)  +  zero * sum a
 * where sum code * q is integer arithmetic: AVX2's maddubs (unsigned 4-bit code times signed int8,
 * pairs summed to int16, at most 2 * 15 * 127), madd to int32, one float multiply-add per group.
 *
 * Layout of the packed weights: [N, K / 2] bytes; in each group of 64 inputs, byte j holds the code
 * of input j in its low nibble and that of input j + 32 in its high nibble, so one 32-byte load and
 * two masks give the group's 64 codes in input order. Scales and zeros: float32 [N, K / 64].
 *
 * Each output is computed by one thread in a fixed order whatever M is, so a row's result does not
 * depend on the other rows (batch invariance). Built by lab/w4a8.py with -fopenmp against the libgomp
 * that torch has loaded already: the parallel loop runs in torch's own OpenMP threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 64

static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *a_scale, float *q_offset,
                          float *a_sum) {
  const int64_t G = K / GROUP;
  for (int64_t i = 0; i < M * G; ++i) {
    const float *a = x + i * GROUP;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < GROUP; ++j) {
      amax = fmaxf(amax, fabsf(a[j]));
      sum += a[j];
    }
    const float s = amax / 127.f;
    const float inv = s > 0.f ? 1.f / s : 0.f;
    int32_t total = 0;
    for (int j = 0; j < GROUP; ++j) {
      const int v = (int)nearbyintf(a[j] * inv);
      q[i * GROUP + j] = (int8_t)v;
      total += v;
    }
    a_scale[i] = s;
    q_offset[i] = 8.f * s * (float)total;
    a_sum[i] = sum;
  }
}

static inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

/* Outputs n of input rows m0 .. m0 + ROWS - 1; ROWS a constant in each call, so that the
 * accumulators stay in registers (an array indexed at run time would live on the stack). */
static inline __attribute__((always_inline)) void rows_times_weights(
    const int ROWS, int64_t m0, int64_t n, int64_t G, int64_t N, const uint8_t *packed, const float *scales,
    const float *zeros, const int8_t *q, const float *a_scale, const float *q_offset, const float *a_sum,
    float *y) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t *row = packed + n * G * (GROUP / 2);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + g * (GROUP / 2)));
    const __m256i first = _mm256_and_si256(bytes, low_nibbles);                         /* inputs 0..31 */
    const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);  /* 32..63 */
    const float scale = scales[n * G + g];
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      const int8_t *qa = q + at * GROUP;
      const __m256i q0 = _mm256_loadu_si256((const __m256i *)qa);
      const __m256i q1 = _mm256_loadu_si256((const __m256i *)(qa + 32));
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, q0), _mm256_maddubs_epi16(second, q1));
      const __m256i dot = _mm256_madd_epi16(pairs, ones); /* [8] int32 */
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * a_scale[at]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  /* the zeros' and the codes' offset's share, out of the loop above: sum over g of
   * zero * sum a  -  scale * 8 * a_scale * sum q  (q_offset holds the second factor) */
  const float *row_scales = scales + n * G, *row_zeros = zeros + n * G;
  for (int r = 0; r < ROWS; ++r) {
    const float *sums = a_sum + (m0 + r) * G, *offsets = q_offset + (m0 + r) * G;
    float rest = 0.f;
    for (int64_t g = 0; g < G; ++g) rest += row_zeros[g] * sums[g] - row_scales[g] * offsets[g];
    y[(m0 + r) * N + n] = sum_lanes(acc[r]) + rest;
  }
}

/* y [M, N] float32 = x [M, K] float32 times the packed weights [N, K / 2]. Returns 0, or -1 when
 * the activations' scratch could not be allocated. */
int w4a8_mm(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *scales,
            const float *zeros, int64_t N, float *y) {
  const int64_t G = K / GROUP;
  /* the activations, quantized: codes [M, K], and per group of 64 the scale, 8 * scale * sum of the
   * codes, and the sum of the values [M, G] (malloc here: a tensor each from Python cost more) */
  int8_t *q = malloc((size_t)(M * K));
  float *a_scale = malloc(sizeof(float) * (size_t)(3 * M * G));
  if (q == NULL || a_scale == NULL) {
    free(q);
    free(a_scale);
    return -1;
  }
  float *q_offset = a_scale + M * G, *a_sum = a_scale + 2 * M * G;
  quantize_rows(x, M, K, q, a_scale, q_offset, a_sum);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) /* 4 input rows share each load of the weights */
      rows_times_weights(4, m0, n, G, N, packed, scales, zeros, q, a_scale, q_offset, a_sum, y);
    switch (M - m0) {
      case 3: rows_times_weights(3, m0, n, G, N, packed, scales, zeros, q, a_scale, q_offset, a_sum, y); break;
      case 2: rows_times_weights(2, m0, n, G, N, packed, scales, zeros, q, a_scale, q_offset, a_sum, y); break;
      case 1: rows_times_weights(1, m0, n, G, N, packed, scales, zeros, q, a_scale, q_offset, a_sum, y); break;
    }
  }
  free(q);
  free(a_scale);
  return 0;
}

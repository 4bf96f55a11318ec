/* y = x W^T + bias with the activations quantized to int8 per group of 64 inputs, two kinds of weights:
 *
 *   w4a8_mm: 4-bit weights, the scheme of llama.cpp's q4_0 x q8_0 dot product on lab.quantize's
 *            asymmetric int4 codes;
 *   w8a8_mm: 8-bit weights, that of q8_0 x q8_0 on lab.quantize's symmetric int8 rows.
 *
 * The activations, for both: a ~= q * a_scale, q in -127..127, per input row and group of 64
 * (a_scale = max |a| / 127). Each group's integer dot product is AVX2 arithmetic: maddubs (unsigned
 * bytes times signed bytes, pairs summed to int16), madd to int32, then one float multiply-add per
 * group with the activations' scale.
 *
 * w4a8: w = (code - 8) * scale + zero per output row and group of 64 inputs (code in 0..15), so a
 * group's contribution to y[m, n] is
 *   scale * a_scale * (sum code * q  -  8 * sum q)  +  zero * sum a
 * (maddubs of the unsigned code and q: at most 2 * 15 * 127 a pair). Packed weights: [N, K / 2] bytes;
 * in each group of 64 inputs, byte j holds the code of input j in its low nibble and that of input
 * j + 32 in its high nibble, so one 32-byte load and two masks give the group's 64 codes in input
 * order. Scales and zeros: float32 [N, K / 64].
 *
 * w8a8: w = value * scale, value in -127..127 [N, K] bytes, one float32 scale per output row [N], so
 *   y[m, n] = scale * sum over groups of a_scale * sum value * q
 * maddubs needs one unsigned operand: |value| times sign(value) * q (sign_epi8), at most
 * 2 * 127 * 127 < 32767 a pair, so nothing saturates.
 *
 * x [M, K], bias [N] (or NULL) and y [M, N] are float32, or bfloat16 where bf16 is nonzero (the
 * model's activations: read and written here, a conversion each way fewer per call). y is rounded to
 * bf16 once, after the bias is added, to nearest even as torch rounds.
 *
 * Each output is computed by one thread in a fixed order whatever M is, so a row's result does not
 * depend on the other rows (batch invariance). Built by lab/intmm.py with -fopenmp against the
 * libgomp that torch has loaded already: the parallel loops run in torch's own OpenMP threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 64

static inline float bf16_to_float(uint16_t half) {
  const uint32_t bits = (uint32_t)half << 16; /* bf16 is float32's upper half */
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

static inline uint16_t float_to_bf16(float value) {
  if (isnan(value)) return 0x7FC0;
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* to nearest, ties to even */
}

static inline float load(const void *x, int bf16, int64_t i) {
  return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The input rows quantized: codes [M, K] and per group of 64 [M, K / 64] the scale, and for w4a8
 * 8 * scale * sum of the codes (offset) and the sum of the values (sum); those two NULL for w8a8. */
struct activations {
  int8_t *q;
  float *scale, *offset, *sum;
};

static void quantize_rows(const void *x, int bf16, int64_t M, int64_t K, const struct activations *a) {
  const int64_t G = K / GROUP;
  for (int64_t i = 0; i < M * G; ++i) {
    float v[GROUP], amax = 0.f, sum = 0.f;
    for (int j = 0; j < GROUP; ++j) v[j] = load(x, bf16, i * GROUP + j);
    for (int j = 0; j < GROUP; ++j) {
      amax = fmaxf(amax, fabsf(v[j]));
      sum += v[j];
    }
    const float s = amax / 127.f;
    const float inv = s > 0.f ? 1.f / s : 0.f;
    int32_t total = 0;
    for (int j = 0; j < GROUP; ++j) {
      const int code = (int)nearbyintf(v[j] * inv);
      a->q[i * GROUP + j] = (int8_t)code;
      total += code;
    }
    a->scale[i] = s;
    if (a->sum != NULL) {
      a->offset[i] = 8.f * s * (float)total;
      a->sum[i] = sum;
    }
  }
}

/* Allocate *a for M x K inputs (with offsets and sums if `sums`) and quantize x into it. Returns 0,
 * or -1 when there is no memory (malloc here: a tensor each from Python cost more per call). */
static int quantize(const void *x, int bf16, int64_t M, int64_t K, int sums, struct activations *a) {
  const int64_t per_group = M * (K / GROUP);
  a->q = malloc((size_t)(M * K));
  a->scale = malloc(sizeof(float) * (size_t)((sums ? 3 : 1) * per_group));
  if (a->q == NULL || a->scale == NULL) {
    free(a->q);
    free(a->scale);
    return -1;
  }
  a->offset = sums ? a->scale + per_group : NULL;
  a->sum = sums ? a->scale + 2 * per_group : NULL;
  quantize_rows(x, bf16, M, K, a);
  return 0;
}

/* Free what quantize allocated; returns 0, the products' status when it succeeded. */
static int release(struct activations *a) {
  free(a->q);
  free(a->scale);
  return 0;
}

/* One product's operands: the activations, quantized, and the weights in one of the two layouts. */
struct product {
  int64_t M, K, N;
  struct activations a;
  const void *weights; /* w4a8: packed codes [N, K / 2]; w8a8: values [N, K] */
  const float *scales; /* w4a8: [N, K / 64]; w8a8: [N] */
  const float *zeros;  /* w4a8: [N, K / 64]; w8a8: NULL */
  const void *bias;
  void *y;
  int bf16;
};

static inline void store(const struct product *p, int64_t m, int64_t n, float value) {
  if (p->bias != NULL) value += load(p->bias, p->bf16, n);
  if (p->bf16)
    ((uint16_t *)p->y)[m * p->N + n] = float_to_bf16(value);
  else
    ((float *)p->y)[m * p->N + n] = value;
}

static inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

/* Outputs n of input rows m0 .. m0 + ROWS - 1 (w4a8_rows, w8a8_rows); ROWS a constant in each call,
 * so that the accumulators stay in registers (an array indexed at run time would live on the stack). */
typedef void rows_kernel(const int ROWS, int64_t m0, int64_t n, const struct product *p);

static inline __attribute__((always_inline)) void w4a8_rows(const int ROWS, int64_t m0, int64_t n,
                                                            const struct product *p) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = p->K / GROUP;
  const uint8_t *row = (const uint8_t *)p->weights + n * G * (GROUP / 2);
  const float *scales = p->scales + n * G, *zeros = p->zeros + n * G;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + g * (GROUP / 2)));
    const __m256i first = _mm256_and_si256(bytes, low_nibbles);                         /* inputs 0..31 */
    const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);  /* 32..63 */
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      const int8_t *qa = p->a.q + at * GROUP;
      const __m256i q0 = _mm256_loadu_si256((const __m256i *)qa);
      const __m256i q1 = _mm256_loadu_si256((const __m256i *)(qa + 32));
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, q0), _mm256_maddubs_epi16(second, q1));
      const __m256i dot = _mm256_madd_epi16(pairs, ones); /* [8] int32 */
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * p->a.scale[at]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  /* the zeros' and the codes' offset's share, out of the loop above: sum over g of
   * zero * sum a  -  scale * 8 * a_scale * sum q  (the activations' offset holds the second factor) */
  for (int r = 0; r < ROWS; ++r) {
    const float *sums = p->a.sum + (m0 + r) * G, *offsets = p->a.offset + (m0 + r) * G;
    float rest = 0.f;
    for (int64_t g = 0; g < G; ++g) rest += zeros[g] * sums[g] - scales[g] * offsets[g];
    store(p, m0 + r, n, sum_lanes(acc[r]) + rest);
  }
}

static inline __attribute__((always_inline)) void w8a8_rows(const int ROWS, int64_t m0, int64_t n,
                                                            const struct product *p) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = p->K / GROUP;
  const int8_t *row = (const int8_t *)p->weights + n * p->K;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(row + g * GROUP));      /* inputs 0..31 */
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(row + g * GROUP + 32)); /* 32..63 */
    const __m256i abs0 = _mm256_sign_epi8(w0, w0), abs1 = _mm256_sign_epi8(w1, w1);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      const int8_t *qa = p->a.q + at * GROUP;
      const __m256i q0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)qa), w0);
      const __m256i q1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qa + 32)), w1);
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(abs0, q0), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, q1), ones));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p->a.scale[at]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store(p, m0 + r, n, p->scales[n] * sum_lanes(acc[r]));
}

/* Output n of every input row, 4 rows at a time: they share each load of the weights. */
static inline __attribute__((always_inline)) void each_row(rows_kernel *rows, int64_t n, const struct product *p) {
  int64_t m0 = 0;
  for (; m0 + 4 <= p->M; m0 += 4) rows(4, m0, n, p);
  switch (p->M - m0) {
    case 3: rows(3, m0, n, p); break;
    case 2: rows(2, m0, n, p); break;
    case 1: rows(1, m0, n, p); break;
  }
}

/* The two products below differ in their weights' layout only, but each has its own parallel loop:
 * GCC outlines an OpenMP region before it inlines, so a loop shared through a function would call
 * the rows' kernel through a pointer, with ROWS no longer a constant. */

/* y [M, N] = x [M, K] times the packed 4-bit weights [N, K / 2] + bias. Returns 0, or -1 when the
 * activations' scratch could not be allocated. */
int w4a8_mm(const void *x, int64_t M, int64_t K, int bf16, const uint8_t *packed, const float *scales,
            const float *zeros, int64_t N, const void *bias, void *y) {
  struct product p = {M, K, N, {0}, packed, scales, zeros, bias, y, bf16};
  if (quantize(x, bf16, M, K, 1, &p.a) != 0) return -1;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) each_row(w4a8_rows, n, &p);
  return release(&p.a);
}

/* y [M, N] = x [M, K] times the 8-bit weights [N, K] + bias. Returns as w4a8_mm. */
int w8a8_mm(const void *x, int64_t M, int64_t K, int bf16, const int8_t *values, const float *scales,
            int64_t N, const void *bias, void *y) {
  struct product p = {M, K, N, {0}, values, scales, NULL, bias, y, bf16};
  if (quantize(x, bf16, M, K, 0, &p.a) != 0) return -1;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) each_row(w8a8_rows, n, &p);
  return release(&p.a);
}

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
 (maddubs of the unsigned code and q: at most 2 * 15 * 127 a pair). The weights are laid out with
 * the outputs in the lanes, as llama.cpp's repacked q4_0 is: blocks of 16 outputs (N padded to a
 * multiple of 16), and in each block and group of 64 inputs, 8 runs of 64 bytes, run i holding for
 * each output c (bytes 4c .. 4c + 3) the codes of inputs 8i .. 8i + 3 in the low nibbles and of
 * 8i + 4 .. 8i + 7 in the high ones: [N / 16, K / 64, 8, 64] bytes. One load and two masks give 16
 * outputs' codes of 4 inputs each, and one dpbusd (AVX2: maddubs and madd) multiplies them by 4
 * activations broadcast, summing into one int32 lane per output; a group's float work (its scale,
 * zero and the activations' scale) is then one vector of 16 (AVX2: 8) outputs, not one per output.
 * Scales and zeros: bf16 [N / 16, K / 64, 2, 16] (a block's 16 scales, then its 16 zeros), torch's
 * int4 kernel's precision: the same weights as --dtype int4, and the same bytes per weight (a decode
 * step streams every weight once, so bytes are time).
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
 * Two instruction sets, chosen when the library loads (intmm_isa): AVX2 as above, or where the CPU
 * has AVX-512 with VNNI, 512-bit registers (a group of 64 bytes is one register) and dpbusd, which
 * multiplies unsigned by signed bytes and sums each four into an int32 lane in one instruction. There
 * w4a8's codes are the unsigned operand as they are; w8a8's values are signed, so the activations
 * are offset to unsigned (q + 128) and 128 * sum value taken back out: the same integer dot products
 * as AVX2's. Both w4a8 kernels take up to 4 rows per load of the weights; the AVX-512 w8a8 kernel
 * takes one output of up to 4 rows at a time for a decode step's rows (NARROW_ROWS), and tiles of up
 * to 4 rows by 4 outputs for more, so one load of the weights serves 4 rows and one of the
 * activations 4 outputs; the activations are quantized 16 at a time.
 *
 * Each output is computed by one thread in a fixed order whatever M is and whichever tile it falls
 * in, so a row's result does not depend on the other rows (batch invariance). Built by lab/intmm.py
 * with -fopenmp against the libgomp that torch has loaded already: the parallel loops run in torch's
 * own OpenMP threads.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 64
/* A product of at most this many input rows (a decode step's) computes one output at a time where a
 * kernel otherwise takes tiles of 4 (AVX-512 w8a8, the float products): its thread reads one weight
 * row after another, a single stream the hardware prefetcher follows, where a tile reads 4 rows side
 * by side, and the single stream is the faster (docs/inference.md, "One weight stream per thread").
 * With more rows a product is bound by its arithmetic, and a tile's one load of the inputs for 4
 * outputs pays. Each output's sum is the same either way. */
#define NARROW_ROWS 4
/* How far ahead in its weights' stream each integer kernel asks for the cache line it will read: a
 * decode step reads every weight once, from L3 or memory, and the hardware prefetcher alone left the
 * products waiting on it (docs/inference.md has the measurement). The AVX2 versions ask with the
 * non-temporal hint: weights read once then do not push out of the second- and third-level caches
 * what the step reads again (the keys and values, the activations, between calls the Python objects
 * of the step), which made every dtype's decode step faster on an AVX2-only EPYC ("Weights that pass
 * through the caches", docs/inference.md). A prompt's products keep the plain hint: their later
 * row groups read the same weights again. The AVX-512 versions keep it too: not measured there. */
#define PREFETCH_BYTES 8192
/* The AVX2 kernels' request for the weights' line at ``line`` (PREFETCH_BYTES ahead) in a product of M
 * input rows: non-temporal for a decode step's few rows, which read each weight once. (The float rows
 * ask where a tile takes one output, for the first row group: a decode step's rows, and a prompt's
 * outputs past its last full tile; int8's at one row, as asking for 4 rows' made those slower; the
 * integer and int4 products at any M, for their first row group.) */
static inline __attribute__((always_inline)) void prefetch_weights_avx2(const char *line, int64_t M) {
  if (M <= NARROW_ROWS)
    _mm_prefetch(line, _MM_HINT_NTA);
  else
    _mm_prefetch(line, _MM_HINT_T0);
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* The instruction set the products use: 0 AVX2, 1 AVX-512 with VNNI; -1 until first asked. Read and
 * written atomically: ctypes releases the GIL, so Python threads call these functions at once. */
static int isa = -1;

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

static void quantize_rows_avx512(const void *x, int bf16, int64_t M, int64_t K, const struct activations *a);

/* Allocate *a for M x K inputs (with offsets and sums if `sums`) and quantize x into it. Returns 0,
 * or -1 when there is no memory (malloc here: a tensor each from Python cost more per call). */
static int quantize(const void *x, int bf16, int64_t M, int64_t K, int sums, int avx512, struct activations *a) {
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
  if (avx512)
    quantize_rows_avx512(x, bf16, M, K, a);
  else
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
  const void *weights;          /* w4a8: packed codes [N / 16, K / 64, 8, 64]; w8a8: values [N, K] */
  const float *scales;          /* w8a8: [N] */
  const uint16_t *scales_zeros; /* w4a8: bf16 [N / 16, K / 64, 2, 16] */
  const void *bias;
  void *y;
  int bf16;
};

/* y[m, n] = value + bias[n], y and bias float32 or (bf16) rounded once to bf16: every product's output. */
static inline void write_output(void *y, const void *bias, int bf16, int64_t N, int64_t m, int64_t n, float value) {
  if (bias != NULL) value += load(bias, bf16, n);
  if (bf16)
    ((uint16_t *)y)[m * N + n] = float_to_bf16(value);
  else
    ((float *)y)[m * N + n] = value;
}

static inline void store(const struct product *p, int64_t m, int64_t n, float value) {
  write_output(p->y, p->bias, p->bf16, p->N, m, n, value);
}

static inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

/* Outputs n of input rows m0 .. m0 + ROWS - 1 (w4a8_cols: its n-th run of 8 outputs; w8a8_rows);
 * ROWS a constant in each call, so that the accumulators stay in registers (an array indexed at run
 * time would live on the stack). */
typedef void rows_kernel(const int ROWS, int64_t m0, int64_t n, const struct product *p);

/* x[i .. i + 7] as float lanes, x float32 or (BF16) bf16. */
static inline __attribute__((always_inline)) __m256 widen_lanes(const int BF16, const void *x, int64_t i) {
  if (!BF16) return _mm256_loadu_ps((const float *)x + i);
  const __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)); /* bf16: float's top half */
}

/* Row m's 4 activation codes of inputs at..at + 3, as one int32 to broadcast. */
static inline int32_t four_codes(const int8_t *q) {
  int32_t four;
  memcpy(&four, q, sizeof four);
  return four;
}

/* Outputs 8 n .. 8 n + 7 (half n % 2 of block n / 2) of input rows m0 .. m0 + ROWS - 1. */
static inline __attribute__((always_inline)) void w4a8_cols(const int ROWS, int64_t m0, int64_t n,
                                                            const struct product *p) {
  const int64_t cb = n / 2, half = n % 2;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t G = p->K / GROUP;
  const uint8_t *block = (const uint8_t *)p->weights + cb * G * 512 + half * 32;
  const uint16_t *scales_zeros = p->scales_zeros + cb * G * 32 + half * 8;
  __m256 acc[4];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[4]; /* [8] int32: each output's sum of code * q over the group */
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      const uint8_t *run = block + g * 512 + i * 64;
      if (m0 == 0) prefetch_weights_avx2((const char *)(run + PREFETCH_BYTES), p->M);
      const __m256i bytes = _mm256_loadu_si256((const __m256i *)run);
      const __m256i first = _mm256_and_si256(bytes, low_nibbles);                         /* inputs 8i.. */
      const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);  /* 8i + 4.. */
      for (int r = 0; r < ROWS; ++r) {
        const int8_t *q = p->a.q + ((m0 + r) * G + g) * GROUP + 8 * i;
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, _mm256_set1_epi32(four_codes(q))),
                                               _mm256_maddubs_epi16(second, _mm256_set1_epi32(four_codes(q + 4))));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 scales = widen_lanes(1, scales_zeros, g * 32), zeros = widen_lanes(1, scales_zeros, g * 32 + 16);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(p->a.scale[at])), _mm256_cvtepi32_ps(dot[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(scales, _mm256_set1_ps(p->a.offset[at]), acc[r]);
      acc[r] = _mm256_fmadd_ps(zeros, _mm256_set1_ps(p->a.sum[at]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    for (int c = 0; c < 8 && 8 * n + c < p->N; ++c) store(p, m0 + r, 8 * n + c, out[c]);
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
    if (m0 == 0) prefetch_weights_avx2((const char *)(row + g * GROUP + PREFETCH_BYTES), p->M);
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

/* AVX-512 with VNNI: the same products on 512-bit registers, in tiles of ROWS x COLS (at most 4 x 4). */
#define TILE_INLINE static inline AVX512 __attribute__((always_inline))
/* AVX-512 VNNI and BF16: int4_mm's tiles (int4_tile). */
#define AVX512_INT4_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))
#define TILE_INLINE_BF16 static inline AVX512_INT4_BF16 __attribute__((always_inline))

/* widen_lanes of 16 bf16 values. */
TILE_INLINE __m512 widen_bf16x16(const uint16_t *h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}

/* As quantize_rows, 16 inputs at a time; the codes are the same, the sums' rounding may differ. */
static AVX512 void quantize_rows_avx512(const void *x, int bf16, int64_t M, int64_t K, const struct activations *a) {
  const int64_t G = K / GROUP;
  for (int64_t i = 0; i < M * G; ++i) {
    __m512 v[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t at = i * GROUP + 16 * j;
      v[j] = bf16 ? widen_bf16x16((const uint16_t *)x + at) : _mm512_loadu_ps((const float *)x + at);
    }
    const __m512 magnitude = _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])),
                                           _mm512_max_ps(_mm512_abs_ps(v[2]), _mm512_abs_ps(v[3])));
    const float s = _mm512_reduce_max_ps(magnitude) / 127.f;
    const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], inv)); /* to nearest even, as nearbyintf */
      total = _mm512_add_epi32(total, codes);
      _mm_storeu_si128((__m128i *)(a->q + i * GROUP + 16 * j), _mm512_cvtepi32_epi8(codes));
    }
    a->scale[i] = s;
    if (a->sum != NULL) {
      a->offset[i] = 8.f * s * (float)_mm512_reduce_add_epi32(total);
      a->sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])));
    }
  }
}

/* w4a8_cols on 512-bit registers: outputs n0 .. n0 + COLS - 1, COLS 16 (the layout's block n0 / 16),
 * of input rows m0 .. m0 + ROWS - 1. */
TILE_INLINE void w4a8_block_rows(const int ROWS, const int COLS, int64_t m0, int64_t n0,
                                  const struct product *p) {
  const int64_t cb = n0 / COLS;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int64_t G = p->K / GROUP;
  const uint8_t *block = (const uint8_t *)p->weights + cb * G * 512;
  const uint16_t *scales_zeros = p->scales_zeros + cb * G * 32;
  __m512 acc[4];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[4]; /* [16] int32: each output's sum of code * q over the group */
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      const uint8_t *run = block + g * 512 + i * 64;
      if (m0 == 0) _mm_prefetch((const char *)(run + PREFETCH_BYTES), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(run);
      const __m512i first = _mm512_and_si512(bytes, low_nibbles);                         /* inputs 8i.. */
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);  /* 8i + 4.. */
      for (int r = 0; r < ROWS; ++r) {
        const int8_t *q = p->a.q + ((m0 + r) * G + g) * GROUP + 8 * i;
        dot[r] = _mm512_dpbusd_epi32(dot[r], first, _mm512_set1_epi32(four_codes(q)));
        dot[r] = _mm512_dpbusd_epi32(dot[r], second, _mm512_set1_epi32(four_codes(q + 4)));
      }
    }
    const __m512 scales = widen_bf16x16(scales_zeros + g * 32), zeros = widen_bf16x16(scales_zeros + g * 32 + 16);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(p->a.scale[at])), _mm512_cvtepi32_ps(dot[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(scales, _mm512_set1_ps(p->a.offset[at]), acc[r]);
      acc[r] = _mm512_fmadd_ps(zeros, _mm512_set1_ps(p->a.sum[at]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float out[16];
    _mm512_storeu_ps(out, acc[r]);
    for (int c = 0; c < COLS && n0 + c < p->N; ++c) store(p, m0 + r, n0 + c, out[c]);
  }
}

TILE_INLINE void w8a8_tile(const int ROWS, const int COLS, int64_t m0, int64_t n0, const struct product *p) {
  const int64_t G = p->K / GROUP;
  const __m512i offset = _mm512_set1_epi8((char)0x80); /* q + 128 as unsigned: q XOR 0x80 */
  const int8_t *values = (const int8_t *)p->weights;
  __m512 acc[4][4];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i w[4], minus_offset[4]; /* the group's values, and -128 * their sum per 4 (one int32 lane) */
    for (int c = 0; c < COLS; ++c) {
      w[c] = _mm512_loadu_si512(values + (n0 + c) * p->K + g * GROUP);
      _mm_prefetch((const char *)(values + (n0 + c) * p->K + g * GROUP + PREFETCH_BYTES), _MM_HINT_T0);
      /* negated in int32: -(-128) does not fit a byte (lab.quantize's values never hold -128; others may) */
      minus_offset[c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w[c]));
    }
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * G + g;
      const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(p->a.q + at * GROUP), offset);
      const __m512 scale = _mm512_set1_ps(p->a.scale[at]);
      for (int c = 0; c < COLS; ++c) {
        const __m512i dot = _mm512_dpbusd_epi32(minus_offset[c], q, w[c]); /* [16] int32: sum q * value */
        acc[r][c] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) store(p, m0 + r, n0 + c, p->scales[n0 + c] * _mm512_reduce_add_ps(acc[r][c]));
}

/* Every row's outputs n0 .. n0 + COLS - 1, 4 rows at a time: TILE(ROWS, COLS) with both constants. */
#define EACH_ROW(TILE, COLS, n0, p)                                   \
  do {                                                                \
    int64_t m0 = 0;                                                   \
    for (; m0 + 4 <= (p)->M; m0 += 4) TILE(4, COLS, m0, n0, p);       \
    switch ((p)->M - m0) {                                            \
      case 3: TILE(3, COLS, m0, n0, p); break;                        \
      case 2: TILE(2, COLS, m0, n0, p); break;                        \
      case 1: TILE(1, COLS, m0, n0, p); break;                        \
    }                                                                 \
  } while (0)

/* Outputs n0 .. n0 + 3 (fewer at the end) of every row. */
#define EACH_TILE(TILE, n0, p)                                        \
  switch ((p)->N - (n0) < 4 ? (p)->N - (n0) : 4) {                    \
    case 4: EACH_ROW(TILE, 4, n0, p); break;                          \
    case 3: EACH_ROW(TILE, 3, n0, p); break;                          \
    case 2: EACH_ROW(TILE, 2, n0, p); break;                          \
    case 1: EACH_ROW(TILE, 1, n0, p); break;                          \
  }

static AVX512 void w4a8_avx512(const struct product *p) {
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < p->N; n0 += 16) EACH_ROW(w4a8_block_rows, 16, n0, p);
}

static AVX512 void w8a8_avx512(const struct product *p) {
  if (p->M <= NARROW_ROWS) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < p->N; ++n) EACH_ROW(w8a8_tile, 1, n, p);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < p->N; n0 += 4) EACH_TILE(w8a8_tile, n0, p);
}

static int avx512_vnni(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* The instruction set in use (request -1), or choose one: 0 AVX2, 1 AVX-512 VNNI where the CPU has
 * it (AVX2 where not). The first call picks the best this CPU has. Returns the one in use. */
int intmm_isa(int request) {
  int now = __atomic_load_n(&isa, __ATOMIC_RELAXED);
  if (request >= 0 || now < 0) {
    now = request == 0 ? 0 : avx512_vnni();
    __atomic_store_n(&isa, now, __ATOMIC_RELAXED);
  }
  return now;
}

/* Floating-point weights, as the model holds them ([N, K], laid out [out, in]), sums in float32:
 *
 *   f32_mm:  float32 weights times float32 inputs;
 *   bf16_mm: bf16 weights times the inputs rounded to bf16, what torch's bf16 product computes.
 *
 * torch's matrix-vector products stream these at a fraction of the memory's rate (bf16: widening
 * the weights; float32 from memory rather than cache: docs/inference.md); these stream them at it.
 * A decode step's rows take one output at a time (NARROW_ROWS), each weight vector loaded once for
 * all of them; more rows take tiles of 4 rows by 4 outputs (AVX2: 3), one load serving 4 sums, or,
 * for sums of at most SHORT_SUMS inputs, tiles of one row by 4 outputs (there a tile's 16 sums cost
 * more to reduce and store than its loads save); the weights of an output or a tile stay in the
 * first-level cache across the input rows, so they stream from memory once per call. The AVX-512
 * versions take no software prefetch: one weight row after another is a stream the hardware
 * prefetcher follows, and asking for lines ahead of it slowed these products on a Zen 4 EPYC. The
 * AVX2 versions ask for one row's weights PREFETCH_BYTES ahead: on an AVX2-only EPYC that made a
 * decode step faster (docs/inference.md, "On an AVX2-only CPU"). Each
 * output's sum runs over the inputs in a fixed order (vector lanes, then one fixed reduction of the
 * lanes, then the inputs past the last full vector), whatever M is: a row's result does not depend
 * on the others. Two versions each: AVX-512 (bf16: AVX-512 BF16's dpbf16ps, 32 products summed in
 * pairs into 16 float lanes per instruction) where the CPU has it and AVX-512 is chosen, else AVX2
 * fused multiply-adds (bf16 weights widened 8 at a time: a 16-bit shift). */

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define SHORT_SUMS 256 /* K up to this: float tiles of one row (below) */
#define FLOAT_TILE 4 /* the most outputs a float tile takes */

static int avx512_bf16(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

struct float_product {
  int64_t M, K, N;
  const void *x; /* float32 [M, K]; bf16 for bf16_mm's AVX-512 version */
  const void *weights;
  const uint16_t *scales; /* int8_mm: bf16 [N]; int4_mm: scales and zeros, bf16 [N / 16, K / 64, 2, 16] */
  const float *sums;      /* int4_mm: each input row's sum per group of 64 [M, K / 64] */
  const void *bias;
  void *y;
  int bf16; /* bias and y are bf16 */
};

static inline void float_store(const struct float_product *p, int64_t m, int64_t n, float value) {
  write_output(p->y, p->bias, p->bf16, p->N, m, n, value);
}

/* Outputs n0 .. n0 + COLS - 1 of rows m0 .. m0 + ROWS - 1; BF16 (the weights' type), ROWS and COLS
 * constants in each call. One load of a weight vector serves the ROWS rows, one of an input vector
 * the COLS outputs; each (row, output) sums in its own accumulator, the same operations in the same
 * order whatever the tile (the rows' chains are independent: a row is not held up by the latency of
 * another's multiply-adds). */
static inline AVX512_BF16 __attribute__((always_inline)) void float_tile_avx512(const int BF16, const int ROWS,
                                                                                 const int COLS, int64_t m0,
                                                                                 int64_t n0,
                                                                                 const struct float_product *p) {
  const int64_t K = p->K, step = BF16 ? 32 : 16, full = K / step * step;
  const uint64_t tail = (1ull << (K - full)) - 1; /* the inputs past the last full vector */
  __m512 acc[NARROW_ROWS][FLOAT_TILE];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += step) {
    __m512i w[FLOAT_TILE];
    for (int c = 0; c < COLS; ++c)
      w[c] = _mm512_loadu_si512(BF16 ? (const void *)((const uint16_t *)p->weights + (n0 + c) * K + k)
                                     : (const void *)((const float *)p->weights + (n0 + c) * K + k));
    for (int r = 0; r < ROWS; ++r) {
      const int64_t at = (m0 + r) * K + k;
      const __m512i a = _mm512_loadu_si512(BF16 ? (const void *)((const uint16_t *)p->x + at)
                                                : (const void *)((const float *)p->x + at));
      for (int c = 0; c < COLS; ++c)
        acc[r][c] = BF16 ? _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)w[c])
                         : _mm512_fmadd_ps(_mm512_castsi512_ps(w[c]), _mm512_castsi512_ps(a), acc[r][c]);
    }
  }
  if (tail) {
    for (int c = 0; c < COLS; ++c) {
      const int64_t at = (n0 + c) * K + full;
      for (int r = 0; r < ROWS; ++r) {
        const int64_t from = (m0 + r) * K + full;
        if (BF16) {
          const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)tail, (const uint16_t *)p->x + from);
          const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)tail, (const uint16_t *)p->weights + at);
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w);
        } else {
          const __m512 a = _mm512_maskz_loadu_ps((__mmask16)tail, (const float *)p->x + from);
          const __m512 w = _mm512_maskz_loadu_ps((__mmask16)tail, (const float *)p->weights + at);
          acc[r][c] = _mm512_fmadd_ps(w, a, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) float_store(p, m0 + r, n0 + c, _mm512_reduce_add_ps(acc[r][c]));
}

/* One vector of inputs k .. k + 7 into the tile's sums acc (one chain's). */
static inline __attribute__((always_inline)) void float_step_avx2(const int BF16, const int ROWS, const int COLS,
                                                                   int64_t k, int64_t n0, const float *x,
                                                                   const struct float_product *p,
                                                                   __m256 acc[NARROW_ROWS][FLOAT_TILE]) {
  const int64_t K = p->K;
  __m256 w[FLOAT_TILE];
  for (int c = 0; c < COLS; ++c) {
    const int64_t at = (n0 + c) * K + k;
    w[c] = BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->weights + at))), 16))
                : _mm256_loadu_ps((const float *)p->weights + at);
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m256 a = _mm256_loadu_ps(x + r * K + k);
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_fmadd_ps(w[c], a, acc[r][c]);
  }
}

/* bf16: each sum in two chains, the even vectors of inputs and the odd ones, added at the end. A tile
 * of a few sums runs them side by side, so that a row alone does not wait on the multiply-adds'
 * latency (widening the weights makes that the bound, not the memory); a larger one runs them one
 * after the other, as their sums side by side would not fit in AVX2's 16 registers: the same
 * operations in the same order either way. float32: one chain, bound by the memory's rate. */
static inline __attribute__((always_inline)) void float_tile_avx2(const int BF16, const int ROWS, const int COLS,
                                                                   int64_t m0, int64_t n0,
                                                                   const struct float_product *p) {
  const int64_t K = p->K, full = K / 8 * 8;
  const float *x = (const float *)p->x + m0 * K;
  __m256 even[NARROW_ROWS][FLOAT_TILE], odd[NARROW_ROWS][FLOAT_TILE];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) even[r][c] = odd[r][c] = _mm256_setzero_ps();
  if (!BF16) {
    for (int64_t k = 0; k < full; k += 8) {
      /* a line of float32 weights per 16 inputs, per output of a decode step's tile */
      if ((COLS == 1 || (COLS == 2 && p->M <= NARROW_ROWS)) && m0 == 0 && k % 16 == 0)
        for (int c = 0; c < COLS; ++c)
          prefetch_weights_avx2((const char *)((const float *)p->weights + (n0 + c) * K + k) + PREFETCH_BYTES, p->M);
      float_step_avx2(BF16, ROWS, COLS, k, n0, x, p, even);
    }
  } else if (ROWS * COLS <= 4) {
    for (int64_t k = 0; k < full; k += 16) {
      if (COLS == 1 && m0 == 0 && k % 32 == 0) /* one line of bf16 weights per 32 inputs */
        prefetch_weights_avx2((const char *)((const uint16_t *)p->weights + n0 * K + k) + PREFETCH_BYTES, p->M);
      float_step_avx2(BF16, ROWS, COLS, k, n0, x, p, even);
      if (k + 8 < full) float_step_avx2(BF16, ROWS, COLS, k + 8, n0, x, p, odd);
    }
  } else {
    for (int64_t k = 0; k < full; k += 16) float_step_avx2(BF16, ROWS, COLS, k, n0, x, p, even);
    for (int64_t k = 8; k < full; k += 16) float_step_avx2(BF16, ROWS, COLS, k, n0, x, p, odd);
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) {
      float value = sum_lanes(_mm256_add_ps(even[r][c], odd[r][c]));
      for (int64_t k = full; k < K; ++k) {
        const int64_t at = (n0 + c) * K + k;
        value += (BF16 ? bf16_to_float(((const uint16_t *)p->weights)[at]) : ((const float *)p->weights)[at]) *
                 x[r * K + k];
      }
      float_store(p, m0 + r, n0 + c, value);
    }
}

/* The tiles as EACH_ROW calls them, TILE(ROWS, COLS, m0, n0, p), per version and type. */
static inline AVX512_BF16 __attribute__((always_inline)) void bf16_tile_avx512(const int ROWS, const int COLS,
                                                                                int64_t m0, int64_t n0,
                                                                                const struct float_product *p) {
  float_tile_avx512(1, ROWS, COLS, m0, n0, p);
}

static inline AVX512_BF16 __attribute__((always_inline)) void f32_tile_avx512(const int ROWS, const int COLS,
                                                                               int64_t m0, int64_t n0,
                                                                               const struct float_product *p) {
  float_tile_avx512(0, ROWS, COLS, m0, n0, p);
}

static inline __attribute__((always_inline)) void bf16_tile_avx2(const int ROWS, const int COLS, int64_t m0,
                                                                  int64_t n0, const struct float_product *p) {
  float_tile_avx2(1, ROWS, COLS, m0, n0, p);
}

static inline __attribute__((always_inline)) void f32_tile_avx2(const int ROWS, const int COLS, int64_t m0,
                                                                 int64_t n0, const struct float_product *p) {
  float_tile_avx2(0, ROWS, COLS, m0, n0, p);
}

/* One parallel loop per version and weight type. One row: one output at a time. A decode step's rows
 * (NARROW_ROWS): one output at a time, all the rows together (one weight stream per thread, each
 * weight loaded once for them); where PAIRED (AVX2), 3 or 4 rows over short sums (SHORT_SUMS) take
 * two neighbouring outputs at a time, their weights still one stream, so that twice the chains of
 * such short sums are in flight (docs/inference.md has the figures). More rows:
 * tiles of COLS outputs, over every row 4 at a time (one row at a time for short sums); the outputs
 * past the last full tile one at a time. */
#define FLOAT_PRODUCT(TILE, COLS, PAIRED, p)                                              \
  do {                                                                                    \
    if ((p)->M == 1) {                                                                    \
      _Pragma("omp parallel for schedule(static)")                                        \
      for (int64_t n = 0; n < (p)->N; ++n) TILE(1, 1, 0, n, p);                           \
    } else if ((PAIRED) && (p)->M >= 3 && (p)->M <= NARROW_ROWS && (p)->K <= SHORT_SUMS) { \
      const int64_t paired = (p)->N / 2 * 2;                                              \
      _Pragma("omp parallel for schedule(static)")                                        \
      for (int64_t n0 = 0; n0 < paired; n0 += 2) EACH_ROW(TILE, 2, n0, p);                \
      if (paired < (p)->N) EACH_ROW(TILE, 1, paired, p);                                  \
    } else if ((p)->M <= NARROW_ROWS) {                                                   \
      _Pragma("omp parallel for schedule(static)")                                        \
      for (int64_t n = 0; n < (p)->N; ++n) EACH_ROW(TILE, 1, n, p);                       \
    } else {                                                                              \
      const int64_t tiled = (p)->N / (COLS) * (COLS);                                     \
      if ((p)->K <= SHORT_SUMS) {                                                         \
        _Pragma("omp parallel for schedule(static)")                                      \
        for (int64_t n0 = 0; n0 < tiled; n0 += COLS)                                      \
          for (int64_t m = 0; m < (p)->M; ++m) TILE(1, COLS, m, n0, p);                   \
      } else {                                                                            \
        _Pragma("omp parallel for schedule(static)")                                      \
        for (int64_t n0 = 0; n0 < tiled; n0 += COLS) EACH_ROW(TILE, COLS, n0, p);         \
      }                                                                                   \
      for (int64_t n = tiled; n < (p)->N; ++n) EACH_ROW(TILE, 1, n, p);                   \
    }                                                                                     \
  } while (0)

/* AVX2 has 16 vector registers: 4 rows by 3 outputs keep 12 sums in them beside 3 weight vectors and an
 * input vector; a prompt's products then load 7 vectors for 12 multiply-adds (2 outputs: 6 for 8),
 * and re-read each row's inputs from the second-level cache once every 3 outputs instead of 2. */
static AVX512_BF16 void bf16_avx512(const struct float_product *p) { FLOAT_PRODUCT(bf16_tile_avx512, 4, 0, p); }

static AVX512_BF16 void f32_avx512(const struct float_product *p) { FLOAT_PRODUCT(f32_tile_avx512, 4, 0, p); }

static void bf16_avx2(const struct float_product *p) { FLOAT_PRODUCT(bf16_tile_avx2, 3, 1, p); }

static void f32_avx2(const struct float_product *p) { FLOAT_PRODUCT(f32_tile_avx2, 3, 1, p); }

/* Weight-only products: integer weights times floating-point inputs, sums in float32, what torch's
 * int8 and int4 kernels compute (weights widened to float), at the rate the weights stream.
 *
 *   int8_mm: lab.quantize's int8 rows, w = value * scale (values [N, K], the bf16 scales [N] torch's
 *            int8 kernel takes): y = scale * sum value * x;
 *   int4_mm: w4a8's layout and weights (below).
 *
 * Both take up to 4 input rows per widening of the weights, and sum each row's products in 4 chains of
 * fused multiply-adds (AVX2: 3), so that a row is not held up by their latency; each output's sum is
 * the same sequence of operations whichever rows share the call (batch invariance). A decode step's
 * int8 row on AVX2 asks for its weights PREFETCH_BYTES ahead, a line per 64 inputs, as the float
 * rows do: the hardware prefetcher alone left its step slower on an AVX2-only EPYC (docs/inference.md
 * has the figures). */

#define CHAINS 4
/* AVX2's 16 registers hold 3 chains for each of 4 rows, and the weights' vector */
#define INT8_AVX2_CHAINS 3

/* int8_mm's output n of input rows m0 .. m0 + ROWS - 1 (COLS 1), inputs float32. */
TILE_INLINE void int8_rows_avx512(const int ROWS, const int COLS, int64_t m0, int64_t n,
                                  const struct float_product *p) {
  (void)COLS;
  const int64_t K = p->K, full = K / 16 * 16;
  const int8_t *w = (const int8_t *)p->weights + n * K;
  const float *x = (const float *)p->x + m0 * K;
  __m512 acc[4][CHAINS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < CHAINS; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += CHAINS * 16)
    for (int j = 0; j < CHAINS && k + 16 * j < full; ++j) {
      if (m0 == 0 && j == 0) _mm_prefetch((const char *)(w + k + PREFETCH_BYTES), _MM_HINT_T0);
      const __m512 weight = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k + 16 * j))));
      for (int r = 0; r < ROWS; ++r) acc[r][j] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + r * K + k + 16 * j), acc[r][j]);
    }
  if (full < K) {
    const __mmask16 tail = (__mmask16)((1u << (K - full)) - 1);
    const __m512 weight = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, w + full)));
    for (int r = 0; r < ROWS; ++r) acc[r][0] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(tail, x + r * K + full), acc[r][0]);
  }
  const float scale = bf16_to_float(p->scales[n]);
  for (int r = 0; r < ROWS; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    float_store(p, m0 + r, n, scale * _mm512_reduce_add_ps(sum));
  }
}

static inline __attribute__((always_inline)) void int8_rows_avx2(const int ROWS, const int COLS, int64_t m0,
                                                                 int64_t n, const struct float_product *p) {
  (void)COLS;
  const int64_t K = p->K, full = K / 8 * 8;
  const int8_t *w = (const int8_t *)p->weights + n * K;
  const float *x = (const float *)p->x + m0 * K;
  __m256 acc[4][INT8_AVX2_CHAINS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < INT8_AVX2_CHAINS; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += INT8_AVX2_CHAINS * 8) {
    if (ROWS == 1 && k % 64 < INT8_AVX2_CHAINS * 8) /* one line of int8 weights per 64 inputs */
      prefetch_weights_avx2((const char *)(w + k) + PREFETCH_BYTES, p->M);
    for (int j = 0; j < INT8_AVX2_CHAINS && k + 8 * j < full; ++j) {
      const __m256 weight = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k + 8 * j))));
      for (int r = 0; r < ROWS; ++r) acc[r][j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + r * K + k + 8 * j), acc[r][j]);
    }
  }
  const float scale = bf16_to_float(p->scales[n]);
  for (int r = 0; r < ROWS; ++r) {
    float value = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), acc[r][2]));
    for (int64_t k = full; k < K; ++k) value += (float)w[k] * x[r * K + k];
    float_store(p, m0 + r, n, scale * value);
  }
}

/* Outputs n0 .. end - 1 of every row, COLS at a time (a constant), 4 rows at a time, each group of rows
 * over all the outputs before the next: the rows' inputs stay in the first-level cache across the
 * outputs (a prompt's inputs, M x K floats, do not), the outputs' weights in the second. */
#define ROW_GROUPS(TILE, COLS, n0, end, p)                                        \
  do {                                                                            \
    int64_t m0 = 0;                                                               \
    for (; m0 + 4 <= (p)->M; m0 += 4)                                             \
      for (int64_t n = n0; n < end; n += COLS) TILE(4, COLS, m0, n, p);           \
    for (int64_t n = n0; n < end; n += COLS) switch ((p)->M - m0) {               \
        case 3: TILE(3, COLS, m0, n, p); break;                                   \
        case 2: TILE(2, COLS, m0, n, p); break;                                   \
        case 1: TILE(1, COLS, m0, n, p); break;                                   \
      }                                                                           \
  } while (0)

/* Outputs a thread takes at a time in a product of more than NARROW_ROWS rows: 64 int8 rows of K = 3072
 * are 192 KiB, in the second-level cache. */
#define OUTPUT_CHUNK 64

/* One parallel loop per kernel, as FLOAT_PRODUCT: a decode step's rows (NARROW_ROWS) take COLS
 * outputs at a time, more rows OUTPUT_CHUNK outputs a thread in ROW_GROUPS. */
#define WEIGHT_ONLY_PRODUCT(TILE, COLS, p)                                                \
  do {                                                                                   \
    if ((p)->M <= NARROW_ROWS) {                                                         \
      _Pragma("omp parallel for schedule(static)")                                       \
      for (int64_t n0 = 0; n0 < (p)->N; n0 += COLS) EACH_ROW(TILE, COLS, n0, p);         \
    } else {                                                                             \
      _Pragma("omp parallel for schedule(static)")                                       \
      for (int64_t n0 = 0; n0 < (p)->N; n0 += OUTPUT_CHUNK) {                            \
        const int64_t end = n0 + OUTPUT_CHUNK < (p)->N ? n0 + OUTPUT_CHUNK : (p)->N;     \
        ROW_GROUPS(TILE, COLS, n0, end, p);                                              \
      }                                                                                  \
    }                                                                                    \
  } while (0)

static AVX512 void int8_avx512(const struct float_product *p) { WEIGHT_ONLY_PRODUCT(int8_rows_avx512, 1, p); }

static void int8_avx2(const struct float_product *p) { WEIGHT_ONLY_PRODUCT(int8_rows_avx2, 1, p); }

/* int4_mm: weight-only int4 in w4a8's layout (its codes, scales and zeros: the same weights), times
 * float32 inputs. With w = (code - 8) * scale + zero per output and group of 64 inputs, a group adds
 *   scale * sum code * x  +  (zero - 8 * scale) * sum x
 * to y, sum x taken once per row and group (p->sums). The codes are widened to float 16 outputs at a
 * time (AVX2: 8), outputs in the lanes as the layout has them: AVX-512 looks each 4-bit code up in a
 * register of the floats 0..15 (permutexvar reads an index's low 4 bits: one instruction a code),
 * AVX2 masks and converts it. */

/* Outputs n0 .. n0 + COLS - 1, COLS 16 (the layout's block n0 / 16), of input rows m0 .. m0 + ROWS - 1;
 * PAIRED (a constant): bf16 inputs where the CPU has AVX-512 BF16, each code widened to a bf16 (0..15,
 * exact) beside the code of the input it pairs with, and dpbf16ps adds two products a lane per
 * instruction, half the float multiply-adds (a prompt's rows are bound by them). The products of a
 * 4-bit code and a bf16 input are exact in float32, and each pair is added in dpbf16ps' fixed order,
 * so a row's result does not depend on the others. p->x: float32 inputs [M, K], or PAIRED each row's
 * inputs in pairs as the codes lie, 32-bit words (bf16 of input 8i + j, bf16 of 8i + 4 + j) for the run
 * i of 8 inputs and j 0..3, [M, K / 2] (int4_bf16_mm). */
TILE_INLINE_BF16 void int4_tile(const int PAIRED, const int ROWS, const int COLS, int64_t m0, int64_t n0,
                                const struct float_product *p) {
  const int64_t K = p->K, G = K / GROUP;
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  /* word e: bf16 of e's low 4 bits (vpermw reads an index's low 5 bits) */
  const __m512i bf16_codes = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000,
      0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
      0x4040, 0x4000, 0x3f80, 0x0000);
  const uint8_t *block = (const uint8_t *)p->weights + n0 / COLS * G * 512;
  const uint16_t *scales_zeros = p->scales + n0 / COLS * G * 32;
  const float *x = (const float *)p->x;
  const uint32_t *pairs = (const uint32_t *)p->x;
  __m512 acc[4];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[4][CHAINS]; /* [row][chain]: sums of code * x, chain j over inputs 8i + j and 8i + 4 + j */
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < CHAINS; ++j) dot[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      const uint8_t *run = block + g * 512 + i * 64;
      if (m0 == 0) _mm_prefetch((const char *)(run + PREFETCH_BYTES), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(run);
      for (int j = 0; j < 4; ++j) {
        if (PAIRED) {
          const __m512i low = _mm512_srli_epi32(bytes, 8 * j);                 /* code 8i + j in bits 0..3 */
          const __m512i high = _mm512_slli_epi32(low, 12);                      /* code 8i + 4 + j in bits 16..19 */
          const __m512i index = _mm512_mask_blend_epi16(0xAAAAAAAA, low, high); /* the high words from high */
          const __m512bh weights = (__m512bh)_mm512_permutexvar_epi16(index, bf16_codes);
          for (int r = 0; r < ROWS; ++r) {
            const int word = (int)pairs[(m0 + r) * (K / 2) + g * 32 + 4 * i + j];
            dot[r][j] = _mm512_dpbf16_ps(dot[r][j], weights, (__m512bh)_mm512_set1_epi32(word));
          }
        } else {
          const __m512 first = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 8 * j), codes);      /* 8i + j */
          const __m512 second = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 8 * j + 4), codes); /* 8i + 4 + j */
          for (int r = 0; r < ROWS; ++r) {
            const float *inputs = x + (m0 + r) * K + g * GROUP + 8 * i;
            dot[r][j] = _mm512_fmadd_ps(first, _mm512_set1_ps(inputs[j]), dot[r][j]);
            dot[r][j] = _mm512_fmadd_ps(second, _mm512_set1_ps(inputs[4 + j]), dot[r][j]);
          }
        }
      }
    }
    const __m512 scales = widen_bf16x16(scales_zeros + g * 32), zeros = widen_bf16x16(scales_zeros + g * 32 + 16);
    const __m512 code_zero = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scales, zeros); /* zero - 8 * scale */
    for (int r = 0; r < ROWS; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(dot[r][0], dot[r][1]), _mm512_add_ps(dot[r][2], dot[r][3]));
      acc[r] = _mm512_fmadd_ps(scales, sum, acc[r]);
      acc[r] = _mm512_fmadd_ps(code_zero, _mm512_set1_ps(p->sums[(m0 + r) * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float out[16];
    _mm512_storeu_ps(out, acc[r]);
    for (int c = 0; c < COLS && n0 + c < p->N; ++c) float_store(p, m0 + r, n0 + c, out[c]);
  }
}

/* int4_tile as WEIGHT_ONLY_PRODUCT calls it, TILE(ROWS, COLS, m0, n0, p): float32 inputs, paired bf16. */
TILE_INLINE_BF16 void int4_block_rows(const int ROWS, const int COLS, int64_t m0, int64_t n0,
                                      const struct float_product *p) {
  int4_tile(0, ROWS, COLS, m0, n0, p);
}

TILE_INLINE_BF16 void int4_block_rows_bf16(const int ROWS, const int COLS, int64_t m0, int64_t n0,
                                           const struct float_product *p) {
  int4_tile(1, ROWS, COLS, m0, n0, p);
}

/* The end of group g for the rows m0 .. m0 + ROWS - 1 of int4_mm's AVX2 products: each half h's sums
 * acc[r][h] += scale * (dot[r][h][0] + dot[r][h][1]) + (zero - 8 * scale) * the row's sum of the group's
 * inputs; scales_zeros at the first half these sums are of. */
static inline __attribute__((always_inline)) void int4_group_end(const int HALVES, const int ROWS, int64_t m0,
                                                                 int64_t g, const uint16_t *scales_zeros,
                                                                 const struct float_product *p,
                                                                 __m256 dot[][2][2], __m256 acc[][2]) {
  const int64_t G = p->K / GROUP;
  for (int h = 0; h < HALVES; ++h) {
    const __m256 scales = widen_lanes(1, scales_zeros, g * 32 + 8 * h);
    const __m256 zeros = widen_lanes(1, scales_zeros, g * 32 + 16 + 8 * h);
    const __m256 code_zero = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scales, zeros);
    for (int r = 0; r < ROWS; ++r) {
      acc[r][h] = _mm256_fmadd_ps(scales, _mm256_add_ps(dot[r][h][0], dot[r][h][1]), acc[r][h]);
      acc[r][h] = _mm256_fmadd_ps(code_zero, _mm256_set1_ps(p->sums[(m0 + r) * G + g]), acc[r][h]);
    }
  }
}

/* The sums acc[r][h] as outputs n0 + 8h .. n0 + 8h + 7 of rows m0 + r (those below N). */
static inline __attribute__((always_inline)) void int4_store(const int HALVES, const int ROWS, int64_t m0,
                                                             int64_t n0, const struct float_product *p,
                                                             __m256 acc[][2]) {
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < HALVES; ++h) {
      float out[8];
      _mm256_storeu_ps(out, acc[r][h]);
      for (int c = 0; c < 8 && n0 + 8 * h + c < p->N; ++c) float_store(p, m0 + r, n0 + 8 * h + c, out[c]);
    }
}

/* Outputs n0 .. n0 + 8 * HALVES - 1 of block n0 / 16 (HALVES 1: its half n0 / 8 % 2 alone; 2: both, each
 * 64-byte run read whole at once), of input rows m0 .. m0 + ROWS - 1. */
static inline __attribute__((always_inline)) void int4_halves(const int HALVES, const int ROWS, int64_t m0, int64_t n0,
                                                              const struct float_product *p) {
  const int64_t K = p->K, G = K / GROUP, first_half = n0 / 8 % 2;
  const __m256i low_nibble = _mm256_set1_epi32(0x0F);
  const uint8_t *block = (const uint8_t *)p->weights + n0 / 16 * G * 512 + first_half * 32;
  const uint16_t *scales_zeros = p->scales + n0 / 16 * G * 32 + first_half * 8;
  const float *x = (const float *)p->x;
  __m256 acc[4][2];
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < HALVES; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 dot[4][2][2]; /* [row][half][chain]: sums of code * x, chain 0 over inputs 8i + j, 1 over 8i + 4 + j */
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < HALVES; ++h) dot[r][h][0] = dot[r][h][1] = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      const uint8_t *run = block + g * 512 + i * 64;
      if (m0 == 0) prefetch_weights_avx2((const char *)(run + PREFETCH_BYTES), p->M);
      __m256i bytes[2];
      for (int h = 0; h < HALVES; ++h) bytes[h] = _mm256_loadu_si256((const __m256i *)(run + 32 * h));
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < HALVES; ++h) {
          const __m256 first = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes[h], 8 * j), low_nibble));
          const __m256 second =
              _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes[h], 8 * j + 4), low_nibble));
          for (int r = 0; r < ROWS; ++r) {
            const float *inputs = x + (m0 + r) * K + g * GROUP + 8 * i;
            dot[r][h][0] = _mm256_fmadd_ps(first, _mm256_set1_ps(inputs[j]), dot[r][h][0]);
            dot[r][h][1] = _mm256_fmadd_ps(second, _mm256_set1_ps(inputs[4 + j]), dot[r][h][1]);
          }
        }
    }
    int4_group_end(HALVES, ROWS, m0, g, scales_zeros, p, dot, acc);
  }
  int4_store(HALVES, ROWS, m0, n0, p, acc);
}

/* Outputs n0 .. n0 + 15 (COLS 16, block n0 / 16) of input rows m0 .. m0 + ROWS - 1: both halves of each
 * run together for one row (a decode step's row reads each 64-byte run once, whole), one half after
 * the other for more (their sums side by side do not fit in AVX2's 16 registers: two rows' spilled).
 * Each output's sums are the same operations either way. */
static inline __attribute__((always_inline)) void int4_cols(const int ROWS, const int COLS, int64_t m0, int64_t n0,
                                                            const struct float_product *p) {
  (void)COLS;
  if (ROWS == 1) {
    int4_halves(2, ROWS, m0, n0, p);
  } else {
    int4_halves(1, ROWS, m0, n0, p);
    int4_halves(1, ROWS, m0, n0 + 8, p);
  }
}

/* int4_mm's prompts on AVX2 (more than NARROW_ROWS rows). int4_halves widens a block's codes again for
 * every 4 rows, and with each input broadcast for 2 multiply-adds the widening and the broadcasts, not
 * the multiply-adds, bound a prompt's product. Here each block of 16 outputs widens its codes once, into
 * `codes` (per group, run i and input j of it: the floats of codes 8i + j and 8i + 4 + j for the 16
 * outputs, [K / 64][8][4][2][16], in the second-level cache), and the rows take them 3 at a time over
 * both halves: 12 sums, 3 inputs and a weight vector in the 16 registers, 10 loads for 12
 * multiply-adds. (A group's codes at a time, read by every row before the next group's, kept them in
 * the first-level cache but ran slower: each row's sums then went through memory once a group.) Each
 * output's sums are int4_halves' operations in its order, so a row gets the bits it gets alone and in
 * a decode step. */
static void int4_codes_avx2(int64_t n0, const struct float_product *p, float *codes) {
  const int64_t G = p->K / GROUP;
  const __m256i low_nibble = _mm256_set1_epi32(0x0F);
  const uint8_t *block = (const uint8_t *)p->weights + n0 / 16 * G * 512;
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < 8; ++i)
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + g * 512 + i * 64 + 32 * h));
        for (int j = 0; j < 4; ++j)
          for (int c = 0; c < 2; ++c) /* c 0: code 8i + j (bits 8j..), 1: code 8i + 4 + j (bits 8j + 4..) */
            _mm256_storeu_ps(codes + (((g * 8 + i) * 4 + j) * 2 + c) * 16 + 8 * h,
                             _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(bytes, 8 * j + 4 * c), low_nibble)));
      }
}

/* Outputs n0 .. n0 + 15 of rows m0 .. m0 + ROWS - 1 (ROWS at most 3) from the block's widened codes. */
static inline __attribute__((always_inline)) void int4_widened_rows(const int ROWS, int64_t m0, int64_t n0,
                                                                    const float *codes,
                                                                    const struct float_product *p) {
  const int64_t K = p->K, G = K / GROUP;
  const uint16_t *scales_zeros = p->scales + n0 / 16 * G * 32;
  const float *x = (const float *)p->x + m0 * K;
  __m256 acc[3][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 dot[3][2][2]; /* [row][half][chain]: chain 0 over inputs 8i + j, 1 over 8i + 4 + j */
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h][0] = dot[r][h][1] = _mm256_setzero_ps();
    const float *group = codes + g * 8 * 4 * 2 * 16;
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 2; ++c) {
          __m256 input[3];
          for (int r = 0; r < ROWS; ++r) input[r] = _mm256_broadcast_ss(x + r * K + g * GROUP + 8 * i + 4 * c + j);
          for (int h = 0; h < 2; ++h) {
            const __m256 weight = _mm256_loadu_ps(group + ((i * 4 + j) * 2 + c) * 16 + 8 * h);
            for (int r = 0; r < ROWS; ++r) dot[r][h][c] = _mm256_fmadd_ps(weight, input[r], dot[r][h][c]);
          }
        }
    int4_group_end(2, ROWS, m0, g, scales_zeros, p, dot, acc);
  }
  int4_store(2, ROWS, m0, n0, p, acc);
}

/* Rows from which int4_mm's AVX2 products widen each block's codes once (int4_prompt_avx2): with fewer,
 * widening every code of a block costs more than widening again every 4 rows (docs/inference.md has
 * the crossover). */
#define WIDENED_ROWS 24

/* Returns 0, or -1 when the widened codes' buffers could not be allocated. */
static int int4_prompt_avx2(const struct float_product *p) {
  const size_t widened = (size_t)(p->K / GROUP) * 8 * 4 * 2 * 16; /* floats per block */
  float *buffers = malloc(sizeof(float) * widened * (size_t)omp_get_max_threads());
  if (buffers == NULL) return -1;
#pragma omp parallel
  {
    float *codes = buffers + widened * (size_t)omp_get_thread_num();
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < p->N; n0 += 16) {
      int4_codes_avx2(n0, p, codes);
      int64_t m0 = 0;
      for (; m0 + 3 <= p->M; m0 += 3) int4_widened_rows(3, m0, n0, codes, p);
      if (p->M - m0 == 2) int4_widened_rows(2, m0, n0, codes, p);
      if (p->M - m0 == 1) int4_widened_rows(1, m0, n0, codes, p);
    }
  }
  free(buffers);
  return 0;
}

/* AVX-512 BF16 in the target for int4_tile's paired version; the float one uses none of it. */
static AVX512_INT4_BF16 void int4_avx512(const struct float_product *p) { WEIGHT_ONLY_PRODUCT(int4_block_rows, 16, p); }

static AVX512_INT4_BF16 void int4_bf16_avx512(const struct float_product *p) {
  WEIGHT_ONLY_PRODUCT(int4_block_rows_bf16, 16, p);
}

static void int4_avx2(const struct float_product *p) { WEIGHT_ONLY_PRODUCT(int4_cols, 16, p); }

/* x [M, K] in float32, from x as it is (bf16: widened; round_to_bf16: rounded first), into scratch;
 * x itself when nothing changes. NULL when there is no memory. */
static const float *float_inputs(const void *x, int bf16, int round_to_bf16, int64_t count, void **scratch) {
  if (!bf16 && !round_to_bf16) return x;
  float *values = *scratch = malloc(sizeof(float) * (size_t)count);
  if (values != NULL)
    for (int64_t i = 0; i < count; ++i)
      values[i] = bf16 ? bf16_to_float(((const uint16_t *)x)[i])
                       : bf16_to_float(float_to_bf16(((const float *)x)[i]));
  return values;
}

/* y [M, N] = x [M, K] times the float32 weights [N, K] + bias. Returns 0, or -1 when the inputs'
 * scratch could not be allocated. */
int f32_mm(const void *x, int64_t M, int64_t K, int bf16, const float *weights, int64_t N, const void *bias,
           void *y) {
  void *scratch = NULL;
  struct float_product p = {.M = M, .K = K, .N = N, .x = float_inputs(x, bf16, 0, M * K, &scratch),
                            .weights = weights, .bias = bias, .y = y, .bf16 = bf16};
  if (p.x == NULL) return -1;
  if (intmm_isa(-1) == 1)
    f32_avx512(&p);
  else
    f32_avx2(&p);
  free(scratch);
  return 0;
}

/* y [M, N] = x [M, K] (rounded to bf16) times the bf16 weights [N, K] + bias. Returns as f32_mm. */
int bf16_mm(const void *x, int64_t M, int64_t K, int bf16, const uint16_t *weights, int64_t N, const void *bias,
            void *y) {
  void *scratch = NULL;
  struct float_product p = {.M = M, .K = K, .N = N, .x = x, .weights = weights, .bias = bias, .y = y, .bf16 = bf16};
  const int avx512 = intmm_isa(-1) == 1 && avx512_bf16();
  if (avx512 && !bf16) { /* the inputs rounded to bf16, as torch rounds */
    uint16_t *rounded = scratch = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (rounded == NULL) return -1;
    for (int64_t i = 0; i < M * K; ++i) rounded[i] = float_to_bf16(((const float *)x)[i]);
    p.x = rounded;
  } else if (!avx512 && (p.x = float_inputs(x, bf16, 1, M * K, &scratch)) == NULL) {
    return -1;
  }
  if (avx512)
    bf16_avx512(&p);
  else
    bf16_avx2(&p);
  free(scratch);
  return 0;
}

/* y [M, N] = x [M, K] times the int8 weights values [N, K] scaled per output row by scales [N] (bf16)
 * + bias. Returns as f32_mm. */
int int8_mm(const void *x, int64_t M, int64_t K, int bf16, const int8_t *values, const uint16_t *scales, int64_t N,
            const void *bias, void *y) {
  void *scratch = NULL;
  struct float_product p = {.M = M, .K = K, .N = N, .x = float_inputs(x, bf16, 0, M * K, &scratch),
                            .weights = values, .scales = scales, .bias = bias, .y = y, .bf16 = bf16};
  if (p.x == NULL) return -1;
  if (intmm_isa(-1) == 1)
    int8_avx512(&p);
  else
    int8_avx2(&p);
  free(scratch);
  return 0;
}

/* int4_mm of bf16 inputs on AVX-512 BF16 (int4_block_rows_bf16): the inputs in pairs as the codes lie,
 * and each row's sum per group of 64, in one fixed order whatever M is. */
static int int4_bf16_mm(const void *x, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *scales_zeros,
                        int64_t N, const void *bias, void *y) {
  const int64_t G = K / GROUP;
  const uint16_t *h = x;
  uint32_t *pairs = malloc(sizeof(uint32_t) * (size_t)(M * K / 2));
  float *sums = malloc(sizeof(float) * (size_t)(M * G));
  if (pairs == NULL || sums == NULL) {
    free(pairs);
    free(sums);
    return -1;
  }
  for (int64_t i = 0; i < M * G; ++i) { /* group i: runs of 8 inputs, pairs (8r + j, 8r + 4 + j) */
    float sum = 0.f;
    for (int j = 0; j < GROUP; ++j) sum += bf16_to_float(h[i * GROUP + j]);
    sums[i] = sum;
    for (int r = 0; r < 8; ++r)
      for (int j = 0; j < 4; ++j) {
        const uint16_t *run = h + i * GROUP + 8 * r;
        pairs[i * 32 + 4 * r + j] = (uint32_t)run[j] | (uint32_t)run[4 + j] << 16;
      }
  }
  struct float_product p = {.M = M, .K = K, .N = N, .x = pairs, .weights = packed, .scales = scales_zeros,
                            .sums = sums, .bias = bias, .y = y, .bf16 = 1};
  int4_bf16_avx512(&p);
  free(pairs);
  free(sums);
  return 0;
}

/* y [M, N] = x [M, K] times the packed 4-bit weights [N / 16, K / 64, 8, 64] (w4a8's layout) + bias, the
 * inputs as they are. Returns as f32_mm. */
int int4_mm(const void *x, int64_t M, int64_t K, int bf16, const uint8_t *packed, const uint16_t *scales_zeros,
            int64_t N, const void *bias, void *y) {
  if (bf16 && intmm_isa(-1) == 1 && avx512_bf16()) return int4_bf16_mm(x, M, K, packed, scales_zeros, N, bias, y);
  void *scratch = NULL;
  const int64_t G = K / GROUP;
  const float *inputs = float_inputs(x, bf16, 0, M * K, &scratch);
  float *sums = malloc(sizeof(float) * (size_t)(M * G));
  if (inputs == NULL || sums == NULL) {
    free(scratch);
    free(sums);
    return -1;
  }
  for (int64_t i = 0; i < M * G; ++i) { /* in one fixed order, whatever M is */
    float sum = 0.f;
    for (int j = 0; j < GROUP; ++j) sum += inputs[i * GROUP + j];
    sums[i] = sum;
  }
  struct float_product p = {.M = M, .K = K, .N = N, .x = inputs, .weights = packed, .scales = scales_zeros,
                            .sums = sums, .bias = bias, .y = y, .bf16 = bf16};
  int status = 0;
  if (intmm_isa(-1) == 1)
    int4_avx512(&p);
  else if (M < WIDENED_ROWS)
    int4_avx2(&p);
  else
    status = int4_prompt_avx2(&p);
  free(scratch);
  free(sums);
  return status;
}

/* The two products below differ in their weights' layout only, but each has its own parallel loop:
 * GCC outlines an OpenMP region before it inlines, so a loop shared through a function would call
 * the rows' kernel through a pointer, with ROWS no longer a constant. */

/* y [M, N] = x [M, K] times the packed 4-bit weights [N / 16, K / 64, 8, 64] + bias. Returns 0, or -1
 * when the activations' scratch could not be allocated. */
int w4a8_mm(const void *x, int64_t M, int64_t K, int bf16, const uint8_t *packed, const uint16_t *scales_zeros,
            int64_t N, const void *bias, void *y) {
  struct product p = {M, K, N, {0}, packed, NULL, scales_zeros, bias, y, bf16};
  const int avx512 = intmm_isa(-1) == 1; /* read once: one call runs in one instruction set */
  if (quantize(x, bf16, M, K, 1, avx512, &p.a) != 0) return -1;
  if (avx512) {
    w4a8_avx512(&p);
    return release(&p.a);
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < (N + 15) / 16 * 2; ++n) each_row(w4a8_cols, n, &p); /* runs of 8 outputs */
  return release(&p.a);
}

/* y [M, N] = x [M, K] times the 8-bit weights [N, K] + bias. Returns as w4a8_mm. */
int w8a8_mm(const void *x, int64_t M, int64_t K, int bf16, const int8_t *values, const float *scales,
            int64_t N, const void *bias, void *y) {
  struct product p = {M, K, N, {0}, values, scales, NULL, bias, y, bf16};
  const int avx512 = intmm_isa(-1) == 1;
  if (quantize(x, bf16, M, K, 0, avx512, &p.a) != 0) return -1;
  if (avx512) {
    w8a8_avx512(&p);
    return release(&p.a);
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) each_row(w8a8_rows, n, &p);
  return release(&p.a);
}

/* Decode attention: each row's newest token over its own cache, every row of a block in one call.
 *
 * Row b's query, key and value are qkv[b] = (q, k, v), D = H * Dh each, head h at h * Dh. Its cache
 * is a pair of tensors [H, t_max[b], Dh] (a decoder's KVCache layer): every row's k and v are written
 * at position pos[b], then each query reads positions 0 .. pos[b] of its cache:
 *   y[b, h] = sum_s softmax_s(q_h . k_s / sqrt(Dh)) v_s
 * written at y[b, h * Dh] ([B, D]: the heads already side by side, as c_proj reads them). Sums and
 * the softmax in float32; bf16 caches are read and written as they are and y is rounded once.
 * Rows may share a cache at consecutive positions (a prompt's tokens): with every key written before
 * any query reads, each attends causally. One (row, head) per task, each summed in the same order
 * whatever rows share the call, so a row's result does not depend on the others (batch invariance).
 * torch's scaled_dot_product_attention costs more to call than the work at these sizes (more in bf16;
 * docs/inference.md), once per row and block: most of it fixed cost, a share of the step that the
 * products left behind. */

/* scores[s] = q . k_s for s in 0..COUNT-1 (COUNT <= 4 keys of Dh, one after another): one chain of
 * multiply-adds per key, so the four proceed at once instead of waiting on each other. */
static inline __attribute__((always_inline)) void dot_keys(const int BF16, const int COUNT, const float *q,
                                                           const void *k, int64_t Dh, float *scores) {
  __m256 lanes[4];
  for (int c = 0; c < COUNT; ++c) lanes[c] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= Dh; d += 8) {
    const __m256 query = _mm256_loadu_ps(q + d);
    for (int c = 0; c < COUNT; ++c) lanes[c] = _mm256_fmadd_ps(query, widen_lanes(BF16, k, c * Dh + d), lanes[c]);
  }
  for (int c = 0; c < COUNT; ++c) {
    float total = sum_lanes(lanes[c]);
    for (int64_t tail = d; tail < Dh; ++tail) total += q[tail] * load(k, BF16, c * Dh + tail);
    scores[c] = total;
  }
}

/* e^x for 8 lanes of x <= 0 (scores minus their maximum): Cephes' expf, 2^n times a degree-5
 * polynomial on the remainder, within 2 ulp of expf; below -87, 0. One call in place of eight to
 * libm, which bounded the softmax. */
static inline __m256 exp_lanes(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts: x - n ln 2, exactly */
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

static inline __attribute__((always_inline)) void attend_head(const int BF16, int64_t D, int64_t Dh,
                                                              const void *qkv, const void *k_cache,
                                                              const void *v_cache,
                                                              int64_t t_max, int64_t pos, int64_t h, void *y,
                                                              float *scratch) {
  const size_t width = BF16 ? 2 : 4;
  const char *k_head = (const char *)k_cache + (size_t)(h * t_max * Dh) * width; /* [t_max, Dh] */
  const char *v_head = (const char *)v_cache + (size_t)(h * t_max * Dh) * width;
  const int64_t S = pos + 1, S8 = (S + 7) / 8 * 8;
  float *q = scratch, *out = scratch + Dh, *weights = scratch + 2 * Dh; /* [Dh], [Dh], [S rounded up to 8] */
  const float scale = 1.f / sqrtf((float)Dh);
  for (int64_t d = 0; d < Dh; ++d) q[d] = load(qkv, BF16, h * Dh + d) * scale;
  int64_t s = 0;
  for (; s + 4 <= S; s += 4) dot_keys(BF16, 4, q, k_head + (size_t)(s * Dh) * width, Dh, weights + s);
  for (; s < S; ++s) dot_keys(BF16, 1, q, k_head + (size_t)(s * Dh) * width, Dh, weights + s);
  float top = -INFINITY;
  for (s = 0; s < S; ++s) top = fmaxf(top, weights[s]);
  for (s = S; s < S8; ++s) weights[s] = -INFINITY; /* e^-inf: 0, outside the sum */
  __m256 totals = _mm256_setzero_ps();
  for (s = 0; s < S8; s += 8) {
    const __m256 e = exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(weights + s), _mm256_set1_ps(top)));
    _mm256_storeu_ps(weights + s, e);
    totals = _mm256_add_ps(totals, e);
  }
  const float total = sum_lanes(totals);
  int64_t d = 0;
  for (; d + 32 <= Dh; d += 32) { /* 32 outputs at a time in registers, every position's value into them */
    __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (s = 0; s < S; ++s) {
      const __m256 weight = _mm256_set1_ps(weights[s]);
      const void *v = v_head + (size_t)(s * Dh) * width;
      for (int j = 0; j < 4; ++j) sums[j] = _mm256_fmadd_ps(weight, widen_lanes(BF16, v, d + 8 * j), sums[j]);
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + d + 8 * j, sums[j]);
  }
  for (; d < Dh; ++d) {
    float sum = 0.f;
    for (s = 0; s < S; ++s) sum += weights[s] * load(v_head + (size_t)(s * Dh) * width, BF16, d);
    out[d] = sum;
  }
  const float inverse = 1.f / total;
  for (d = 0; d < Dh; ++d) {
    const float value = out[d] * inverse;
    if (BF16)
      ((uint16_t *)y)[h * Dh + d] = float_to_bf16(value);
    else
      ((float *)y)[h * Dh + d] = value;
  }
}

/* Below this many (head, position) pairs in a call, one thread attends them all: waking the others
 * costs more than the work (a few nanoseconds a pair). */
#define ATTEND_PARALLEL_PAIRS 1024

/* y [B, H * Dh] from qkv [B, 3 * H * Dh] over each row's caches k_caches[b], v_caches[b] ([H, t_max[b],
 * Dh] each, written at pos[b]). bf16: qkv, the caches and y are bf16, else float32. Returns 0, or -1
 * when there is no memory for a task's scratch. */
int attend_rows(int64_t B, int64_t H, int64_t Dh, int bf16, const void *qkv, void *const *k_caches,
                void *const *v_caches, const int64_t *t_max, const int64_t *pos, void *y) {
  const int64_t D = H * Dh;
  const size_t width = bf16 ? 2 : 4;
  int64_t pairs = 0;
  for (int64_t b = 0; b < B; ++b) { /* every row's key and value first: rows may share a cache */
    pairs += H * (pos[b] + 1);
    const char *row = (const char *)qkv + (size_t)(b * 3 * D) * width;
    for (int64_t h = 0; h < H; ++h) {
      const size_t at = (size_t)((h * t_max[b] + pos[b]) * Dh) * width, head = (size_t)Dh * width;
      memcpy((char *)k_caches[b] + at, row + (size_t)(D + h * Dh) * width, head);
      memcpy((char *)v_caches[b] + at, row + (size_t)(2 * D + h * Dh) * width, head);
    }
  }
  int status = 0;
#pragma omp parallel for schedule(static) reduction(min : status) if (pairs >= ATTEND_PARALLEL_PAIRS)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, h = task % H;
    float *scratch = malloc(sizeof(float) * (size_t)(2 * Dh + pos[b] + 8));
    if (scratch == NULL) {
      status = -1;
      continue;
    }
    const void *row = (const char *)qkv + (size_t)(b * 3 * D) * width;
    void *out = (char *)y + (size_t)(b * D) * width;
    if (bf16)
      attend_head(1, D, Dh, row, k_caches[b], v_caches[b], t_max[b], pos[b], h, out, scratch);
    else
      attend_head(0, D, Dh, row, k_caches[b], v_caches[b], t_max[b], pos[b], h, out, scratch);
    free(scratch);
  }
  return status;
}

/* The largest value of x [n] (float32, or bf16), NaNs aside, and whether x holds a NaN (any_nan). */
static float largest_value(const void *x, int64_t n, int bf16, int *any_nan) {
  __m256 top = _mm256_set1_ps(-INFINITY), nan_lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 values = bf16 ? widen_lanes(1, x, i) : widen_lanes(0, x, i);
    top = _mm256_max_ps(top, values);
    nan_lanes = _mm256_or_ps(nan_lanes, _mm256_cmp_ps(values, values, _CMP_UNORD_Q));
  }
  float largest = -INFINITY;
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (int j = 0; j < 8; ++j) largest = fmaxf(largest, lanes[j]);
  *any_nan = _mm256_movemask_ps(nan_lanes) != 0;
  for (int64_t tail = i; tail < n; ++tail) {
    const float value = load(x, bf16, tail);
    *any_nan |= isnan(value);
    largest = fmaxf(largest, value);
  }
  return largest;
}

/* log sum_i exp x[i] over x [n] (float32), as torch's logsumexp: the largest value m plus the log of
 * sum exp(x - m), summed in 8 lanes; m itself when m is infinite (every value -inf, or one +inf), NaN
 * where x holds one. A sampled token's log-probability at every step, which torch's logsumexp took
 * several times longer to compute over GPT-2's vocabulary. */
float logsumexp(const float *x, int64_t n) {
  int any_nan;
  const float largest = largest_value(x, n, 0, &any_nan);
  if (any_nan) return NAN;
  if (isinf(largest)) return largest;
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) sums = _mm256_add_ps(sums, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift)));
  float total = sum_lanes(sums);
  for (; i < n; ++i) total += expf(x[i] - largest);
  return largest + logf(total);
}

/* The index of x's largest value [n] (float32, or bf16), the first of equals; where x holds a NaN,
 * the first NaN's, as torch's argmax answers. Greedy decoding's pick over the vocabulary, which
 * torch's argmax took several times longer to find, a bf16 one more (docs/inference.md). */
int64_t argmax(const void *x, int64_t n, int bf16) {
  int any_nan;
  const float largest = largest_value(x, n, bf16, &any_nan);
  const __m256 target = _mm256_set1_ps(largest);
  int64_t at = 0;
  for (; at + 8 <= n; at += 8) { /* the first lane that is the largest value (or a NaN) */
    const __m256 values = bf16 ? widen_lanes(1, x, at) : widen_lanes(0, x, at);
    const __m256 hit = any_nan ? _mm256_cmp_ps(values, values, _CMP_UNORD_Q) : _mm256_cmp_ps(values, target, _CMP_EQ_OQ);
    const int mask = _mm256_movemask_ps(hit);
    if (mask) return at + __builtin_ctz((unsigned)mask);
  }
  for (; at < n; ++at) {
    const float value = load(x, bf16, at);
    if (any_nan ? isnan(value) : value == largest) return at;
  }
  return 0; /* n == 0 */
}

/* The roof a prompt's float products are measured against (scripts/bench_intmm.py): how many float
 * multiply-adds a second this CPU sustains on torch's threads, in the vectors the products use
 * (AVX-512 where chosen, else AVX2), each thread `turns` times through PEAK_CHAINS independent chains
 * of fused multiply-adds (enough to hide their latency on every core seen here), nothing loaded. */
#define PEAK_CHAINS 12

static AVX512 double multiply_adds_avx512(int64_t turns) {
  __m512 chain[PEAK_CHAINS];
  for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_set1_ps(1e-3f * (float)c);
  const __m512 scale = _mm512_set1_ps(0.999f), shift = _mm512_set1_ps(1e-4f);
  for (int64_t t = 0; t < turns; ++t)
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm512_fmadd_ps(chain[c], scale, shift);
  __m512 total = chain[0];
  for (int c = 1; c < PEAK_CHAINS; ++c) total = _mm512_add_ps(total, chain[c]);
  return (double)_mm512_reduce_add_ps(total);
}

static double multiply_adds_avx2(int64_t turns) {
  __m256 chain[PEAK_CHAINS];
  for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm256_set1_ps(1e-3f * (float)c);
  const __m256 scale = _mm256_set1_ps(0.999f), shift = _mm256_set1_ps(1e-4f);
  for (int64_t t = 0; t < turns; ++t)
    for (int c = 0; c < PEAK_CHAINS; ++c) chain[c] = _mm256_fmadd_ps(chain[c], scale, shift);
  __m256 total = chain[0];
  for (int c = 1; c < PEAK_CHAINS; ++c) total = _mm256_add_ps(total, chain[c]);
  return (double)sum_lanes(total);
}

static volatile double multiply_add_sink; /* the chains' sum is stored, so the compiler keeps them */

/* Multiply-adds a second over every thread, from `turns` turns each. */
double multiply_add_rate(int64_t turns) {
  const int avx512 = intmm_isa(-1) == 1, lanes = avx512 ? 16 : 8;
  double sink = 0.0, start = omp_get_wtime(), threads = 0.0;
#pragma omp parallel reduction(+ : sink, threads)
  {
    sink += avx512 ? multiply_adds_avx512(turns) : multiply_adds_avx2(turns);
    threads += 1.0;
  }
  const double seconds = omp_get_wtime() - start;
  multiply_add_sink = sink;
  return threads * (double)(turns * PEAK_CHAINS * lanes) / seconds;
}

/* A decode step's block in one call: every row of one token through a pre-LN (GPT-2) block,
 *
 *   h = ln_1(x); mid = x + attn_proj(attend(c_attn(h))); out = mid + mlp_proj(gelu(c_fc(ln_2(mid))))
 *
 * (out = attn_out + mlp_out for a row whose overwrite flag is set: lab.model.Block's overwrite), with
 * the products, attention and argmax above. From Python the same block was some thirty calls into
 * torch and ctypes, each costing more than its work at one row: the step's fixed cost beside the
 * weights' bytes. Each intermediate is kept in the activations' dtype, rounded where torch's ops
 * round (every op's output, in bf16), so the block computes what lab.model.Block computes up to the
 * arithmetic inside a LayerNorm and a GELU; each row on its own, as every part here computes it
 * (batch invariance). */

enum { PRODUCT_F32, PRODUCT_BF16, PRODUCT_W4A8, PRODUCT_W8A8, PRODUCT_INT8, PRODUCT_INT4 };

/* One of a block's products as lab/intmm.py describes it: kind, K, N, the weights of f32_mm, bf16_mm,
 * w4a8_mm or int4_mm (packed, scales_zeros), w8a8_mm or int8_mm (values, scales), and the bias (NULL:
 * none). */
struct linear {
  int64_t kind, k, n;
  const void *weights, *scales, *bias;
};

struct block_weights {
  struct linear c_attn, attn_proj, c_fc, mlp_proj;
  const void *ln_1_weight, *ln_1_bias, *ln_2_weight, *ln_2_bias; /* [D] each; the biases may be NULL */
  double eps;
  int64_t n_head, head_dim;
};

static int linear_rows(const struct linear *l, const void *x, int64_t M, int bf16, void *y) {
  switch (l->kind) {
  case PRODUCT_F32:
    return f32_mm(x, M, l->k, bf16, l->weights, l->n, l->bias, y);
  case PRODUCT_BF16:
    return bf16_mm(x, M, l->k, bf16, l->weights, l->n, l->bias, y);
  case PRODUCT_W4A8:
    return w4a8_mm(x, M, l->k, bf16, l->weights, l->scales, l->n, l->bias, y);
  case PRODUCT_W8A8:
    return w8a8_mm(x, M, l->k, bf16, l->weights, l->scales, l->n, l->bias, y);
  case PRODUCT_INT8:
    return int8_mm(x, M, l->k, bf16, l->weights, l->scales, l->n, l->bias, y);
  case PRODUCT_INT4:
    return int4_mm(x, M, l->k, bf16, l->weights, l->scales, l->n, l->bias, y);
  }
  return -2;
}

/* y[i .. i + 7] = v, y float32 or (BF16) bf16 rounded as float_to_bf16 rounds: to nearest even, a NaN
 * to 0x7FC0. */
static inline __attribute__((always_inline)) void narrow_lanes(const int BF16, void *y, int64_t i, __m256 v) {
  if (!BF16) {
    _mm256_storeu_ps((float *)y + i, v);
    return;
  }
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i halves = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  halves = _mm256_blendv_epi8(halves, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  _mm_storeu_si128((__m128i *)((uint16_t *)y + i), packed);
}

/* y [n] = a + b, each sum rounded once (bf16), as torch adds. n a multiple of 8. */
static void add_lanes(const int BF16, const void *a, const void *b, int64_t n, void *y) {
  for (int64_t i = 0; i < n; i += 8)
    narrow_lanes(BF16, y, i, _mm256_add_ps(widen_lanes(BF16, a, i), widen_lanes(BF16, b, i)));
}

/* y [B, D] = LayerNorm(x [B, D]) * weight + bias, each row's mean and variance in float32, eight lanes
 * at a time in a fixed order. D a multiple of 8. */
static inline __attribute__((always_inline)) void layer_norm_rows(const int BF16, const void *x, int64_t B, int64_t D,
                                                                  const void *weight, const void *bias, float eps,
                                                                  void *y) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = b * D;
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) lanes = _mm256_add_ps(lanes, widen_lanes(BF16, x, row + d));
    const __m256 mean = _mm256_set1_ps(sum_lanes(lanes) / (float)D);
    lanes = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 centred = _mm256_sub_ps(widen_lanes(BF16, x, row + d), mean);
      lanes = _mm256_fmadd_ps(centred, centred, lanes);
    }
    const __m256 rstd = _mm256_set1_ps(1.f / sqrtf(sum_lanes(lanes) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(widen_lanes(BF16, x, row + d), mean), rstd),
                                          widen_lanes(BF16, weight, d));
      narrow_lanes(BF16, y, row + d, bias != NULL ? _mm256_add_ps(scaled, widen_lanes(BF16, bias, d)) : scaled);
    }
  }
}

/* tanh for 8 lanes: sign(u) (1 - e) / (1 + e), e = e^(-2 |u|) (exp_lanes takes arguments <= 0). */
static inline __m256 tanh_lanes(__m256 u) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  const __m256 e = exp_lanes(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, u), _mm256_set1_ps(-2.f)));
  const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(magnitude, _mm256_and_ps(u, sign_bit));
}

/* x [n] = GELU(x), the tanh approximation GPT-2 was trained with, in place. n a multiple of 8. */
static inline __attribute__((always_inline)) void gelu_lanes(const int BF16, void *x, int64_t n) {
  const __m256 kappa = _mm256_set1_ps(0.044715f), beta = _mm256_set1_ps(0.7978845608028654f);
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = widen_lanes(BF16, x, i);
    const __m256 inner = _mm256_mul_ps(beta, _mm256_fmadd_ps(_mm256_mul_ps(kappa, v), _mm256_mul_ps(v, v), v));
    narrow_lanes(BF16, x, i, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, tanh_lanes(inner))));
  }
}

/* The block's work between its products and attention, for x, its intermediates and out in float32 or
 * (BF16) bf16: a constant in each call, so the lanes' loads and stores need no branch. */
static inline __attribute__((always_inline)) int block_rows_of(const int BF16, const struct block_weights *w,
                                                               int64_t B, const void *x, void *const *k_caches,
                                                               void *const *v_caches, const int64_t *t_max,
                                                               const int64_t *pos, const uint8_t *overwrite,
                                                               void *out) {
  const int64_t D = w->n_head * w->head_dim;
  const size_t row = (size_t)(B * D) * (BF16 ? 2 : 4);
  char *h = malloc(row * 12); /* h, qkv (3), attended, attn_out, mid, hidden (4), mlp_out: [B, D] units */
  if (h == NULL) return -1;
  char *qkv = h + row, *attended = qkv + 3 * row, *attn_out = attended + row, *mid = attn_out + row;
  char *hidden = mid + row, *mlp_out = hidden + 4 * row;
  const float eps = (float)w->eps;
  layer_norm_rows(BF16, x, B, D, w->ln_1_weight, w->ln_1_bias, eps, h);
  int status = linear_rows(&w->c_attn, h, B, BF16, qkv);
  if (status == 0)
    status = attend_rows(B, w->n_head, w->head_dim, BF16, qkv, k_caches, v_caches, t_max, pos, attended);
  if (status == 0) status = linear_rows(&w->attn_proj, attended, B, BF16, attn_out);
  if (status == 0) {
    add_lanes(BF16, x, attn_out, B * D, mid);
    layer_norm_rows(BF16, mid, B, D, w->ln_2_weight, w->ln_2_bias, eps, h);
    status = linear_rows(&w->c_fc, h, B, BF16, hidden);
  }
  if (status == 0) {
    gelu_lanes(BF16, hidden, 4 * B * D);
    status = linear_rows(&w->mlp_proj, hidden, B, BF16, mlp_out);
  }
  if (status == 0)
    for (int64_t b = 0; b < B; ++b) {
      const size_t at = (size_t)(b * D) * (BF16 ? 2 : 4);
      const char *kept = overwrite != NULL && overwrite[b] ? attn_out : mid;
      add_lanes(BF16, kept + at, mlp_out + at, D, out + at);
    }
  free(h);
  return status;
}

/* out [B, D] from the stream x [B, D] of B rows of one token each through the block `w`: row b's
 * attention over its caches k_caches[b], v_caches[b] ([H, t_max[b], Dh]) at pos[b], as attend_rows
 * (rows of one prompt share a cache at consecutive positions). overwrite [B] (or NULL): the rows whose
 * output is attn_out + mlp_out. bf16: x, out and the caches bf16, else float32. Returns 0, -1 when
 * there is no memory, -2 for a product of no known kind, -3 for a width D that is no multiple of 8. */
int block_rows(const struct block_weights *w, int64_t B, int bf16, const void *x, void *const *k_caches,
               void *const *v_caches, const int64_t *t_max, const int64_t *pos, const uint8_t *overwrite,
               void *out) {
  if ((w->n_head * w->head_dim) % 8) return -3;
  if (bf16) return block_rows_of(1, w, B, x, k_caches, v_caches, t_max, pos, overwrite, out);
  return block_rows_of(0, w, B, x, k_caches, v_caches, t_max, pos, overwrite, out);
}

/* Scratch for a block over some of a step's B rows (gathered_block): their streams in and out, their
 * caches, lengths, positions and flags. */
struct gather {
  char *in, *through;
  void **caches;
  int64_t *lengths, *positions;
  uint8_t *flags;
};

static int gather_alloc(struct gather *g, int64_t B, size_t row_bytes) {
  g->in = malloc(2 * (size_t)B * row_bytes);
  g->through = g->in == NULL ? NULL : g->in + (size_t)B * row_bytes;
  g->caches = malloc(sizeof(void *) * (size_t)(2 * B));
  g->lengths = malloc(sizeof(int64_t) * (size_t)(2 * B));
  g->positions = g->lengths == NULL ? NULL : g->lengths + B;
  g->flags = malloc((size_t)B);
  return g->in == NULL || g->caches == NULL || g->lengths == NULL || g->flags == NULL ? -1 : 0;
}

static void gather_free(struct gather *g) {
  free(g->in);
  free(g->caches);
  free(g->lengths);
  free(g->flags);
}

/* Block i of a step over the n rows `rows` of the B rows' streams `stream` [B, D], in place, as
 * block_rows of those rows alone computes them (caches, lengths and flags [count * B] as stack_rows
 * takes them, pos [B]). */
static int gathered_block(const struct block_weights *w, int64_t i, int64_t B, int bf16, const int64_t *rows,
                          int64_t n, void *stream, void *const *k_caches, void *const *v_caches, const int64_t *t_max,
                          const int64_t *pos, const uint8_t *overwrite, struct gather *g) {
  if (n == 0) return 0;
  if (n == B)
    return block_rows(w, B, bf16, stream, k_caches + i * B, v_caches + i * B, t_max + i * B, pos,
                      overwrite == NULL ? NULL : overwrite + i * B, stream);
  const size_t row_bytes = (size_t)(w->n_head * w->head_dim) * (bf16 ? 2 : 4);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t b = rows[j], at = i * B + b;
    memcpy(g->in + (size_t)j * row_bytes, (const char *)stream + (size_t)b * row_bytes, row_bytes);
    g->caches[j] = k_caches[at], g->caches[B + j] = v_caches[at];
    g->lengths[j] = t_max[at], g->positions[j] = pos[b];
    g->flags[j] = overwrite != NULL && overwrite[at];
  }
  int status = block_rows(w, n, bf16, g->in, g->caches, g->caches + B, g->lengths, g->positions, g->flags, g->through);
  for (int64_t j = 0; j < n && status == 0; ++j)
    memcpy((char *)stream + (size_t)rows[j] * row_bytes, g->through + (size_t)j * row_bytes, row_bytes);
  return status;
}

/* How an adaptive row decides to leave (lab.decode's adaptive exit): after each block from its
 * min_blocks-th on (never after its last), the final norm's output of its stream, `read`, scores
 * sigmoid(read . probe_weight[layer] + probe_bias[layer]) (the exit probe), or without a probe the
 * cosine between read and the read before that block; at threshold or above it leaves. ln_weight and
 * ln_bias (or NULL) in the activations' dtype [D]; the probe float32 [L, D] and [L]. */
struct exit_rule {
  const void *ln_weight, *ln_bias;
  double eps;
  const float *probe_weight, *probe_bias;
  double threshold;
  int64_t min_blocks;
};

/* read [D] float32 = the final norm of one row's stream, rounded to the activations' dtype first. */
static void exit_read(int bf16, const struct exit_rule *rule, const void *row, int64_t D, void *normed, float *read) {
  if (bf16) {
    layer_norm_rows(1, row, 1, D, rule->ln_weight, rule->ln_bias, (float)rule->eps, normed);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(read + d, widen_lanes(1, normed, d));
  } else {
    layer_norm_rows(0, row, 1, D, rule->ln_weight, rule->ln_bias, (float)rule->eps, read);
  }
}

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

/* What the rule's threshold applies to after `layer`: the probe's probability, or the cosine of read
 * and before as torch's cosine_similarity takes it (each divided by its norm, at least 1e-8, then
 * their products summed; with bf16 activations each of those rounded to bf16, as torch's ops round). */
static double exit_score(int bf16, const struct exit_rule *rule, int64_t layer, const float *read,
                         const float *before, int64_t D) {
  if (rule->probe_weight != NULL) {
    const float *w = rule->probe_weight + layer * D;
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) lanes = _mm256_fmadd_ps(_mm256_loadu_ps(read + d), _mm256_loadu_ps(w + d), lanes);
    return 1.f / (1.f + expf(-(sum_lanes(lanes) + rule->probe_bias[layer])));
  }
  if (bf16) { /* torch's ops each round to bf16: the norms, the quotients, their products, the sum */
    float now = 0.f, then = 0.f, both = 0.f;
    for (int64_t d = 0; d < D; ++d) now += read[d] * read[d], then += before[d] * before[d];
    const float now_norm = fmaxf(round_bf16(sqrtf(now)), 1e-8f), then_norm = fmaxf(round_bf16(sqrtf(then)), 1e-8f);
    for (int64_t d = 0; d < D; ++d)
      both += round_bf16(round_bf16(read[d] / now_norm) * round_bf16(before[d] / then_norm));
    return round_bf16(both);
  }
  __m256 now = _mm256_setzero_ps(), then = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 r = _mm256_loadu_ps(read + d), p = _mm256_loadu_ps(before + d);
    now = _mm256_fmadd_ps(r, r, now), then = _mm256_fmadd_ps(p, p, then);
  }
  const __m256 now_norm = _mm256_set1_ps(fmaxf(sqrtf(sum_lanes(now)), 1e-8f));
  const __m256 then_norm = _mm256_set1_ps(fmaxf(sqrtf(sum_lanes(then)), 1e-8f));
  __m256 both = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8)
    both = _mm256_fmadd_ps(_mm256_div_ps(_mm256_loadu_ps(read + d), now_norm),
                           _mm256_div_ps(_mm256_loadu_ps(before + d), then_norm), both);
  return sum_lanes(both);
}

/* Block w's keys and values for the n rows `rows` of stream [B, D] written at their positions without
 * running the block: c_attn(ln_1(stream)) of each, as the block's attention stores them (CALM's state
 * propagation for a row that left before it; lab.decode.propagate_kv). Caches as gathered_block's. */
static int propagate_rows(const struct block_weights *w, int64_t i, int64_t B, int bf16, const int64_t *rows,
                          int64_t n, const void *stream, void *const *k_caches, void *const *v_caches,
                          const int64_t *t_max, const int64_t *pos, struct gather *g) {
  if (n == 0) return 0;
  const int64_t D = w->n_head * w->head_dim, Dh = w->head_dim;
  const size_t width = bf16 ? 2 : 4, row_bytes = (size_t)D * width;
  char *qkv = malloc(3 * (size_t)n * row_bytes);
  if (qkv == NULL) return -1;
  for (int64_t j = 0; j < n; ++j)
    memcpy(g->through + (size_t)j * row_bytes, (const char *)stream + (size_t)rows[j] * row_bytes, row_bytes);
  layer_norm_rows(bf16, g->through, n, D, w->ln_1_weight, w->ln_1_bias, (float)w->eps, g->in);
  int status = linear_rows(&w->c_attn, g->in, n, bf16, qkv);
  for (int64_t j = 0; j < n && status == 0; ++j) {
    const int64_t at = i * B + rows[j];
    const char *row = qkv + 3 * (size_t)j * row_bytes;
    for (int64_t h = 0; h < w->n_head; ++h) {
      const size_t to = (size_t)((h * t_max[at] + pos[rows[j]]) * Dh) * width, head = (size_t)Dh * width;
      memcpy((char *)k_caches[at] + to, row + (size_t)(D + h * Dh) * width, head);
      memcpy((char *)v_caches[at] + to, row + (size_t)(2 * D + h * Dh) * width, head);
    }
  }
  free(qkv);
  return status;
}

/* A decode step's rows in one call: out [B, D] from the stream x [B, D] through `count` blocks, block i
 * (layer layers[i] of the model) on the rows b with runs[i * B + b] (the others' streams pass it
 * unchanged), over caches k_caches[i * B + b], v_caches[i * B + b] ([H, t_max[i * B + b], Dh]) at pos[b],
 * overwrite [count * B] (or NULL) per block and row, each block's rows as block_rows of them alone
 * computes them. rules [B] (or NULL: every row fixed): an adaptive row's exit_rule (NULL for a fixed
 * row): it leaves after a block once the rule says so, and each later block it would have run gets its
 * keys and values from its exit state (propagate_rows). ran [B] (or NULL): the blocks each row ran.
 * Returns as block_rows. */
int step_rows(const struct block_weights *const *blocks, int64_t count, int64_t B, int bf16, const void *x,
              void *const *k_caches, void *const *v_caches, const int64_t *t_max, const int64_t *pos,
              const uint8_t *overwrite, const uint8_t *runs, const int64_t *layers,
              const struct exit_rule *const *rules, int64_t *ran, void *out) {
  const int64_t D = blocks[0]->n_head * blocks[0]->head_dim;
  const size_t row_bytes = (size_t)D * (bf16 ? 2 : 4);
  memcpy(out, x, (size_t)B * row_bytes); /* rows that run no block leave as they came */
  struct gather g;
  int status = gather_alloc(&g, B, row_bytes);
  int64_t *numbers = malloc(sizeof(int64_t) * (size_t)(3 * B)); /* rows, blocks_ran, total: [B] each */
  uint8_t *going = malloc((size_t)B);
  float *reads = malloc(sizeof(float) * (size_t)((B + 2) * D)); /* before [B, D], read [D], normed [D] */
  if (numbers == NULL || going == NULL || reads == NULL) status = -1;
  int64_t *rows = numbers, *blocks_ran = numbers + B, *total = numbers + 2 * B;
  float *before = reads, *read = reads + B * D;
  void *normed = reads + (B + 1) * D;
  for (int64_t b = 0; b < B && status == 0; ++b) {
    blocks_ran[b] = total[b] = 0, going[b] = 1;
    for (int64_t i = 0; i < count; ++i) total[b] += runs[i * B + b];
  }
  for (int64_t i = 0; i < count && status == 0; ++i) {
    int64_t n = 0, left = 0; /* rows that run block i; rows that left before it and would have */
    for (int64_t b = 0; b < B; ++b)
      if (runs[i * B + b] && !going[b]) rows[B - 1 - left++] = b;
    status = propagate_rows(blocks[i], i, B, bf16, rows + B - left, left, out, k_caches, v_caches, t_max, pos, &g);
    for (int64_t b = 0; b < B; ++b) {
      if (!runs[i * B + b] || !going[b]) continue;
      rows[n++] = b;
      const struct exit_rule *rule = rules == NULL ? NULL : rules[b];
      /* the row's first cosine check comes after this block: the read it compares with, before it */
      const int64_t after = blocks_ran[b] + 1;
      const int checks = rule != NULL && rule->min_blocks <= after && after < total[b];
      if (checks && rule->probe_weight == NULL && after == (rule->min_blocks > 1 ? rule->min_blocks : 1))
        exit_read(bf16, rule, (const char *)out + (size_t)b * row_bytes, D, normed, before + b * D);
    }
    if (status == 0)
      status = gathered_block(blocks[i], i, B, bf16, rows, n, out, k_caches, v_caches, t_max, pos, overwrite, &g);
    for (int64_t j = 0; j < n && status == 0; ++j) {
      const int64_t b = rows[j], after = ++blocks_ran[b];
      const struct exit_rule *rule = rules == NULL ? NULL : rules[b];
      if (rule == NULL || after < rule->min_blocks || after >= total[b]) continue;
      exit_read(bf16, rule, (const char *)out + (size_t)b * row_bytes, D, normed, read);
      if (exit_score(bf16, rule, layers[i], read, before + b * D, D) >= rule->threshold)
        going[b] = 0;
      else
        memcpy(before + b * D, read, sizeof(float) * (size_t)D);
    }
  }
  if (ran != NULL && status == 0) memcpy(ran, blocks_ran, sizeof(int64_t) * (size_t)B);
  gather_free(&g);
  free(numbers);
  free(going);
  free(reads);
  return status;
}

/* out [B, D] from the stream x [B, D] through `count` blocks in turn, each as block_rows: blocks[i]
 * over its caches k_caches[i * B + b], v_caches[i * B + b] ([H, t_max[i * B + b], Dh]), every block at
 * the rows' positions pos [B]; overwrite [count * B] (or NULL) per block and row. One call for a run
 * of blocks (a draft's, a verification's): each block reads the stream before it writes its output,
 * so the blocks after the first run in place in out. Returns as block_rows. */
int stack_rows(const struct block_weights *const *blocks, int64_t count, int64_t B, int bf16, const void *x,
               void *const *k_caches, void *const *v_caches, const int64_t *t_max, const int64_t *pos,
               const uint8_t *overwrite, void *out) {
  int status = 0;
  for (int64_t i = 0; i < count && status == 0; ++i)
    status = block_rows(blocks[i], B, bf16, i == 0 ? x : out, k_caches + i * B, v_caches + i * B, t_max + i * B,
                        pos, overwrite == NULL ? NULL : overwrite + i * B, out);
  return status;
}

/* What a draft reads its token out through (lab.block_kernel.DraftKernel), float32: the token and
 * position tables, the tuned lens's translator of the last drafting block (NULL: the logit lens),
 * the final norm, and the draft vocabulary's rows of the token table with their biases. */
struct draft_head {
  const float *wte, *wpe;                    /* [V, D], [T, D] */
  const float *translator, *translator_bias; /* [D, D] laid out [out, in] as f32_mm reads it, [D] */
  const float *ln_weight, *ln_bias;          /* [D] each; ln_bias may be NULL */
  double eps;
  const float *table, *table_bias; /* [N, D], [N] */
  int64_t n, d;
};

/* One greedy draft step of one sequence in one call, float32: token at position pos embedded, through
 * the run of blocks (stack_rows, its caches as there for one row; stream: the stream leaving them
 * [D]), and, where logits is not NULL, translated (stream + stream W + bias, summed in that order as
 * the lens does), normed, and read out over the draft vocabulary into logits [N]. Returns the index
 * of the largest logit (the first of equals; 0 without logits), or a negative status as
 * block_rows's: -1 no memory. */
int64_t draft_row(const struct block_weights *const *blocks, int64_t count, const struct draft_head *head,
                  int64_t token, int64_t pos, void *const *k_caches, void *const *v_caches, const int64_t *t_max,
                  const uint8_t *overwrite, float *stream, float *logits) {
  const int64_t D = head->d;
  float *scratch = malloc(sizeof(float) * (size_t)(3 * D));
  if (scratch == NULL) return -1;
  float *x = scratch, *translated = scratch + D, *normed = scratch + 2 * D;
  for (int64_t i = 0; i < D; ++i) x[i] = head->wte[token * D + i] + head->wpe[pos * D + i];
  int status = stack_rows(blocks, count, 1, 0, x, k_caches, v_caches, t_max, &pos, overwrite, stream);
  if (logits == NULL) {
    free(scratch);
    return status;
  }
  const float *read = stream;
  if (status == 0 && head->translator != NULL) {
    status = f32_mm(stream, 1, D, 0, head->translator, D, NULL, translated);
    for (int64_t i = 0; i < D; ++i) translated[i] = (stream[i] + translated[i]) + head->translator_bias[i];
    read = translated;
  }
  if (status == 0) {
    layer_norm_rows(0, read, 1, D, head->ln_weight, head->ln_bias, (float)head->eps, normed);
    status = f32_mm(normed, 1, D, 0, head->table, head->n, head->table_bias, logits);
  }
  free(scratch);
  return status != 0 ? status : argmax(logits, head->n, 0);
}

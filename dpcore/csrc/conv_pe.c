/* Per-example weight gradients of a 2-D convolution (groups = 1, zero padding), and their
 * squared norms, for dpcore's book-keeping clipper (dpcore/bookkeeping/conv.py, dpcore/native.py).
 *
 *   W_i[o, c, p, q] = sum_{y, x} g_i[o, y, x] * a_i[c, y*sh - ph + p*dh, x*sw - pw + q*dw]
 *   sq_i            = sum over (o, c, p, q) of W_i[...]^2, accumulated in double
 *
 * a: [B, C, H, Wd] float32, contiguous (the layer's input, before padding)
 * g: [B, O, OH, OW] float32, contiguous (the gradient of the layer's output)
 * W: [B, O, C*KH*KW] float32 (written), sq: [B] double (written)
 *
 * Per example: the input is copied into a zero-padded buffer, unfolded into patches P [T, D]
 * (T = OH*OW positions, D = C*KH*KW), and for each output channel o the row
 * W_i[o, :] = sum over t with g[o, t] != 0 of g[o, t] * P[t, :] is accumulated in vector
 * registers. Filters 8 wide (dw = 1) skip the unfolding: each patch row of 8 is read straight
 * from the padded input (rows8), the same terms in the same order. After a ReLU and max
 * pooling most output gradients are exactly zero, and a zero term adds nothing
 * (0 * finite = 0): skipping it changes no value of the result.
 * When any input or output-gradient value of the example is not finite, no term is skipped,
 * so that 0 * inf = NaN reaches W exactly as in the dense reference (where W then has a
 * non-finite entry, so does sq, and the caller skips and counts the example, as the reference
 * path does; a non-finite input no filter window covers leaves W finite, as in the reference).
 *
 * The terms of each W element are added in the order of t (the reference's order is its own;
 * the caller's tests compare both within float32 rounding). Examples are split over
 * `nthreads` threads: OpenMP where built with -fopenmp, else POSIX threads. Returns 0, or 1 if a buffer could not be allocated (then the
 * caller uses its torch path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "threads.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The widest vector the build has registers for: 16 floats with AVX-512, else 8. (A 64-byte
 * vector type without AVX-512 is kept in memory, not split over two registers: ~15x slower.) */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vwf __attribute__((vector_size(4 * VW)));
typedef float v8f __attribute__((vector_size(32)));
typedef float vhf __attribute__((vector_size(2 * VW)));  /* VW / 2 floats */
typedef double vwd __attribute__((vector_size(4 * VW))); /* VW / 2 doubles: one register */

static inline vwf loadw(const float *p) { vwf v; memcpy(&v, p, sizeof v); return v; }
static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline vhf loadh(const float *p) { vhf v; memcpy(&v, p, sizeof v); return v; }

typedef struct {
  const float *a, *g;
  float *W;
  double *sq;
  int64_t C, H, Wd, O, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw;
  int64_t i0, i1;
  int status;
} job_t;

/* Unfold the padded input Ap [C, Hp, Wp] into P [T, D]. KW_CONST > 0: rows of KW_CONST
 * contiguous floats (dw == 1), a fixed-size copy the compiler inlines; 0: the general case. */
static inline __attribute__((always_inline)) void unfold(float *restrict P, const float *restrict Ap,
                                                         const job_t *j, int64_t Hp, int64_t Wp,
                                                         int64_t D, const int KW_CONST) {
  /* The shape in locals: P's stores cannot then be taken to change it, and the loops keep
   * their bounds and strides in registers. */
  const int64_t OH = j->OH, OW = j->OW, C = j->C, KH = j->KH, KW = j->KW;
  const int64_t sh = j->sh, sw = j->sw, dw = j->dw, row = j->dh * Wp, plane = Hp * Wp;
  for (int64_t y = 0; y < OH; y++)
    for (int64_t x = 0; x < OW; x++) {
      float *restrict p = P + (y * OW + x) * D;
      const float *base = Ap + y * sh * Wp + x * sw;
      for (int64_t c = 0; c < C; c++, base += plane) {
        const float *src = base;
        for (int64_t kh = 0; kh < KH; kh++, src += row) {
          if (KW_CONST) {
            memcpy(p, src, (size_t)KW_CONST * sizeof(float));
            p += KW_CONST;
          } else {
            for (int64_t k = 0; k < KW; k++) p[k] = src[k * dw];
            p += KW;
          }
        }
      }
    }
}

/* Indices t of the non-zero entries of row[0..T). */
static inline int64_t nonzeros(const float *row, int64_t T, int32_t *idx) {
  int64_t n = 0, t = 0;
#if defined(__AVX512F__)
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; t + 16 <= T; t += 16, at = _mm512_add_epi32(at, step)) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + t), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    /* Compressed in a register, then one full store of idx[n..n+16), inside idx[0..T) as
     * n <= t: a compress straight to memory is microcoded on some CPUs (AMD Zen 4). */
    _mm512_storeu_si512((void *)(idx + n), _mm512_maskz_compress_epi32(m, at));
    n += __builtin_popcount((unsigned)m);
  }
#endif
  for (; t < T; t++) { /* branch-free: the pattern of zeros is data, not predictable */
    idx[n] = (int32_t)t;
    n += row[t] != 0.0f;
  }
  return n;
}

/* The largest |x| of x[0..n) and m as bit patterns: x is finite iff its bits are below INF_BITS.
 * Integer max, so that it vectorises (isfinite() in a loop does not). */
#define INF_BITS 0x7f800000u
static inline uint32_t top_bits(const float *x, int64_t n, uint32_t m) {
  for (int64_t k = 0; k < n; k++) {
    uint32_t b;
    memcpy(&b, x + k, sizeof b);
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  return m;
}

/* Rows of 8 (KW = 8, dw = 1), read straight from the padded input: W[o, r, :] for NR rows
 * r = (c, kh) at once, in NR 8-float registers, summed over the non-zero t in order of t. The
 * values are those of the unfolded path (same terms, same order) without writing the
 * patches: a first layer's patches (e.g. 196 × 64 floats for MNIST's 8×8 filters) outgrow
 * the L1 cache. */
static inline __attribute__((always_inline)) void rows8(float *restrict w, const float *restrict Ap,
                                                        const float *restrict go, const int32_t *restrict idx,
                                                        int64_t n, const int64_t *restrict toff,
                                                        const int64_t *restrict roff, const int NR) {
  v8f acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < NR; r++) acc[r] = (v8f){0};
  for (int64_t k = 0; k < n; k++) {
    const int32_t t = idx[k];
    const v8f gv = (v8f){0} + go[t];
    const float *b = Ap + toff[t];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) acc[r] += gv * load8(b + roff[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; r++) memcpy(w + 8 * r, &acc[r], 32);
}

static void run(job_t *j) {
  const int64_t T = j->OH * j->OW, D = j->C * j->KH * j->KW;
  const int64_t Hp = j->H + 2 * j->ph, Wp = j->Wd + 2 * j->pw;
  const size_t ap_bytes = ((size_t)(j->C * Hp * Wp) * sizeof(float) + 63) / 64 * 64;
  const int direct = j->dw == 1 && j->KW == 8; /* rows of 8 read from Ap: no patches P */
  const size_t p_bytes = direct ? 64 : ((size_t)(T * D) * sizeof(float) + 63) / 64 * 64;
  float *Ap = aligned_alloc(64, ap_bytes);
  float *P = aligned_alloc(64, p_bytes);
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T > 0 ? T : 1));
  /* rows8's offsets into Ap of each position's patch (toff) and each patch row (c, kh) (roff). */
  const int64_t R = j->C * j->KH;
  int64_t *toff = malloc(sizeof(int64_t) * (size_t)(direct ? T + R : 1));
  if (!Ap || !P || !idx || !toff) {
    free(Ap); free(P); free(idx); free(toff);
    j->status = 1;
    return;
  }
  int64_t *roff = toff + T; /* (used only where direct) */
  for (int64_t y = 0; direct && y < j->OH; y++)
    for (int64_t x = 0; x < j->OW; x++) toff[y * j->OW + x] = y * j->sh * Wp + x * j->sw;
  for (int64_t c = 0; direct && c < j->C; c++)
    for (int64_t kh = 0; kh < j->KH; kh++) roff[c * j->KH + kh] = c * Hp * Wp + kh * j->dh * Wp;
  memset(Ap, 0, ap_bytes); /* the border stays zero; the interior is overwritten per example */
  for (int64_t i = j->i0; i < j->i1; i++) {
    const float *ai = j->a + i * j->C * j->H * j->Wd;
    const float *gi = j->g + i * j->O * T;
    float *Wi = j->W + i * j->O * D;
    for (int64_t c = 0; c < j->C; c++)
      for (int64_t r = 0; r < j->H; r++)
        memcpy(Ap + (c * Hp + r + j->ph) * Wp + j->pw, ai + (c * j->H + r) * j->Wd, sizeof(float) * (size_t)j->Wd);
    const int finite = top_bits(ai, j->C * j->H * j->Wd, top_bits(gi, j->O * T, 0)) < INF_BITS;
    if (!direct) switch (j->dw == 1 ? j->KW : 0) {
      case 1: unfold(P, Ap, j, Hp, Wp, D, 1); break;
      case 2: unfold(P, Ap, j, Hp, Wp, D, 2); break;
      case 3: unfold(P, Ap, j, Hp, Wp, D, 3); break;
      case 4: unfold(P, Ap, j, Hp, Wp, D, 4); break;
      case 5: unfold(P, Ap, j, Hp, Wp, D, 5); break;
      case 7: unfold(P, Ap, j, Hp, Wp, D, 7); break;
      case 8: unfold(P, Ap, j, Hp, Wp, D, 8); break;
      default: unfold(P, Ap, j, Hp, Wp, D, 0); break;
    }
    double sq = 0.0;
    for (int64_t o = 0; o < j->O; o++) {
      const float *go = gi + o * T;
      int64_t n;
      if (finite) {
        n = nonzeros(go, T, idx);
      } else {
        for (int64_t t = 0; t < T; t++) idx[t] = (int32_t)t;
        n = T;
      }
      float *w = Wi + o * D;
      int64_t d0 = direct ? D : 0; /* direct: rows of 8 below, else blocks of the patches P */
      for (int64_t r0 = 0; direct && r0 < R;) {
        const int64_t left = R - r0;
        float *wr = w + 8 * r0;
        const int64_t *ro = roff + r0;
        if (left >= 16) { rows8(wr, Ap, go, idx, n, toff, ro, 16); r0 += 16; }
        else if (left >= 8) { rows8(wr, Ap, go, idx, n, toff, ro, 8); r0 += 8; }
        else if (left >= 4) { rows8(wr, Ap, go, idx, n, toff, ro, 4); r0 += 4; }
        else if (left >= 2) { rows8(wr, Ap, go, idx, n, toff, ro, 2); r0 += 2; }
        else { rows8(wr, Ap, go, idx, n, toff, ro, 1); r0 += 1; }
      }
      for (; d0 + 64 <= D; d0 += 64) {
        vwf acc[64 / VW];
#pragma GCC unroll 8
        for (int v = 0; v < 64 / VW; v++) acc[v] = (vwf){0};
        for (int64_t k = 0; k < n; k++) {
          const vwf gv = (vwf){0} + go[idx[k]];
          const float *p = P + (int64_t)idx[k] * D + d0;
#pragma GCC unroll 8
          for (int v = 0; v < 64 / VW; v++) acc[v] += gv * loadw(p + VW * v);
        }
        memcpy(w + d0, acc, sizeof acc);
      }
      for (; d0 + VW <= D; d0 += VW) {
        vwf acc = {0};
        for (int64_t k = 0; k < n; k++) acc += ((vwf){0} + go[idx[k]]) * loadw(P + (int64_t)idx[k] * D + d0);
        memcpy(w + d0, &acc, sizeof acc);
      }
      for (; d0 < D; d0++) {
        float s = 0.0f;
        for (int64_t k = 0; k < n; k++) s += go[idx[k]] * P[(int64_t)idx[k] * D + d0];
        w[d0] = s;
      }
      /* Squares of float32 values are exact in double; double accumulation. */
      vwd q0 = {0}, q1 = {0};
      int64_t d = 0;
      for (; d + VW <= D; d += VW) {
        vwd x0 = __builtin_convertvector(loadh(w + d), vwd), x1 = __builtin_convertvector(loadh(w + d + VW / 2), vwd);
        q0 += x0 * x0;
        q1 += x1 * x1;
      }
      for (int k = 0; k < VW / 2; k++) sq += q0[k] + q1[k];
      for (; d < D; d++) sq += (double)w[d] * (double)w[d];
    }
    j->sq[i] = sq;
  }
  free(Ap);
  free(P);
  free(idx);
  free(toff);
}

static void run_job(void *p) { run((job_t *)p); }

int dp_conv2d_per_example(const float *a, const float *g, float *W, double *sq, int64_t B, int64_t C,
                          int64_t H, int64_t Wd, int64_t O, int64_t OH, int64_t OW, int64_t KH, int64_t KW,
                          int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                          int64_t nthreads) {
  if (B <= 0) return 0;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > B) nthreads = B;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  job_t jobs[MAX_THREADS];
  for (int64_t k = 0; k < nthreads; k++) {
    job_t jk = {a, g, W, sq, C, H, Wd, O, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw,
                B * k / nthreads, B * (k + 1) / nthreads, 0};
    jobs[k] = jk;
  }
  dp_run_jobs(run_job, jobs, sizeof(job_t), nthreads);
  int status = 0;
  for (int64_t k = 0; k < nthreads; k++) status |= jobs[k].status;
  return status;
}

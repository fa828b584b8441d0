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
 * registers. After a ReLU and max pooling most output gradients are exactly zero, and a zero
 * term adds nothing (0 * finite = 0): skipping it changes no value of the result.
 * When any input or output-gradient value of the example is not finite, no term is skipped,
 * so that 0 * inf = NaN reaches W exactly as in the dense reference (the example is then
 * skipped and counted by the caller, as the reference path does).
 *
 * The terms of each W element are added in the order of t (the reference's order is its own;
 * the caller's tests compare both within float32 rounding). Examples are split over
 * `nthreads` threads: OpenMP where built with -fopenmp, else POSIX threads. Returns 0, or 1 if a buffer could not be allocated (then the
 * caller uses its torch path).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

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
  for (int64_t y = 0; y < j->OH; y++)
    for (int64_t x = 0; x < j->OW; x++) {
      float *p = P + (y * j->OW + x) * D;
      const float *base = Ap + y * j->sh * Wp + x * j->sw;
      for (int64_t c = 0; c < j->C; c++)
        for (int64_t kh = 0; kh < j->KH; kh++) {
          const float *src = base + (c * Hp + kh * j->dh) * Wp;
          if (KW_CONST) {
            memcpy(p, src, (size_t)KW_CONST * sizeof(float));
            p += KW_CONST;
          } else {
            for (int64_t k = 0; k < j->KW; k++) p[k] = src[k * j->dw];
            p += j->KW;
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
    _mm512_mask_compressstoreu_epi32(idx + n, m, at);
    n += __builtin_popcount((unsigned)m);
  }
#endif
  for (; t < T; t++) { /* branch-free: the pattern of zeros is data, not predictable */
    idx[n] = (int32_t)t;
    n += row[t] != 0.0f;
  }
  return n;
}

static void run(job_t *j) {
  const int64_t T = j->OH * j->OW, D = j->C * j->KH * j->KW;
  const int64_t Hp = j->H + 2 * j->ph, Wp = j->Wd + 2 * j->pw;
  const size_t ap_bytes = ((size_t)(j->C * Hp * Wp) * sizeof(float) + 63) / 64 * 64;
  const size_t p_bytes = ((size_t)(T * D) * sizeof(float) + 63) / 64 * 64;
  float *Ap = aligned_alloc(64, ap_bytes);
  float *P = aligned_alloc(64, p_bytes);
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T > 0 ? T : 1));
  if (!Ap || !P || !idx) {
    free(Ap); free(P); free(idx);
    j->status = 1;
    return;
  }
  memset(Ap, 0, ap_bytes); /* the border stays zero; the interior is overwritten per example */
  for (int64_t i = j->i0; i < j->i1; i++) {
    const float *ai = j->a + i * j->C * j->H * j->Wd;
    const float *gi = j->g + i * j->O * T;
    float *Wi = j->W + i * j->O * D;
    int finite = 1;
    for (int64_t c = 0; c < j->C; c++)
      for (int64_t r = 0; r < j->H; r++) {
        const float *src = ai + (c * j->H + r) * j->Wd;
        float *dst = Ap + (c * Hp + r + j->ph) * Wp + j->pw;
        for (int64_t s = 0; s < j->Wd; s++) {
          dst[s] = src[s];
          finite &= isfinite(src[s]) != 0;
        }
      }
    for (int64_t k = 0; k < j->O * T; k++) finite &= isfinite(gi[k]) != 0;
    switch (j->dw == 1 ? j->KW : 0) {
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
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) {
        v16f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int64_t k = 0; k < n; k++) {
          const v16f gv = (v16f){0} + go[idx[k]];
          const float *p = P + (int64_t)idx[k] * D + d0;
          s0 += gv * load16(p);
          s1 += gv * load16(p + 16);
          s2 += gv * load16(p + 32);
          s3 += gv * load16(p + 48);
        }
        memcpy(w + d0, &s0, 64);
        memcpy(w + d0 + 16, &s1, 64);
        memcpy(w + d0 + 32, &s2, 64);
        memcpy(w + d0 + 48, &s3, 64);
      }
      for (; d0 + 16 <= D; d0 += 16) {
        v16f s0 = {0};
        for (int64_t k = 0; k < n; k++) s0 += ((v16f){0} + go[idx[k]]) * load16(P + (int64_t)idx[k] * D + d0);
        memcpy(w + d0, &s0, 64);
      }
      for (; d0 < D; d0++) {
        float s = 0.0f;
        for (int64_t k = 0; k < n; k++) s += go[idx[k]] * P[(int64_t)idx[k] * D + d0];
        w[d0] = s;
      }
      /* Squares of float32 values are exact in double; double accumulation. */
      v8d q0 = {0}, q1 = {0};
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        v8d x0 = __builtin_convertvector(load8(w + d), v8d), x1 = __builtin_convertvector(load8(w + d + 8), v8d);
        q0 += x0 * x0;
        q1 += x1 * x1;
      }
      for (int k = 0; k < 8; k++) sq += q0[k] + q1[k];
      for (; d < D; d++) sq += (double)w[d] * (double)w[d];
    }
    j->sq[i] = sq;
  }
  free(Ap);
  free(P);
  free(idx);
}

#ifndef _OPENMP
static void *run_thread(void *p) {
  run((job_t *)p);
  return NULL;
}
#endif

#define MAX_THREADS 256

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
  int status = 0;
#ifdef _OPENMP
  /* Built with -fopenmp, this library binds to the OpenMP runtime that torch has already
   * loaded (the same soname), so its threads are torch's own: no second pool competes with
   * torch's spinning workers for the cores. */
#pragma omp parallel for num_threads((int)nthreads) schedule(static, 1) reduction(| : status)
  for (int64_t k = 0; k < nthreads; k++) {
    run(&jobs[k]);
    status |= jobs[k].status;
  }
#else
  pthread_t threads[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int64_t k = 1; k < nthreads; k++)
    started[k] = pthread_create(&threads[k], NULL, run_thread, &jobs[k]) == 0;
  run(&jobs[0]);
  status = jobs[0].status;
  for (int64_t k = 1; k < nthreads; k++) {
    if (started[k])
      pthread_join(threads[k], NULL);
    else
      run(&jobs[k]); /* could not start a thread: do its share here */
    status |= jobs[k].status;
  }
#endif
  return status;
}

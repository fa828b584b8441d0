/* The clipped sum of a batch's per-example gradients, accumulated in double, for dpcore's
 * clipping (dpcore/clipping.py, dpcore/native.py).
 *
 *   out[j] = sum over i = 0 .. B-1, in that order, of f[i] * (double)X[i, j]
 *
 * X: [B, n] float32, rows contiguous (a per-example gradient per row)
 * f: [B] double (each example's clip factor), out: [n] double (written)
 *
 * Why double: an example's share f[i]·X[i] has norm at most C, but the rounding of a float32 sum
 * over the examples depends on all of them, so that taking one example out of a lot moves the
 * released sum by more than C (docs/benchmarks/float_sensitivity.py). In double, that rounding
 * is at most (B - 1)·2^-53 of the sum of the shares' magnitudes, far inside the clipping margin.
 * torch can only do this on a double copy of X (8 bytes written and read again per element);
 * here X is read once.
 *
 * Each term is multiplied and added in that order; the compiler may fuse the two into one
 * multiply-add (-march=native: FMA), which rounds once instead of twice, so the bits can differ
 * from torch's float64 product by a unit in the last place (the bound only tightens).
 *
 * A row with f[i] == 0 (an example with a non-finite gradient) is skipped: it adds exactly
 * nothing, never 0·NaN. Columns are split over `nthreads` threads in blocks; each column's sum
 * runs over the rows in order, so the result does not depend on the thread count. Returns 0.
 */
#include <stdint.h>
#include <string.h>

#include "threads.h"

#define BLOCK 512 /* columns per block: 4 KiB of double accumulators, in L1 */

/* A thread's share: X, f (as v), out, B (as a), n (as b) and its columns [lo, hi). */
static void wsum_run(const dp_span_t *s) {
  const float *X = s->X;
  const double *f = s->v;
  const int64_t B = s->a, n = s->b;
  double acc[BLOCK];
  for (int64_t j0 = s->lo; j0 < s->hi; j0 += BLOCK) {
    const int64_t m = s->hi - j0 < BLOCK ? s->hi - j0 : BLOCK;
    for (int64_t j = 0; j < m; j++) acc[j] = 0.0;
    int64_t i = 0;
    while (i < B) {
      /* Up to 4 rows with non-zero factors at a time, added into each accumulator in row
       * order: one load and store of the accumulators per 4 rows. */
      const float *x[4];
      double fs[4];
      int k = 0;
      for (; i < B && k < 4; i++)
        if (f[i] != 0.0) {
          fs[k] = f[i];
          x[k++] = X + i * n + j0;
        }
      if (k == 4) {
        const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];
        const double f0 = fs[0], f1 = fs[1], f2 = fs[2], f3 = fs[3];
        for (int64_t j = 0; j < m; j++) {
          double s = acc[j];
          s += f0 * (double)x0[j];
          s += f1 * (double)x1[j];
          s += f2 * (double)x2[j];
          s += f3 * (double)x3[j];
          acc[j] = s;
        }
      } else {
        for (int r = 0; r < k; r++) {
          const float *restrict xr = x[r];
          const double fr = fs[r];
          for (int64_t j = 0; j < m; j++) acc[j] += fr * (double)xr[j];
        }
      }
    }
    memcpy(s->out + j0, acc, (size_t)m * sizeof(double));
  }
}

static void wsum_job(void *p) { wsum_run((const dp_span_t *)p); }

int dp_weighted_sum(const float *X, const double *f, double *out, int64_t B, int64_t n, int64_t nthreads) {
  if (n <= 0) return 0;
  /* Whole blocks per thread, at least one. */
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  nthreads = dp_threads_for(nthreads, blocks);
  dp_span_t jobs[MAX_THREADS];
  for (int64_t k = 0; k < nthreads; k++) {
    int64_t b0 = blocks * k / nthreads, b1 = blocks * (k + 1) / nthreads;
    dp_span_t jk = {X, f, out, B, n, b0 * BLOCK, b1 * BLOCK < n ? b1 * BLOCK : n};
    jobs[k] = jk;
  }
  dp_run_jobs(wsum_job, jobs, sizeof(dp_span_t), nthreads);
  return 0;
}

/* Three sums over each row of a batch's per-example gradients, in double, for the weight-
 * standardised convolution's norms (dpcore/bookkeeping/wsconv.py, dpcore/native.py).
 *
 *   out[r, 0] = sum_k X[r, k]^2,  out[r, 1] = sum_k X[r, k],  out[r, 2] = sum_k w[r % rows_w, k] * X[r, k]
 *
 * X: [R, n] float32, rows contiguous (R = examples x filters: row r is filter r % rows_w of an
 * example); w: [rows_w, n] double (each filter's standardised weights); out: [R, 3] double.
 *
 * Every term is formed in double: the square of a float32 is exact there (48 bits), the product
 * with w rounds once, and each sum of n terms is within (n - 1)·2^-53 of the sum of its terms'
 * magnitudes in any order (the compiler may reorder and vectorise the sums; the bound does not
 * depend on the order). The caller's allowance for the cancellation in ‖v‖² − (1ᵀv)²/n − ...
 * takes that bound. X is read once; torch needs a pass for the squares and a double copy of X
 * (or float32 products, whose rounding bound is 2^29 times larger) for the other two.
 *
 * A non-finite entry makes its row's sums non-finite (the example is then skipped or measured
 * again by the caller). Rows are split over `nthreads` threads; each row's sums are the same
 * whatever the thread count. Returns 0.
 */
#include <stdint.h>

#include "threads.h"

/* A thread's share: X, w (as v), out, n (as a), rows_w (as b) and its rows [lo, hi). */
static void rowstats_run(const dp_span_t *s) {
  const int64_t n = s->a, rows_w = s->b;
  for (int64_t r = s->lo; r < s->hi; r++) {
    const float *restrict x = s->X + r * n;
    const double *restrict w = s->v + (r % rows_w) * n;
    double s2 = 0.0, s1 = 0.0, sw = 0.0;
#pragma omp simd reduction(+ : s2, s1, sw)
    for (int64_t k = 0; k < n; k++) {
      const double v = (double)x[k];
      s2 += v * v;
      s1 += v;
      sw += w[k] * v;
    }
    s->out[3 * r] = s2;
    s->out[3 * r + 1] = s1;
    s->out[3 * r + 2] = sw;
  }
}

static void rowstats_job(void *p) { rowstats_run((const dp_span_t *)p); }

int dp_row_stats(const float *X, const double *w, double *out, int64_t R, int64_t n, int64_t rows_w, int64_t nthreads) {
  if (R <= 0) return 0;
  if (n <= 0 || rows_w <= 0) return 1;
  nthreads = dp_threads_for(nthreads, R);
  dp_span_t jobs[MAX_THREADS];
  for (int64_t k = 0; k < nthreads; k++) {
    dp_span_t jk = {X, w, out, n, rows_w, R * k / nthreads, R * (k + 1) / nthreads};
    jobs[k] = jk;
  }
  dp_run_jobs(rowstats_job, jobs, sizeof(dp_span_t), nthreads);
  return 0;
}

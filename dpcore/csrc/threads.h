/* Running n jobs on n threads, for the kernels of dpcore/csrc (included by each .c file).
 *
 * Built with -fopenmp, a library binds to the OpenMP runtime that torch has already loaded (the
 * same soname), so its threads are torch's own: no second pool competes with torch's spinning
 * workers for the cores. Without OpenMP, POSIX threads; a thread that cannot be started has its
 * job run on the calling thread. */
#ifndef DP_THREADS_H
#define DP_THREADS_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 256

typedef void (*dp_job_fn)(void *);

/* One thread's share of a kernel over float32 rows X with a double vector v, written to out:
 * the span [lo, hi) of columns or rows, and the two sizes a kernel names (rows, width...). */
typedef struct {
  const float *X;
  const double *v;
  double *out;
  int64_t a, b, lo, hi;
} dp_span_t;

/* At most `units` threads (each gets work), at most MAX_THREADS, at least one. */
static int64_t dp_threads_for(int64_t nthreads, int64_t units) {
  if (nthreads > units) nthreads = units;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  return nthreads < 1 ? 1 : nthreads;
}

#ifndef _OPENMP
typedef struct {
  dp_job_fn fn;
  void *job;
} dp_thread_arg;

static void *dp_thread_main(void *p) {
  dp_thread_arg *t = (dp_thread_arg *)p;
  t->fn(t->job);
  return NULL;
}
#endif

/* fn(jobs + k * size) for k in [0, n), n <= MAX_THREADS, each on its own thread; returns when
 * all are done. */
static void dp_run_jobs(dp_job_fn fn, void *jobs, size_t size, int64_t n) {
  char *base = (char *)jobs;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)n) schedule(static, 1)
  for (int64_t k = 0; k < n; k++) fn(base + k * size);
#else
  pthread_t threads[MAX_THREADS];
  dp_thread_arg args[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int64_t k = 1; k < n; k++) {
    args[k].fn = fn;
    args[k].job = base + k * size;
    started[k] = pthread_create(&threads[k], NULL, dp_thread_main, &args[k]) == 0;
  }
  fn(base);
  for (int64_t k = 1; k < n; k++) {
    if (started[k])
      pthread_join(threads[k], NULL);
    else
      fn(base + k * size);
  }
#endif
}
#endif

/*
 * Few-row matrix products for MLX's CPU backend on Linux.
 *
 * Decoding multiplies a few activation rows by every weight matrix of the LLM: one row per
 * token of an autoregressive step, one per node of a ReDrafter tree, one per sequence of a
 * batch. That product only has to
 * stream the weights once, so it should cost about the same for 1 row or 8. The BLAS libraries
 * MLX can use here do not behave that way (measured on a 2-core AMD EPYC, Qwen2.5-0.5B float32,
 * one forward of n tokens relative to n = 1: MKL 1.13x at n = 2 but 2.2x at n = 3; OpenBLAS
 * 1.5x at n = 3 and 1.75x at n = 8), so this library interposes ``cblas_sgemm``: loaded with
 * global symbol scope before the BLAS, it takes the row-major products with at most
 * ``max_rows`` rows in A and passes every other call to the BLAS loaded after it.
 *
 * The kernel reads each weight row once for all activation rows (a dot-product form, 4 weight
 * rows x 2 activation rows per block in 8-wide vectors), splits the output columns over a small
 * thread pool, and computes every output element with the same sequence of operations whatever
 * the number of rows: row i of a product is bit-identical to the product of row i alone. So the
 * LLM's logits at a tree node equal those of the same token decoded alone (up to attention).
 *
 * Nothing here runs until redrafter_gemm_init() is called (redrafter_mlx/_blas.py does), so
 * loading the library alone changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

#if defined(__x86_64__)
#define KERNEL __attribute__((target("avx2,fma")))
#else
#define KERNEL
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

static int enabled = 0;
static int max_rows = 32; /* set by redrafter_gemm_init */
static long parallel_work = 1L << 16; /* N * K from which the columns are split over threads */
static atomic_long handled = 0;

/* ---- the BLAS everything else goes to: the next cblas_sgemm in load order ---------------- */

static sgemm_fn blas_sgemm = NULL;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
                 float, float *, int);

#define MAX_OBJECTS 1024

typedef struct {
    int n;
    char *names[MAX_OBJECTS];
} objects_t;

static int collect_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    objects_t *o = data;
    if (info->dlpi_name && info->dlpi_name[0] && o->n < MAX_OBJECTS)
        o->names[o->n++] = strdup(info->dlpi_name);
    return 0;
}

/* dlsym(RTLD_NEXT) does not look past a dlopen()ed caller's own dependencies, so walk the
 * loaded objects in load order and take the first cblas_sgemm that is not this one. */
static void resolve_blas(void) {
    objects_t o = {0};
    dl_iterate_phdr(collect_object, &o);
    for (int i = 0; i < o.n; i++) {
        void *handle = blas_sgemm ? NULL : dlopen(o.names[i], RTLD_LAZY | RTLD_NOLOAD);
        if (handle) {
            void *fn = dlsym(handle, "cblas_sgemm");
            if (fn && fn != (void *)&cblas_sgemm) blas_sgemm = (sgemm_fn)fn;
            dlclose(handle);
        }
        free(o.names[i]);
    }
}

/* ---- kernels: C[m, j0:j1] = alpha * (A @ op(B))[m, j0:j1] + beta * C ----------------------- */

typedef struct {
    int nt; /* 1: op(B) = B^T, B is [N, K]; 0: op(B) = B, B is [K, N] */
    int M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
} job_t;

KERNEL static inline v8 load8(const float *p) { return *(const v8u *)p; }

KERNEL static inline float hsum8(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

KERNEL static inline void store(const job_t *g, int m, int j, float s) {
    float *c = g->C + (size_t)m * g->ldc + j;
    *c = g->beta == 0.0f ? g->alpha * s : g->alpha * s + g->beta * *c;
}

/* One output element of the NT product; every path below computes exactly this. */
KERNEL static inline float dot_tail(float s, const float *a, const float *b, int k0, int K) {
    for (int k = k0; k < K; k++) s += a[k] * b[k];
    return s;
}

/* Row m of C at columns j..j+3 from the vector accumulators of a against weight rows b[0..3]. */
KERNEL static inline void store4(const job_t *g, int m, int j, const float *a, const v8 c[4],
                                 const float *const b[4]) {
    const int K = g->K, K8 = K & ~7;
    for (int q = 0; q < 4; q++) store(g, m, j + q, dot_tail(hsum8(c[q]), a, b[q], K8, K));
}

KERNEL static void nt_columns(const job_t *g, int j0, int j1) {
    const int K = g->K, K8 = K & ~7, M = g->M;
    int j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *b0 = g->B + (size_t)j * g->ldb, *b1 = b0 + g->ldb, *b2 = b1 + g->ldb,
                    *b3 = b2 + g->ldb;
        const float *const b[4] = {b0, b1, b2, b3};
        int m = 0;
        for (; m + 2 <= M; m += 2) {
            const float *a0 = g->A + (size_t)m * g->lda, *a1 = a0 + g->lda;
            v8 c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0};
            v8 c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
            for (int k = 0; k < K8; k += 8) {
                v8 w0 = load8(b0 + k), w1 = load8(b1 + k), w2 = load8(b2 + k), w3 = load8(b3 + k);
                v8 x0 = load8(a0 + k), x1 = load8(a1 + k);
                c00 += x0 * w0, c01 += x0 * w1, c02 += x0 * w2, c03 += x0 * w3;
                c10 += x1 * w0, c11 += x1 * w1, c12 += x1 * w2, c13 += x1 * w3;
            }
            store4(g, m, j, a0, (const v8[4]){c00, c01, c02, c03}, b);
            store4(g, m + 1, j, a1, (const v8[4]){c10, c11, c12, c13}, b);
        }
        if (m < M) {
            const float *a0 = g->A + (size_t)m * g->lda;
            v8 c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0};
            for (int k = 0; k < K8; k += 8) {
                v8 x0 = load8(a0 + k);
                c00 += x0 * load8(b0 + k), c01 += x0 * load8(b1 + k);
                c02 += x0 * load8(b2 + k), c03 += x0 * load8(b3 + k);
            }
            store4(g, m, j, a0, (const v8[4]){c00, c01, c02, c03}, b);
        }
    }
    for (; j < j1; j++) {
        const float *b0 = g->B + (size_t)j * g->ldb;
        for (int m = 0; m < M; m++) {
            const float *a0 = g->A + (size_t)m * g->lda;
            v8 c00 = {0};
            for (int k = 0; k < K8; k += 8) c00 += load8(a0 + k) * load8(b0 + k);
            store(g, m, j, dot_tail(hsum8(c00), a0, b0, K8, K));
        }
    }
}

/* NN: C[m, j] = sum_k A[m, k] * B[k, j], k in order, 8 columns per vector. */
KERNEL static void nn_columns(const job_t *g, int j0, int j1) {
    const int K = g->K, M = g->M;
    for (int m = 0; m < M; m++) {
        const float *a = g->A + (size_t)m * g->lda;
        int j = j0;
        for (; j + 8 <= j1; j += 8) {
            v8 c = {0};
            const float *b = g->B + j;
            for (int k = 0; k < K; k++) c += a[k] * load8(b + (size_t)k * g->ldb);
            for (int q = 0; q < 8; q++) store(g, m, j + q, c[q]);
        }
        for (; j < j1; j++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += a[k] * g->B[(size_t)k * g->ldb + j];
            store(g, m, j, s);
        }
    }
}

static void run_columns(const job_t *g, int j0, int j1) {
    if (j0 >= j1) return;
    if (g->nt)
        nt_columns(g, j0, j1);
    else
        nn_columns(g, j0, j1);
}

/* ---- a small persistent pool: part p of P takes the p-th slice of the columns ------------- */

#define MAX_THREADS 64
#define SPIN_NS 100000 /* a worker spins this long for the next product before it sleeps */

static int nthreads = 0; /* 0: not started */
static int want_threads = 0;
static job_t job;
static atomic_int generation = 0, pending = 0;
static atomic_flag busy = ATOMIC_FLAG_INIT;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_part(int part, int parts) {
    const int align = 8, N = job.N;
    int per = ((N + parts - 1) / parts + align - 1) / align * align;
    int j0 = part * per, j1 = j0 + per < N ? j0 + per : N;
    run_columns(&job, j0, j1);
}

static void *worker(void *arg) {
    const int part = (int)(long)arg;
    int seen = 0; /* the pool starts before the first job is published (generation 0) */
    for (;;) {
        int g = atomic_load_explicit(&generation, memory_order_acquire);
        if (g == seen) {
            long until = now_ns() + SPIN_NS;
            for (int i = 0; (g = atomic_load_explicit(&generation, memory_order_acquire)) == seen;
                 i++) {
                cpu_relax();
                if ((i & 255) == 255 && now_ns() > until) {
                    pthread_mutex_lock(&mu);
                    while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&cv, &mu);
                    pthread_mutex_unlock(&mu);
                    break;
                }
            }
        }
        seen = g;
        run_part(part, nthreads);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void start_pool(void) {
    int n = want_threads;
    if (n <= 0) {
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
        if (n > 8) n = 8; /* weight streaming saturates memory well before that */
    }
    if (n > MAX_THREADS) n = MAX_THREADS;
    int started = 1;
    for (int i = 1; i < n; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker, (void *)(long)i) == 0) started++;
        pthread_attr_destroy(&attr);
        if (started != i + 1) break;
    }
    nthreads = started;
}

/* After fork() only the calling thread exists: start a new pool on first use. */
static void reset_after_fork(void) {
    nthreads = 0;
    atomic_store(&generation, 0);
    atomic_store(&pending, 0);
    atomic_flag_clear(&busy);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

static void run(const job_t *g) {
    long work = (long)g->N * g->K;
    /* Small products, or a second caller while the pool works: compute in this thread. */
    if (work < parallel_work || atomic_flag_test_and_set(&busy)) {
        run_columns(g, 0, g->N);
        return;
    }
    if (nthreads == 0) start_pool();
    job = *g;
    if (nthreads > 1) {
        atomic_store(&pending, nthreads - 1);
        pthread_mutex_lock(&mu);
        atomic_fetch_add_explicit(&generation, 1, memory_order_release);
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    run_part(0, nthreads);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) cpu_relax();
    atomic_flag_clear(&busy);
}

/* ---- the interposed entry point and the control API ------------------------------------- */

void cblas_sgemm(int layout, int ta, int tb, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (enabled && layout == ROW_MAJOR && ta == NO_TRANS && (tb == TRANS || tb == NO_TRANS) &&
        M >= 1 && M <= max_rows && N >= 1 && K >= 1) {
        job_t g = {tb == TRANS, M, N, K, lda, ldb, ldc, alpha, beta, A, B, C};
        run(&g);
        atomic_fetch_add_explicit(&handled, 1, memory_order_relaxed);
        return;
    }
    pthread_once(&blas_once, resolve_blas);
    if (!blas_sgemm) { /* cannot happen beside MLX (libmlx needs a BLAS); never return garbage */
        fputs("redrafter-mlx: no BLAS cblas_sgemm was loaded after the few-row kernel\n", stderr);
        abort();
    }
    blas_sgemm(layout, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* Turn the kernel on: products with 1..rows rows in A (0 turns it off); threads 0 = one per
 * core, at most 8. Returns 1 when on, 0 where it does not run: x86-64 without AVX2 and FMA,
 * and other architectures (not measured yet). */
int redrafter_gemm_init(int rows, int threads) {
    static int atfork = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
#else
    (void)rows, (void)threads;
    return 0; /* only measured and tested on x86-64 so far */
#endif
    if (!atfork) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork = 1;
    }
    max_rows = rows;
    want_threads = threads;
    enabled = rows > 0;
    return enabled;
}

/* Products computed here so far (tests check the interposition is live). */
long redrafter_gemm_handled(void) { return atomic_load(&handled); }

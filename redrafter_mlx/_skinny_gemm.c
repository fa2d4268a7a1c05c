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
 * global symbol scope before the BLAS, it takes the row-major products x W^T with at most
 * ``max_rows`` rows in x and dot products of at least MIN_DOT (the layers' weight products) and
 * passes every other call to the BLAS loaded after it. Attention's products (dot products over
 * a head dimension of 64, and probabilities times values, which are not W^T) stay with the
 * BLAS: their operands sit in cache, so there is no weight stream to save, and the BLAS is
 * faster on them (1.5-2x on the scores, 3-6x on probabilities times values, 2-core AMD EPYC).
 *
 * The kernel reads each weight row once for all activation rows (a dot-product form in 8-wide
 * vectors: one weight row at a time for up to 4 short activation rows, and on Zen 1 for up to 4
 * rows of any length, blocks of 4 weight rows otherwise), splits the output columns over a small thread pool, and computes every output
 * element with the same sequence of operations whatever the number of rows: row i of a product
 * is bit-identical to the product of row i alone. So the LLM's logits at a tree node equal those
 * of the same token decoded alone (up to attention).
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
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MIN_DOT = 128 }; /* shortest dot product (K) the kernel takes; a head dimension is less */

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
static atomic_long serial = 0; /* products passed to MKL on one thread */

/* ---- the BLAS everything else goes to: the next cblas_sgemm in load order ---------------- */

static sgemm_fn blas_sgemm = NULL;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

/* MKL's thread-local thread count (absent from OpenBLAS). MKL parallelises even the tiny
 * products of decoding's attention (a few rows by a head dimension of 64), and its OpenMP
 * workers then spin between calls (for KMP_BLOCKTIME, 200 ms by default), so on a small machine
 * they take cores from this kernel's pool: a 3-token forward of Qwen2.5-0.5B took 123 ms with
 * MKL on 2 threads and 101 ms on 1 (2-core AMD EPYC, one process, alternating blocks). Products
 * below SERIAL_WORK multiply-adds therefore run on one MKL thread; OpenBLAS already keeps small
 * products on one thread. */
typedef int (*set_threads_fn)(int);
static set_threads_fn mkl_threads_local = NULL;
enum { SERIAL_WORK = 1 << 22 };

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
    mkl_threads_local = (set_threads_fn)dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local");
}

/* ---- kernels: C[m, j0:j1] = alpha * (A @ op(B))[m, j0:j1] + beta * C ----------------------- */

typedef struct job job_t;
struct job { /* C = alpha * A B^T + beta * C; A is [M, K], B is [N, K] */
    int M, N, K, lda, ldb, ldc;
    float alpha, beta;
    const float *A, *B;
    float *C;
    void (*columns)(const job_t *, int, int); /* computes C[:, j0:j1]; NULL: nt_columns */
    const signed char *Q; /* the greedy head's screen: int8 weights [N, K], */
    const float *S;       /* one scale per weight row [N], */
    const short *X;       /* int16 activations [M, K] */
    const float *XS;      /* and one scale per activation row [M] */
};

KERNEL static inline v8 load8(const float *p) { return *(const v8u *)p; }

/* Floats ahead of the current one at which each weight stream is prefetched, one cache line per
 * 16 floats, without temporal locality (every weight is read once per forward);
 * REDRAFTER_GEMM_PREFETCH sets it (redrafter_mlx/_blas.py), 0 turns it off. On the 2-core Zen 1
 * EPYC (no AVX-512) the hardware prefetcher alone left the cores' arithmetic unhidden behind the
 * weight stream: each activation row added its multiply-adds' time to the stream's. With 512
 * floats (2 KB) a forward of Qwen2.5-0.5B plus its LM head took 16% less at n = 1 and 17.5% less
 * at n = 3 (python bench/prefetch.py: 15 of 15 rounds each; 256-2048 floats all gave 7-20%).
 * Only timings depend on it: a prefetch never faults, so it may point past the weights. */
static long prefetch_floats = 512;

KERNEL static inline void prefetch(const float *p, int k) {
    if (prefetch_floats) __builtin_prefetch(p + prefetch_floats + k, 0, 0);
}

KERNEL static inline float hsum8(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

KERNEL static inline void store(const job_t *g, int m, int j, float s) {
    float *c = g->C + (size_t)m * g->ldc + j;
    *c = g->beta == 0.0f ? g->alpha * s : g->alpha * s + g->beta * *c;
}

/*
 * One output element, C[m, j] = a . b over K, is computed the same way on every path below:
 * two vector accumulators take the alternate 8-float blocks of the first K & ~15 (c the even
 * blocks, d the odd ones: two dependency chains, so one row alone is not bound by the FMA
 * latency), c takes one more block when K & 8, then hsum8(c + d), then the last K % 8 terms in
 * order. The paths differ only in how many rows and columns share their loads.
 */
KERNEL static inline float finish(v8 c, v8 d, const float *a, const float *b, int K) {
    const int K16 = K & ~15, K8 = K & ~7;
    if (K8 > K16) c += load8(a + K16) * load8(b + K16);
    float s = hsum8(c + d);
    for (int k = K8; k < K; k++) s += a[k] * b[k];
    return s;
}

/* Rows m..m+G-1 (G <= 4) of C at column j: one pass over weight row j, which streams from memory
 * once for all G rows. One stream per thread (not one per column of a block) is what keeps the
 * memory bandwidth up: 4 interleaved row streams read ~20% slower on the AMD machine. */
KERNEL static inline __attribute__((always_inline)) void rows_at_column(const job_t *g, int m,
                                                                       int G, int j) {
    const int K = g->K, K16 = K & ~15;
    const float *b = g->B + (size_t)j * g->ldb, *a = g->A + (size_t)m * g->lda;
    v8 c[4], d[4];
    for (int r = 0; r < G; r++) c[r] = d[r] = (v8){0};
    for (int k = 0; k < K16; k += 16) {
        prefetch(b, k);
        v8 w0 = load8(b + k), w1 = load8(b + k + 8);
        for (int r = 0; r < G; r++) {
            c[r] += load8(a + (size_t)r * g->lda + k) * w0;
            d[r] += load8(a + (size_t)r * g->lda + k + 8) * w1;
        }
    }
    for (int r = 0; r < G; r++) {
        const float *x = a + (size_t)r * g->lda;
        store(g, m + r, j, finish(c[r], d[r], x, b, K));
    }
}

/* Row m of C at columns j..j+3: four weight rows share each activation load. With more than
 * four rows this wins: the first row streams the block from memory, the others find it in L1. */
KERNEL static void row_at_4_columns(const job_t *g, int m, int j) {
    const int K = g->K, K16 = K & ~15;
    const float *a = g->A + (size_t)m * g->lda, *b0 = g->B + (size_t)j * g->ldb;
    const float *b1 = b0 + g->ldb, *b2 = b1 + g->ldb, *b3 = b2 + g->ldb;
    v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
    for (int k = 0; k < K16; k += 16) {
        prefetch(b0, k), prefetch(b1, k), prefetch(b2, k), prefetch(b3, k);
        v8 x = load8(a + k), y = load8(a + k + 8);
        c0 += x * load8(b0 + k), c1 += x * load8(b1 + k);
        c2 += x * load8(b2 + k), c3 += x * load8(b3 + k);
        d0 += y * load8(b0 + k + 8), d1 += y * load8(b1 + k + 8);
        d2 += y * load8(b2 + k + 8), d3 += y * load8(b3 + k + 8);
    }
    store(g, m, j, finish(c0, d0, a, b0, K));
    store(g, m, j + 1, finish(c1, d1, a, b1, K));
    store(g, m, j + 2, finish(c2, d2, a, b2, K));
    store(g, m, j + 3, finish(c3, d3, a, b3, K));
}

/* Activation floats (M x K) up to which one weight row at a time serves all rows: they must stay
 * in L1 while the weight rows stream past. Beyond it (more rows, or a long K such as an MLP's
 * down projection) blocks of 4 weight rows are faster (measured on an AVX-512 Intel machine:
 * one row at a time for Qwen2.5-0.5B's down projections at 3 rows took 32.2 ms against 20.5).
 *
 * Except on Zen 1 (AMD family 17h before Zen 2), whose loads are 16 bytes wide: L2 feeds L1 as
 * fast as the load ports drain it, so 2-4 activation rows may come from L2 while 4-row blocks
 * would read every weight again from L2 for each row. One weight row at a time there streamed
 * the down projection (896 x 4864, 24 copies) at 20.1 against 15.6 GB/s with 3 rows, 16.0
 * against 12.8 with 4, and Gemma 3 270M's (640 x 2048) at 19.4 against 14.9 with 3 (2-core EPYC
 * 7001, 15 alternating rounds). Blocking K so the activations fit in L1 recovered only part of
 * it (18.2-18.8 GB/s at 3 rows). */
enum { ROW_STREAM_FLOATS = 4096 };
static int rows_from_l2 = 0; /* set by redrafter_gemm_init on Zen 1 */

/* fn(g, m, G, j) over the rows of column j in groups of at most G = 4, G a constant in each
 * call: each group size compiles to its own unrolled loop. */
#define EACH_ROW_GROUP(fn, g, j)                                                                   \
    for (int m_ = 0; m_ < (g)->M; m_ += 4) switch ((g)->M - m_) {                                \
        case 1: fn(g, m_, 1, j); break;                                                            \
        case 2: fn(g, m_, 2, j); break;                                                            \
        case 3: fn(g, m_, 3, j); break;                                                            \
        default: fn(g, m_, 4, j); break;                                                           \
        }

KERNEL static void nt_columns(const job_t *g, int j0, int j1) {
    const int M = g->M;
    int j = j0;
    if (M > 4 || (M * g->K > ROW_STREAM_FLOATS && !(rows_from_l2 && M > 1)))
        for (; j + 4 <= j1; j += 4)
            for (int m = 0; m < M; m++) row_at_4_columns(g, m, j);
    for (; j < j1; j++) EACH_ROW_GROUP(rows_at_column, g, j);
}

/*
 * The greedy head's screen: C[m, j] = (X[m] . Q[j]) * S[j] * XS[m], int8 weights Q (one scale S
 * per row) times int16 activations X (one scale XS per row), the dot products summed exactly in
 * int32 (|X| * 127 * K < 2^31, which the caller ensures). redrafter_mlx/greedy_head.py bounds
 * how far this can be from the float32 product and recomputes exactly (redrafter_head_exact)
 * only the columns that could hold the argmax: the 151936 x 896 LM head of Qwen2.5-0.5B then
 * streams 136 MB instead of 545 MB. Where AVX-512 VNNI exists one instruction does 32
 * multiply-adds, so a few rows cost what one does; the AVX2 path gives the same integers.
 */
#if defined(__x86_64__)
#define VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))
static int has_vnni = 0;

VNNI static inline __attribute__((always_inline)) void screen_rows_vnni(const job_t *g, int m,
                                                                       int G, int j) {
    const int K = g->K, K32 = K & ~31;
    const signed char *q = g->Q + (size_t)j * g->ldb;
    const short *x = g->X + (size_t)m * g->lda;
    __m512i c[4];
    for (int r = 0; r < G; r++) c[r] = _mm512_setzero_si512();
    for (int k = 0; k < K32; k += 32) {
        __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + k)));
        for (int r = 0; r < G; r++)
            c[r] = _mm512_dpwssd_epi32(c[r], w, _mm512_loadu_si512(x + (size_t)r * g->lda + k));
    }
    for (int r = 0; r < G; r++) {
        const short *xr = x + (size_t)r * g->lda;
        int sum = _mm512_reduce_add_epi32(c[r]);
        for (int k = K32; k < K; k++) sum += xr[k] * q[k];
        g->C[(size_t)(m + r) * g->ldc + j] = (float)sum * g->S[j] * g->XS[m + r];
    }
}

VNNI static void screen_columns_vnni(const job_t *g, int j0, int j1) {
    for (int j = j0; j < j1; j++) EACH_ROW_GROUP(screen_rows_vnni, g, j);
}

KERNEL static inline __attribute__((always_inline)) void screen_rows(const job_t *g, int m, int G,
                                                                    int j) {
    const int K = g->K, K16 = K & ~15;
    const signed char *q = g->Q + (size_t)j * g->ldb;
    const short *x = g->X + (size_t)m * g->lda;
    __m256i c[4];
    for (int r = 0; r < G; r++) c[r] = _mm256_setzero_si256();
    for (int k = 0; k < K16; k += 16) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + k)));
        for (int r = 0; r < G; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(x + (size_t)r * g->lda + k));
            c[r] = _mm256_add_epi32(c[r], _mm256_madd_epi16(w, a));
        }
    }
    for (int r = 0; r < G; r++) {
        const short *xr = x + (size_t)r * g->lda;
        int lanes[8], sum = 0;
        _mm256_storeu_si256((__m256i *)lanes, c[r]);
        for (int i = 0; i < 8; i++) sum += lanes[i];
        for (int k = K16; k < K; k++) sum += xr[k] * q[k];
        g->C[(size_t)(m + r) * g->ldc + j] = (float)sum * g->S[j] * g->XS[m + r];
    }
}

KERNEL static void screen_columns(const job_t *g, int j0, int j1) {
    if (has_vnni) {
        screen_columns_vnni(g, j0, j1);
        return;
    }
    for (int j = j0; j < j1; j++) EACH_ROW_GROUP(screen_rows, g, j);
}
#else
static void screen_columns(const job_t *g, int j0, int j1) {
    for (int j = j0; j < j1; j++)
        for (int m = 0; m < g->M; m++) {
            const signed char *q = g->Q + (size_t)j * g->ldb;
            const short *x = g->X + (size_t)m * g->lda;
            int sum = 0;
            for (int k = 0; k < g->K; k++) sum += x[k] * q[k];
            g->C[(size_t)m * g->ldc + j] = (float)sum * g->S[j] * g->XS[m];
        }
}
#endif

static void run_columns(const job_t *g, int j0, int j1) {
    if (j0 < j1) (g->columns ? g->columns : nt_columns)(g, j0, j1);
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
    if (enabled && layout == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && M >= 1 &&
        M <= max_rows && N >= 1 && K >= MIN_DOT) {
        job_t g = {M, N, K, lda, ldb, ldc, alpha, beta, A, B, C}; /* the rest NULL: nt_columns */
        run(&g);
        atomic_fetch_add_explicit(&handled, 1, memory_order_relaxed);
        return;
    }
    pthread_once(&blas_once, resolve_blas);
    if (!blas_sgemm) { /* cannot happen beside MLX (libmlx needs a BLAS); never return garbage */
        fputs("redrafter-mlx: no BLAS cblas_sgemm was loaded after the few-row kernel\n", stderr);
        abort();
    }
    if (mkl_threads_local && (double)M * N * K < SERIAL_WORK) {
        int previous = mkl_threads_local(1); /* this thread only; 0 restores the global count */
        blas_sgemm(layout, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        mkl_threads_local(previous);
        atomic_fetch_add_explicit(&serial, 1, memory_order_relaxed);
        return;
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
    has_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
               !getenv("REDRAFTER_NO_VNNI");
    rows_from_l2 = __builtin_cpu_is("znver1");
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

/*
 * silu(g) * u, the MLP activation of Llama-style models, with the very operations MLX's CPU
 * backend uses (mlx/backend/cpu/simd/math.h exp, unary_ops.h Sigmoid, run one float at a time
 * there): bit-identical to mlx-lm's compiled swiglu, 8 floats at a time. No contraction: MLX's
 * JIT compiles for baseline x86-64, where 1 + a * b stays two roundings.
 */
#if defined(__x86_64__)
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) static inline __m256
mlx_exp8(__m256 x0) {
    __m256 x = _mm256_mul_ps(x0, _mm256_set1_ps(1.442695f));
    /* floor(x + 0.5) as MLX computes it (in double, so exactly): floor(x) + (frac(x) >= 0.5) */
    __m256 fl = _mm256_floor_ps(x);
    __m256 ipart = _mm256_add_ps(
        fl, _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(x, fl), _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                          _mm256_set1_ps(1.0f)));
    __m256 fpart = _mm256_sub_ps(x, ipart);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
    r = _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
    __m256 over = _mm256_cmp_ps(x0, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
    __m256 under = _mm256_cmp_ps(x0, _mm256_set1_ps(-88.0f), _CMP_LT_OQ);
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), over);
    r = _mm256_blendv_ps(r, _mm256_setzero_ps(), under);
    return r;
}

__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) static inline __m256
mlx_swiglu8(__m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
    __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, mlx_exp8(a)));
    __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 s = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, negative); /* sigmoid(g) */
    return _mm256_mul_ps(_mm256_mul_ps(g, s), u);
}

/* out[i] = silu(g[i]) * u[i] for i < n (out may be g or u). Returns 0 where it does not run. */
__attribute__((target("avx2,fma"))) int redrafter_swiglu(long n, const float *g, const float *u,
                                                         float *out) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    long i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, mlx_swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) { /* the tail through one padded vector */
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        memcpy(gt, g + i, (n - i) * sizeof(float));
        memcpy(ut, u + i, (n - i) * sizeof(float));
        _mm256_storeu_ps(ot, mlx_swiglu8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(out + i, ot, (n - i) * sizeof(float));
    }
    return 1;
}
#else
int redrafter_swiglu(long n, const float *g, const float *u, float *out) {
    (void)n, (void)g, (void)u, (void)out;
    return 0;
}
#endif

/*
 * The nucleus screen's pass over one row (redrafter_mlx/nucleus_screen.py): s [V] are the int8
 * screen's logits and eps [V] their bounds. With best = max(s - eps) (float32, as NumPy takes
 * it), cols gets the columns whose upper bound s + eps reaches best + offset, ascending (their
 * count is returned; at most max_cols are written), and over the other columns out [4] =
 * [best, sum exp(s + eps - best), sum exp(s - eps - best), max(s + eps) (-inf if none)], the
 * sums in float64 of terms each within 1e-5 of its exp (tests/test_nucleus_screen.py; 0 below
 * e^-88). One pass in place of NumPy's eight over 152k floats (~2 ms a row on the Zen 1).
 */
static long screen_tail_from(long j, long V, const float *s, const float *eps, float best,
                             float cut, int *cols, long max_cols, long count, double *out) {
    for (; j < V; j++) {
        float u = s[j] + eps[j], l = s[j] - eps[j];
        if (u >= cut) {
            if (count < max_cols) cols[count] = (int)j;
            count++;
            continue;
        }
        out[1] += exp((double)(u - best));
        out[2] += exp((double)(l - best));
        if (u > out[3]) out[3] = u;
    }
    return count;
}

#if defined(__x86_64__)
KERNEL static long screen_tail_avx2(long V, const float *s, const float *eps, float offset,
                                    int *cols, long max_cols, double *out) {
    long j = 0, count = 0;
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= V; j += 8)
        m8 = _mm256_max_ps(m8, _mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(eps + j)));
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    for (; j < V; j++) best = s[j] - eps[j] > best ? s[j] - eps[j] : best;
    const float cut = best + offset;
    const __m256 cut8 = _mm256_set1_ps(cut), best8 = _mm256_set1_ps(best);
    const __m256 none = _mm256_set1_ps(-INFINITY);
    __m256d hi0 = _mm256_setzero_pd(), hi1 = hi0, lo0 = hi0, lo1 = hi0;
    __m256 rest = none;
    for (j = 0; j + 8 <= V; j += 8) {
        __m256 a = _mm256_loadu_ps(s + j), b = _mm256_loadu_ps(eps + j);
        __m256 u = _mm256_add_ps(a, b), l = _mm256_sub_ps(a, b);
        __m256 reach = _mm256_cmp_ps(u, cut8, _CMP_GE_OQ);
        for (int bits = _mm256_movemask_ps(reach); bits; bits &= bits - 1, count++)
            if (count < max_cols) cols[count] = (int)j + __builtin_ctz(bits);
        __m256 eu = _mm256_andnot_ps(reach, mlx_exp8(_mm256_sub_ps(u, best8)));
        __m256 el = _mm256_andnot_ps(reach, mlx_exp8(_mm256_sub_ps(l, best8)));
        hi0 = _mm256_add_pd(hi0, _mm256_cvtps_pd(_mm256_castps256_ps128(eu)));
        hi1 = _mm256_add_pd(hi1, _mm256_cvtps_pd(_mm256_extractf128_ps(eu, 1)));
        lo0 = _mm256_add_pd(lo0, _mm256_cvtps_pd(_mm256_castps256_ps128(el)));
        lo1 = _mm256_add_pd(lo1, _mm256_cvtps_pd(_mm256_extractf128_ps(el, 1)));
        rest = _mm256_max_ps(rest, _mm256_blendv_ps(u, none, reach));
    }
    double h[4], g[4];
    _mm256_storeu_pd(h, _mm256_add_pd(hi0, hi1));
    _mm256_storeu_pd(g, _mm256_add_pd(lo0, lo1));
    _mm256_storeu_ps(lanes, rest);
    out[0] = best, out[1] = (h[0] + h[1]) + (h[2] + h[3]), out[2] = (g[0] + g[1]) + (g[2] + g[3]);
    out[3] = -INFINITY;
    for (int i = 0; i < 8; i++) out[3] = lanes[i] > out[3] ? lanes[i] : out[3];
    return screen_tail_from(j, V, s, eps, best, cut, cols, max_cols, count, out);
}
#endif

long redrafter_screen_tail(long V, const float *s, const float *eps, float offset, int *cols,
                           long max_cols, double *out) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return screen_tail_avx2(V, s, eps, offset, cols, max_cols, out);
#endif
    float best = -INFINITY;
    for (long j = 0; j < V; j++) best = s[j] - eps[j] > best ? s[j] - eps[j] : best;
    out[0] = best, out[1] = out[2] = 0.0, out[3] = -INFINITY;
    return screen_tail_from(0, V, s, eps, best, best + offset, cols, max_cols, 0, out);
}

/* Changes whenever the kernel's arithmetic or speed does: stored tunes (step costs) name it.
 * 5: our forwards take their MLP activation from redrafter_swiglu (cheaper trees).
 * 6: each weight stream is prefetched (faster at every row count, most at 2-3 rows).
 * 7: on Zen 1, 2-4 rows with a long K take one weight row at a time (see rows_from_l2). */
int redrafter_gemm_version(void) { return 7; }

/* The prefetch distance in floats: sets it when floats >= 0 (0: off), returns the one in force. */
long redrafter_gemm_prefetch(long floats) {
    if (floats >= 0) prefetch_floats = floats > (1L << 20) ? (1L << 20) : floats;
    return prefetch_floats;
}

/* Whether 2-4 rows with a long K take one weight row at a time (the Zen 1 choice, set by
 * redrafter_gemm_init): sets it when on >= 0, returns the one in force. Only timings depend on
 * it; tests run both paths on any machine. */
int redrafter_gemm_rows_from_l2(int on) {
    if (on >= 0) rows_from_l2 = on > 0;
    return rows_from_l2;
}

/* Products computed here so far (tests check the interposition is live). */
long redrafter_gemm_handled(void) { return atomic_load(&handled); }

/* Small products passed to MKL on one of its threads so far (0 under OpenBLAS). */
long redrafter_gemm_serial(void) { return atomic_load(&serial); }

/* Whether cblas_sgemm computes x W^T for x of M rows and W of N x K here (not in the BLAS):
 * redrafter_head_exact reproduces this kernel's products only. */
int redrafter_gemm_takes(int M, int N, int K) {
    return enabled && M >= 1 && M <= max_rows && N >= 1 && K >= MIN_DOT;
}

/* The greedy head's screen (see screen_columns): C [M, N] = (X [M, K] . Q [N, K]^T) * S [N] *
 * XS [M], on the pool's threads. */
void redrafter_head_screen(int M, int N, int K, const short *X, const float *XS,
                           const signed char *Q, const float *S, float *C) {
    job_t g = {.M = M, .N = N, .K = K, .lda = K, .ldb = K, .ldc = N, .alpha = 1.0f, .C = C,
               .columns = screen_columns, .Q = Q, .S = S, .X = X, .XS = XS};
    run(&g);
}

/* The screen's weights: per row of W [N, K], scale S = max|w| / 127 (1 for a zero row), Q =
 * round(w / S) as int8, and in float64 the norms ||w - S Q|| (exact residuals), ||S Q|| and
 * ||w|| (norms [N, 3]). Returns 0, or 1 at the first non-finite weight. */
int redrafter_head_quantize(int N, int K, const float *W, signed char *Q, float *S,
                            double *norms) {
    for (int j = 0; j < N; j++) {
        const float *w = W + (size_t)j * K;
        signed char *q = Q + (size_t)j * K;
        float amax = 0.0f;
        for (int k = 0; k < K; k++) {
            if (!isfinite(w[k])) return 1;
            amax = fmaxf(amax, fabsf(w[k]));
        }
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        double e2 = 0.0, q2 = 0.0, w2 = 0.0;
        for (int k = 0; k < K; k++) {
            float r = rintf(w[k] / s);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[k] = (signed char)r;
            double sq = (double)s * r, e = (double)w[k] - sq; /* both exact in float64 */
            e2 += e * e, q2 += sq * sq, w2 += (double)w[k] * w[k];
        }
        S[j] = s;
        norms[3 * j] = sqrt(e2), norms[3 * j + 1] = sqrt(q2), norms[3 * j + 2] = sqrt(w2);
    }
    return 0;
}

/* C [M, n] = A [M, K] . B[cols]^T: the columns cols[0..n-1] of A B^T, each element computed by
 * the same operations as cblas_sgemm here, so bit-identical to the full product's. */
void redrafter_head_exact(int M, int K, const float *A, const float *B, const int *cols, int n,
                          float *C) {
    for (int i = 0; i < n; i++) {
        job_t g = {.M = M, .N = 1, .K = K, .lda = K, .ldb = K, .ldc = n, .alpha = 1.0f,
                   .A = A, .B = B + (size_t)cols[i] * K, .C = C + i};
        nt_columns(&g, 0, 1);
    }
}

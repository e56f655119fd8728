/* cblas_sgemm for libmlx and mlxvlm's kernels: every float32 product of the process.
 *
 * mlxvlm/_backend.py compiles this file with the system C compiler once (cached), loads
 * it with RTLD_GLOBAL before OpenBLAS and libmlx so that libmlx's cblas_sgemm resolves
 * here, and passes OpenBLAS's own functions and a thread count to mlxvlm_blas_init.
 *
 * 1. One-row and one-column products go to sgemv. MLX's CPU backend computes every
 *    float32 matmul with cblas_sgemm, including the one-row products of decoding
 *    (x @ W.T with x of shape 1 x K). OpenBLAS 0.3.21 (Debian 12) streams the weights of
 *    such an sgemm at ~7 GB/s on a 2-core x86-64 machine, and of the same product as
 *    sgemv at ~20 GB/s (0.44 GB of weights: 66 ms against 23 ms). Newer OpenBLAS builds
 *    forward these cases themselves (GEMM_GEMV_FORWARD); this does it for the one the
 *    system has.
 * 2. The products run on mlxvlm's threads, OpenBLAS on one thread inside each. With
 *    OpenBLAS's own threads, its idle workers spin in sched_yield for ~0.1 s after every
 *    product, and between products the CPU kernels (attention, norms, activations) run on
 *    mlxvlm's threads: on 2 cores, three runnable threads. Measured over a SmolVLM first
 *    token: during the attention, a third of the CPU time went to that spin. Here a
 *    product is split in row or column blocks over threads that sleep on a condition
 *    variable between jobs, so nothing spins. (Telling OpenBLAS to sleep sooner,
 *    OPENBLAS_THREAD_TIMEOUT, cost more than it saved on a contended host: each product
 *    then woke a sleeping vCPU, and the thread count stays OpenBLAS's either way.)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <unistd.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn real_sgemm = NULL;
static sgemv_fn real_sgemv = NULL;
static long forwarded = 0, split = 0;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

/* Below these sizes a product stays on the calling thread: a wake-up costs ~10-50 us. */
#define MIN_SPLIT_FLOPS (1L << 22) /* 2 m n k */
#define MIN_SPLIT_GEMV (1L << 17)  /* matrix elements */
#define MIN_PART 16                /* rows or columns per thread */

/* ---- the threads ---------------------------------------------------------------- */

typedef void (*part_fn)(const void *job, int part, int parts);

static struct {
    int threads; /* 1: every product on the calling thread */
    pid_t owner; /* the process whose workers exist (a forked child starts its own) */
    pthread_mutex_t busy, lock;
    pthread_cond_t wake, done;
    unsigned long generation;
    int pending, parts;
    part_fn fn;
    const void *job;
} pool = {1, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
          PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, NULL};

static void *worker(void *arg) {
    int index = (int)(size_t)arg;
    unsigned long seen = 0; /* start_workers reset the count before creating us */
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        part_fn fn = pool.fn;
        const void *job = pool.job;
        int parts = pool.parts;
        pthread_mutex_unlock(&pool.lock);
        fn(job, index, parts);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Workers 1..threads-1 for this process; 0 when they cannot be started. */
static int start_workers(void) {
    if (pool.owner == getpid()) return 1;
    pthread_mutex_init(&pool.lock, NULL); /* a child inherits the parent's state */
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.generation = 0;
    for (int i = 1; i < pool.threads; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)(size_t)i) != 0) {
            pool.threads = i; /* the ones started still serve */
            break;
        }
        pthread_detach(thread);
    }
    pool.owner = getpid();
    return pool.threads > 1;
}

/* fn(job, part, parts) for every part; on the calling thread alone when the threads
 * are busy with another caller's product (another MLX stream) or do not exist. */
static void run_parts(part_fn fn, const void *job) {
    if (pool.threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(job, 0, 1);
        return;
    }
    if (!start_workers()) {
        pthread_mutex_unlock(&pool.busy);
        fn(job, 0, 1);
        return;
    }
    int parts = pool.threads;
    pthread_mutex_lock(&pool.lock);
    pool.fn = fn;
    pool.job = job;
    pool.pending = parts - 1;
    pool.parts = parts;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(job, 0, parts);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    split++;
    pthread_mutex_unlock(&pool.busy);
}

/* [*start, *stop) of n for `part` of `parts`, in multiples of MIN_PART but the last. */
static void part_range(int n, int part, int parts, int *start, int *stop) {
    int blocks = (n + MIN_PART - 1) / MIN_PART;
    *start = (int)((long)blocks * part / parts) * MIN_PART;
    *stop = part + 1 == parts ? n : (int)((long)blocks * (part + 1) / parts) * MIN_PART;
    if (*start > n) *start = n;
    if (*stop > n) *stop = n;
}

static int transposed(int op) { return op == TRANS || op == CONJ_TRANS; }

/* ---- sgemm, split over the rows of C (m) or its columns (n) ---------------------- */

typedef struct {
    int trans_a, trans_b, m, n, k, lda, ldb, ldc, by_rows;
    float alpha, beta;
    const float *a, *b;
    float *c;
} gemm_job;

static void gemm_part(const void *p, int part, int parts) {
    const gemm_job *g = p;
    int start, stop;
    if (g->by_rows) { /* A's rows start..stop: A stored m x k, or k x m when transposed */
        part_range(g->m, part, parts, &start, &stop);
        if (start < stop)
            real_sgemm(ROW_MAJOR, g->trans_a, g->trans_b, stop - start, g->n, g->k, g->alpha,
                       g->a + (transposed(g->trans_a) ? (size_t)start : (size_t)start * g->lda),
                       g->lda, g->b, g->ldb, g->beta, g->c + (size_t)start * g->ldc, g->ldc);
    } else { /* B's columns start..stop: B stored k x n, or n x k when transposed */
        part_range(g->n, part, parts, &start, &stop);
        if (start < stop)
            real_sgemm(ROW_MAJOR, g->trans_a, g->trans_b, g->m, stop - start, g->k, g->alpha,
                       g->a, g->lda,
                       g->b + (transposed(g->trans_b) ? (size_t)start * g->ldb : (size_t)start),
                       g->ldb, g->beta, g->c + start, g->ldc);
    }
}

/* ---- sgemv (row-major), split over the outputs ---------------------------------- */

typedef struct {
    int trans, rows, cols, lda, incx, incy;
    float alpha, beta;
    const float *a, *x;
    float *y;
} gemv_job;

static void gemv_part(const void *p, int part, int parts) {
    const gemv_job *g = p;
    int start, stop;
    if (transposed(g->trans)) { /* y (cols) = A^T x: A's columns start..stop */
        part_range(g->cols, part, parts, &start, &stop);
        if (start < stop)
            real_sgemv(ROW_MAJOR, g->trans, g->rows, stop - start, g->alpha, g->a + start,
                       g->lda, g->x, g->incx, g->beta, g->y + (size_t)start * g->incy, g->incy);
    } else { /* y (rows) = A x: A's rows start..stop */
        part_range(g->rows, part, parts, &start, &stop);
        if (start < stop)
            real_sgemv(ROW_MAJOR, g->trans, stop - start, g->cols, g->alpha,
                       g->a + (size_t)start * g->lda, g->lda, g->x, g->incx, g->beta,
                       g->y + (size_t)start * g->incy, g->incy);
    }
}

static void gemv(int trans, int rows, int cols, float alpha, const float *a, int lda,
                 const float *x, int incx, float beta, float *y, int incy) {
    gemv_job g = {trans, rows, cols, lda, incx, incy, alpha, beta, a, x, y};
    int outputs = transposed(trans) ? cols : rows;
    if ((long)rows * cols < MIN_SPLIT_GEMV || outputs < 2 * MIN_PART)
        gemv_part(&g, 0, 1);
    else
        run_parts(gemv_part, &g);
}

/* ---- the entry points ------------------------------------------------------------ */

/* threads > 1: products of more than MIN_SPLIT_FLOPS are split over that many threads
 * (the caller has set OpenBLAS to one thread). */
void mlxvlm_blas_init(sgemm_fn sgemm, sgemv_fn sgemv, int threads) {
    real_sgemm = sgemm;
    real_sgemv = sgemv;
    pool.threads = threads > 1 ? threads : 1;
}

long mlxvlm_gemv_forwarded(void) { return __atomic_load_n(&forwarded, __ATOMIC_RELAXED); }

long mlxvlm_products_split(void) { return split; }

/* y = beta * y before an sgemv that must not read an uninitialised y when beta == 0. */
static void zero_if_no_beta(float beta, float *y, int n, int stride) {
    if (beta == 0.0f)
        for (int i = 0; i < n; i++) y[(size_t)i * stride] = 0.0f;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && k > 0 && real_sgemv != NULL && (m == 1 || n == 1) &&
        !(m == 1 && n == 1)) {
        if (m == 1) {
            /* c (1 x n) = a (1 x k) . op(b) (k x n): y = op(b)^T a. */
            int a_stride = transposed(trans_a) ? lda : 1;
            zero_if_no_beta(beta, c, n, 1);
            if (transposed(trans_b)) /* b stored n x k */
                gemv(NO_TRANS, n, k, alpha, b, ldb, a, a_stride, beta, c, 1);
            else /* b stored k x n */
                gemv(TRANS, k, n, alpha, b, ldb, a, a_stride, beta, c, 1);
        } else {
            /* c (m x 1) = op(a) (m x k) . b (k x 1): y = op(a) b, y's stride ldc. */
            int b_stride = transposed(trans_b) ? 1 : ldb;
            zero_if_no_beta(beta, c, m, ldc);
            if (transposed(trans_a)) /* a stored k x m */
                gemv(TRANS, k, m, alpha, a, lda, b, b_stride, beta, c, ldc);
            else /* a stored m x k */
                gemv(NO_TRANS, m, k, alpha, a, lda, b, b_stride, beta, c, ldc);
        }
        __atomic_add_fetch(&forwarded, 1, __ATOMIC_RELAXED);
        return;
    }
    if (real_sgemm == NULL) /* not initialised: the next definition in load order */
        real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (order == ROW_MAJOR && pool.threads > 1 && 2.0 * m * n * k >= MIN_SPLIT_FLOPS) {
        /* Split the dimension whose blocks repack less: by rows, every thread packs all
         * of B (n x k); by columns, all of A (m x k). */
        int by_rows = n < m;
        if ((by_rows ? m : n) >= 2 * MIN_PART) {
            gemm_job g = {trans_a, trans_b, m, n, k, lda, ldb, ldc, by_rows,
                          alpha, beta, a, b, c};
            run_parts(gemm_part, &g);
            return;
        }
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

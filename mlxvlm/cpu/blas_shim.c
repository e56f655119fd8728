/* mlxvlm's CPU threads, and cblas_sgemm for libmlx and mlxvlm's kernels.
 *
 * mlxvlm/cpu/shim_build.py compiles this file with the system C compiler once (cached);
 * mlxvlm/cpu/blas.py loads it with RTLD_GLOBAL before OpenBLAS and libmlx, so that
 * libmlx's cblas_sgemm resolves here, and passes OpenBLAS's own functions and a thread
 * count (and the spin time, both from mlxvlm/cpu/policy.py) to mlxvlm_blas_init.
 *
 * 1. One pool of threads for all of mlxvlm's CPU work. The CPU kernels (attention,
 *    norms, activations, 16-bit and quantized products; mlxvlm/cpu/kernels/cpu_parallel.h)
 *    find mlxvlm_pool_run here, and the float32 products below run on it too, with
 *    OpenBLAS set to one thread. With OpenBLAS's own threads next to a pool of the
 *    kernels', a SmolVLM first token lost a third of the CPU during the attention kernel
 *    to OpenBLAS's idle worker spinning in sched_yield (0.89 of 5.67 CPU-seconds); with
 *    two pools that sleep between jobs instead, waking a sleeping thread cost 100-300 us
 *    on a virtual machine (a 576 x 576 sgemv: 171-406 us against 49-77 us). With one
 *    pool, nothing spins next to the work, and its threads spin briefly between jobs
 *    (yielding the CPU: MLX's and Python's threads run between operations) before they
 *    sleep, so the operations of a step do not each pay a wake-up.
 * 2. One-row and one-column products go to sgemv. MLX's CPU backend computes every
 *    float32 matmul with cblas_sgemm, including the one-row products of decoding
 *    (x @ W.T with x of shape 1 x K). OpenBLAS 0.3.21 (Debian 12) streams the weights of
 *    such an sgemm at ~7 GB/s on a 2-core x86-64 machine, and of the same product as
 *    sgemv at ~20 GB/s (0.44 GB of weights: 66 ms against 23 ms). Newer OpenBLAS builds
 *    forward these cases themselves (GEMM_GEMV_FORWARD); this does it for the one the
 *    system has.
 * 3. Products of more than MIN_SPLIT_FLOPS are split in row or column blocks over the
 *    pool, OpenBLAS single-threaded inside each block.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn real_sgemm = NULL;
static sgemv_fn real_sgemv = NULL;
static int split_products = 0; /* OpenBLAS is single-threaded: split products here */
/* Counters, for tests and profiling: products forwarded to sgemv, products split over
 * the pool, jobs the pool ran, the times an idle thread went to sleep, and the times one
 * found its next job while it spun (never with a spin of 0). */
static long forwarded = 0, products_split = 0, pooled = 0, sleeps = 0, spun = 0;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

/* Below these sizes a product stays on the calling thread. */
#define MIN_SPLIT_FLOPS (1L << 22) /* 2 m n k */
#define MIN_SPLIT_GEMV (1L << 17)  /* matrix elements */
#define MIN_PART 16                /* rows or columns per part */

/* ---- the pool --------------------------------------------------------------------- */

typedef void (*part_fn)(const void *job, int part, int parts);

/* A job is published by writing its fields, then `state`: the job's number in the high
 * 32 bits, the next unclaimed part in the low 32. A thread claims a part by advancing
 * the low half with a compare-and-swap that also checks the number, so a thread that
 * woke late can never claim a part of a newer job it did not read. The caller takes
 * parts too: a part whose thread is slow to wake is done by whoever is free. */
static struct {
    int threads;          /* 0 until mlxvlm_blas_init; 1: all on the calling thread */
    long spin_ns;         /* how long an idle thread spins before it sleeps */
    pid_t owner;          /* the process whose threads exist (a forked child starts anew) */
    pthread_mutex_t busy; /* one job at a time; another caller runs its job alone */
    pthread_mutex_t lock; /* for sleeping and waking */
    pthread_cond_t wake;
    uint64_t state;       /* job number << 32 | next part */
    int sleepers, finished, parts;
    part_fn fn;
    const void *job;
} pool = {0, 1000000L, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static uint32_t job_number(uint64_t state) { return (uint32_t)(state >> 32); }

/* Claim and run parts of job `number` until none is left. */
static void run_claimed_parts(uint32_t number) {
    for (;;) {
        uint64_t state = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
        if (job_number(state) != number) return;
        /* The fields may already be a newer job's if this one has ended meanwhile; then
         * the compare-and-swap below fails and they are not used. */
        int part = (int)(uint32_t)state, parts = __atomic_load_n(&pool.parts, __ATOMIC_RELAXED);
        if (part >= parts) return;
        part_fn fn = __atomic_load_n(&pool.fn, __ATOMIC_RELAXED);
        const void *job = __atomic_load_n(&pool.job, __ATOMIC_RELAXED);
        if (!__atomic_compare_exchange_n(&pool.state, &state, state + 1, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        fn(job, part, parts);
        __atomic_add_fetch(&pool.finished, 1, __ATOMIC_RELEASE);
    }
}

static int still_job(uint32_t seen) {
    return job_number(__atomic_load_n(&pool.state, __ATOMIC_SEQ_CST)) == seen;
}

/* Return once a job newer than `seen` is published: spin (yielding) up to spin_ns, then
 * sleep. The deadline is read after every yield, not every few: on a core another
 * process keeps busy a yield can hand it over for a whole time slice, so a count of
 * yields is no bound on the time spun, and with spin_ns 0 the thread would still yield
 * a few times, taking a job that came meanwhile instead of sleeping as asked. The clock
 * read (vDSO) costs little next to the yield's system call. spin_ns 0 sleeps at once. */
static void wait_for_job(uint32_t seen) {
    if (!still_job(seen)) return;
    long spin_ns = pool.spin_ns;
    if (spin_ns > 0) {
        long deadline = now_ns() + spin_ns;
        do {
            sched_yield(); /* let MLX's and Python's threads have the core between jobs */
            if (!still_job(seen)) {
                __atomic_add_fetch(&spun, 1, __ATOMIC_RELAXED);
                return;
            }
        } while (now_ns() < deadline);
    }
    pthread_mutex_lock(&pool.lock);
    __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&sleeps, 1, __ATOMIC_RELAXED);
    /* Checked after sleepers is raised: a caller that publishes a job from here on sees
     * a sleeper and wakes it (under the lock, so not before the wait below begins). */
    while (still_job(seen)) pthread_cond_wait(&pool.wake, &pool.lock);
    __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.lock);
}

static void *worker(void *unused) {
    (void)unused;
    uint32_t seen = job_number(__atomic_load_n(&pool.state, __ATOMIC_ACQUIRE));
    for (;;) {
        wait_for_job(seen);
        seen = job_number(__atomic_load_n(&pool.state, __ATOMIC_ACQUIRE));
        run_claimed_parts(seen);
    }
    return NULL;
}

/* The pool's threads for this process; 0 when none could be started. */
static int start_workers(void) {
    if (pool.owner == getpid()) return pool.threads > 1;
    pthread_mutex_init(&pool.lock, NULL); /* a child inherits the parent's state */
    pthread_cond_init(&pool.wake, NULL);
    pool.sleepers = 0;
    for (int i = 1; i < pool.threads; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, NULL) != 0) {
            pool.threads = i; /* the ones started still serve */
            break;
        }
        pthread_detach(thread);
        pthread_setname_np(thread, "mlxvlm-pool"); /* as top -H and /proc show it */
    }
    pool.owner = getpid();
    return pool.threads > 1;
}

static void run_alone(part_fn fn, const void *job, int parts) {
    for (int part = 0; part < parts; part++) fn(job, part, parts);
}

/* fn(job, part, parts) once for every part in [0, parts), where parts is the pool's
 * size, on the pool's threads; on the calling thread alone when the pool is busy with
 * another caller's job (another MLX stream, or a part of a job that starts one). */
void mlxvlm_pool_run(part_fn fn, const void *job) {
    int parts = pool.threads > 0 ? pool.threads : 1;
    if (parts <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        run_alone(fn, job, parts);
        return;
    }
    /* parts stays what the caller read as the pool's size, even if fewer threads could
     * be started: parts are claimed, so any number of threads completes them. */
    if (!start_workers()) {
        pthread_mutex_unlock(&pool.busy);
        run_alone(fn, job, parts);
        return;
    }
    __atomic_store_n(&pool.fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.job, job, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.parts, parts, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    uint32_t number = job_number(__atomic_load_n(&pool.state, __ATOMIC_ACQUIRE)) + 1;
    __atomic_store_n(&pool.state, (uint64_t)number << 32, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_claimed_parts(number);
    while (__atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < parts) sched_yield();
    __atomic_add_fetch(&pooled, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.busy);
}

/* The pool's size; 0 while the shim is not initialised (OpenBLAS did not load), when
 * the kernels keep their own pool. */
int mlxvlm_pool_threads(void) { return pool.threads; }

/* Jobs run on the pool's threads so far (not those a busy pool left to their caller). */
long mlxvlm_pool_jobs(void) { return __atomic_load_n(&pooled, __ATOMIC_RELAXED); }

/* The times an idle thread has gone to sleep (it spun spin_us without a job). */
long mlxvlm_pool_sleeps(void) { return __atomic_load_n(&sleeps, __ATOMIC_RELAXED); }

/* The times an idle thread found its next job while it spun, without sleeping. */
long mlxvlm_pool_spun(void) { return __atomic_load_n(&spun, __ATOMIC_RELAXED); }

/* ---- products --------------------------------------------------------------------- */

/* [*start, *stop) of n for `part` of `parts`, in multiples of MIN_PART but the last. */
static void part_range(int n, int part, int parts, int *start, int *stop) {
    int blocks = (n + MIN_PART - 1) / MIN_PART;
    *start = (int)((long)blocks * part / parts) * MIN_PART;
    *stop = part + 1 == parts ? n : (int)((long)blocks * (part + 1) / parts) * MIN_PART;
    if (*start > n) *start = n;
    if (*stop > n) *stop = n;
}

static int transposed(int op) { return op == TRANS || op == CONJ_TRANS; }

/* sgemm, split over the rows of C (m) or its columns (n). */
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

/* sgemv (row-major), split over the outputs. */
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
    if (!split_products || (long)rows * cols < MIN_SPLIT_GEMV || outputs < 2 * MIN_PART) {
        gemv_part(&g, 0, 1);
    } else {
        mlxvlm_pool_run(gemv_part, &g);
        __atomic_add_fetch(&products_split, 1, __ATOMIC_RELAXED);
    }
}

/* ---- the entry points ------------------------------------------------------------- */

/* threads: the pool's size. split: OpenBLAS was set to one thread, so products of more
 * than MIN_SPLIT_FLOPS are split over the pool (otherwise OpenBLAS threads them).
 * spin_us: how long an idle thread spins before it sleeps. */
void mlxvlm_blas_init(sgemm_fn sgemm, sgemv_fn sgemv, int threads, int split, long spin_us) {
    real_sgemm = sgemm;
    real_sgemv = sgemv;
    pool.threads = threads > 1 ? threads : 1;
    /* Capped where a deadline (now + spin) could overflow: that long is forever anyway. */
    pool.spin_ns = spin_us <= 0 ? 0 : spin_us > LONG_MAX / 2000 ? LONG_MAX / 2 : spin_us * 1000L;
    split_products = split && pool.threads > 1;
}

long mlxvlm_gemv_forwarded(void) { return __atomic_load_n(&forwarded, __ATOMIC_RELAXED); }

long mlxvlm_products_split(void) { return __atomic_load_n(&products_split, __ATOMIC_RELAXED); }

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
    if (order == ROW_MAJOR && split_products && 2.0 * m * n * k >= MIN_SPLIT_FLOPS) {
        /* Split the dimension whose blocks repack less: by rows, every part packs all of
         * B (n x k); by columns, all of A (m x k). */
        int by_rows = n < m;
        if ((by_rows ? m : n) >= 2 * MIN_PART) {
            gemm_job g = {trans_a, trans_b, m, n, k, lda, ldb, ldc, by_rows,
                          alpha, beta, a, b, c};
            mlxvlm_pool_run(gemm_part, &g);
            __atomic_add_fetch(&products_split, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

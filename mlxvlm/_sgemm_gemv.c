/* cblas_sgemm for libmlx that hands single-row and single-column products to sgemv.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm, including the
 * one-row products of decoding (x @ W.T with x of shape 1 x K). OpenBLAS 0.3.21 (Debian
 * 12) streams the weights of such an sgemm at ~7 GB/s on a 2-core x86-64 machine, and of
 * the same product as sgemv at ~20 GB/s (0.44 GB of weights: 66 ms against 23 ms).
 * Newer OpenBLAS builds forward these cases themselves (GEMM_GEMV_FORWARD); this does
 * the same for the one the system has. Everything else goes to OpenBLAS's cblas_sgemm.
 *
 * mlxvlm/_backend.py compiles this file with the system C compiler once (cached), loads
 * it with RTLD_GLOBAL before OpenBLAS and libmlx so that libmlx's cblas_sgemm resolves
 * here, and passes OpenBLAS's own functions to mlxvlm_gemv_forward_init.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn real_sgemm = NULL;
static sgemv_fn real_sgemv = NULL;
static long forwarded = 0;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

void mlxvlm_gemv_forward_init(sgemm_fn sgemm, sgemv_fn sgemv) {
    real_sgemm = sgemm;
    real_sgemv = sgemv;
}

long mlxvlm_gemv_forwarded(void) { return forwarded; }

static int transposed(int op) { return op == TRANS || op == CONJ_TRANS; }

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
                real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, a_stride, beta, c, 1);
            else /* b stored k x n */
                real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, a_stride, beta, c, 1);
        } else {
            /* c (m x 1) = op(a) (m x k) . b (k x 1): y = op(a) b, y's stride ldc. */
            int b_stride = transposed(trans_b) ? 1 : ldb;
            zero_if_no_beta(beta, c, m, ldc);
            if (transposed(trans_a)) /* a stored k x m */
                real_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, b_stride, beta, c, ldc);
            else /* a stored m x k */
                real_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, b_stride, beta, c, ldc);
        }
        forwarded++;
        return;
    }
    if (real_sgemm == NULL) /* not initialised: the next definition in load order */
        real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

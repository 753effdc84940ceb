/*
 * test_gpu_nccl.c - the NCCL backend of parallel/comm.h (COMM_NCCL) against the MPI backend: every collective and
 * message of the interface on fresh random device data through NCCL, compared byte for byte with the same call of
 * the MPI backend on host copies of the same data (the sums too: both backends add in rank order).
 *
 * Run under mpirun with one GPU per rank (`mpirun -np N`, tests/gpu/nccl.sh) or alone (tests/gpu/run.sh: a world of
 * one, MPI started as a singleton). comm_nccl_force_for_tests makes groups of size 1 take the NCCL path (messages to
 * themselves through NCCL, the device sum kernel) instead of the size-1 identity, so a one-GPU machine runs the NCCL
 * code. The groups: the world (comm_nccl_dup of comm_world()) and its halves (comm_split by rank parity), each beside
 * the MPI group of the same ranks. Every case runs with the default limits and with 1 KiB reduction rounds (several
 * NCCL rounds on small buffers), uneven and zero blocks, in place and out of place; device outputs are poisoned
 * (0xff bytes) before each call, so an element nobody wrote is a mismatch. The inputs are drawn from a seed taken
 * from the clock (printed). Since one GPU gives one rank, the device sum kernel is also checked alone on 2 to 8
 * slots against a rank-order sum computed here (NaNs of several payloads, a signalling one and signed zeros
 * planted), and the sum in reverse order must differ somewhere (else the check could not see a wrong order).
 *
 * Modes that must end the job (tests/gpu/nccl.sh checks the line and the exit status):
 *   mismatch    rank r sends 100 bytes to rank r+1 while r receives 200 from r-1 (itself on one rank): exit 3,
 *               "... has 100 bytes, expected 200"
 *   timeout     a host function holds the legacy default stream for 8 s, then an all-reduce of device memory, whose
 *               NCCL work waits behind it, with a 2 s timeout: exit 4, "... timed out after 2 s"
 *   collective  (2 ranks or more) rank 0 all-reduces 10 elements, the others 11: exit 3, naming n on both
 *   shared-gpu  (2 ranks or more on one GPU: comm_nccl_select_gpu is not called) comm_nccl_dup refuses: exit 3,
 *               "parallel.backend = nccl needs one GPU per rank; use backend = mpi to share a GPU"
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "kernels/cuda/comm_reduce.h"
#include "tests/gpu/gpucheck.h"
#include "tests/mpi/mpitest.h"

static uint64_t SEED;

typedef struct {
    Comm *nccl, *mpi;  // the same ranks: COMM_NCCL and COMM_MPI
    int P, me;
} Pair;

// ---------------------------------------------------------------------------- buffers

static void *alloc_host(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "test_gpu_nccl: out of host memory\n");
        exit(1);
    }
    return p;
}

static void *to_dev(const void *host, size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes ? bytes : 1);
    device_memcpy_from_host(DEVICE_CUDA, d, host, bytes);
    return d;
}

static void *poisoned_dev(size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes ? bytes : 1);
    if (cudaMemset(d, 0xff, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "test_gpu_nccl: cudaMemset failed\n");
        exit(1);
    }
    return d;
}

// Whether device buffer d holds the bytes of host buffer h.
static int same_bytes(const void *d, const void *h, size_t bytes) {
    unsigned char *t = alloc_host(bytes);
    device_memcpy_to_host(DEVICE_CUDA, t, d, bytes);
    const int same = memcmp(t, h, bytes) == 0;
    free(t);
    return same;
}

static void fill_real(real *x, int64_t n, uint64_t seed, int rank) {
    for (int64_t i = 0; i < n; i++) x[i] = (real)input_double(SEED + seed, rank, i);
}

static void fill_bytes(unsigned char *x, int64_t n, uint64_t seed, int rank) {
    for (int64_t i = 0; i < n; i++) x[i] = (unsigned char)input_bits(SEED + seed, rank, i);
}

// ---------------------------------------------------------------------------- all-reduce

static void test_allreduce(const Pair *g, int64_t n, uint64_t seed, const char *limits) {
    const size_t nb = (size_t)n * 8;
    real *xr = alloc_host((size_t)n * sizeof *xr);
    double *xs = alloc_host(nb), *xmax = alloc_host(nb), *xmin = alloc_host(nb);
    int64_t *xi = alloc_host(nb);
    fill_real(xr, n, seed, g->me);
    for (int64_t i = 0; i < n; i++) {
        xs[i] = xmax[i] = xmin[i] = input_double(SEED + seed + 1, g->me, i);
        xi[i] = (int64_t)input_bits(SEED + seed + 2, g->me, i);
    }
    if (n > 3 && g->me == g->P - 1) xmax[3] = xmin[3] = NAN;
    real *dr = to_dev(xr, (size_t)n * sizeof *xr);
    double *ds = to_dev(xs, nb), *dmax = to_dev(xmax, nb), *dmin = to_dev(xmin, nb);
    int64_t *di = to_dev(xi, nb);
    double *hs = alloc_host(nb);  // the host path of a COMM_NCCL group: MPI's code
    memcpy(hs, xs, nb);
    comm_allreduce_sum_real(g->mpi, xr, n), comm_allreduce_sum_real(g->nccl, dr, n);
    comm_allreduce_sum_double(g->mpi, xs, n), comm_allreduce_sum_double(g->nccl, ds, n);
    comm_allreduce_max_double(g->mpi, xmax, n), comm_allreduce_max_double(g->nccl, dmax, n);
    comm_allreduce_min_double(g->mpi, xmin, n), comm_allreduce_min_double(g->nccl, dmin, n);
    comm_allreduce_sum_i64(g->mpi, xi, n), comm_allreduce_sum_i64(g->nccl, di, n);
    comm_allreduce_sum_double(g->nccl, hs, n);
    CHECK(same_bytes(dr, xr, (size_t)n * sizeof *xr), "%s: allreduce_sum_real n=%lld", limits, (long long)n);
    CHECK(same_bytes(ds, xs, nb), "%s: allreduce_sum_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(dmax, xmax, nb), "%s: allreduce_max_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(dmin, xmin, nb), "%s: allreduce_min_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(di, xi, nb), "%s: allreduce_sum_i64 n=%lld", limits, (long long)n);
    CHECK(memcmp(hs, xs, nb) == 0, "%s: allreduce_sum_double of host memory on the NCCL group n=%lld", limits, (long long)n);
    device_free(DEVICE_CUDA, dr), device_free(DEVICE_CUDA, ds), device_free(DEVICE_CUDA, dmax);
    device_free(DEVICE_CUDA, dmin), device_free(DEVICE_CUDA, di);
    free(xr), free(xs), free(xmax), free(xmin), free(xi), free(hs);
}

// ---------------------------------------------------------------------------- reduce-scatter, all-gather

// Uneven blocks, some empty: rank r gets ((5r + 3) % 4) * k elements (3k, 0, k, 2k, 3k, ...).
static int64_t block_of(int r, int64_t k) { return (int64_t)((r * 5 + 3) % 4) * k; }

// counts: uneven (block_of) or every block `k`. Reduce-scatter then all-gather of its result, in place and not.
static void test_reduce_scatter_allgather(const Pair *g, int64_t k, int equal, uint64_t seed, const char *limits) {
    const int P = g->P, me = g->me;
    int64_t *counts = alloc_host((size_t)P * sizeof *counts), *d = alloc_host((size_t)P * sizeof *d);
    for (int r = 0; r < P; r++) counts[r] = equal ? k : block_of(r, k);
    const int64_t total = comm_displacements(counts, P, d), mine = counts[me];
    const size_t tb = (size_t)total * sizeof(real), mb = (size_t)mine * sizeof(real);
    real *send = alloc_host(tb);
    fill_real(send, total, seed, me);
    const char *shape = equal ? "equal blocks" : "uneven blocks";
    for (int in_place = 0; in_place < 2; in_place++) {
        const char *where = in_place ? "in place" : "out of place";
        real *h_send = alloc_host(tb), *h_recv = alloc_host(mb);
        memcpy(h_send, send, tb);
        real *d_send = to_dev(send, tb), *d_recv = in_place ? NULL : poisoned_dev(mb);
        real *h_out = in_place ? h_send + d[me] : h_recv, *d_out = in_place ? d_send + d[me] : d_recv;
        if (equal) {
            comm_reduce_scatter_block_sum_real(g->mpi, h_send, h_out, k);
            comm_reduce_scatter_block_sum_real(g->nccl, d_send, d_out, k);
        } else {
            comm_reduce_scatter_sum_real(g->mpi, h_send, h_out, counts);
            comm_reduce_scatter_sum_real(g->nccl, d_send, d_out, counts);
        }
        CHECK(same_bytes(d_out, h_out, mb), "%s: reduce_scatter k=%lld %s %s", limits, (long long)k, shape, where);
        real *h_all = in_place ? h_send : alloc_host(tb), *d_all = in_place ? d_send : poisoned_dev(tb);
        if (equal) {
            comm_allgather_block_real(g->mpi, h_out, h_all, k);
            comm_allgather_block_real(g->nccl, d_out, d_all, k);
        } else {
            comm_allgather_real(g->mpi, h_out, h_all, counts);
            comm_allgather_real(g->nccl, d_out, d_all, counts);
        }
        CHECK(same_bytes(d_all, h_all, tb), "%s: allgather k=%lld %s %s", limits, (long long)k, shape, where);
        if (!in_place) free(h_all), device_free(DEVICE_CUDA, d_all);
        free(h_send), free(h_recv), device_free(DEVICE_CUDA, d_send), device_free(DEVICE_CUDA, d_recv);
    }
    const size_t nb = (size_t)(13 * k + 5);  // bytes: every rank's 13k + 5
    unsigned char *mine_b = alloc_host(nb), *h_all_b = alloc_host(nb * (size_t)P);
    fill_bytes(mine_b, (int64_t)nb, seed + 7, me);
    unsigned char *d_mine = to_dev(mine_b, nb), *d_all_b = poisoned_dev(nb * (size_t)P);
    comm_allgather_bytes(g->mpi, mine_b, h_all_b, nb);
    comm_allgather_bytes(g->nccl, d_mine, d_all_b, nb);
    CHECK(same_bytes(d_all_b, h_all_b, nb * (size_t)P), "%s: allgather_bytes %zu bytes", limits, nb);
    free(mine_b), free(h_all_b), device_free(DEVICE_CUDA, d_mine), device_free(DEVICE_CUDA, d_all_b);
    free(send), free(counts), free(d);
}

// ---------------------------------------------------------------------------- all-to-all-v, broadcast

static int64_t a2a_bytes(int from, int to, int64_t k) { return (int64_t)((from * 3 + to * 5) % 4) * k + (from == to ? 7 : 0); }

static void test_alltoallv(const Pair *g, int64_t k, uint64_t seed, const char *limits) {
    const int P = g->P, me = g->me;
    int64_t *sb = alloc_host((size_t)P * sizeof *sb), *rb = alloc_host((size_t)P * sizeof *rb);
    int64_t *sd = alloc_host((size_t)P * sizeof *sd), *rd = alloc_host((size_t)P * sizeof *rd);
    for (int r = 0; r < P; r++) sb[r] = a2a_bytes(me, r, k), rb[r] = a2a_bytes(r, me, k);
    const int64_t ts = comm_displacements(sb, P, sd), tr = comm_displacements(rb, P, rd);
    unsigned char *h_send = alloc_host((size_t)ts), *h_recv = alloc_host((size_t)tr);
    fill_bytes(h_send, ts, seed, me);
    unsigned char *d_send = to_dev(h_send, (size_t)ts), *d_recv = poisoned_dev((size_t)tr);
    comm_alltoallv_bytes(g->mpi, h_send, sb, h_recv, rb);
    comm_alltoallv_bytes(g->nccl, d_send, sb, d_recv, rb);
    CHECK(same_bytes(d_recv, h_recv, (size_t)tr), "%s: alltoallv k=%lld", limits, (long long)k);
    free(h_send), free(h_recv), device_free(DEVICE_CUDA, d_send), device_free(DEVICE_CUDA, d_recv);
    free(sb), free(rb), free(sd), free(rd);
}

static void test_bcast(const Pair *g, int64_t k, uint64_t seed, const char *limits) {
    const size_t n = (size_t)(29 * k + 3);
    for (int root = 0; root < g->P; root++) {
        unsigned char *h = alloc_host(n);
        fill_bytes(h, (int64_t)n, seed + (uint64_t)root, g->me);
        unsigned char *dv = to_dev(h, n);
        comm_bcast_bytes(g->mpi, h, n, root);
        comm_bcast_bytes(g->nccl, dv, n, root);
        CHECK(same_bytes(dv, h, n), "%s: bcast %zu bytes from %d", limits, n, root);
        free(h), device_free(DEVICE_CUDA, dv);
    }
}

// ---------------------------------------------------------------------------- point to point

// A ring (each rank to itself on one rank), as the MPI backend on host buffers and NCCL on device buffers:
// isend + blocking recv; irecv + blocking send; two irecvs and two isends of different sizes and tags, waited in
// reverse order; a message of 0 bytes. Each device receive must hold what the MPI receive holds, which must be
// what the peer drew.
static void test_send_recv(const Pair *g, int64_t k, uint64_t seed, const char *limits) {
    const int P = g->P, me = g->me, next = (me + 1) % P, prev = (me + P - 1) % P;
    const size_t n = (size_t)(41 * k + 1), m = n / 2 + 3;  // the second message: bytes [n, n + m) of the drawn ones
    unsigned char *mine = alloc_host(n + m), *want = alloc_host(n + m), *h_in = alloc_host(n), *h_in2 = alloc_host(m);
    fill_bytes(mine, (int64_t)(n + m), seed, me);
    unsigned char *d_mine = to_dev(mine, n + m), *d_in = poisoned_dev(n), *d_in2 = poisoned_dev(m);
    for (int backend = 0; backend < 2; backend++) {  // MPI on host buffers, then NCCL on device buffers
        Comm *c = backend ? g->nccl : g->mpi;
        unsigned char *src = backend ? d_mine : mine, *in = backend ? d_in : h_in, *in2 = backend ? d_in2 : h_in2;
        CommRequest a, b, s1, s2;
        comm_isend_bytes(c, src, n, next, 5, &a);
        comm_recv_bytes(c, in, n, prev, 5);
        comm_wait(&a);
        fill_bytes(want, (int64_t)n, seed, prev);
        CHECK(backend ? same_bytes(in, h_in, n) : memcmp(in, want, n) == 0, "%s: isend/recv %zu bytes (%s)", limits, n,
              backend ? "nccl" : "mpi");
        comm_irecv_bytes(c, in, n, next, 6, &a);
        comm_send_bytes(c, src, n, prev, 6);
        comm_wait(&a);
        fill_bytes(want, (int64_t)n, seed, next);
        CHECK(backend ? same_bytes(in, want, n) : memcmp(in, want, n) == 0, "%s: irecv/send %zu bytes (%s)", limits, n,
              backend ? "nccl" : "mpi");
        comm_irecv_bytes(c, in, n, prev, 7, &a);
        comm_irecv_bytes(c, in2, m, prev, 8, &b);
        comm_isend_bytes(c, src, n, next, 7, &s1);
        comm_isend_bytes(c, src + n, m, next, 8, &s2);
        comm_wait(&b), comm_wait(&s2), comm_wait(&a), comm_wait(&s1);
        fill_bytes(want, (int64_t)(n + m), seed, prev);
        CHECK(backend ? same_bytes(in, want, n) && same_bytes(in2, want + n, m)
                      : memcmp(in, want, n) == 0 && memcmp(in2, want + n, m) == 0,
              "%s: two irecvs and isends of %zu and %zu bytes (%s)", limits, n, m, backend ? "nccl" : "mpi");
        comm_isend_bytes(c, src, 0, next, 9, &a);
        comm_recv_bytes(c, in, 0, prev, 9);
        comm_wait(&a);
    }
    free(mine), free(want), free(h_in), free(h_in2);
    device_free(DEVICE_CUDA, d_mine), device_free(DEVICE_CUDA, d_in), device_free(DEVICE_CUDA, d_in2);
}

// ---------------------------------------------------------------------------- the device sum kernel, alone

static double max_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : (b > a ? b : a); }
static double min_nan(double a, double b) { return isnan(a) ? a : isnan(b) ? b : (b < a ? b : a); }

// host reference of slot 0 (op) slot 1 (op) ... in the order `order` (P entries)
static void combine_host(int type, int op, void *out, const void *slots, int P, int64_t stride, int64_t n, const int *order) {
    for (int64_t i = 0; i < n; i++) {
        if (type == COMM_COMBINE_FLOAT) {
            const float *s = slots;
            float y = s[(int64_t)order[0] * stride + i];
            for (int r = 1; r < P; r++) y = y + s[(int64_t)order[r] * stride + i];
            ((float *)out)[i] = y;
        } else if (type == COMM_COMBINE_I64) {
            const uint64_t *s = slots;
            uint64_t y = s[(int64_t)order[0] * stride + i];
            for (int r = 1; r < P; r++) y = y + s[(int64_t)order[r] * stride + i];
            ((uint64_t *)out)[i] = y;
        } else {
            const double *s = slots;
            double y = s[(int64_t)order[0] * stride + i];
            for (int r = 1; r < P; r++) {
                const double x = s[(int64_t)order[r] * stride + i];
                y = op == COMM_COMBINE_SUM ? y + x : op == COMM_COMBINE_MAX ? max_nan(y, x) : min_nan(y, x);
            }
            ((double *)out)[i] = y;
        }
    }
}

static void test_combine_kernel(void) {
    static const int Ps[] = {2, 3, 5, 8};
    static const struct { int type, op; const char *name; } cases[] = {
        {COMM_COMBINE_FLOAT, COMM_COMBINE_SUM, "float sum"}, {COMM_COMBINE_DOUBLE, COMM_COMBINE_SUM, "double sum"},
        {COMM_COMBINE_DOUBLE, COMM_COMBINE_MAX, "double max"}, {COMM_COMBINE_DOUBLE, COMM_COMBINE_MIN, "double min"},
        {COMM_COMBINE_I64, COMM_COMBINE_SUM, "int64 sum"},
    };
    const int64_t n = 40009, stride = n + 13;
    for (int pi = 0; pi < 4; pi++) {
        const int P = Ps[pi];
        int fwd[8], rev[8];
        for (int r = 0; r < P; r++) fwd[r] = r, rev[r] = P - 1 - r;
        for (int ci = 0; ci < 5; ci++) {
            const int type = cases[ci].type, op = cases[ci].op;
            const size_t es = type == COMM_COMBINE_FLOAT ? 4 : 8, sb = (size_t)P * (size_t)stride * es;
            unsigned char *slots = alloc_host(sb), *want = alloc_host((size_t)n * es), *back = alloc_host((size_t)n * es);
            for (int r = 0; r < P; r++)
                for (int64_t i = 0; i < stride; i++) {
                    const uint64_t s = SEED + 900 + (uint64_t)ci, at = (uint64_t)r * (uint64_t)stride + (uint64_t)i;
                    if (type == COMM_COMBINE_FLOAT) ((float *)slots)[at] = (float)input_double(s, r, i);
                    else if (type == COMM_COMBINE_I64) ((uint64_t *)slots)[at] = input_bits(s, r, i);
                    else ((double *)slots)[at] = input_double(s, r, i);
                }
            if (type == COMM_COMBINE_DOUBLE) {  // NaNs of different payloads in different slots, a signalling one; signed zeros
                double *s = (double *)slots;
                const uint64_t q1 = 0x7ff8000000000001ULL, q2 = 0xfff8000000000002ULL, sn = 0x7ff0000000000003ULL;
                memcpy(&s[(int64_t)(P - 1) * stride + 5], &q1, 8), memcpy(&s[(int64_t)(P / 2) * stride + 5], &q2, 8);
                memcpy(&s[(int64_t)(P - 1) * stride + 6], &q2, 8), memcpy(&s[8], &sn, 8);
                s[7] = -0.0, s[stride + 7] = 0.0;
            } else if (type == COMM_COMBINE_FLOAT) {
                float *s = (float *)slots;
                const uint32_t q1 = 0x7fc00001u, q2 = 0xffc00002u, sn = 0x7f800003u;
                memcpy(&s[(int64_t)(P - 1) * stride + 5], &q1, 4), memcpy(&s[(int64_t)(P / 2) * stride + 5], &q2, 4);
                memcpy(&s[(int64_t)(P - 1) * stride + 6], &q2, 4), memcpy(&s[8], &sn, 4);
                s[7] = -0.0f, s[stride + 7] = 0.0f;
            }
            void *d_slots = to_dev(slots, sb), *d_out = poisoned_dev((size_t)n * es);
            const int rc = cuda_comm_combine_slots(type, op, d_out, d_slots, P, stride, n, NULL);
            CHECK(rc == 0, "cuda_comm_combine_slots %s P=%d: %s", cases[ci].name, P, cudaGetErrorString((cudaError_t)rc));
            CHECK(cudaDeviceSynchronize() == cudaSuccess, "cuda_comm_combine_slots %s P=%d ran", cases[ci].name, P);
            combine_host(type, op, want, slots, P, stride, n, fwd);
            device_memcpy_to_host(DEVICE_CUDA, back, d_out, (size_t)n * es);
            int64_t bad = 0, order_matters = 0;
            for (int64_t i = 0; i < n; i++) bad += memcmp(back + (size_t)i * es, want + (size_t)i * es, es) != 0;
            combine_host(type, op, want, slots, P, stride, n, rev);
            for (int64_t i = 0; i < n; i++) order_matters += memcmp(back + (size_t)i * es, want + (size_t)i * es, es) != 0;
            CHECK(bad == 0, "cuda_comm_combine_slots %s P=%d: %lld of %lld elements differ from the rank-order sum",
                  cases[ci].name, P, (long long)bad, (long long)n);
            if (op == COMM_COMBINE_SUM && type != COMM_COMBINE_I64 && P >= 3)
                CHECK(order_matters > 0, "%s P=%d: the reverse order gives the same bits everywhere, so this check could "
                      "not see a wrong order", cases[ci].name, P);
            if (P == 8 && op == COMM_COMBINE_SUM && type != COMM_COMBINE_I64 && comm_world()->rank == 0)
                printf("test_gpu_nccl: device sum kernel, %s of 8 slots: bitwise the rank-order sum in %lld of %lld "
                       "elements; the reverse order differs in %lld\n", cases[ci].name, (long long)(n - bad),
                       (long long)n, (long long)order_matters);
            free(slots), free(want), free(back), device_free(DEVICE_CUDA, d_slots), device_free(DEVICE_CUDA, d_out);
        }
    }
}

// ---------------------------------------------------------------------------- timing

// The median of 5 all-reduces of 64 MiB of floats through the NCCL group (after one to warm up).
static void time_allreduce(const Pair *g) {
    const int64_t n = (int64_t)16 << 20;
    real *h = alloc_host((size_t)n * sizeof *h);
    fill_real(h, n, 77, g->me);
    real *dv = to_dev(h, (size_t)n * sizeof *h);
    double ms[5];
    comm_allreduce_sum_real(g->nccl, dv, n);
    for (int i = 0; i < 5; i++) {
        device_memcpy_from_host(DEVICE_CUDA, dv, h, (size_t)n * sizeof *h);
        comm_barrier(g->mpi);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        comm_allreduce_sum_real(g->nccl, dv, n);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ms[i] = 1e3 * (double)(t1.tv_sec - t0.tv_sec) + 1e-6 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (ms[j] < ms[i]) { const double t = ms[i]; ms[i] = ms[j]; ms[j] = t; }
    if (g->me == 0)
        printf("test_gpu_nccl: comm_allreduce_sum_real of %lld floats (64 MiB) on %d rank(s) through NCCL: median %.3f ms "
               "of 5 (min %.3f, max %.3f)\n", (long long)n, g->P, ms[2], ms[0], ms[4]);
    free(h), device_free(DEVICE_CUDA, dv);
}

// ---------------------------------------------------------------------------- modes that end the job

static void hold_stream(void *seconds) { sleep(*(unsigned *)seconds); }

static int fault(const char *mode) {
    Comm *world = comm_world();
    const int P = world->size, me = world->rank;
    if (strcmp(mode, "shared-gpu") == 0) {
        comm_nccl_dup(world);  // every rank on its current GPU, 0
        fprintf(stderr, "test_gpu_nccl shared-gpu: FAIL: comm_nccl_dup accepted %d ranks on one GPU\n", P);
        return 1;
    }
    Comm *c = comm_nccl_dup(world);
    const int next = (me + 1) % P, prev = (me + P - 1) % P;
    unsigned char *d = poisoned_dev(256), *d2 = poisoned_dev(256);
    if (strcmp(mode, "mismatch") == 0) {
        comm_set_timeout(20);
        CommRequest req;
        comm_isend_bytes(c, d, 100, next, 3, &req);
        comm_recv_bytes(c, d2, 200, prev, 3);
        comm_wait(&req);
        fprintf(stderr, "test_gpu_nccl mismatch: FAIL: a 100-byte message was received as 200 bytes\n");
    } else if (strcmp(mode, "timeout") == 0) {
        const int64_t n = 1 << 20;
        real *h = alloc_host((size_t)n * sizeof *h);
        fill_real(h, n, 5, me);
        real *x = to_dev(h, (size_t)n * sizeof *h);
        comm_allreduce_sum_real(c, x, n);  // once, so the NCCL connections exist
        comm_set_timeout(2);
        static unsigned seconds = 8;
        if (cudaLaunchHostFunc(cudaStreamLegacy, hold_stream, &seconds) != cudaSuccess) {
            fprintf(stderr, "test_gpu_nccl timeout: FAIL: cudaLaunchHostFunc failed\n");
            return 1;
        }
        comm_allreduce_sum_real(c, x, n);
        fprintf(stderr, "test_gpu_nccl timeout: FAIL: the all-reduce behind an 8 s stall returned with a 2 s timeout\n");
    } else if (strcmp(mode, "collective") == 0) {
        if (P < 2) {
            fprintf(stderr, "test_gpu_nccl collective: needs 2 ranks or more (this job has %d)\n", P);
            return 1;
        }
        comm_set_timeout(20);
        comm_allreduce_sum_real(c, (real *)d, me == 0 ? 10 : 11);
        fprintf(stderr, "test_gpu_nccl collective: FAIL: all-reduces of 10 and 11 elements were not told apart\n");
    } else {
        fprintf(stderr, "test_gpu_nccl: unknown mode '%s' - expected mismatch, timeout, collective or shared-gpu\n", mode);
    }
    return 1;
}

// ---------------------------------------------------------------------------- main

static void run_all(const Pair *g, const char *limits) {
    static const int64_t sizes[] = {1, 5, 1000, 65537, 0, 3};
    for (int i = 0; i < (int)(sizeof sizes / sizeof sizes[0]); i++) test_allreduce(g, sizes[i], 100 + 10 * (uint64_t)i, limits);
    static const int64_t ks[] = {1, 37, 300, 0};
    for (int i = 0; i < (int)(sizeof ks / sizeof ks[0]); i++) {
        test_reduce_scatter_allgather(g, ks[i], 0, 200 + 10 * (uint64_t)i, limits);
        test_reduce_scatter_allgather(g, ks[i] * 3 + 1, 1, 300 + 10 * (uint64_t)i, limits);
        test_alltoallv(g, ks[i], 400 + 10 * (uint64_t)i, limits);
        test_bcast(g, ks[i], 500 + 10 * (uint64_t)i, limits);
        test_send_recv(g, ks[i], 600 + 10 * (uint64_t)i, limits);
    }
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    comm_init(&argc, &argv);  // under mpirun the job's world; alone a world of one (singleton)
    Comm *world = comm_world();
    if (!comm_nccl_available()) {
        if (world->rank == 0)
            fprintf(stderr, "test_gpu_nccl: FAIL: NCCL is not in this build (see make's 'fp8moe: ... NCCL' line)\n");
        comm_finalize();
        return 1;
    }
    if (gpucheck_devices("test_gpu_nccl") == 0) {
        comm_finalize();
        return 1;
    }
    int gpu = 0;
    if (strcmp(mode, "shared-gpu") != 0) gpu = comm_nccl_select_gpu(world);
    comm_nccl_force_for_tests(1);  // groups of size 1 through NCCL too: set before the groups are made
    if (mode[0]) return fault(mode);
    comm_set_timeout(60);  // a hang fails the test within a minute
    if (world->rank == 0) SEED = (uint64_t)time(NULL) * 1000003ULL + (uint64_t)getpid();
    comm_bcast_bytes(world, &SEED, sizeof SEED, 0);
    // the first device allocation before any call: device_of_pointer asks the runtime only after one
    void *first = device_alloc(DEVICE_CUDA, 16);
    Pair whole = {.nccl = comm_nccl_dup(world), .mpi = world, .P = world->size, .me = world->rank};
    CHECK(whole.nccl->kind == COMM_NCCL && whole.nccl->size == world->size && whole.nccl->rank == world->rank &&
          strcmp(whole.nccl->name, "world") == 0, "comm_nccl_dup: a COMM_NCCL copy of the world");
    Comm *half_nccl = comm_split(whole.nccl, world->rank % 2, world->rank, "half");
    Comm *half_mpi = comm_split(world, world->rank % 2, world->rank, "half");
    Pair half = {.nccl = half_nccl, .mpi = half_mpi, .P = half_mpi->size, .me = half_mpi->rank};
    CHECK(half_nccl->kind == COMM_NCCL && half_nccl->size == half_mpi->size && half_nccl->rank == half_mpi->rank,
          "comm_split of a COMM_NCCL group is a COMM_NCCL group");
    Comm *host = comm_split_host(whole.nccl, "host");
    CHECK(host->kind == COMM_MPI, "comm_split_host of a COMM_NCCL group is a COMM_MPI group");
    comm_free(host);
    if (world->rank == 0)
        printf("test_gpu_nccl: %d rank(s), rank 0 on GPU %d; seed %llu\n", world->size, gpu, (unsigned long long)SEED);
    test_combine_kernel();
    const Pair *groups[2] = {&whole, &half};
    for (int i = 0; i < 2; i++) {
        run_all(groups[i], i ? "half, default limits" : "world, default limits");
        comm_set_limits_for_tests(64, 1024);
        run_all(groups[i], i ? "half, 1 KiB rounds" : "world, 1 KiB rounds");
        comm_set_limits_for_tests(0, 0);
    }
    comm_barrier(whole.nccl);
    time_allreduce(&whole);
    comm_free(half_nccl), comm_free(half_mpi), comm_free(whole.nccl);
    device_free(DEVICE_CUDA, first);
    const int rc = mpitest_finish("test_gpu_nccl");
    comm_finalize();
    return rc;
}

/*
 * test_gpu_comm.c - parallel/comm.h on device buffers: the MPI backend's staging through pinned host memory (how
 * several ranks share one GPU) gives the bytes that the same call gives on host buffers.
 *
 * tests/gpu/run.sh runs it as one process (no mpirun: the size-1 paths, where an out-of-place call makes its one
 * copy on the device), and tests/gpu/mpi_parity.sh under mpirun on 2 and 3 ranks that share GPU 0. Every
 * operation runs twice on the same inputs, on host buffers and on device buffers (device_alloc); the device
 * result, copied back, must equal the host result byte for byte. The host results themselves are checked
 * against the rank-order sums by tests/mpi/test_comm.c; here the question is only whether staging changes
 * anything. Each case runs with the default limits and with tiny ones (comm_set_limits_for_tests: 64-byte
 * pieces, 1 KiB rounds), so the staged reductions and gathers take several rounds on small buffers, and with
 * uneven and zero blocks, in place and out of place.
 */
#include <stdlib.h>
#include <string.h>

#include "tests/gpu/gpucheck.h"
#include "tests/mpi/mpitest.h"

static Comm *world;
static int P, me;

// ---------------------------------------------------------------------------- device copies

static void *to_dev(const void *host, size_t bytes) {
    void *d = device_alloc(DEVICE_CUDA, bytes ? bytes : 1);
    device_memcpy_from_host(DEVICE_CUDA, d, host, bytes);
    return d;
}

// Whether the device buffer d holds the bytes of host buffer h.
static int same_bytes(const void *d, const void *h, size_t bytes) {
    unsigned char *t = malloc(bytes ? bytes : 1);
    device_memcpy_to_host(DEVICE_CUDA, t, d, bytes);
    const int same = memcmp(t, h, bytes) == 0;
    free(t);
    return same;
}

static void *alloc_host(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "test_gpu_comm: out of host memory\n");
        exit(1);
    }
    return p;
}

// ---------------------------------------------------------------------------- all-reduce

static void test_allreduce(int64_t n, uint64_t seed, const char *limits) {
    real *xr = alloc_host((size_t)n * sizeof *xr);
    double *xs = alloc_host((size_t)n * sizeof *xs), *xmax = alloc_host((size_t)n * sizeof *xmax);
    double *xmin = alloc_host((size_t)n * sizeof *xmin);
    int64_t *xi = alloc_host((size_t)n * sizeof *xi);
    for (int64_t i = 0; i < n; i++) {
        xr[i] = (real)input_double(seed, me, i);
        xs[i] = xmax[i] = xmin[i] = input_double(seed + 1, me, i);
        xi[i] = (int64_t)input_bits(seed + 2, me, i);
    }
    if (n > 3 && me == P - 1) xmax[3] = xmin[3] = NAN;
    real *dr = to_dev(xr, (size_t)n * sizeof *xr);
    double *ds = to_dev(xs, (size_t)n * sizeof *xs), *dmax = to_dev(xmax, (size_t)n * sizeof *xmax);
    double *dmin = to_dev(xmin, (size_t)n * sizeof *xmin);
    int64_t *di = to_dev(xi, (size_t)n * sizeof *xi);
    comm_allreduce_sum_real(world, xr, n);
    comm_allreduce_sum_real(world, dr, n);
    comm_allreduce_sum_double(world, xs, n);
    comm_allreduce_sum_double(world, ds, n);
    comm_allreduce_max_double(world, xmax, n);
    comm_allreduce_max_double(world, dmax, n);
    comm_allreduce_min_double(world, xmin, n);
    comm_allreduce_min_double(world, dmin, n);
    comm_allreduce_sum_i64(world, xi, n);
    comm_allreduce_sum_i64(world, di, n);
    CHECK(same_bytes(dr, xr, (size_t)n * sizeof *xr), "%s: allreduce_sum_real n=%lld", limits, (long long)n);
    CHECK(same_bytes(ds, xs, (size_t)n * sizeof *xs), "%s: allreduce_sum_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(dmax, xmax, (size_t)n * sizeof *xmax), "%s: allreduce_max_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(dmin, xmin, (size_t)n * sizeof *xmin), "%s: allreduce_min_double n=%lld", limits, (long long)n);
    CHECK(same_bytes(di, xi, (size_t)n * sizeof *xi), "%s: allreduce_sum_i64 n=%lld", limits, (long long)n);
    device_free(DEVICE_CUDA, dr), device_free(DEVICE_CUDA, ds), device_free(DEVICE_CUDA, dmax);
    device_free(DEVICE_CUDA, dmin), device_free(DEVICE_CUDA, di);
    free(xr), free(xs), free(xmax), free(xmin), free(xi);
}

// ---------------------------------------------------------------------------- reduce-scatter, all-gather

// Uneven blocks, some empty: rank r gets ((5r + 3) % 4) * k elements (3k, 0, k, 2k, 3k, ...).
static int64_t block_of(int r, int64_t k) { return (int64_t)((r * 5 + 3) % 4) * k; }

static void test_reduce_scatter_allgather(int64_t k, uint64_t seed, const char *limits) {
    int64_t *counts = alloc_host((size_t)P * sizeof *counts), *d = alloc_host((size_t)P * sizeof *d);
    for (int r = 0; r < P; r++) counts[r] = block_of(r, k);
    const int64_t total = comm_displacements(counts, P, d), mine = counts[me];
    real *send = alloc_host((size_t)total * sizeof *send);
    for (int64_t i = 0; i < total; i++) send[i] = (real)input_double(seed, me, i);
    for (int in_place = 0; in_place < 2; in_place++) {
        // reduce-scatter: out of place into recv (mine), or in place into send's own block
        real *h_send = alloc_host((size_t)total * sizeof *h_send), *h_recv = alloc_host((size_t)mine * sizeof *h_recv);
        memcpy(h_send, send, (size_t)total * sizeof *send);
        real *d_send = to_dev(send, (size_t)total * sizeof *send);
        real *d_recv = in_place ? NULL : device_alloc(DEVICE_CUDA, (size_t)(mine ? mine : 1) * sizeof *d_recv);
        real *h_out = in_place ? h_send + d[me] : h_recv, *d_out = in_place ? d_send + d[me] : d_recv;
        comm_reduce_scatter_sum_real(world, h_send, h_out, counts);
        comm_reduce_scatter_sum_real(world, d_send, d_out, counts);
        CHECK(same_bytes(d_out, h_out, (size_t)mine * sizeof *h_out), "%s: reduce_scatter k=%lld %s", limits,
              (long long)k, in_place ? "in place" : "out of place");
        // all-gather of the reduced blocks: out of place into a fresh buffer, or in place from the own block
        real *h_all = in_place ? h_send : alloc_host((size_t)total * sizeof *h_all);
        real *d_all = in_place ? d_send : device_alloc(DEVICE_CUDA, (size_t)(total ? total : 1) * sizeof *d_all);
        comm_allgather_real(world, h_out, h_all, counts);
        comm_allgather_real(world, d_out, d_all, counts);
        CHECK(same_bytes(d_all, h_all, (size_t)total * sizeof *h_all), "%s: allgather k=%lld %s", limits,
              (long long)k, in_place ? "in place" : "out of place");
        if (!in_place) free(h_all), device_free(DEVICE_CUDA, d_all);
        free(h_send), free(h_recv);
        device_free(DEVICE_CUDA, d_send), device_free(DEVICE_CUDA, d_recv);
    }
    // bytes: every rank's 13 * k + 5 bytes
    const size_t nb = (size_t)(13 * k + 5);
    unsigned char *mine_b = alloc_host(nb), *h_all_b = alloc_host(nb * (size_t)P);
    for (size_t j = 0; j < nb; j++) mine_b[j] = (unsigned char)input_bits(seed + 7, me, (int64_t)j);
    unsigned char *d_mine = to_dev(mine_b, nb), *d_all_b = device_alloc(DEVICE_CUDA, nb * (size_t)P);
    comm_allgather_bytes(world, mine_b, h_all_b, nb);
    comm_allgather_bytes(world, d_mine, d_all_b, nb);
    CHECK(same_bytes(d_all_b, h_all_b, nb * (size_t)P), "%s: allgather_bytes %zu bytes", limits, nb);
    free(mine_b), free(h_all_b), device_free(DEVICE_CUDA, d_mine), device_free(DEVICE_CUDA, d_all_b);
    free(send), free(counts), free(d);
}

// ---------------------------------------------------------------------------- all-to-all-v, broadcast, p2p

static int64_t a2a_bytes(int from, int to, int64_t k) { return (int64_t)((from * 3 + to * 5) % 4) * k + (from == to ? 7 : 0); }

static void test_alltoallv(int64_t k, const char *limits) {
    int64_t *sb = alloc_host((size_t)P * sizeof *sb), *rb = alloc_host((size_t)P * sizeof *rb);
    int64_t *sd = alloc_host((size_t)P * sizeof *sd), *rd = alloc_host((size_t)P * sizeof *rd);
    for (int r = 0; r < P; r++) sb[r] = a2a_bytes(me, r, k), rb[r] = a2a_bytes(r, me, k);
    const int64_t ts = comm_displacements(sb, P, sd), tr = comm_displacements(rb, P, rd);
    unsigned char *h_send = alloc_host((size_t)ts), *h_recv = alloc_host((size_t)tr);
    for (int64_t j = 0; j < ts; j++) h_send[j] = (unsigned char)input_bits(11, me, j);
    unsigned char *d_send = to_dev(h_send, (size_t)ts), *d_recv = device_alloc(DEVICE_CUDA, (size_t)(tr ? tr : 1));
    comm_alltoallv_bytes(world, h_send, sb, h_recv, rb);
    comm_alltoallv_bytes(world, d_send, sb, d_recv, rb);
    CHECK(same_bytes(d_recv, h_recv, (size_t)tr), "%s: alltoallv k=%lld", limits, (long long)k);
    free(h_send), free(h_recv), device_free(DEVICE_CUDA, d_send), device_free(DEVICE_CUDA, d_recv);
    free(sb), free(rb), free(sd), free(rd);
}

static void test_bcast(int64_t k, const char *limits) {
    const size_t n = (size_t)(29 * k + 3);
    for (int root = 0; root < P; root++) {
        unsigned char *h = alloc_host(n);
        for (size_t j = 0; j < n; j++) h[j] = (unsigned char)input_bits(13 + (uint64_t)root, me, (int64_t)j);
        unsigned char *dv = to_dev(h, n);
        comm_bcast_bytes(world, h, n, root);
        comm_bcast_bytes(world, dv, n, root);
        CHECK(same_bytes(dv, h, n), "%s: bcast %zu bytes from %d", limits, n, root);
        free(h), device_free(DEVICE_CUDA, dv);
    }
}

// A ring both ways: isend + blocking recv (a request's own pinned buffer, the Comm's for the blocking call),
// then irecv + blocking send; the device receives must hold what the peers sent.
static void test_send_recv(int64_t k, const char *limits) {
    if (P < 2) return;
    const int next = (me + 1) % P, prev = (me + P - 1) % P;
    const size_t n = (size_t)(41 * k + 1);
    unsigned char *mine = alloc_host(n), *want = alloc_host(n);
    for (size_t j = 0; j < n; j++) {
        mine[j] = (unsigned char)input_bits(17, me, (int64_t)j);
        want[j] = (unsigned char)input_bits(17, prev, (int64_t)j);
    }
    unsigned char *d_mine = to_dev(mine, n), *d_in = device_alloc(DEVICE_CUDA, n);
    CommRequest req;
    comm_isend_bytes(world, d_mine, n, next, 5, &req);
    comm_recv_bytes(world, d_in, n, prev, 5);
    comm_wait(&req);
    CHECK(same_bytes(d_in, want, n), "%s: isend/recv %zu bytes", limits, n);
    for (size_t j = 0; j < n; j++) want[j] = (unsigned char)input_bits(17, next, (int64_t)j);
    device_memset_zero(DEVICE_CUDA, d_in, n);
    comm_irecv_bytes(world, d_in, n, next, 6, &req);
    comm_send_bytes(world, d_mine, n, prev, 6);
    comm_wait(&req);
    CHECK(same_bytes(d_in, want, n), "%s: irecv/send %zu bytes", limits, n);
    free(mine), free(want), device_free(DEVICE_CUDA, d_mine), device_free(DEVICE_CUDA, d_in);
}

// ---------------------------------------------------------------------------- main

static void run_all(const char *limits) {
    static const int64_t sizes[] = {0, 1, 5, 1000, 65537};
    for (int i = 0; i < (int)(sizeof sizes / sizeof sizes[0]); i++) test_allreduce(sizes[i], 100 + (uint64_t)i, limits);
    static const int64_t ks[] = {0, 1, 37, 300};
    for (int i = 0; i < (int)(sizeof ks / sizeof ks[0]); i++) {
        test_reduce_scatter_allgather(ks[i], 200 + (uint64_t)i, limits);
        test_alltoallv(ks[i], limits);
        test_bcast(ks[i], limits);
        test_send_recv(ks[i], limits);
    }
}

int main(int argc, char **argv) {
    // under mpirun the MPI world; alone, the single-process world (no MPI), as the trainer decides
    const int launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
    if (launched) comm_init(&argc, &argv);
    world = comm_world();
    P = world->size, me = world->rank;
    if (gpucheck_devices("test_gpu_comm") == 0) {
        comm_finalize();
        return 1;
    }
    // the first device allocation before any call: device_of_pointer asks the runtime only after one
    void *first = device_alloc(DEVICE_CUDA, 16);
    CHECK(device_of_pointer(first) == DEVICE_CUDA && device_of_pointer((char *)first + 8) == DEVICE_CUDA,
          "device_of_pointer of device memory");
    CHECK(device_of_pointer(&P) == DEVICE_CPU && device_of_pointer(NULL) == DEVICE_CPU, "device_of_pointer of host memory");
    void *pin = device_host_alloc(DEVICE_CUDA, 64);
    CHECK(device_of_pointer(pin) == DEVICE_CPU, "device_of_pointer of pinned host memory");
    device_host_free(DEVICE_CUDA, pin);
    run_all("default limits");
    comm_set_limits_for_tests(64, 1024);
    run_all("64-byte pieces, 1 KiB rounds");
    comm_set_limits_for_tests(0, 0);
    device_free(DEVICE_CUDA, first);
    char name[64];
    snprintf(name, sizeof name, "test_gpu_comm (%s)", launched ? "mpirun" : "one process");
    const int rc = mpitest_finish(name);
    comm_finalize();
    return rc;
}

/*
 * test_comm.c - the MPI backend of parallel/comm.h on however many ranks it is started with (tests/mpi/run.sh
 * runs it on 1, 2, 3, 4 and 8 ranks, and once without mpirun as an MPI singleton).
 *
 * Every rank's inputs come from a counter-based generator, so each rank computes locally what the result
 * must be: the sums in rank order ((x_0 + x_1) + x_2) + ..., compared bit for bit; gathers, all-to-all-v
 * and broadcasts byte for byte. Each test runs twice: with the default message limits, and with tiny ones
 * (comm_set_limits_for_tests) so that the paths large buffers take (messages in pieces, reductions in
 * rounds) run on small buffers too.
 */
#include <math.h>
#include <string.h>

#include "mpitest.h"

static int P, me;

// ---------------------------------------------------------------------------- all-reduce

// The rank-order sums, computed here from every rank's inputs; also counts the elements where the reverse
// order gives other bits, to show that the test can tell the orders apart.
static void test_allreduce_real(int64_t n, uint64_t seed, long *order_matters) {
    real *x = malloc((size_t)(n ? n : 1) * sizeof *x);
    for (int64_t i = 0; i < n; i++) x[i] = (real)input_double(seed, me, i);
    comm_allreduce_sum_real(comm_world(), x, n);
    int64_t bad = 0, first_bad = -1;
    for (int64_t i = 0; i < n; i++) {
        real want = (real)input_double(seed, 0, i), rev = (real)input_double(seed, P - 1, i);
        for (int r = 1; r < P; r++) want = want + (real)input_double(seed, r, i);
        for (int r = P - 2; r >= 0; r--) rev = rev + (real)input_double(seed, r, i);
        if (memcmp(&want, &x[i], sizeof want) != 0 && bad++ == 0) first_bad = i;
        *order_matters += memcmp(&want, &rev, sizeof want) != 0;
    }
    CHECK(bad == 0, "allreduce_sum_real n=%lld: %lld elements differ from the rank-order sum, first at %lld",
          (long long)n, (long long)bad, (long long)first_bad);
    // identical bits on every rank: rank 0's result broadcast and compared
    real *r0 = malloc((size_t)(n ? n : 1) * sizeof *r0);
    memcpy(r0, x, (size_t)n * sizeof *x);
    comm_bcast_bytes(comm_world(), r0, (size_t)n * sizeof *r0, 0);
    CHECK(n == 0 || memcmp(r0, x, (size_t)n * sizeof *x) == 0, "allreduce_sum_real n=%lld: bits differ from rank 0's",
          (long long)n);
    free(r0);
    free(x);
}

static void test_allreduce_double(int64_t n, uint64_t seed) {
    double *x = malloc((size_t)(n ? n : 1) * sizeof *x);
    double *mx = malloc((size_t)(n ? n : 1) * sizeof *mx), *mn = malloc((size_t)(n ? n : 1) * sizeof *mn);
    for (int64_t i = 0; i < n; i++) x[i] = mx[i] = mn[i] = input_double(seed, me, i);
    // NaN on the last rank at element 3: max and min must give NaN there on every rank
    if (n > 3 && me == P - 1) mx[3] = mn[3] = NAN;
    comm_allreduce_sum_double(comm_world(), x, n);
    comm_allreduce_max_double(comm_world(), mx, n);
    comm_allreduce_min_double(comm_world(), mn, n);
    int64_t bad = 0, bad_max = 0, bad_min = 0;
    for (int64_t i = 0; i < n; i++) {
        double want = input_double(seed, 0, i), hi = want, lo = want;
        for (int r = 1; r < P; r++) {
            const double v = input_double(seed, r, i);
            want = want + v;
            hi = v > hi ? v : hi;
            lo = v < lo ? v : lo;
        }
        bad += memcmp(&want, &x[i], sizeof want) != 0;
        if (i == 3) {
            bad_max += !isnan(mx[i]);
            bad_min += !isnan(mn[i]);
        } else {
            bad_max += mx[i] != hi;
            bad_min += mn[i] != lo;
        }
    }
    CHECK(bad == 0, "allreduce_sum_double n=%lld: %lld elements differ", (long long)n, (long long)bad);
    CHECK(bad_max == 0, "allreduce_max_double n=%lld: %lld elements differ", (long long)n, (long long)bad_max);
    CHECK(bad_min == 0, "allreduce_min_double n=%lld: %lld elements differ", (long long)n, (long long)bad_min);
    free(x);
    free(mx);
    free(mn);
}

static void test_allreduce_i64(int64_t n, uint64_t seed) {
    int64_t *x = malloc((size_t)(n ? n : 1) * sizeof *x);
    for (int64_t i = 0; i < n; i++) x[i] = (int64_t)(input_bits(seed, me, i) >> 3) - (INT64_C(1) << 60);
    comm_allreduce_sum_i64(comm_world(), x, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t want = 0;  // wraps like the backend's sum
        for (int r = 0; r < P; r++) want += (uint64_t)((int64_t)(input_bits(seed, r, i) >> 3) - (INT64_C(1) << 60));
        bad += (uint64_t)x[i] != want;
    }
    CHECK(bad == 0, "allreduce_sum_i64 n=%lld: %lld elements differ", (long long)n, (long long)bad);
    free(x);
}

// ---------------------------------------------------------------------------- reduce-scatter, all-gather

// Uneven blocks with some of zero length: (r * 5 + 3) % 4 * 37 elements for rank r.
static int64_t uneven(int r) { return (int64_t)((r * 5 + 3) % 4) * 37; }

static void test_reduce_scatter(uint64_t seed) {
    int64_t *counts = malloc((size_t)P * sizeof *counts), *d = malloc((size_t)P * sizeof *d);
    for (int r = 0; r < P; r++) counts[r] = uneven(r);
    const int64_t total = comm_displacements(counts, P, d);
    real *send = malloc((size_t)(total + 1) * sizeof *send), *recv = malloc((size_t)(counts[me] + 1) * sizeof *recv);
    for (int pass = 0; pass < 2; pass++) {  // 0: into recv, 1: in place (recv = send + d[me])
        for (int64_t i = 0; i < total; i++) send[i] = (real)input_double(seed, me, i);
        real *out = pass == 0 ? recv : send + d[me];
        comm_reduce_scatter_sum_real(comm_world(), send, out, counts);
        int64_t bad = 0;
        for (int64_t i = 0; i < counts[me]; i++) {
            real want = (real)input_double(seed, 0, d[me] + i);
            for (int r = 1; r < P; r++) want = want + (real)input_double(seed, r, d[me] + i);
            bad += memcmp(&want, &out[i], sizeof want) != 0;
        }
        CHECK(bad == 0, "reduce_scatter_sum_real (%s): %lld of %lld elements differ", pass ? "in place" : "into recv",
              (long long)bad, (long long)counts[me]);
    }
    free(send);
    free(recv);
    // equal blocks
    const int64_t block = 129;
    send = malloc((size_t)(P * block) * sizeof *send);
    recv = malloc((size_t)block * sizeof *recv);
    for (int64_t i = 0; i < P * block; i++) send[i] = (real)input_double(seed + 1, me, i);
    comm_reduce_scatter_block_sum_real(comm_world(), send, recv, block);
    int64_t bad = 0;
    for (int64_t i = 0; i < block; i++) {
        real want = (real)input_double(seed + 1, 0, me * block + i);
        for (int r = 1; r < P; r++) want = want + (real)input_double(seed + 1, r, me * block + i);
        bad += memcmp(&want, &recv[i], sizeof want) != 0;
    }
    CHECK(bad == 0, "reduce_scatter_block_sum_real: %lld elements differ", (long long)bad);
    free(send);
    free(recv);
    free(counts);
    free(d);
}

static void test_allgather(uint64_t seed) {
    int64_t *counts = malloc((size_t)P * sizeof *counts), *d = malloc((size_t)P * sizeof *d);
    for (int r = 0; r < P; r++) counts[r] = uneven(r);
    const int64_t total = comm_displacements(counts, P, d);
    real *mine = malloc((size_t)(counts[me] + 1) * sizeof *mine), *all = malloc((size_t)(total + 1) * sizeof *all);
    for (int pass = 0; pass < 2; pass++) {  // 0: from a separate buffer, 1: in place (send = all + d[me])
        memset(all, 0xff, (size_t)total * sizeof *all);
        real *src = pass == 0 ? mine : all + d[me];
        for (int64_t i = 0; i < counts[me]; i++) src[i] = (real)input_double(seed, me, i);
        comm_allgather_real(comm_world(), src, all, counts);
        int64_t bad = 0;
        for (int r = 0; r < P; r++)
            for (int64_t i = 0; i < counts[r]; i++) {
                const real want = (real)input_double(seed, r, i);
                bad += memcmp(&want, &all[d[r] + i], sizeof want) != 0;
            }
        CHECK(bad == 0, "allgather_real (%s): %lld elements differ", pass ? "in place" : "separate", (long long)bad);
    }
    free(mine);
    free(all);
    const int64_t block = 77;
    mine = malloc((size_t)block * sizeof *mine);
    all = malloc((size_t)(P * block) * sizeof *all);
    for (int64_t i = 0; i < block; i++) mine[i] = (real)input_double(seed + 2, me, i);
    comm_allgather_block_real(comm_world(), mine, all, block);
    int64_t bad = 0;
    for (int r = 0; r < P; r++)
        for (int64_t i = 0; i < block; i++) {
            const real want = (real)input_double(seed + 2, r, i);
            bad += memcmp(&want, &all[r * block + i], sizeof want) != 0;
        }
    CHECK(bad == 0, "allgather_block_real: %lld elements differ", (long long)bad);
    char name[24], *names = malloc((size_t)P * sizeof name);
    memset(name, 0, sizeof name);
    snprintf(name, sizeof name, "rank-%d", me);
    comm_allgather_bytes(comm_world(), name, names, sizeof name);
    for (int r = 0; r < P; r++) {
        snprintf(name, sizeof name, "rank-%d", r);
        CHECK(strcmp(names + r * sizeof name, name) == 0, "allgather_bytes: block %d is \"%s\"", r, names + r * sizeof name);
    }
    free(names);
    free(mine);
    free(all);
    free(counts);
    free(d);
}

// ---------------------------------------------------------------------------- all-to-all-v

// Bytes rank `from` sends to rank `to`: uneven, zero for about a quarter of the pairs, never zero to itself.
static int64_t a2a_bytes(int from, int to) { return (int64_t)((from * 3 + to * 5) % 4) * 13 + (from == to ? 7 : 0); }
static unsigned char a2a_byte(int from, int to, int64_t j) { return (unsigned char)(from * 31 + to * 17 + j * 7 + 1); }

static void test_alltoallv(void) {
    int64_t *sc = malloc((size_t)P * sizeof *sc), *rc = malloc((size_t)P * sizeof *rc);
    int64_t *sd = malloc((size_t)P * sizeof *sd), *rd = malloc((size_t)P * sizeof *rd);
    for (int q = 0; q < P; q++) sc[q] = a2a_bytes(me, q);
    comm_alltoall_counts(comm_world(), sc, rc);
    int bad_counts = 0;
    for (int r = 0; r < P; r++) bad_counts += rc[r] != a2a_bytes(r, me);
    CHECK(bad_counts == 0, "alltoall_counts: %d counts differ", bad_counts);
    const int64_t stotal = comm_displacements(sc, P, sd), rtotal = comm_displacements(rc, P, rd);
    unsigned char *send = malloc((size_t)stotal + 1), *recv = malloc((size_t)rtotal + 1);
    for (int q = 0; q < P; q++)
        for (int64_t j = 0; j < sc[q]; j++) send[sd[q] + j] = a2a_byte(me, q, j);
    memset(recv, 0, (size_t)rtotal + 1);
    comm_alltoallv_bytes(comm_world(), send, sc, recv, rc);
    int64_t bad = 0;
    for (int r = 0; r < P; r++)
        for (int64_t j = 0; j < rc[r]; j++) bad += recv[rd[r] + j] != a2a_byte(r, me, j);
    CHECK(bad == 0, "alltoallv_bytes: %lld of %lld bytes differ", (long long)bad, (long long)rtotal);
    free(send);
    free(recv);
    free(sc);
    free(rc);
    free(sd);
    free(rd);
}

// ---------------------------------------------------------------------------- point to point, broadcast

// Every rank sends K messages of varying sizes to the next rank (isend, then one wait each) and receives K
// from the previous one with blocking receives: they must arrive in the order sent. On one rank the
// messages go to itself (irecv first, so nothing blocks).
static void test_send_recv_fifo(void) {
    enum { K = 24, MAXB = 3001 };
    const int next = (me + 1) % P, prev = (me + P - 1) % P;
    static unsigned char out[K][MAXB], in[MAXB];
    CommRequest reqs[K], self_reqs[K];
    static unsigned char self_in[K][MAXB];
    size_t size[K];
    for (int k = 0; k < K; k++) size[k] = (size_t)(k * 131) % MAXB + (k == 3 ? 0 : 1);
    size[3] = 0;  // an empty message keeps its place in the sequence too
    if (P == 1)
        for (int k = 0; k < K; k++) comm_irecv_bytes(comm_world(), self_in[k], size[k], prev, 7, &self_reqs[k]);
    for (int k = 0; k < K; k++) {
        for (size_t j = 0; j < size[k]; j++) out[k][j] = (unsigned char)(me * 7 + k * 13 + (int)j);
        comm_isend_bytes(comm_world(), out[k], size[k], next, 7, &reqs[k]);
    }
    int bad = 0;
    for (int k = 0; k < K; k++) {
        unsigned char *got = in;
        if (P == 1) {
            comm_wait(&self_reqs[k]);
            got = self_in[k];
        } else {
            comm_recv_bytes(comm_world(), in, size[k], prev, 7);
        }
        for (size_t j = 0; j < size[k]; j++) bad += got[j] != (unsigned char)(prev * 7 + k * 13 + (int)j);
    }
    for (int k = 0; k < K; k++) comm_wait(&reqs[k]);
    CHECK(bad == 0, "send/recv FIFO: %d bytes out of order or wrong", bad);
    CHECK(reqs[0].n == 0, "comm_wait leaves the request cleared");
    comm_wait(&reqs[0]);  // a cleared request returns at once
    // blocking send and receive between neighbours: even ranks send first, odd ranks receive first
    if (P > 1 && (P % 2 == 0)) {
        unsigned char msg[64], back[64];
        for (int j = 0; j < 64; j++) msg[j] = (unsigned char)(me + j);
        if (me % 2 == 0) {
            comm_send_bytes(comm_world(), msg, sizeof msg, me + 1, 9);
            comm_recv_bytes(comm_world(), back, sizeof back, me + 1, 9);
        } else {
            comm_recv_bytes(comm_world(), back, sizeof back, me - 1, 9);
            comm_send_bytes(comm_world(), msg, sizeof msg, me - 1, 9);
        }
        const int peer = me % 2 == 0 ? me + 1 : me - 1;
        int wrong = 0;
        for (int j = 0; j < 64; j++) wrong += back[j] != (unsigned char)(peer + j);
        CHECK(wrong == 0, "blocking send/recv with rank %d: %d bytes wrong", peer, wrong);
    }
}

static void test_bcast(void) {
    enum { B = 5003 };
    unsigned char buf[B];
    for (int root = 0; root < P; root++) {
        for (int j = 0; j < B; j++) buf[j] = me == root ? (unsigned char)(root * 3 + j) : 0;
        comm_bcast_bytes(comm_world(), buf, B, root);
        int bad = 0;
        for (int j = 0; j < B; j++) bad += buf[j] != (unsigned char)(root * 3 + j);
        CHECK(bad == 0, "bcast from root %d: %d bytes wrong", root, bad);
    }
}

// ---------------------------------------------------------------------------- groups

static void test_split(void) {
    // two groups by parity, ordered by descending world rank (key = -rank)
    Comm *c = comm_split(comm_world(), me % 2, -me, "parity");
    int members = 0, rank_want = 0;
    for (int q = 0; q < P; q++)
        if (q % 2 == me % 2) {
            members++;
            rank_want += q > me;
        }
    CHECK(c != NULL && c->size == members && c->rank == rank_want && strcmp(c->name, "parity") == 0,
          "comm_split: rank %d of %d named %s, expected rank %d of %d", c ? c->rank : -1, c ? c->size : -1,
          c ? c->name : "-", rank_want, members);
    double s = me;
    comm_allreduce_sum_double(c, &s, 1);
    double want = 0;
    for (int q = 0; q < P; q++) want += q % 2 == me % 2 ? q : 0;
    CHECK(s == want, "allreduce over the parity group: %g, expected %g", s, want);
    comm_barrier(c);
    comm_free(c);
    // rank 0 joins nothing
    c = comm_split(comm_world(), me == 0 ? COMM_UNDEFINED : 0, me, "rest");
    CHECK(me == 0 ? c == NULL : c != NULL && c->size == P - 1 && c->rank == me - 1,
          "comm_split with COMM_UNDEFINED on rank 0");
    comm_free(c);
    c = comm_split_host(comm_world(), "host");
    CHECK(c->size == P && c->rank == me, "comm_split_host on one host: rank %d of %d", c->rank, c->size);
    comm_free(c);
}

static void test_single_backend(void) {
    // the single-process world is usable beside MPI and stays the identity
    Comm *s = comm_world_single();
    double x[2] = {1.5, -2};
    comm_allreduce_sum_double(s, x, 2);
    comm_barrier(s);
    CHECK(x[0] == 1.5 && x[1] == -2 && s->kind == COMM_SINGLE && s->size == 1, "COMM_SINGLE is the identity");
    Comm *c = comm_split(s, 0, 0, "dp");
    CHECK(c != NULL && c->kind == COMM_SINGLE && c->size == 1 && strcmp(c->name, "dp") == 0, "split of COMM_SINGLE");
    comm_free(c);
    CHECK(comm_world()->kind == COMM_MPI && comm_is_initialized(), "comm_world is MPI after comm_init");
}

static void run_all(const char *limits, const int64_t *sizes, int n_sizes) {
    const double t0 = MPI_Wtime();
    long order_matters = 0;
    int64_t summed = 0;
    for (int s = 0; s < n_sizes; s++) {
        summed += sizes[s];
        test_allreduce_real(sizes[s], 11 + s, &order_matters);
        test_allreduce_double(sizes[s], 23 + s);
        test_allreduce_i64(sizes[s], 37 + s);
    }
    test_reduce_scatter(41);
    test_allgather(43);
    test_alltoallv();
    test_send_recv_fifo();
    test_bcast();
    comm_barrier(comm_world());
    test_split();
    int64_t om = order_matters;
    comm_allreduce_sum_i64(comm_world(), &om, 1);
    if (me == 0)
        printf("test_comm: %d rank(s), %s limits: %.2f s; summing in reverse rank order would change %lld of the %lld "
               "reals summed\n", P, limits, MPI_Wtime() - t0, (long long)om / P, (long long)summed);
    fflush(stdout);
}

int main(int argc, char **argv) {
    comm_init(&argc, &argv);
    comm_set_timeout(60);
    P = comm_world()->size;
    me = comm_world()->rank;
    test_single_backend();
    const int64_t sizes[] = {0, 1, 2, 7, 1000, 65537};
    run_all("default", sizes, 6);
    // 64-byte pieces and a 1 KiB round: every message above 64 bytes travels in pieces, and a reduction with
    // more than 1024 / element size / P elements per block runs in rounds
    comm_set_limits_for_tests(64, 1024);
    run_all("tiny", sizes, 5);
    comm_set_limits_for_tests(0, 0);
    const int rc = mpitest_finish("test_comm");
    comm_finalize();
    return rc;
}

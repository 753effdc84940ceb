/*
 * test_groups.c - parallel/groups.h on however many ranks it is started with: for every layout the world
 * size allows (pp * dp = world, ep dividing dp), every rank's coordinates and the members of its pp, dp,
 * ep and edp groups are checked against membership rules written out here independently (by brute force
 * over the world: "same stage", "same EP block of dp ranks", ...), and a sum over each group checks that
 * the communicators carry data. Also: emulated nodes (parallel.gpus_per_node), the placement check of
 * expert groups on nodes, refused layouts (the keys and numbers in the message), config_check_layout and
 * the banner.
 */
#include <string.h>

#include "mpitest.h"
#include "parallel/groups.h"
#include "train/config.h"

static int P, me;

// The members of this rank's group under `same(q, me)`, in world-rank order.
typedef int (*SameGroup)(int q, int r, int pp, int dp, int ep);
static int same_pp(int q, int r, int pp, int dp, int ep) { (void)pp, (void)ep; return q % dp == r % dp; }
static int same_dp(int q, int r, int pp, int dp, int ep) { (void)pp, (void)ep; return q / dp == r / dp; }
static int same_ep(int q, int r, int pp, int dp, int ep) {
    (void)pp;
    return q / dp == r / dp && (q % dp) / ep == (r % dp) / ep;
}
static int same_edp(int q, int r, int pp, int dp, int ep) {
    (void)pp;
    return q / dp == r / dp && (q % dp) % ep == (r % dp) % ep;
}

static void check_group(Comm *c, const char *name, SameGroup same, int pp, int dp, int ep, int coord) {
    int want[64], n = 0, my_index = -1;
    for (int q = 0; q < P; q++)
        if (same(q, me, pp, dp, ep)) {
            if (q == me) my_index = n;
            want[n++] = q;
        }
    CHECK(c != NULL && strcmp(c->name, name) == 0, "pp=%d dp=%d ep=%d: group %s missing or misnamed", pp, dp, ep, name);
    if (c == NULL) return;
    CHECK(c->size == n && c->rank == my_index && c->rank == coord,
          "pp=%d dp=%d ep=%d: %s group: rank %d of %d, expected rank %d (= the coordinate %d) of %d", pp, dp, ep, name,
          c->rank, c->size, my_index, coord, n);
    int got[64];
    comm_allgather_bytes(c, &me, got, sizeof me);
    int bad = c->size != n;
    for (int i = 0; i < n && !bad; i++) bad += got[i] != want[i];
    CHECK(bad == 0, "pp=%d dp=%d ep=%d: %s group members differ from the rule", pp, dp, ep, name);
    double s = me, want_sum = 0;
    for (int i = 0; i < n; i++) want_sum += want[i];
    comm_allreduce_sum_double(c, &s, 1);
    CHECK(s == want_sum, "pp=%d dp=%d ep=%d: sum over the %s group %g, expected %g", pp, dp, ep, name, s, want_sum);
}

static void test_layout(int pp, int dp, int ep) {
    Groups g;
    char err[512];
    int rc = groups_init(&g, comm_world(), pp, dp, ep, 0, err, sizeof err);
    CHECK(rc == 0, "groups_init pp=%d dp=%d ep=%d: %s", pp, dp, ep, err);
    if (rc != 0) return;
    // coordinates from the layout's definition: rank = stage * dp + dp_rank; EP groups are consecutive dp ranks
    const int stage = me / dp, dp_rank = me - stage * dp;
    CHECK(g.me.stage == stage && g.me.dp_rank == dp_rank && g.me.ep_rank == dp_rank % ep &&
              g.me.edp_rank == dp_rank / ep && g.me.ep_group == dp_rank / ep && g.layout.edp == dp / ep,
          "pp=%d dp=%d ep=%d: coordinates stage %d dp %d ep %d edp %d", pp, dp, ep, g.me.stage, g.me.dp_rank,
          g.me.ep_rank, g.me.edp_rank);
    CHECK(layout_world_rank(&g.layout, g.me.stage, g.me.dp_rank) == me, "layout_world_rank inverts layout_coords");
    check_group(g.pp, "pp", same_pp, pp, dp, ep, g.me.stage);
    check_group(g.dp, "dp", same_dp, pp, dp, ep, g.me.dp_rank);
    check_group(g.ep, "ep", same_ep, pp, dp, ep, g.me.ep_rank);
    check_group(g.edp, "edp", same_edp, pp, dp, ep, g.me.edp_rank);
    // one host: every rank on node 0, as many ranks per node as the world
    CHECK(g.node == 0 && g.n_nodes == 1 && g.gpus_per_node == P, "one host: node %d of %d, %d per node", g.node,
          g.n_nodes, g.gpus_per_node);
    groups_free(&g);
}

static void test_all_layouts(void) {
    int n = 0;
    for (int pp = 1; pp <= P; pp++) {
        if (P % pp) continue;
        const int dp = P / pp;
        for (int ep = 1; ep <= dp; ep++)
            if (dp % ep == 0) {
                test_layout(pp, dp, ep);
                n++;
            }
    }
    if (me == 0) printf("test_groups: %d rank(s): %d layouts checked on every rank\n", P, n);
}

static void test_nodes(void) {
    Groups g;
    char err[512];
    const int per = P >= 2 ? 2 : 1;
    int rc = groups_init(&g, comm_world(), 1, P, P, per, err, sizeof err);
    CHECK(rc == 0, "groups_init with gpus_per_node = %d: %s", per, err);
    if (rc != 0) return;
    int bad = 0;
    for (int r = 0; r < P; r++) bad += g.node_of_rank[r] != r / per;
    CHECK(bad == 0 && g.node == me / per && g.n_nodes == (P + per - 1) / per && g.gpus_per_node == per,
          "emulated nodes of %d: node %d of %d", per, g.node, g.n_nodes);
    // 8 experts in 4 groups over ep = P ranks: groups of 2 experts, whole on nodes of 2 ranks when each rank has
    // at most 2 experts... and whenever a group sits on one rank
    if (8 % P == 0) {
        rc = groups_check_expert_groups(&g, 8, 4, err, sizeof err);
        CHECK(rc == 0, "8 experts, 4 groups, ep = %d, nodes of %d: %s", P, per, err);
    }
    // 8 experts in 2 groups of 4: at ep = 8 a group spans 4 ranks, i.e. 2 nodes of 2
    if (P == 8) {
        rc = groups_check_expert_groups(&g, 8, 2, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "moe.n_expert_groups = 2: expert group 0 (experts 0..3)") &&
                  strstr(err, "rank 0 is on node 0 but rank 2 on node 1") && strstr(err, "parallel.gpus_per_node"),
              "a group split over nodes is refused, with its ranks, nodes and keys named: %s", err);
    }
    char line[384];
    groups_format_line(&g, "cpu", line, sizeof line);
    char want[64];
    snprintf(want, sizeof want, "fp8moe: rank %d of %d: stage 0/1 dp %d/%d", me, P, me, P);
    CHECK(strncmp(line, want, strlen(want)) == 0 && strstr(line, "device cpu"), "banner line: %s", line);
    groups_print_banner(&g, "cpu", stdout);
    groups_free(&g);
}

// Placement checks on layouts of any size, from node tables written out here (no communication).
static void test_expert_placement(void) {
    Layout l;
    char err[512];
    int node[16];
    CHECK(layout_make(&l, 8, 1, 8, 8, err, sizeof err) == 0, "%s", err);
    for (int r = 0; r < 8; r++) node[r] = r / 2;
    CHECK(layout_check_expert_groups(&l, node, 8, 4, err, sizeof err) == 0, "ep 8, groups of 2 on nodes of 2: %s", err);
    for (int r = 0; r < 8; r++) node[r] = r;
    CHECK(layout_check_expert_groups(&l, node, 8, 4, err, sizeof err) == -1 && strstr(err, "expert group 0 (experts 0..1)"),
          "ep 8, groups of 2 on nodes of 1: %s", err);
    CHECK(layout_check_expert_groups(&l, node, 16, 8, err, sizeof err) == 0, "16 experts, 8 groups, 1 rank per node: %s",
          err);
    // pp 2 x dp 4, ep 4: 8 experts in 2 groups, 2 experts per rank, a group on 2 ranks; nodes of 3 ranks split
    // stage 0's group 1 (ranks 2 and 3)
    CHECK(layout_make(&l, 8, 2, 4, 4, err, sizeof err) == 0, "%s", err);
    for (int r = 0; r < 8; r++) node[r] = r / 3;
    CHECK(layout_check_expert_groups(&l, node, 8, 2, err, sizeof err) == -1 &&
              strstr(err, "expert group 1 (experts 4..7) of stage 0, EP group 0 lies on world ranks 2..3"),
          "pp 2, nodes of 3: %s", err);
    for (int r = 0; r < 8; r++) node[r] = r / 2;
    CHECK(layout_check_expert_groups(&l, node, 8, 2, err, sizeof err) == 0, "pp 2, nodes of 2: %s", err);
    // dp 8, ep 2: each EP group of 2 ranks holds 4 experts per rank, groups of 2 inside a rank: any nodes work
    CHECK(layout_make(&l, 8, 1, 8, 2, err, sizeof err) == 0, "%s", err);
    for (int r = 0; r < 8; r++) node[r] = r;
    CHECK(layout_check_expert_groups(&l, node, 8, 4, err, sizeof err) == 0, "ep 2: %s", err);
    CHECK(layout_check_expert_groups(&l, node, 6, 4, err, sizeof err) == -1 && strstr(err, "moe.n_expert_groups = 4"),
          "groups not dividing experts: %s", err);
    CHECK(layout_check_expert_groups(&l, node, 9, 3, err, sizeof err) == -1 && strstr(err, "parallel.ep = 2 does not divide"),
          "ep not dividing experts: %s", err);
}

static void test_refused_layouts(void) {
    Groups g;
    char err[512], want[256];
    int rc = groups_init(&g, comm_world(), 2, P, 1, 0, err, sizeof err);
    snprintf(want, sizeof want, "parallel.pp * parallel.dp = 2 * %d = %d ranks, but the job has %d ranks", P, 2 * P, P);
    CHECK(rc == -1 && strstr(err, want), "world != pp * dp: %s", err);
    if (P % 4 == 0) {
        rc = groups_init(&g, comm_world(), P / 4, 4, 3, 0, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "parallel.ep = 3 does not divide parallel.dp = 4"), "ep not dividing dp: %s", err);
    }
    rc = groups_init(&g, comm_world(), 1, P, 1, -1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "parallel.gpus_per_node = -1"), "negative gpus_per_node: %s", err);
    Layout l;
    CHECK(layout_make(&l, 6, 2, 4, 1, err, sizeof err) == -1 && strstr(err, "2 * 4 = 8 ranks, but the job has 6 ranks"),
          "layout_make world: %s", err);
    CHECK(layout_make(&l, 8, 1, 8, 3, err, sizeof err) == -1 && strstr(err, "parallel.ep = 3 does not divide parallel.dp = 8"),
          "layout_make ep: %s", err);
    CHECK(layout_make(&l, 8, 0, 8, 1, err, sizeof err) == -1 && strstr(err, "parallel.pp = 0"), "layout_make pp 0: %s", err);

    Config c;
    config_defaults(&c);  // 8 experts
    c.parallel.dp = P;
    c.parallel.ep = (8 % P == 0) ? P : 1;
    CHECK(config_check_layout(&c, P, err, sizeof err) == 0, "config_check_layout dp=%d ep=%d: %s", P, c.parallel.ep, err);
    CHECK(config_check_layout(&c, P + 1, err, sizeof err) == -1 && strstr(err, "parallel.pp * parallel.dp"),
          "config_check_layout world mismatch: %s", err);
    c.parallel.dp = 3;
    c.parallel.ep = 3;
    CHECK(config_check_layout(&c, 3, err, sizeof err) == -1 &&
              strstr(err, "parallel.ep = 3 does not divide moe.n_routed_experts = 8"),
          "config_check_layout experts: %s", err);
    c.parallel.ep = 1;
    c.parallel.backend = PARALLEL_BACKEND_NCCL;  // a build's own backends only: refused where NCCL is not built
    err[0] = '\0';
    if (comm_nccl_available())
        CHECK(config_check_layout(&c, 3, err, sizeof err) == 0, "config_check_layout backend nccl (built): %s", err);
    else
        CHECK(config_check_layout(&c, 3, err, sizeof err) == -1 && strstr(err, "parallel.backend = nccl: this build "
              "has no NCCL backend"), "config_check_layout backend nccl (not built): %s", err);
}

int main(int argc, char **argv) {
    comm_init(&argc, &argv);
    comm_set_timeout(60);
    P = comm_world()->size;
    me = comm_world()->rank;
    if (P > 64) {
        if (me == 0) fprintf(stderr, "test_groups: at most 64 ranks\n");
        comm_finalize();
        return 2;
    }
    test_all_layouts();
    test_nodes();
    test_expert_placement();
    test_refused_layouts();
    const int rc = mpitest_finish("test_groups");
    comm_finalize();
    return rc;
}

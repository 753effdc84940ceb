/*
 * groups.c - the parallel layout (pure arithmetic) and the process groups built from it over a world
 * communicator (parallel/groups.h).
 *
 * The coordinates are computed from the formulas in groups.h, and each communicator is a comm_split
 * of the world whose color is the group's index and whose key is the world rank, so group ranks follow
 * world ranks. Nodes come from MPI (ranks that share a host's memory) unless gpus_per_node emulates
 * smaller nodes; host names are gathered for the banner and for messages.
 */
#include "parallel/groups.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int set_err(char *err, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_err(char *err, size_t size, const char *fmt, ...) {
    if (err != NULL && size > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, size, fmt, ap);
        va_end(ap);
    }
    return -1;
}

// ---------------------------------------------------------------------------- layout

int layout_make(Layout *l, int world, int pp, int dp, int ep, char *err, size_t err_size) {
    memset(l, 0, sizeof *l);
    if (world < 1) return set_err(err, err_size, "parallel layout: a world of %d ranks - expected at least 1", world);
    if (pp < 1 || dp < 1 || ep < 1)
        return set_err(err, err_size, "parallel.pp = %d, parallel.dp = %d, parallel.ep = %d - expected each at least 1",
                       pp, dp, ep);
    if ((long long)pp * dp != world)
        return set_err(err, err_size,
                       "parallel.pp * parallel.dp = %d * %d = %lld ranks, but the job has %d ranks - expected "
                       "parallel.pp * parallel.dp = the world size (mpirun -np %lld, or a layout for %d ranks)",
                       pp, dp, (long long)pp * dp, world, (long long)pp * dp, world);
    if (dp % ep != 0)
        return set_err(err, err_size,
                       "parallel.ep = %d does not divide parallel.dp = %d - expected a divisor of parallel.dp (EP groups "
                       "are formed from consecutive dp ranks of a stage)",
                       ep, dp);
    l->world = world;
    l->pp = pp;
    l->dp = dp;
    l->ep = ep;
    l->edp = dp / ep;
    return 0;
}

RankCoords layout_coords(const Layout *l, int world_rank) {
    RankCoords c;
    c.stage = world_rank / l->dp;
    c.dp_rank = world_rank % l->dp;
    c.ep_rank = c.dp_rank % l->ep;
    c.edp_rank = c.dp_rank / l->ep;
    c.ep_group = c.edp_rank;
    return c;
}

int layout_world_rank(const Layout *l, int stage, int dp_rank) { return stage * l->dp + dp_rank; }

int layout_check_expert_groups(const Layout *l, const int *node_of_rank, int n_experts, int n_expert_groups,
                               char *err, size_t err_size) {
    if (n_experts < 1 || n_expert_groups < 1 || n_experts % n_expert_groups != 0)
        return set_err(err, err_size, "moe.n_expert_groups = %d does not divide moe.n_routed_experts = %d - expected a "
                       "divisor", n_expert_groups, n_experts);
    if (n_experts % l->ep != 0)
        return set_err(err, err_size, "parallel.ep = %d does not divide moe.n_routed_experts = %d - expected a divisor "
                       "(experts are split evenly over an EP group)", l->ep, n_experts);
    const int per_rank = n_experts / l->ep, per_group = n_experts / n_expert_groups;
    for (int s = 0; s < l->pp; s++) {
        for (int j = 0; j < l->edp; j++) {
            const int base = layout_world_rank(l, s, j * l->ep);  // ep rank 0 of this EP group
            for (int k = 0; k < n_expert_groups; k++) {
                const int e0 = k * per_group, e1 = e0 + per_group - 1;
                const int first = base + e0 / per_rank, last = base + e1 / per_rank;
                for (int r = first + 1; r <= last; r++) {
                    if (node_of_rank[r] == node_of_rank[first]) continue;
                    return set_err(err, err_size,
                                   "moe.n_expert_groups = %d: expert group %d (experts %d..%d) of stage %d, EP group %d "
                                   "lies on world ranks %d..%d, and rank %d is on node %d but rank %d on node %d - "
                                   "expected every expert group on one node (node-limited routing): with parallel.ep = "
                                   "%d, %d experts per rank and %d per group, the nodes (parallel.gpus_per_node, 0 = "
                                   "hosts) must hold whole groups",
                                   n_expert_groups, k, e0, e1, s, j, first, last, first, node_of_rank[first], r,
                                   node_of_rank[r], l->ep, per_rank, per_group);
                }
            }
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------- groups over a world

// node_of_rank and gpus_per_node from the hosts (gpus_per_node = 0) or the emulated node size; host names into
// g->host_of_rank. Collective. Returns 0 or -1 with err (the same on every rank: it is computed from gathered data).
static int find_nodes(Groups *g, int gpus_per_node, char *err, size_t err_size) {
    const int W = g->layout.world;
    char host[GROUPS_HOST_MAX] = {0};
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
    comm_allgather_bytes(g->world, host, g->host_of_rank, sizeof host);
    // The host's lowest world rank names the host: the host group orders its ranks by world rank.
    Comm *local = comm_split_host(g->world, "host");
    int leader = g->world_rank;
    comm_bcast_bytes(local, &leader, sizeof leader, 0);
    const int host_ranks = local->size;
    comm_free(local);
    int *leaders = malloc((size_t)W * sizeof *leaders);
    int *sizes = malloc((size_t)W * sizeof *sizes);
    if (leaders == NULL || sizes == NULL) {
        free(leaders);
        free(sizes);
        return set_err(err, err_size, "groups_init: out of memory for %d ranks", W);
    }
    comm_allgather_bytes(g->world, &leader, leaders, sizeof leader);
    comm_allgather_bytes(g->world, &host_ranks, sizes, sizeof host_ranks);
    int rc = 0;
    if (gpus_per_node == 0) {
        // node = the host's index among the hosts in order of their lowest rank
        int most = 0;
        for (int r = 0; r < W; r++) {
            int n = 0;
            for (int q = 0; q < r; q++) n += leaders[q] == q && q < leaders[r];
            g->node_of_rank[r] = n;
            most = sizes[r] > most ? sizes[r] : most;
        }
        g->gpus_per_node = most;
    } else {
        g->gpus_per_node = gpus_per_node;
        for (int r = 0; r < W && rc == 0; r++) {
            g->node_of_rank[r] = r / gpus_per_node;
            const int first = (r / gpus_per_node) * gpus_per_node;
            if (leaders[r] != leaders[first])
                rc = set_err(err, err_size,
                             "parallel.gpus_per_node = %d puts world ranks %d and %d on node %d, but they run on "
                             "different hosts (%s and %s) - expected a node size that divides the ranks of every "
                             "host (mpirun places consecutive ranks on a host), or 0 for the hosts themselves",
                             gpus_per_node, first, r, r / gpus_per_node, g->host_of_rank[first], g->host_of_rank[r]);
        }
    }
    g->n_nodes = 0;
    for (int r = 0; r < W; r++) g->n_nodes = g->node_of_rank[r] + 1 > g->n_nodes ? g->node_of_rank[r] + 1 : g->n_nodes;
    g->node = g->node_of_rank[g->world_rank];
    free(leaders);
    free(sizes);
    return rc;
}

int groups_init(Groups *g, Comm *world, int pp, int dp, int ep, int gpus_per_node, char *err, size_t err_size) {
    memset(g, 0, sizeof *g);
    if (world == NULL) return set_err(err, err_size, "groups_init: world is NULL - expected a communicator");
    if (gpus_per_node < 0)
        return set_err(err, err_size, "parallel.gpus_per_node = %d - expected 0 (from MPI) or a positive count",
                       gpus_per_node);
    if (layout_make(&g->layout, world->size, pp, dp, ep, err, err_size) != 0) return -1;
    g->world = world;
    g->world_rank = world->rank;
    g->me = layout_coords(&g->layout, world->rank);
    const RankCoords *m = &g->me;
    // color = the group's index in the world, key = world rank: group ranks follow world ranks
    g->pp = comm_split(world, m->dp_rank, world->rank, "pp");
    g->dp = comm_split(world, m->stage, world->rank, "dp");
    g->ep = comm_split(world, m->stage * g->layout.edp + m->ep_group, world->rank, "ep");
    g->edp = comm_split(world, m->stage * g->layout.ep + m->ep_rank, world->rank, "edp");
    const int is_end = pp > 1 && (m->stage == 0 || m->stage == pp - 1);
    g->ends = comm_split(world, is_end ? m->dp_rank : COMM_UNDEFINED, world->rank, "ends");
    const int low = m->stage < pp - 1 - m->stage ? m->stage : pp - 1 - m->stage;  // the pair's lower stage
    g->mirror = comm_split(world, pp > 1 ? m->dp_rank * pp + low : COMM_UNDEFINED, world->rank, "mirror");
    g->node_of_rank = calloc((size_t)world->size, sizeof *g->node_of_rank);
    g->host_of_rank = calloc((size_t)world->size, sizeof *g->host_of_rank);
    if (g->node_of_rank == NULL || g->host_of_rank == NULL) {
        groups_free(g);
        return set_err(err, err_size, "groups_init: out of memory for %d ranks", world->size);
    }
    if (find_nodes(g, gpus_per_node, err, err_size) != 0) {
        groups_free(g);
        return -1;
    }
    return 0;
}

void groups_free(Groups *g) {
    comm_free(g->pp);
    comm_free(g->dp);
    comm_free(g->ep);
    comm_free(g->edp);
    comm_free(g->ends);
    comm_free(g->mirror);
    free(g->node_of_rank);
    free(g->host_of_rank);
    memset(g, 0, sizeof *g);
}

int groups_check_expert_groups(const Groups *g, int n_experts, int n_expert_groups, char *err, size_t err_size) {
    return layout_check_expert_groups(&g->layout, g->node_of_rank, n_experts, n_expert_groups, err, err_size);
}

// ---------------------------------------------------------------------------- banner

// "a..b step s" (or "a" or "a..b") for the members first, first + step, ... of a group of n ranks
static void format_members(char *buf, size_t size, int first, int step, int n) {
    if (n == 1) snprintf(buf, size, "%d", first);
    else if (step == 1) snprintf(buf, size, "%d..%d", first, first + n - 1);
    else snprintf(buf, size, "%d..%d step %d", first, first + (n - 1) * step, step);
}

void groups_format_line(const Groups *g, const char *device, char *buf, size_t size) {
    const Layout *l = &g->layout;
    const RankCoords *m = &g->me;
    char pp[48], dp[48], ep[48], edp[48];
    format_members(pp, sizeof pp, m->dp_rank, l->dp, l->pp);
    format_members(dp, sizeof dp, layout_world_rank(l, m->stage, 0), 1, l->dp);
    format_members(ep, sizeof ep, layout_world_rank(l, m->stage, m->ep_group * l->ep), 1, l->ep);
    format_members(edp, sizeof edp, layout_world_rank(l, m->stage, m->ep_rank), l->ep, l->edp);
    snprintf(buf, size,
             "fp8moe: rank %d of %d: stage %d/%d dp %d/%d ep %d/%d edp %d/%d | groups (world ranks) pp [%s] dp [%s] "
             "ep [%s] edp [%s] | host %s node %d of %d (%d ranks per node) | device %s",
             g->world_rank, l->world, m->stage, l->pp, m->dp_rank, l->dp, m->ep_rank, l->ep, m->edp_rank, l->edp, pp,
             dp, ep, edp, g->host_of_rank[g->world_rank], g->node, g->n_nodes, g->gpus_per_node,
             device ? device : "?");
}

#define BANNER_LINE 384

void groups_print_banner(const Groups *g, const char *device, FILE *f) {
    const int W = g->layout.world;
    char line[BANNER_LINE] = {0};
    groups_format_line(g, device, line, sizeof line);
    char *all = malloc((size_t)W * BANNER_LINE);
    if (all == NULL) {  // leaving would hang the other ranks in the gather until their timeout
        fprintf(stderr, "fp8moe: rank %d: groups_print_banner: out of memory for %d lines\n", g->world_rank, W);
        exit(1);
    }
    comm_allgather_bytes(g->world, line, all, BANNER_LINE);
    if (g->world_rank == 0) {
        for (int r = 0; r < W; r++) fprintf(f, "%.*s\n", BANNER_LINE - 1, all + (size_t)r * BANNER_LINE);
        fflush(f);
    }
    free(all);
}

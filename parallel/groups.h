/*
 * groups.h - the parallel layout of a job and its process groups: which pipeline stage, data-parallel
 * rank, expert-parallel rank and expert-data-parallel rank every world rank is, the pp, dp, ep and edp
 * communicators built from that, and which node each rank is on (DESIGN.md section 5).
 *
 * Layout, from (world, pp, dp, ep), world = pp * dp, ep dividing dp, edp = dp / ep:
 *   world rank      = stage * dp + dp_rank          (the dp ranks of a stage are consecutive)
 *   ep_rank         = dp_rank % ep,  EP group index = dp_rank / ep   (EP groups: ep consecutive dp ranks)
 *   edp_rank        = dp_rank / ep,  edp group index = ep_rank       (ranks of a stage with the same ep rank)
 *   pp group        = the ranks with the same dp_rank, one per stage, in stage order
 *   dp group        = the dp ranks of a stage (non-expert gradients are reduced over it)
 *   ep group        = the ranks that split the experts of a stage (dispatch / combine all-to-all)
 *   edp group       = the replicas of one set of local experts (expert gradients are reduced over it)
 *   ends group      = pp > 1: the first and the last stage of a pp group (both hold the embedding when MTP is
 *                     on: its two gradients are summed over it); NULL on the other stages and at pp = 1
 *   mirror group    = pp > 1: stages s and pp-1-s of a pp group (DualPipe puts the same two stages on both:
 *                     their gradients are summed over it); the middle stage of an odd pp alone; NULL at pp = 1
 * Every group orders its ranks by world rank, so group rank = dp_rank, ep_rank, edp_rank or stage.
 *
 * Nodes: node-limited routing needs every expert group (moe.n_expert_groups) whole on one node. A node
 * is a host as MPI reports it (MPI_COMM_TYPE_SHARED), or, with gpus_per_node = g > 0, the world ranks
 * [k g, (k+1) g): one host may stand for several nodes (tests), but an emulated node may not span hosts.
 *
 * The layout functions are pure (no communication) so the tests can check every rank of any layout in
 * one process; groups_init is collective over the world. Errors come back as one line in err naming the
 * config keys and numbers; the caller decides how to stop (every rank computes the same message).
 */
#ifndef FP8MOE_GROUPS_H
#define FP8MOE_GROUPS_H

#include <stddef.h>
#include <stdio.h>

#include "parallel/comm.h"

typedef struct {
    int world;  // ranks in the job
    int pp;     // pipeline stages
    int dp;     // data-parallel ranks per stage
    int ep;     // expert-parallel ranks per EP group (divides dp)
    int edp;    // dp / ep: replicas of each expert
} Layout;

typedef struct {
    int stage;     // pipeline stage = rank in the pp group
    int dp_rank;   // rank in the dp group
    int ep_rank;   // rank in the EP group
    int edp_rank;  // rank in the edp group
    int ep_group;  // which EP group of the stage (= edp_rank)
} RankCoords;

// Fills l from the four numbers; returns 0, or -1 with err naming parallel.pp / parallel.dp / parallel.ep
// and the world size when world != pp * dp or ep does not divide dp (or a number is < 1).
int layout_make(Layout *l, int world, int pp, int dp, int ep, char *err, size_t err_size);
RankCoords layout_coords(const Layout *l, int world_rank);
int layout_world_rank(const Layout *l, int stage, int dp_rank);

// Every expert group of n_experts experts in n_expert_groups groups (consecutive experts) must lie on one
// node in every EP group: expert e lives on ep rank e / (n_experts / ep). node_of_rank: layout->world
// entries. Returns 0, or -1 with err naming the group, its ranks and nodes, and the keys (moe.n_expert_groups,
// parallel.ep, parallel.gpus_per_node).
int layout_check_expert_groups(const Layout *l, const int *node_of_rank, int n_experts, int n_expert_groups,
                               char *err, size_t err_size);

#define GROUPS_HOST_MAX 64

typedef struct {
    Layout layout;
    RankCoords me;
    int world_rank;
    Comm *world;          // not owned
    Comm *pp, *dp, *ep, *edp;  // owned: freed by groups_free
    Comm *ends;           // owned; stages 0 and pp-1 at pp > 1, else NULL
    Comm *mirror;         // owned; stages s and pp-1-s at pp > 1, else NULL
    int gpus_per_node;    // ranks per node: the config's value, or the most ranks MPI reports on a host
    int node;             // this rank's node, 0 .. n_nodes-1
    int n_nodes;
    int *node_of_rank;    // layout.world entries
    char (*host_of_rank)[GROUPS_HOST_MAX];  // layout.world host names
} Groups;

// Collective over world (whose size is the world of the layout). gpus_per_node: 0 = nodes are hosts.
// Returns 0, or -1 with err (the same message on every rank: a bad layout, or an emulated node spanning
// two hosts) and g cleared; nothing needs freeing after an error.
int groups_init(Groups *g, Comm *world, int pp, int dp, int ep, int gpus_per_node, char *err, size_t err_size);
void groups_free(Groups *g);
int groups_check_expert_groups(const Groups *g, int n_experts, int n_expert_groups, char *err, size_t err_size);
// One line per rank (coordinates, group members, host, node, device), gathered over the world and
// printed by world rank 0 to f in rank order. Collective. device: e.g. "cpu" or "cuda:0".
void groups_print_banner(const Groups *g, const char *device, FILE *f);
// This rank's banner line (what groups_print_banner prints for it), without a newline.
void groups_format_line(const Groups *g, const char *device, char *buf, size_t size);

#endif

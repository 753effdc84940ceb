/*
 * job_groups.h - a job's process groups over the world that launched it (comm_world(): MPI's under mpirun, else
 * one process), as `fp8moe train` and `fp8moe bench step` make them. See job_groups.c.
 */
#ifndef FP8MOE_JOB_GROUPS_H
#define FP8MOE_JOB_GROUPS_H

#include "parallel/comm.h"
#include "parallel/groups.h"
#include "train/config.h"

typedef struct {
    Groups groups;     // the layout's pp / dp / ep / edp / ends / mirror groups
    int groups_ok;     // groups was made (job_groups_free frees it)
    Comm *world;       // the world the groups split: MPI's, or its NCCL copy
    Comm *nccl_world;  // that NCCL copy when device buffers go over NCCL (owned), else NULL
    int gpu;           // this rank's CUDA device (0 unless NCCL gave each rank its own)
} JobGroups;

// The groups of cfg's layout over the world, with every rank's line in the banner (stdout) and, from world
// rank 0, the host's RDMA topology. Checks the layout against the world size, parallel.backend against dev,
// expert groups whole on nodes. Over NCCL (parallel.backend = nccl, or auto with a GPU per rank) it selects
// this rank's GPU before any device allocation. Collective. Returns 0, or -1 after world rank 0 printed the
// reason (every rank reaches the same answer); g is then to be freed all the same.
int job_groups_create(JobGroups *g, const Config *cfg, Device dev);
// Frees what job_groups_create made (safe on a zeroed or failed g).
void job_groups_free(JobGroups *g);

#endif

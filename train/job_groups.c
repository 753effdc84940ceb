/*
 * job_groups.c - the process groups of a job's parallel layout over the world that launched it: the checks
 * that need the world (layout against the world size, the backend against the device, expert groups whole on
 * nodes), the NCCL world for GPU ranks that have a GPU each, and every rank's banner line (job_groups.h).
 * Shared by `fp8moe train` and `fp8moe bench step`, so that a benchmark runs exactly the trainer's layout.
 */
#include "train/job_groups.h"

#include <stdio.h>
#include <string.h>

#include "parallel/topology.h"

#define ERR_MAX 2048

// Whether this job's device buffers travel over NCCL: GPU ranks of a launched job (world size above 1) with
// parallel.backend = nccl, or auto when the build has NCCL and every host has a GPU for each of its ranks (so
// that auto never refuses a job the MPI backend can run: ranks that share a GPU stay on MPI). All ranks agree.
static int use_nccl(const Config *cfg, Device dev, Comm *world) {
    const ParallelBackend b = cfg->parallel.backend;
    if (dev != DEVICE_CUDA || world->size == 1 || b == PARALLEL_BACKEND_MPI) return 0;
    if (b == PARALLEL_BACKEND_NCCL) return 1;  // (comm_nccl_select_gpu refuses a host short of GPUs)
    if (!comm_nccl_available()) return 0;
    Comm *host = comm_split_host(world, "host");
    double short_of_gpus = host->size > cuda_device_count();
    comm_free(host);
    comm_allreduce_max_double(world, &short_of_gpus, 1);
    return short_of_gpus == 0;
}

int job_groups_create(JobGroups *g, const Config *cfg, Device dev) {
    char err[ERR_MAX];
    const ParallelConfig *pc = &cfg->parallel;
    g->world = comm_world();
    if (pc->backend == PARALLEL_BACKEND_NCCL && dev != DEVICE_CUDA) {
        if (g->world->rank == 0)
            fprintf(stderr, "fp8moe: %s: parallel.backend = nccl needs GPU ranks, but the device is the CPU - set "
                    "parallel.backend = auto or mpi, or train.device = cuda\n", cfg->path);
        return -1;
    }
    if (config_check_layout(cfg, g->world->size, err, sizeof err) != 0) {
        if (g->world->rank == 0) fprintf(stderr, "fp8moe: %s: %s\n", cfg->path, err);
        return -1;
    }
    g->gpu = 0;  // without NCCL every GPU rank uses GPU 0 (ranks share it over the MPI backend)
    if (use_nccl(cfg, dev, g->world)) {
        g->gpu = comm_nccl_select_gpu(g->world);  // before the first device allocation
        g->world = g->nccl_world = comm_nccl_dup(g->world);
    }
    if (groups_init(&g->groups, g->world, pc->pp, pc->dp, pc->ep, pc->gpus_per_node, err, sizeof err) != 0) {
        if (g->world->rank == 0) fprintf(stderr, "fp8moe: %s: %s\n", cfg->path, err);
        return -1;
    }
    g->groups_ok = 1;
    if (groups_check_expert_groups(&g->groups, cfg->moe.n_routed_experts, cfg->moe.n_expert_groups, err,
                                   sizeof err) != 0) {
        if (g->world->rank == 0) fprintf(stderr, "fp8moe: %s: %s\n", cfg->path, err);
        return -1;
    }
    // over MPI, GPU ranks all use CUDA device 0 and share it: their device buffers are staged through pinned host
    // memory (parallel/comm.h); over NCCL each has its own
    char device[32] = "cpu";
    if (dev == DEVICE_CUDA) snprintf(device, sizeof device, "cuda:%d %s", g->gpu, comm_kind_name(g->world->kind));
    groups_print_banner(&g->groups, device, stdout);
    if (g->world->rank == 0) topology_print(stdout);  // the host's RDMA devices and the GPUs closest to them
    return 0;
}

void job_groups_free(JobGroups *g) {
    if (g->groups_ok) groups_free(&g->groups);
    comm_free(g->nccl_world);  // after the groups split from it (comm.h)
    memset(g, 0, sizeof *g);
}

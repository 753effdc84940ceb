/*
 * test_parallel_equivalence.c - pipeline, data and expert parallel compute the model of one process (issues 19
 * and 20, DESIGN.md sections 5 and 6).
 *
 * Run under mpirun with N ranks and an EP size P (dividing N): every rank builds the TrainState of
 * configs/tiny.ini (8 experts, or EXPERTS) with parallel.dp = N, parallel.ep = P, micro_batch_size B and grad_accum A,
 * so it holds every non-expert tensor and experts [rank_in_ep x E/P, ...). World rank 0 also builds the
 * one-process state of the same global batch: micro_batch_size P x B, grad_accum (N/P) x A. The loader gives
 * the P ranks of EP group g the consecutive blocks of rows that make the one process's micro-batch
 * a (N/P) + g (data/loader.h), and dispatch fills each expert's segment from source ranks in order, so each
 * expert sees the rows in the order one process gives them; with B x T a multiple of 128 the FP8 tiles along
 * the tokens cover the same rows too. Both train `steps` steps. Checked:
 *   - step 1: the loss terms and every parameter's gradient against the one process (each rank its own
 *     tensors, by global name). Not bitwise: the one process adds its micro-batches' gradients into one
 *     buffer in its order (a GEMM adds a whole micro-batch's dW to the running sum, over P x B rows), the
 *     ranks sum their own micro-batches and then the partial sums in rank order; the same terms grouped
 *     otherwise round differently (about 1e-7 relative per sum). Bound: per tensor max |par - one| <=
 *     1e-5 x max |one| (+ 1e-12); the loss terms within 1e-6 relative.
 *   - every step: the non-expert gradients and weights, the router biases and the step's numbers of every
 *     rank equal rank 0's bit for bit, and the experts' of every rank equal those of their replicas (edp);
 *   - every step: the loss within 1e-5 relative of the one process's in fp32 (the curves of the two runs);
 *     with tiny.ini's lr of 3e-3 a model this small amplifies rounding differences past 1e-5 by step 20,
 *     so the test trains at lr 5e-4. In bf16 and fp8 modes the bound is 1e-4: a weight that differs by one
 *     FP32 ulp can round to a neighbouring BF16 / FP8 value (steps of 2^-8 relative and coarser), which
 *     moves the loss by ~1e-5 within 10-20 steps (measured: up to 2.4e-5). Only bitwise-equal gradients
 *     would hold those curves to 1e-5: with one micro-batch per rank and P = 1 every tensor but embed.weight
 *     and head.weight already sums bitwise like the one process (they take two additions per micro-batch,
 *     main and MTP), so that is where the remaining order difference lies.
 *   - the expert load counts of step 1, summed over the ranks, equal the one process's exactly (integers),
 *     so the router biases after step 1 are bitwise those of the one process.
 * With ZERO1 = 1 the parallel run shards its master weights' update and AdamW moments over dp (experts over
 * edp): its gradient sums are the same rank-order sums, reduce-scattered; the gradients compared at step 1 are
 * then this rank's shard (the rest of the buffer holds partial sums and is skipped), and the weights, all-gathered
 * after the update, are again bitwise equal on every rank. Only the clip norm is summed in another order.
 * With PP > 1 the N ranks are PP stages of N / PP dp ranks each, running parallel.schedule = SCHEDULE over their
 * GRAD_ACCUM micro-batches; each stage holds its layers (and the last the head, the MTP modules and a copy of
 * the embedding), and each rank checks the gradients of the tensors it holds. Every stage-local tensor sums its
 * micro-batches in the order of one process, so at dp = 1 every gradient but embed.weight's is bitwise (the last
 * stage's MTP part of it and the first stage's main part are summed after the step, where one process adds them
 * micro-batch by micro-batch); the bounds above hold for all of them. dualpipev holds both ends on rank 0 (the same
 * embedding sum, within one rank); dualpipe runs two copies of every stage (directions A and B, half the
 * micro-batches each) whose gradients are summed after the step, so none of its gradients is bitwise (about 1e-7).
 * The replicas checked bit for bit are then a stage's dp ranks, the two ends' embedding copies, dualpipe's mirror
 * ranks (the same two stages), and the router biases (the same on every rank of the world).
 * Usage: test_parallel_equivalence MODE CACHE_DIR [STEPS] [B] [GRAD_ACCUM] [EP] [EXPERTS GROUPS] [ZERO1] [PP SCHEDULE
 * [STAGE_LAYERS]]
 * (MODE: fp32, bf16 or fp8; EXPERTS routed experts in GROUPS expert groups, default tiny.ini's 8 in 4; SCHEDULE
 * 1f1b, zb1p, dualpipe or dualpipev; STAGE_LAYERS parallel.stage_layers, e.g. "2,1")
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpitest.h"
#include "parallel/groups.h"
#include "train/config.h"
#include "train/step.h"
#include "train/train_state.h"

// Loads configs/tiny.ini with the test's overrides. Returns 0 or -1 (message printed).
static int n_experts = 8, n_groups = 4;  // tiny.ini's; the EP64 run passes 64 in 8 groups
static int zero1;                        // parallel.zero1 of the parallel run
static int pp = 1;                       // parallel.pp of the parallel run
static const char *schedule = "1f1b";    // parallel.schedule of the parallel run
static const char *stage_layers = "";    // parallel.stage_layers of the parallel run (empty: the even split)

static int load_config(Config *cfg, const char *mode, const char *cache, int stages, int dp, int ep, int B, int A,
                       int steps) {
    char o[17][256];
    snprintf(o[0], sizeof o[0], "precision.mode=%s", mode);
    snprintf(o[1], sizeof o[1], "data.text=tests/data/shakespeare.txt");
    snprintf(o[2], sizeof o[2], "data.cache_dir=%s", cache);
    snprintf(o[3], sizeof o[3], "parallel.dp=%d", dp);
    snprintf(o[4], sizeof o[4], "train.micro_batch_size=%d", B);
    snprintf(o[5], sizeof o[5], "train.grad_accum=%d", A);
    snprintf(o[6], sizeof o[6], "train.steps=%d", steps);
    snprintf(o[7], sizeof o[7], "optim.lr=%s", getenv("DP_TEST_LR") ? getenv("DP_TEST_LR") : "0.0005");
    snprintf(o[8], sizeof o[8], "parallel.ep=%d", ep);
    snprintf(o[9], sizeof o[9], "checkpoint.save_weights=false");
    snprintf(o[10], sizeof o[10], "moe.n_routed_experts=%d", n_experts);
    snprintf(o[11], sizeof o[11], "moe.n_expert_groups=%d", n_groups);
    snprintf(o[12], sizeof o[12], "parallel.zero1=%s", zero1 && dp > 1 ? "true" : "false");
    snprintf(o[13], sizeof o[13], "parallel.pp=%d", stages);
    snprintf(o[14], sizeof o[14], "parallel.schedule=%s", schedule);
    // at least one layer per stage of the parallel run (tiny.ini has 3), the same model in both runs
    const int pipe_stages = strcmp(schedule, "dualpipev") == 0 ? 2 * pp : pp;  // dualpipev: two stages per rank
    snprintf(o[15], sizeof o[15], "model.n_layers=%d", pipe_stages > 3 ? pipe_stages : 3);
    snprintf(o[16], sizeof o[16], "parallel.stage_layers=%s", stages > 1 ? stage_layers : "");
    const char *ov[17];
    for (int i = 0; i < 17; i++) ov[i] = o[i];
    char err[2048];
    if (config_load(cfg, "configs/tiny.ini", ov, 17, err, sizeof err) != 0) {
        fprintf(stderr, "rank %d: %s\n", comm_world()->rank, err);
        return -1;
    }
    return 0;
}

// Whether every rank's n bytes at p equal those of rank 0 of the group.
static int same_as_rank0(Comm *group, const void *p, size_t n) {
    char *root = malloc(n ? n : 1);
    if (group->rank == 0) memcpy(root, p, n);
    comm_bcast_bytes(group, root, n, 0);
    int same = memcmp(root, p, n) == 0;
    free(root);
    return same;
}

static double rel(double a, double b) { return fabs(a - b) / fmax(fabs(b), 1e-30); }

int main(int argc, char **argv) {
    comm_init(&argc, &argv);
    if (argc < 3) {
        fprintf(stderr, "usage: test_parallel_equivalence MODE CACHE_DIR [STEPS] [B] [GRAD_ACCUM] [EP] [EXPERTS GROUPS] "
                "[ZERO1] [PP SCHEDULE]\n");
        comm_finalize();
        return 2;
    }
    const char *mode = argv[1], *cache = argv[2];
    const int steps = argc > 3 ? atoi(argv[3]) : 20, B = argc > 4 ? atoi(argv[4]) : 2, A = argc > 5 ? atoi(argv[5]) : 2;
    const int P = argc > 6 ? atoi(argv[6]) : 1;
    if (argc > 8) n_experts = atoi(argv[7]), n_groups = atoi(argv[8]);
    if (argc > 9) zero1 = atoi(argv[9]);
    if (argc > 11) pp = atoi(argv[10]), schedule = argv[11];
    if (argc > 12) stage_layers = argv[12];
    Comm *world = comm_world();
    const int N = world->size / pp;  // dp ranks per stage
    char name[96];
    if (pp > 1)
        snprintf(name, sizeof name, "test_parallel_equivalence %s pp=%d %s dp=%d ep=%d%s", mode, pp, schedule, N, P,
                 zero1 ? " zero1" : "");
    else
        snprintf(name, sizeof name, "test_parallel_equivalence %s dp=%d ep=%d%s", mode, N, P, zero1 ? " zero1" : "");

    Config *cfg = calloc(2, sizeof *cfg);
    Groups g;
    char err[2048];
    if (load_config(&cfg[0], mode, cache, pp, N, P, B, A, steps) != 0 ||
        load_config(&cfg[1], mode, cache, 1, 1, 1, P * B, N / P * A, steps) != 0)
        return 1;
    if (groups_init(&g, world, pp, N, P, 0, err, sizeof err) != 0) {
        fprintf(stderr, "rank %d: %s\n", world->rank, err);
        return 1;
    }
    TrainState dp, one;
    int ok = train_state_create(&dp, &cfg[0], DEVICE_CPU, &g, steps, 0, err, sizeof err) == 0;
    CHECK(ok, "dp state: %s", err);
    const int ref = world->rank == 0;  // rank 0 also runs the one-process reference
    if (ref) {
        int one_ok = train_state_create(&one, &cfg[1], DEVICE_CPU, NULL, steps, 0, err, sizeof err) == 0;
        CHECK(one_ok, "one-process state: %s", err);
        ok = ok && one_ok;
    }
    // every rank knows the one-process table (the same on every rank), to find its tensors in rank 0's gradients
    Model table;
    ok = ok && model_create(&table, &cfg[1], DEVICE_CPU, 1, err, sizeof err) == 0;
    if (!all_ranks_ok(world, ok)) return mpitest_finish(name);
    Model *m = &dp.model;
    const int64_t n_one = table.n_dense_elems + table.n_expert_elems;
    const int64_t n_bias = (int64_t)m->n_moe_layers * cfg[0].moe.n_routed_experts;
    real *one_grads = malloc((size_t)n_one * sizeof(real));
    model_zero_load(m);
    if (ref) model_zero_load(&one.model);
    if (stage_layers[0]) {  // the listed split took effect: this stage's chunk holds the layers the list gives it
        int first = 0, n = 0;
        placement_stage_layers(&cfg[0], g.me.stage, pp, &first, &n);
        CHECK(m->chunks[0].first_block == first && m->chunks[0].n_blocks == n && n == cfg[0].parallel.stage_layer_count[g.me.stage],
              "stage %d holds layers [%d, +%d), expected [%d, +%d) from parallel.stage_layers = %s", g.me.stage,
              m->chunks[0].first_block, m->chunks[0].n_blocks, first, n, stage_layers);
    }
    const int share = n_experts / P;
    CHECK(m->placement.n_experts == share && m->placement.expert0 == g.me.ep_rank * share,
          "holds experts [%d, +%d), expected [%d, +%d)", m->placement.expert0, m->placement.n_experts,
          g.me.ep_rank * share, share);

    double worst_loss = 0, worst_grad = 0;
    for (int s = 1; s <= steps; s++) {
        StepResult r_dp, r_one = {0};
        int step_ok = train_step(&dp, &r_dp, err, sizeof err) == 0;
        CHECK(step_ok, "dp step %d: %s", s, err);
        if (ref) {
            int one_ok = train_step(&one, &r_one, err, sizeof err) == 0;
            CHECK(one_ok, "one-process step %d: %s", s, err);
        }
        if (!all_ranks_ok(world, step_ok)) break;
        // the replicas hold the same bits: non-expert tensors on every dp rank of a stage, experts within their edp
        // group, router biases and the step's numbers on every rank
        const size_t dense = (size_t)m->n_dense_elems * sizeof(real), expert = (size_t)m->n_expert_elems * sizeof(real);
        if (!zero1) CHECK(same_as_rank0(g.dp, m->grads, dense), "step %d: gradients differ from dp rank 0's", s);
        CHECK(same_as_rank0(g.dp, m->weights, dense), "step %d: weights differ from dp rank 0's", s);
        if (!zero1)
            CHECK(same_as_rank0(g.edp, m->grads + m->n_dense_elems, expert), "step %d: expert gradients differ from "
                  "their replica's", s);
        CHECK(same_as_rank0(g.edp, m->weights + m->n_dense_elems, expert), "step %d: expert weights differ from "
              "their replica's", s);
        CHECK(same_as_rank0(world, m->router_bias, (size_t)n_bias * sizeof(real)), "step %d: router biases differ from "
              "rank 0's", s);
        const ParamInfo *embed = dp.ends ? model_find_param(m, "embed.weight") : NULL;
        if (embed)  // the first and the last stage's copies of the embedding take the same update
            CHECK(same_as_rank0(dp.ends, m->weights + embed->offset, (size_t)embed->numel * sizeof(real)),
                  "step %d: the last stage's copy of embed.weight differs from the first stage's", s);
        if (dp.mirror)  // dualpipe: the two copies of a rank's stages take the same update
            CHECK(same_as_rank0(dp.mirror, m->weights, dense + expert), "step %d: weights differ from the mirror rank's",
                  s);
        StepResult agreed = r_dp;
        agreed.fp8_gemms = 0;  // a rank's own count: an expert that gets no rows on a rank runs no GEMM there
        CHECK(same_as_rank0(world, &agreed, sizeof agreed), "step %d: the step's result differs from rank 0's", s);
        if (ref) {
            const double e = rel(r_dp.loss, r_one.loss);
            if (e > worst_loss) worst_loss = e;
            if (getenv("DP_TEST_VERBOSE")) printf("step %d loss %.9g %.9g rel %.3g\n", s, r_dp.loss, r_one.loss, e);
            const double curve = !strcmp(mode, "fp32") ? 1e-5 : 1e-4;
            CHECK(e <= (s == 1 ? 1e-6 : curve), "step %d: loss %.9g vs one process %.9g (relative %.3g)", s, r_dp.loss,
                  r_one.loss, e);
            CHECK(rel(r_dp.mtp, r_one.mtp) <= (s == 1 ? 1e-6 : curve), "step %d: mtp %.9g vs %.9g", s, r_dp.mtp,
                  r_one.mtp);
        }
        if (s != 1) continue;
        if (ref) {
            CHECK(rel(r_dp.balance, r_one.balance) <= 1e-6, "step 1: balance %.9g vs %.9g", r_dp.balance, r_one.balance);
            CHECK(memcmp(m->router_bias, one.model.router_bias, (size_t)n_bias * sizeof(real)) == 0,
                  "step 1: router biases differ from the one process's (the summed loads must be exact)");
            memcpy(one_grads, one.model.grads, (size_t)n_one * sizeof(real));
        }
        comm_bcast_bytes(world, one_grads, (size_t)n_one * sizeof(real), 0);
        for (int i = 0; i < m->n_params; i++) {
            const ParamInfo *p = &m->params[i];
            const ParamInfo *q = model_find_param(&table, p->name);
            CHECK(q != NULL && q->numel == p->numel, "%s: not in the one-process table", p->name);
            if (!q) continue;
            const real *a = m->grads + p->offset, *b = one_grads + q->offset;
            double scale = 0, diff = 0;
            int64_t k0 = 0, k1 = p->numel;  // with ZeRO-1, only this rank's shard holds the summed gradient
            if (zero1) {
                const TrainedRegion *r = &dp.regions[p->is_expert ? REGION_EXPERTS : REGION_DENSE];
                k0 = r->lo - p->offset > 0 ? r->lo - p->offset : 0;
                k1 = r->lo + r->n - p->offset < p->numel ? r->lo + r->n - p->offset : p->numel;
            }
            for (int64_t k = k0; k < k1; k++) {
                scale = fmax(scale, fabs((double)b[k]));
                diff = fmax(diff, fabs((double)a[k] - (double)b[k]));
            }
            const double r = diff / fmax(scale, 1e-30);
            if (getenv("DP_TEST_VERBOSE") && diff > 0) printf("rank %d: not bitwise: %s %.3g\n", world->rank, p->name, r);
            if (r > worst_grad) worst_grad = r;
            CHECK(diff <= 1e-5 * scale + 1e-12, "step 1: %s: max |dp - one| = %.3g, max |one| = %.3g", p->name, diff,
                  scale);
        }
    }
    comm_allreduce_max_double(world, &worst_grad, 1);
    if (ref)
        printf("%s: %d steps; worst loss relative difference %.3g; step-1 worst gradient difference %.3g of its "
               "tensor's max\n", name, steps, worst_loss, worst_grad);
    free(one_grads);
    model_free(&table);
    if (ref) train_state_free(&one);
    train_state_free(&dp);
    groups_free(&g);
    const int rc = mpitest_finish(name);
    free(cfg);
    comm_finalize();
    return rc;
}

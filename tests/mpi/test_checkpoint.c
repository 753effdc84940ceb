/*
 * test_checkpoint.c - checkpoints under data and expert parallelism (issue 21, train/checkpoint.c).
 *
 * Run under mpirun with 4 ranks on configs/tiny.ini (8 experts), micro_batch_size 4 x seq_len 32 (one FP8 tile),
 * grad_accum 1. Three parts:
 *   1. dp = 4, ep = 2: train 10 steps, save (collective), train to step 20; a fresh state of the same layout
 *      loads the checkpoint and trains 10 steps: every step's loss, MTP loss and gradient norm (bits, printed in
 *      hex by rank 0) and at the end every rank's weights, moments and router biases equal the uninterrupted
 *      run's. A dp = 4, ep = 2 state with ZeRO-1 loads the same checkpoint: its step-11 loss (the forward of the
 *      loaded weights) equals the run's bit for bit, its moments are its shards of the saved ones.
 *   2. one process -> dp = 2, ep = 2 with ZeRO-1 (world ranks 0 and 1): world rank 0 alone trains the one-process
 *      job of the same global batch (micro_batch_size 2 x 4, data/loader.h) for 10 steps and saves; the two ranks
 *      load it: every tensor and every moment element they hold equals the one process's bit for bit (checked by
 *      global name against rank 0's state), and the next step's loss is the one process's within 1e-6 relative
 *      (the same weights and rows; only the order of the float sums over rows differs).
 *   3. and back: the dp = 2 state saves at step 11; a one-process state loads it on rank 0: bitwise the tensors
 *      the two ranks hold, and step 12's loss within 1e-6 relative of theirs.
 * Usage: test_checkpoint MODE CACHE_DIR (MODE: fp32, bf16 or fp8; the checkpoints go to a temporary directory
 * that rank 0 makes and removes, or keeps with CHECKPOINT_TEST_KEEP=1 in the environment, to inspect them).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpitest.h"
#include "parallel/groups.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/step.h"
#include "train/train_state.h"

static const char *mode, *cache;
static char err[4096];

static int load_config(Config *cfg, int dp, int ep, int B, int zero1) {
    char o[10][256];
    snprintf(o[0], sizeof o[0], "precision.mode=%s", mode);
    snprintf(o[1], sizeof o[1], "data.text=tests/data/shakespeare.txt");
    snprintf(o[2], sizeof o[2], "data.cache_dir=%s", cache);
    snprintf(o[3], sizeof o[3], "parallel.dp=%d", dp);
    snprintf(o[4], sizeof o[4], "parallel.ep=%d", ep);
    snprintf(o[5], sizeof o[5], "train.micro_batch_size=%d", B);
    snprintf(o[6], sizeof o[6], "parallel.zero1=%s", zero1 ? "true" : "false");
    snprintf(o[7], sizeof o[7], "train.device=cpu");
    snprintf(o[8], sizeof o[8], "checkpoint.save_weights=false");
    snprintf(o[9], sizeof o[9], "train.grad_accum=1");
    const char *ov[10] = {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9]};
    char cerr[2048];
    if (config_load(cfg, "configs/tiny.ini", ov, 10, cerr, sizeof cerr) != 0) {
        fprintf(stderr, "rank %d: %s\n", comm_world()->rank, cerr);
        return -1;
    }
    return 0;
}

// n steps into out (may be NULL); returns 0 or -1 (checked).
static int train(TrainState *ts, int n, StepResult *out) {
    for (int s = 0; s < n; s++) {
        StepResult r;
        const int ok = train_step(ts, &r, err, sizeof err) == 0;
        CHECK(ok, "step %d: %s", ts->step + 1, err);
        if (!ok) return -1;
        if (out) out[s] = r;
    }
    return 0;
}

static uint64_t bits(double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static double rel(double a, double b) { return fabs(a - b) / fmax(fabs(b), 1e-30); }

// ---------------------------------------------------------------------------- state against a one-process state

// The one-process state's flat buffers, as world rank 0 holds them, sent to every rank of `group`.
typedef struct {
    real *weights, *bias;
    uint16_t *mom[2][2];  // [region][m, v], regions over the one-process buffer: dense [0, nd), experts [nd, nd + ne)
} OneState;

static void one_state_share(Comm *group, const Model *table, const TrainState *one, OneState *o) {
    const int64_t nd = table->n_dense_elems, ne = table->n_expert_elems;
    const int64_t nb = (int64_t)table->n_moe_layers * table->cfg.moe.n_routed_experts;
    const int64_t n[2] = {nd, ne};
    o->weights = malloc((size_t)(nd + ne) * sizeof(real));
    o->bias = malloc((size_t)nb * sizeof(real));
    for (int k = 0; k < 2; k++)
        for (int q = 0; q < 2; q++) o->mom[k][q] = malloc((size_t)(n[k] + 1) * sizeof(uint16_t));
    if (group->rank == 0) {
        memcpy(o->weights, one->model.weights, (size_t)(nd + ne) * sizeof(real));
        memcpy(o->bias, one->model.router_bias, (size_t)nb * sizeof(real));
        for (int k = 0; k < 2; k++) {
            memcpy(o->mom[k][0], one->regions[k].opt.m, (size_t)n[k] * sizeof(uint16_t));
            memcpy(o->mom[k][1], one->regions[k].opt.v, (size_t)n[k] * sizeof(uint16_t));
        }
    }
    comm_bcast_bytes(group, o->weights, (size_t)(nd + ne) * sizeof(real), 0);
    comm_bcast_bytes(group, o->bias, (size_t)nb * sizeof(real), 0);
    for (int k = 0; k < 2; k++)
        for (int q = 0; q < 2; q++) comm_bcast_bytes(group, o->mom[k][q], (size_t)n[k] * sizeof(uint16_t), 0);
}

static void one_state_free(OneState *o) {
    free(o->weights);
    free(o->bias);
    for (int k = 0; k < 2; k++)
        for (int q = 0; q < 2; q++) free(o->mom[k][q]);
}

// Every tensor ts holds and every moment element of its regions, by global name, against the one-process state.
static void check_same_as_one(const TrainState *ts, const Model *table, const OneState *o, const char *what) {
    const Model *m = &ts->model;
    int bad_w = 0, bad_m = 0;
    for (int i = 0; i < m->n_params; i++) {
        const ParamInfo *p = &m->params[i], *q = model_find_param(table, p->name);
        CHECK(q != NULL, "%s: %s is not in the one-process table", what, p->name);
        if (!q) continue;
        if (memcmp(m->weights + p->offset, o->weights + q->offset, (size_t)p->numel * sizeof(real)) != 0 && bad_w++ < 3)
            CHECK(0, "%s: weights of %s differ from the one process's", what, p->name);
        for (int k = 0; k < 2; k++) {
            const TrainedRegion *r = &ts->regions[k];
            const int64_t a = p->offset > r->lo ? p->offset : r->lo;
            const int64_t b = p->offset + p->numel < r->lo + r->n ? p->offset + p->numel : r->lo + r->n;
            if (b <= a) continue;
            const int ok_region = q->is_expert == (k == REGION_EXPERTS);
            CHECK(ok_region, "%s: %s is in region %d here but not in the one process", what, p->name, k);
            if (!ok_region) continue;
            const int64_t at = q->offset + (a - p->offset) - (k == REGION_EXPERTS ? table->n_dense_elems : 0);
            for (int v = 0; v < 2; v++) {
                const uint16_t *mine = (v ? r->opt.v : r->opt.m) + (a - r->lo);
                if (memcmp(mine, o->mom[k][v] + at, (size_t)(b - a) * sizeof(uint16_t)) != 0 && bad_m++ < 3)
                    CHECK(0, "%s: AdamW %s of %s (elements [%lld, %lld)) differs from the one process's", what,
                          v ? "v" : "m", p->name, (long long)(a - p->offset), (long long)(b - p->offset));
            }
        }
    }
    const size_t nb = (size_t)m->n_moe_layers * m->cfg.moe.n_routed_experts * sizeof(real);
    CHECK(memcmp(m->router_bias, o->bias, nb) == 0, "%s: router biases differ from the one process's", what);
    CHECK(bad_w == 0 && bad_m == 0, "%s: %d tensors' weights and %d moment pieces differ", what, bad_w, bad_m);
}

// ---------------------------------------------------------------------------- parts

// 1. dp = 4, ep = 2: bitwise continuation, and a ZeRO-1 state of the same layout from the same checkpoint.
static void part_same_layout(Groups *g, const char *root) {
    Comm *world = g->world;
    Config cfg, cfg_z;
    if (load_config(&cfg, 4, 2, 4, 0) != 0 || load_config(&cfg_z, 4, 2, 4, 1) != 0) return;
    char dir[256];
    snprintf(dir, sizeof dir, "%s/dp4ep2", root);
    TrainState a, b, z;
    StepResult ra[20], rb[10], rz;
    int ok = train_state_create(&a, &cfg, DEVICE_CPU, g, 20, 0, err, sizeof err) == 0;
    CHECK(ok, "dp=4 state: %s", err);
    if (!all_ranks_ok(world, ok)) return;
    model_zero_load(&a.model);
    ok = train(&a, 10, ra) == 0;
    if (!all_ranks_ok(world, ok)) return;
    ok = checkpoint_save(&a, g, dir, 2, err, sizeof err) == 0;
    CHECK(ok, "save at step 10: %s", err);
    if (!ok || train(&a, 10, ra + 10) != 0) return;

    ok = train_state_create(&b, &cfg, DEVICE_CPU, g, 20, 0, err, sizeof err) == 0;
    CHECK(ok, "second dp=4 state: %s", err);
    if (!all_ranks_ok(world, ok)) return;
    model_zero_load(&b.model);
    ok = checkpoint_load(&b, g, dir, err, sizeof err) == 0;
    CHECK(ok, "load: %s", err);
    if (!ok) return;
    CHECK(b.step == 10, "loaded step %d, expected 10", b.step);
    if (train(&b, 10, rb) != 0) return;
    for (int s = 0; s < 10; s++) {
        const StepResult *x = &ra[10 + s], *y = &rb[s];
        const int same = bits(x->loss) == bits(y->loss) && bits(x->mtp) == bits(y->mtp) &&
                         bits(x->grad_norm) == bits(y->grad_norm) && bits(x->balance) == bits(y->balance);
        if (world->rank == 0)
            printf("dp=4 ep=2 %s step %2d: loss %016llx (%.9f) resumed %016llx%s\n", mode, 11 + s,
                   (unsigned long long)bits(x->loss), x->loss, (unsigned long long)bits(y->loss),
                   same ? "" : "  DIFFERENT");
        CHECK(same, "step %d: the resumed run differs (loss %.17g vs %.17g)", 11 + s, y->loss, x->loss);
    }
    const Model *ma = &a.model, *mb = &b.model;
    CHECK(memcmp(ma->weights, mb->weights, (size_t)(ma->n_dense_elems + ma->n_expert_elems) * sizeof(real)) == 0,
          "weights after step 20 differ from the uninterrupted run's");
    for (int k = 0; k < 2; k++)
        CHECK(memcmp(a.regions[k].opt.m, b.regions[k].opt.m, (size_t)a.regions[k].n * 2) == 0 &&
                  memcmp(a.regions[k].opt.v, b.regions[k].opt.v, (size_t)a.regions[k].n * 2) == 0,
              "region %d's moments after step 20 differ", k);
    CHECK(memcmp(ma->router_bias, mb->router_bias, (size_t)ma->n_moe_layers * cfg.moe.n_routed_experts * sizeof(real))
              == 0, "router biases after step 20 differ");
    train_state_free(&b);

    // the same checkpoint into ZeRO-1 shards
    ok = train_state_create(&z, &cfg_z, DEVICE_CPU, g, 20, 0, err, sizeof err) == 0;
    CHECK(ok, "ZeRO-1 state: %s", err);
    if (!all_ranks_ok(world, ok)) return;
    model_zero_load(&z.model);
    ok = checkpoint_load(&z, g, dir, err, sizeof err) == 0;
    CHECK(ok, "ZeRO-1 load: %s", err);
    if (ok && train(&z, 1, &rz) == 0) {
        if (world->rank == 0)
            printf("dp=4 ep=2 zero1 %s step 11: loss %016llx, uninterrupted %016llx\n", mode,
                   (unsigned long long)bits(rz.loss), (unsigned long long)bits(ra[10].loss));
        CHECK(bits(rz.loss) == bits(ra[10].loss), "ZeRO-1 step 11: loss %.17g, expected %.17g", rz.loss, ra[10].loss);
    }
    train_state_free(&z);
    train_state_free(&a);
}

// 2 and 3: one process <-> dp = 2, ep = 2 with ZeRO-1, on world ranks 0 and 1.
static void part_other_layout(Comm *world, const char *root) {
    Config cfg_one, cfg_two;
    if (load_config(&cfg_one, 1, 1, 8, 0) != 0 || load_config(&cfg_two, 2, 2, 4, 1) != 0) return;
    char dir_one[256], dir_two[256];
    snprintf(dir_one, sizeof dir_one, "%s/one", root);
    snprintf(dir_two, sizeof dir_two, "%s/two", root);
    Model table;  // the one-process tensor table, on every rank
    int ok = model_create(&table, &cfg_one, DEVICE_CPU, 1, err, sizeof err) == 0;
    CHECK(ok, "one-process table: %s", err);
    TrainState one = {0};
    double loss11 = 0;
    if (world->rank == 0) {
        int one_ok = ok && train_state_create(&one, &cfg_one, DEVICE_CPU, NULL, 20, 0, err, sizeof err) == 0;
        CHECK(one_ok, "one-process state: %s", err);
        if (one_ok) {
            model_zero_load(&one.model);
            one_ok = train(&one, 10, NULL) == 0;
        }
        if (one_ok) {
            one_ok = checkpoint_save(&one, NULL, dir_one, 0, err, sizeof err) == 0;
            CHECK(one_ok, "one-process save: %s", err);
        }
        ok = one_ok;
    }
    if (!all_ranks_ok(world, ok)) return;
    Comm *pair = comm_split(world, world->rank < 2 ? 0 : COMM_UNDEFINED, world->rank, "pair");
    if (pair) {
        Groups g2;
        TrainState two = {0};
        OneState o = {0};
        int two_ok = groups_init(&g2, pair, 1, 2, 2, 0, err, sizeof err) == 0;
        CHECK(two_ok, "dp=2 groups: %s", err);
        two_ok = two_ok && train_state_create(&two, &cfg_two, DEVICE_CPU, &g2, 20, 0, err, sizeof err) == 0;
        CHECK(two_ok, "dp=2 ep=2 zero1 state: %s", err);
        if (all_ranks_ok(pair, two_ok)) {
            model_zero_load(&two.model);
            two_ok = checkpoint_load(&two, &g2, dir_one, err, sizeof err) == 0;
            CHECK(two_ok, "dp=2 load of the one-process checkpoint: %s", err);
            if (two_ok) {
                CHECK(two.step == 10, "loaded step %d", two.step);
                one_state_share(pair, &table, pair->rank == 0 ? &one : NULL, &o);
                check_same_as_one(&two, &table, &o, "one process -> dp=2 ep=2 zero1");
                one_state_free(&o);
                StepResult r_two, r_one;
                if (pair->rank == 0) train(&one, 1, &r_one), loss11 = r_one.loss;
                comm_bcast_bytes(pair, &loss11, sizeof loss11, 0);
                if (train(&two, 1, &r_two) == 0) {
                    if (pair->rank == 0)
                        printf("one process -> dp=2 ep=2 zero1 %s step 11: loss %.9f vs %.9f (relative %.2e)\n", mode,
                               r_two.loss, loss11, rel(r_two.loss, loss11));
                    CHECK(rel(r_two.loss, loss11) <= 1e-6, "step 11 loss %.9g vs one process %.9g", r_two.loss,
                          loss11);
                }
                // and back: dp = 2 saves at step 11, one process loads it
                two_ok = checkpoint_save(&two, &g2, dir_two, 0, err, sizeof err) == 0;
                CHECK(two_ok, "dp=2 save: %s", err);
            }
            TrainState back = {0};
            int back_ok = 1;
            if (pair->rank == 0) {
                back_ok = two_ok && train_state_create(&back, &cfg_one, DEVICE_CPU, NULL, 20, 0, err, sizeof err) == 0;
                if (back_ok) {
                    model_zero_load(&back.model);
                    back_ok = checkpoint_load(&back, NULL, dir_two, err, sizeof err) == 0;
                    CHECK(back_ok, "one-process load of the dp=2 checkpoint: %s", err);
                }
            }
            if (all_ranks_ok(pair, two_ok && back_ok)) {
                one_state_share(pair, &table, pair->rank == 0 ? &back : NULL, &o);
                check_same_as_one(&two, &table, &o, "dp=2 ep=2 zero1 -> one process");
                one_state_free(&o);
                StepResult r_two, r_back;
                double loss12 = 0;
                if (pair->rank == 0) {
                    CHECK(back.step == 11, "loaded step %d", back.step);
                    train(&back, 1, &r_back);
                    loss12 = r_back.loss;
                }
                comm_bcast_bytes(pair, &loss12, sizeof loss12, 0);
                if (train(&two, 1, &r_two) == 0) {
                    if (pair->rank == 0)
                        printf("dp=2 ep=2 zero1 -> one process %s step 12: loss %.9f vs %.9f (relative %.2e)\n", mode,
                               loss12, r_two.loss, rel(loss12, r_two.loss));
                    CHECK(rel(loss12, r_two.loss) <= 1e-6, "step 12 loss %.9g (one process) vs %.9g (dp=2)", loss12,
                          r_two.loss);
                }
            }
            train_state_free(&back);  // also after a failed create, or none (zeroed)
        }
        train_state_free(&two);
        groups_free(&g2);
        comm_free(pair);
    }
    if (world->rank == 0) train_state_free(&one);
    model_free(&table);
    comm_barrier(world);
}

int main(int argc, char **argv) {
    comm_init(&argc, &argv);
    if (argc < 3) {
        fprintf(stderr, "usage: test_checkpoint MODE CACHE_DIR\n");
        comm_finalize();
        return 2;
    }
    mode = argv[1], cache = argv[2];
    Comm *world = comm_world();
    char name[64], root[128] = "/tmp/fp8moe_ckmpi_XXXXXX";
    snprintf(name, sizeof name, "test_checkpoint %s", mode);
    CHECK(world->size == 4, "run with 4 ranks (mpirun -np 4), not %d", world->size);
    if (world->size != 4) return mpitest_finish(name);
    int made = world->rank != 0 || mkdtemp(root) != NULL;
    comm_bcast_bytes(world, root, sizeof root, 0);
    if (!all_ranks_ok(world, made)) return mpitest_finish(name);
    Groups g;
    if (groups_init(&g, world, 1, 4, 2, 0, err, sizeof err) != 0) {
        CHECK(0, "groups: %s", err);
        return mpitest_finish(name);
    }
    part_same_layout(&g, root);
    comm_barrier(world);
    part_other_layout(world, root);
    if (world->rank == 0 && getenv("CHECKPOINT_TEST_KEEP")) printf("checkpoints kept in %s\n", root);
    else if (world->rank == 0) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
        CHECK(system(cmd) == 0, "cannot remove %s", root);
    }
    groups_free(&g);
    const int rc = mpitest_finish(name);
    comm_finalize();
    return rc;
}

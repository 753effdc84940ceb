/*
 * model.h - the DeepSeek-V3 model (DESIGN.md section 3) as a list of chunks, forward and backward.
 *
 * Parameters live in one flat buffer: the non-expert tensors first, then the routed-expert tensors, so
 * reduction (DP for the first part, EDP for the second), clipping, AdamW and checkpoints are single
 * calls over flat memory. A table (ParamInfo) names every tensor as in DeepSeek's reference code
 * ("layers.3.attn.wq_a.weight") with its shape and offset; ModelWeights is a struct of pointers into
 * the buffer filled once, and the same struct is filled for the gradient buffer.
 *
 * A chunk is a contiguous range of blocks; the first chunk also holds the embedding, the last one the
 * final norm, the output head and the MTP modules. Pipeline schedules drive chunk_forward and
 * chunk_backward one micro-batch at a time, each micro-batch with its own ChunkActs. In one process
 * there is a single chunk holding everything.
 */
#ifndef FP8MOE_MODEL_H
#define FP8MOE_MODEL_H

#include <stdint.h>

#include "kernels/kernels.h"
#include "parallel/ep.h"
#include "train/config.h"
#include "train/linear.h"
#include "train/params.h"
#include "train/run_ctx.h"

#define MTP_MAX_DEPTH 8

// What this process holds of the model (DESIGN.md section 2, "Placement"): one or two chunks, each a
// contiguous range of the main model's layers (two under DualPipe and DualPipeV, which put two pipeline
// stages on every rank); the embedding (a chunk that embeds its input, or one with the head when MTP needs
// it); the final norm, output head and MTP modules (a chunk that ends a pipe); the routed experts [expert0,
// expert0 + n_experts) of every MoE layer. Tensors are the full model's, by global name, with the same
// initial values under every placement; memory is allocated for the placement's tensors only, laid out in
// the order of the whole model (layers in increasing order whatever the chunk order), so two placements of
// the same chunks in another order hold the same flat buffer layout (DualPipe's mirror ranks).
#define PLACEMENT_MAX_CHUNKS 2
typedef struct {
    int first_layer, n_layers;  // layers [first_layer, first_layer + n_layers)
    int embeds_input;           // the chunk starts from the embedding of its input tokens (a pipe's first stage)
    int has_head;               // the chunk ends with the final norm, the head, the losses and the MTP modules
} ChunkPlacement;
typedef struct {
    int n_chunks;                                // 1, or 2 (two stages per rank)
    ChunkPlacement chunk[PLACEMENT_MAX_CHUNKS];  // in the executor's chunk order
    int has_embedding;  // holds the embedding table: a chunk embeds its input, or has the head with mtp.depth > 0
    int has_head;       // a chunk has the head: final norm, output head, MTP modules
    int expert0, n_experts;
} Placement;

// The whole model: every layer in one chunk, the embedding, the head and MTP, every expert.
Placement placement_whole(const Config *cfg);
// Stages stages[0 .. n-1] (0-based, n <= PLACEMENT_MAX_CHUNKS, distinct) of a pipeline of n_stages, chunk c
// = stage stages[c]: the layers of placement_stage_layers (parallel.stage_layers, or as evenly as the count
// allows: the first n_layers % n_stages stages one more), every expert. Returns 0, or -1 with err when n_stages is not in [1, n_layers] or a stage not in
// [0, n_stages).
int placement_stages(const Config *cfg, const int *stages, int n, int n_stages, Placement *p, char *err,
                     size_t err_size);
// The first layer and layer count of stage s of n_stages (the split placement_stages uses; no checks):
// parallel.stage_layers when it lists n_stages stages, else as even as the count allows.
void placement_stage_layers(const Config *cfg, int s, int n_stages, int *first_layer, int *n_layers);
// Restricts p to routed experts [expert0, expert0 + n_experts). Returns 0, or -1 with err when the range
// is not inside [0, n_routed_experts) or empty.
int placement_set_experts(const Config *cfg, Placement *p, int expert0, int n_experts, char *err, size_t err_size);
typedef struct {
    real *wq_a, *q_norm, *wq_b;  // q_lora_rank > 0
    real *wq;                    // q_lora_rank == 0
    real *wkv_a, *kv_norm, *wkv_b, *wo;
} MlaWeights;
typedef struct {
    real *gate;          // (E, D) router
    FfnWeights shared;   // n_shared * moe_inter_dim wide
    FfnWeights experts;  // stacked over experts: w1, w3 (E, I, D), w2 (E, D, I)
} MoeWeights;
typedef struct {
    int is_moe;
    int moe_index;       // index of this MoE layer among all MoE layers (router bias, load counts)
    real *attn_norm, *ffn_norm;
    MlaWeights attn;
    FfnWeights ffn;      // dense
    MoeWeights moe;
} BlockWeights;
typedef struct {
    real *enorm, *hnorm, *eh_proj, *norm;  // eh_proj (D, 2D): input [RMSNorm(emb) ; RMSNorm(h)]
    BlockWeights block;
} MtpWeights;
typedef struct {
    real *embed;         // (V, D)
    real *norm;          // (D) final norm
    real *head;          // (V, D) untied output head
    BlockWeights *blocks;   // n_layers
    MtpWeights *mtp;        // mtp depth
} ModelWeights;

typedef struct {
    int first_block, n_blocks;  // blocks [first_block, first_block + n_blocks)
    int has_embedding;          // the first chunk
    int has_head;               // the last chunk: final norm, head, CE, MTP modules
} ChunkSpec;

// Which loss terms a backward pass differentiates and with which weights. The default is the training
// objective L = L_main + (lambda/D) sum_k L_k + L_bal; gradient checks select one term at a time.
typedef struct {
    real main;
    real mtp[MTP_MAX_DEPTH];
    real balance;
} LossWeights;

typedef struct {
    Config cfg;
    RunCtx rc;           // device, Linear scratch, weight cache, FP8 GEMM count (train/run_ctx.h)
    Placement placement;
    ParamInfo *params;
    int n_params;
    int64_t n_dense_elems, n_expert_elems;  // the flat buffer is n_dense_elems + n_expert_elems long
    real *weights;       // flat master weights
    real *grads;         // flat gradients, same layout
    ModelWeights w, g;   // pointer views into weights and grads
    int n_moe_layers;    // MoE layers in the main model and the MTP modules
    real *router_bias;   // (n_moe_layers, E) on dev: selection bias, updated by the balancer, not by gradients
    char (*router_bias_names)[MODEL_NAME_MAX];  // (n_moe_layers) global names, "layers.3.ffn.gate.bias"
    int64_t *expert_load;  // (n_moe_layers, E) on the host: tokens routed to each expert since the last reset
    int count_load;      // count expert load in forward passes (training, not eval)
    int freeze_routing;  // reuse the routing stored in the ChunkActs (gradient checks)
    LossWeights loss_weights;
    ChunkSpec *chunks;
    int n_chunks;
    EpGroup ep;
} Model;

// Activations of one chunk for one micro-batch (B sequences of T tokens), kept for its backward pass.
typedef struct ChunkActs ChunkActs;

// Build the whole model for `cfg` on `dev` with n_chunks equal chunks (1 in one process) and initialise
// the weights from cfg->train.seed. Returns 0, or -1 with a message in err.
int model_create(Model *m, const Config *cfg, Device dev, int n_chunks, char *err, size_t err_size);
// The same for the part of the model a placement holds, its chunks as the model's. A placement with only some of
// the routed experts builds and initialises, but its MoE layers run only with expert parallelism
// (chunk_acts_create refuses them until then). Returns 0, or -1 with a message in err.
int model_create_placement(Model *m, const Config *cfg, Device dev, const Placement *p, char *err, size_t err_size);
void model_free(Model *m);
// Hands the model its EP group (parallel/groups.h: the ranks that split the experts of this stage), before
// chunk_acts_create: the placement's experts must be this rank's share, [rank E/size, (rank+1) E/size).
// A model starts with the one-process group. Returns 0, or -1 with err.
int model_set_ep_group(Model *m, Comm *ep, char *err, size_t err_size);
// Whoever writes m->weights (the optimizer step, a weights load) calls this afterwards: cached copies
// derived from the weights (the FP8 128x128 quantisation, train/linear.c) are then recomputed at their
// next use instead of reused.
void model_weights_changed(Model *m);
int64_t model_num_params(const Model *m);
// Parameters one token passes through (embedding lookup excluded): attention, dense FFN, shared and
// top-K routed experts, router, head, MTP modules. Used for FLOPs accounting.
int64_t model_active_params(const Model *m);
const ParamInfo *model_find_param(const Model *m, const char *name);
// The MoE layer whose router bias has this global name (Model.router_bias_names), or -1.
int model_find_router_bias(const Model *m, const char *name);

// Also sizes the model's FP8 scratch for B*T tokens (train/linear.h), so steps allocate nothing.
ChunkActs *chunk_acts_create(Model *m, int chunk, int B, int T);
void chunk_acts_free(ChunkActs *a);

// Forward of one chunk for one micro-batch.
//   inputs (B*T) token ids, targets (B*T) next-token ids (-1 = no target); every chunk gets them (the
//   first for the embedding, the last for the losses and the MTP inputs).
//   in_hidden (B*T, D): the previous chunk's output, on m->dev; NULL on the first chunk.
//   out_hidden (B*T, D): this chunk's output for the next chunk, on m->dev; NULL on the last chunk.
//   (The boundary tensors are device buffers, so an executor sends and receives them as they are.)
// Returns this chunk's weighted loss terms: the balance loss of its blocks, plus on the last chunk the
// main and MTP terms and the MTP blocks' balance loss; summed over chunks this is L.
real chunk_forward(Model *m, int chunk, ChunkActs *a, const int *inputs, const int *targets,
                   const real *in_hidden, real *out_hidden);
// Backward of the same micro-batch: accumulates parameter gradients into m->grads.
//   dout_hidden (B*T, D): gradient of this chunk's output, on m->dev (NULL on the last chunk).
//   din_hidden (B*T, D): receives the gradient of in_hidden, on m->dev (NULL on the first chunk);
//   overwritten.
//   loss_scale multiplies every loss term's gradient (1/grad_accum for a mean over micro-batches).
void chunk_backward(Model *m, int chunk, ChunkActs *a, const real *dout_hidden, real *din_hidden,
                    real loss_scale);
// The backward split in two (the pipeline schedules' I and W, parallel/schedule.h): chunk_backward_input is
// chunk_backward without the block Linears' weight gradients, which it leaves in the activation set's W ticket
// (train/wgrad_ticket.h); chunk_backward_weights runs them. The set must not take another forward in between
// (the ticket's operands may lie in it). The gradients are chunk_backward's, bit for bit, whatever else runs
// between the two, provided each chunk's tickets run in the order of their micro-batches' I parts.
void chunk_backward_input(Model *m, int chunk, ChunkActs *a, const real *dout_hidden, real *din_hidden,
                          real loss_scale);
void chunk_backward_weights(Model *m, ChunkActs *a);
// Whether a's W ticket holds weight gradients not yet run (chunk_backward_input without chunk_backward_weights).
int chunk_weights_pending(const ChunkActs *a);

// Loss terms of the last forward pass of a last chunk (unweighted means over valid positions).
typedef struct {
    double main;                  // mean CE of the main head, nats per token
    double mtp[MTP_MAX_DEPTH];    // mean CE of each MTP depth
    double mtp_mean;              // mean over depths
    double balance;               // sum over MoE layers of the sequence-wise balance loss
    int64_t n_valid;              // positions with a main target
} LossTerms;
LossTerms chunk_losses(const ChunkActs *a);
// Probabilities (V) of position t of sequence b from the last forward pass (sampling, on the CPU device: in bf16 and
// fp8 modes they are made on the host from the row's statistics, and another device stops the process), or NULL
// when the chunk has no head; valid until the next call. A backward pass overwrites what they are made from.
const real *chunk_probs_at(ChunkActs *a, int b, int t);

// MTP depth k (1-based) at position i takes t_{i+k} as input and predicts t_{i+k+1}. From the main
// targets (B*T, targets[i] = t_{i+1}) fills tok (B*T) and tgt (B*T); positions whose target falls off the
// sequence (the last k) get tgt = -1 and input token 0.
void model_mtp_tokens(int *tok, int *tgt, const int *targets, int B, int T, int k);

void model_zero_grads(Model *m);
// A training step's form of model_zero_grads: the routed experts' gradients are not cleared but left to the step's
// first Wgrad into each stack, which writes all of it (RunCtx.grad_stacks; kernels.h GradStore), saving a pass over
// most of the buffer and the first Wgrads' reads of it; model_finish_step_grads, after the step's backward passes,
// clears the stacks that no Wgrad wrote. The same gradients as model_zero_grads (a zero's sign aside: 0 + -0 is +0).
void model_zero_grads_for_step(Model *m);
void model_finish_step_grads(Model *m);
void model_zero_load(Model *m);
// Sums the step's expert load counts over `group` (the ranks that route distinct tokens: dp), so that
// every rank makes the same bias update. The identity in one process.
void model_reduce_load(Model *m, Comm *group);
// End of a training step: the aux-loss-free bias update of every MoE layer from the step's expert load
// (b_i += gamma * sign(mean load - load_i), gamma = moe.bias_update_speed), then the load counts are
// reset. Returns the worst layer's max/mean load of the step (0 without MoE layers).
double model_update_router_bias(Model *m);
// Model FLOPs per token for throughput accounting (docs/model.md): 6 x active parameters plus causal
// attention 6 x layers x heads x T x (qk_head_dim + v_head_dim) / 2 over the main model's layers.
double model_flops_per_token(const Model *m, int T);

#endif

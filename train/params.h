/*
 * params.h - the parameter table's entry: what each tensor of the model is (its global name and
 * shape, its offset in this placement's flat buffer, its role and its reduction group), recorded by
 * the table builder in train/model.c so that no other code recovers a role from a name or a pointer.
 * Apart from model.h so that the layers (train/linear.h) can read the table without the model.
 */
#ifndef FP8MOE_PARAMS_H
#define FP8MOE_PARAMS_H

#include <stdint.h>

#define MODEL_NAME_MAX 96

// What a parameter is, recorded by the table builder so that no code recovers it from a name.
typedef enum {
    PARAM_BLOCK_LINEAR,   // a Linear inside a block or MTP module: FP8 in fp8 mode, BF16 in bf16 mode
    PARAM_ROUTED_EXPERT,  // a routed expert's w1, w2 or w3 (also a block Linear, grouped over experts)
    PARAM_EMBEDDING,      // the token embedding (V, D)
    PARAM_HEAD,           // the output head (V, D)
    PARAM_ROUTER,         // an MoE layer's gate (E, D): FP32, never FP8
    PARAM_NORM,           // an RMSNorm weight: no weight decay
} ParamRole;

// Over which ranks a parameter's gradient is summed (DESIGN.md section 5). One process sums nothing;
// the distributed issues read this instead of guessing from names.
typedef enum {
    REDUCE_DP,               // non-expert parameters: every data-parallel replica
    REDUCE_EDP,              // routed experts: the replicas of this expert (dp / ep of them)
    REDUCE_TIED_EMBEDDING,   // the embedding: dp, and the copy on the last stage when MTP needs one
} ReduceGroup;

typedef struct {
    char name[MODEL_NAME_MAX];  // global name, as in DeepSeek's reference code
    int ndim;
    int shape[3];               // global shape (a routed expert's tensor is one expert's)
    int64_t numel;
    int64_t offset;   // element offset in this placement's flat parameter buffer
    ParamRole role;
    ReduceGroup reduce;
    int layer;        // main-model layer, or -1 (embedding, head, final norm, MTP modules)
    int expert;       // global routed-expert index, or -1
    int is_expert;    // role == PARAM_ROUTED_EXPERT (second part of the buffer, reduced over EDP)
    int no_decay;     // norms: no weight decay
    int shares_input; // SwiGLU's w1 and w3: their backward runs as one call over their shared input
} ParamInfo;

#endif

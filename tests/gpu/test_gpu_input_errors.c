/*
 * test_gpu_input_errors.c - the CUDA ops' reports of bad input (kernels/cuda/common.cuh ErrorSlots): a negative token
 * in embedding_forward or embedding_backward, and an expert index outside [0, E) in moe_permute_plan_device, must
 * stop the process with exit status 1 and one line that names the op, the element (the one with the smallest
 * index when there are several, whatever the timing) and what was expected. The kernels record the bad element in
 * a device slot and the host reports it at its next sync, so nothing else shows that the slots work.
 *
 * Each case runs in a child process, this binary run again with the case's name as its one argument (an op that
 * meets bad input ends the process it runs in, and a forked child cannot use its parent's CUDA context); the
 * parent checks the child's exit status and that its output holds the expected line. The child sets
 * FP8MOE_CUDA_SYNC=1 before its first CUDA call, so embedding_backward reports at its own call (without it, the
 * report waits for the next embedding_forward, by design).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/gpu/gpucheck.h"

typedef struct {
    const char *name;
    const char *expected;  // a part of the child's output: the op, the element and what was expected
} InputErrorCase;

static const InputErrorCase cases[] = {
    // tokens 5 and 6 are negative: the lower row is the one reported
    {"embedding_forward", "embedding_forward: token -3 at row 5 is negative; expected an id in [0, vocab_size)"},
    {"embedding_backward", "embedding_backward: token -4 at row 2 is negative; expected an id in [0, vocab_size)"},
    // slots (3, 1) and (6, 0) are out of range: the lower index t * K + k is the one reported
    {"moe_permute_plan", "moe_permute_plan: topk_idx[3, 1] = 9; expected an expert index in [0, 8)"},
};
enum { N_CASES = sizeof cases / sizeof cases[0] };

// ---------------------------------------------------------------------------- the child: one op on bad input

static void run_embedding(int backward) {
    const int N = 8, C = 64, V = 16;
    int tokens[8] = {1, 4, 9, 15, 0, 7, 2, 3};
    if (backward) tokens[2] = -4;
    else tokens[5] = -3, tokens[6] = -7;
    float *table = gpucheck_malloc(sizeof(float) * V * C), *rows = gpucheck_malloc(sizeof(float) * N * C);
    for (int i = 0; i < V * C; i++) table[i] = 0.01f * (float)(i % 97) - 0.4f;
    for (int i = 0; i < N * C; i++) rows[i] = 0.02f * (float)(i % 53) - 0.5f;
    int *d_tokens = gpucheck_to_device(tokens, sizeof tokens);
    float *d_table = gpucheck_to_device(table, sizeof(float) * V * C);
    float *d_rows = gpucheck_to_device(rows, sizeof(float) * N * C);
    if (backward) embedding_backward(DEVICE_CUDA, d_table, d_rows, d_tokens, N, C);
    else embedding_forward(DEVICE_CUDA, d_rows, d_tokens, d_table, N, C);
    float first;  // a copy back: a sync point, should the op not have stopped the process itself
    device_memcpy_to_host(DEVICE_CUDA, &first, backward ? d_table : d_rows, sizeof first);
}

static void run_permute_plan(void) {
    const int N = 8, K = 2, E = 8;
    int topk[16] = {0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 0};
    topk[3 * K + 1] = 9, topk[6 * K + 0] = -2;
    int *d_topk = gpucheck_to_device(topk, sizeof topk);
    int *d_offsets = device_alloc(DEVICE_CUDA, sizeof(int) * (E + 1));
    int *d_seg_token = device_alloc(DEVICE_CUDA, sizeof(int) * N * K);
    int *d_slot_of = device_alloc(DEVICE_CUDA, sizeof(int) * N * K);
    moe_permute_plan_device(DEVICE_CUDA, d_offsets, d_seg_token, d_slot_of, d_topk, N, K, E);  // synchronises
}

static int run_child(const char *name) {
    setenv("FP8MOE_CUDA_SYNC", "1", 1);
    if (strcmp(name, "embedding_forward") == 0) run_embedding(0);
    else if (strcmp(name, "embedding_backward") == 0) run_embedding(1);
    else if (strcmp(name, "moe_permute_plan") == 0) run_permute_plan();
    else {
        fprintf(stderr, "test_gpu_input_errors: unknown case '%s'\n", name);
        return 2;
    }
    printf("the op went on after bad input\n");
    return 3;
}

// ---------------------------------------------------------------------------- the parent: each case's child

static int check_case(const char *self, const InputErrorCase *c) {
    char cmd[4200], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", self, c->name);
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        printf("%-20s FAIL: cannot start '%s'\n", c->name, cmd);
        return 0;
    }
    const size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    const int status = pclose(p);
    const int exited = status != -1 && WIFEXITED(status), code = exited ? WEXITSTATUS(status) : -1;
    const int ok = exited && code == 1 && strstr(out, c->expected) != NULL;
    printf("%-20s exit %d, expected \"%s\": %s\n", c->name, code, c->expected, ok ? "ok" : "FAIL");
    if (!ok) printf("    the child printed:\n%s\n", out);
    return ok;
}

int main(int argc, char **argv) {
    if (argc == 2) return run_child(argv[1]);
    if (!gpucheck_devices(argv[0])) return 1;
    char self[4096];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) {
        fprintf(stderr, "test_gpu_input_errors: cannot read /proc/self/exe\n");
        return 1;
    }
    self[len] = '\0';
    int passed = 0;
    for (int i = 0; i < N_CASES; i++) passed += check_case(self, &cases[i]);
    printf("test_gpu_input_errors: %d of %d cases passed\n", passed, N_CASES);
    return passed == N_CASES ? 0 : 1;
}

/*
 * test_gpu_wgrad_split.c - the backward split into the pipeline's I and W parts against the full backward, on the
 * GPU (DEVICE_CUDA: the fp8 tickets hold the 128x1 operands that the GPU quantisers write, the Wgrads run on
 * cuBLASLt), in fp32, bf16 and fp8: bitwise the same gradients, the block Linears' only after the W
 * (tests/unit/wgrad_split_check.h says what is checked; tests/unit/test_wgrad_split.c is the CPU form).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "tests/unit/wgrad_split_check.h"

static void test_split_fp32(void **state) {
    (void)state;
    check_split("fp32", DEVICE_CUDA);
}
static void test_split_bf16(void **state) {
    (void)state;
    check_split("bf16", DEVICE_CUDA);
}
static void test_split_fp8(void **state) {
    (void)state;
    check_split("fp8", DEVICE_CUDA);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_fp32),
        cmocka_unit_test(test_split_bf16),
        cmocka_unit_test(test_split_fp8),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

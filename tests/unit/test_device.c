/*
 * test_device.c - the CPU branch of the device-memory helpers in kernels.h (the CUDA branch is covered
 * by tests/gpu/test_gpu_ops.c): allocations come back zeroed, copies round-trip, zeroing a sub-range
 * touches only that range, and device_name names the device.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kernels.h"

static void test_cpu_memory(void **state) {
    (void)state;
    enum { N = 1000 };
    real *p = device_alloc(DEVICE_CPU, N * sizeof(real));
    assert_non_null(p);
    for (int i = 0; i < N; i++) assert_true(p[i] == 0);
    real host[N], back[N];
    for (int i = 0; i < N; i++) host[i] = (real)(i + 1) * (real)0.5;
    device_memcpy_from_host(DEVICE_CPU, p, host, sizeof host);
    device_memcpy_to_host(DEVICE_CPU, back, p, sizeof back);
    assert_memory_equal(host, back, sizeof host);
    device_memset_zero(DEVICE_CPU, p + 100, 50 * sizeof(real));
    for (int i = 0; i < N; i++) assert_true(p[i] == (i >= 100 && i < 150 ? 0 : host[i]));
    device_free(DEVICE_CPU, p);
    assert_string_equal(device_name(DEVICE_CPU), "cpu");
    assert_true(cuda_device_count() >= 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_cpu_memory)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

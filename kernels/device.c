/*
 * device.c - the device-memory functions of kernels.h: allocate, free, copy and zero buffers on the
 * CPU (plain heap memory) or on the current CUDA device, so model and optimizer code never call the
 * CUDA runtime themselves.
 *
 * Every CUDA call is checked (CUDA_CHECK in kernels/cuda/common.cuh) and a failure stops the process
 * with "file:line: cudaXxx(...) failed: <reason>". In a build without CUDA (no FP8MOE_CUDA), asking
 * for DEVICE_CUDA stops with a message that says so instead of silently using the CPU.
 * Copies use cudaMemcpy on the default stream: they wait for earlier kernels, so a copy to the host
 * is also where errors of earlier asynchronous kernels are reported. Pinned host memory (device_host_alloc)
 * and device_of_pointer serve the MPI backend's staging of device buffers (parallel/comm.c).
 */
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FP8MOE_CUDA
#include "kernels/cuda/common.cuh"
#endif

#ifndef FP8MOE_CUDA
static void no_cuda(const char *fn) {
    fprintf(stderr, "fp8moe: %s asked for DEVICE_CUDA, but this build has no CUDA (kernels/device.c); "
                    "rebuild with CUDA >= 12.9 or use device = cpu\n", fn);
    exit(1);
}
#endif

static void bad_device(const char *fn, Device dev) {
    fprintf(stderr, "fp8moe: %s got device %d (kernels/device.c); expected DEVICE_CPU (0) or DEVICE_CUDA (1)\n",
            fn, (int)dev);
    exit(1);
}

long long fp8moe_cuda_allocations = 0;  // see kernels/cuda/common.cuh

int64_t device_allocation_count(void) { return fp8moe_cuda_allocations; }

// Returns zeroed memory; NULL for 0 bytes on both devices (device_free(NULL) is a no-op).
void *device_alloc(Device dev, size_t bytes) {
    if (bytes == 0) return NULL;
    if (dev == DEVICE_CPU) {
        void *p = calloc(1, bytes);
        if (p == NULL) {
            fprintf(stderr, "%s:%d: calloc of %zu bytes failed: out of host memory\n", __FILE__, __LINE__, bytes);
            exit(1);
        }
        return p;
    }
    if (dev != DEVICE_CUDA) bad_device("device_alloc", dev);
#ifdef FP8MOE_CUDA
    void *p = NULL;
    cuda_counted_malloc(&p, bytes, __FILE__, __LINE__);
    CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
#else
    no_cuda("device_alloc");
    return NULL;
#endif
}

void device_free(Device dev, void *p) {
    if (p == NULL) return;
    if (dev == DEVICE_CPU) {
        free(p);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_free", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaFree(p));
#else
    no_cuda("device_free");
#endif
}

// dst_host (bytes) = src (bytes on dev)
void device_memcpy_to_host(Device dev, void *dst_host, const void *src, size_t bytes) {
    if (bytes == 0) return;
    if (dev == DEVICE_CPU) {
        memcpy(dst_host, src, bytes);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_memcpy_to_host", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaMemcpy(dst_host, src, bytes, cudaMemcpyDeviceToHost));
#else
    no_cuda("device_memcpy_to_host");
#endif
}

// dst (bytes on dev) = src_host (bytes)
void device_memcpy_from_host(Device dev, void *dst, const void *src_host, size_t bytes) {
    if (bytes == 0) return;
    if (dev == DEVICE_CPU) {
        memcpy(dst, src_host, bytes);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_memcpy_from_host", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaMemcpy(dst, src_host, bytes, cudaMemcpyHostToDevice));
#else
    no_cuda("device_memcpy_from_host");
#endif
}

void device_memset_zero(Device dev, void *p, size_t bytes) {
    if (bytes == 0) return;
    if (dev == DEVICE_CPU) {
        memset(p, 0, bytes);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_memset_zero", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaMemset(p, 0, bytes));
#else
    no_cuda("device_memset_zero");
#endif
}

// dst (bytes on dev) = src (bytes on dev)
void device_memcpy(Device dev, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    if (dev == DEVICE_CPU) {
        memcpy(dst, src, bytes);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_memcpy", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
#else
    no_cuda("device_memcpy");
#endif
}

// Pinned for the GPU: a copy from pageable memory goes through the driver's own staging buffer (an extra copy
// and, for copies to the device, a wait on it); from pinned memory it is one DMA transfer.
void *device_host_alloc(Device dev, size_t bytes) {
    if (bytes == 0) return NULL;
    if (dev == DEVICE_CPU) {
        void *p = malloc(bytes);
        if (p == NULL) {
            fprintf(stderr, "%s:%d: malloc of %zu bytes failed: out of host memory\n", __FILE__, __LINE__, bytes);
            exit(1);
        }
        return p;
    }
    if (dev != DEVICE_CUDA) bad_device("device_host_alloc", dev);
#ifdef FP8MOE_CUDA
    void *p = NULL;
    CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
#else
    no_cuda("device_host_alloc");
    return NULL;
#endif
}

void device_host_free(Device dev, void *p) {
    if (p == NULL) return;
    if (dev == DEVICE_CPU) {
        free(p);
        return;
    }
    if (dev != DEVICE_CUDA) bad_device("device_host_free", dev);
#ifdef FP8MOE_CUDA
    CUDA_CHECK(cudaFreeHost(p));
#else
    no_cuda("device_host_free");
#endif
}

// Every device buffer comes from a counted cudaMalloc (kernels/cuda/common.cuh), so before the first one no
// pointer can be a device pointer and the runtime is not asked (nor started, on a CPU run of a CUDA build).
Device device_of_pointer(const void *p) {
#ifdef FP8MOE_CUDA
    if (p == NULL || fp8moe_cuda_allocations == 0) return DEVICE_CPU;
    struct cudaPointerAttributes a;
    CUDA_CHECK(cudaPointerGetAttributes(&a, p));
    // unregistered (plain heap or stack) and pinned host memory are read by the host directly; managed memory
    // (not used by fp8moe) is staged like device memory, which is correct for it too
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? DEVICE_CUDA : DEVICE_CPU;
#else
    (void)p;
    return DEVICE_CPU;
#endif
}

// Number of visible CUDA devices; 0 without CUDA, without a driver, or when the runtime cannot start
// (callers decide whether that is an error: the CLI reports it for device = cuda, GPU tests fail).
int cuda_device_count(void) {
#ifdef FP8MOE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); // clear it, so it is not reported later by an unrelated call
        return 0;
    }
    return n;
#else
    return 0;
#endif
}

// Short lower-case name of a device, as written in job files and log lines.
const char *device_name(Device dev) {
    switch (dev) {
    case DEVICE_CPU: return "cpu";
    case DEVICE_CUDA: return "cuda";
    }
    return "unknown";
}

#!/usr/bin/env python3
"""tests/gpu/torch_gemm.py - the comparison point of `fp8moe bench gemm`'s BF16 rows: torch.matmul in BF16
on the three GEMMs of a Linear, in the layouts fp8moe runs them (row-major tensors, as PyTorch holds them):
  Fprop  y  (M, N) = x (M, K) @ w.T   (w is (N, K))
  Dgrad  dx (M, N) = dy (M, K) @ w    (w is (K, N))
  Wgrad  dw (M, N) = dy.T @ x         (dy is (K, M), x is (K, N))
M x N x K as in bench gemm: (M, N) output, contraction K. Same method: median of --runs timed runs after
--warmup, CUDA events around each run, back to back; --idle-ms N leaves the GPU idle N ms before each
measurement (warm-up + timed runs of one GEMM), as `fp8moe bench gemm --idle-ms N` does (docs/gpu.md: sustained clocks drop under load).
Random normal inputs (never zeros)."""
import argparse
import statistics
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=50)
ap.add_argument("--warmup", type=int, default=5)
ap.add_argument("--shape", default="8192,8192,8192", help="M,N,K")
ap.add_argument("--idle-ms", type=int, default=0)
args = ap.parse_args()
M, N, K = (int(v) for v in args.shape.split(","))
g = torch.Generator(device="cuda").manual_seed(1)


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


cases = {
    "Fprop  x @ w.T": (lambda a, b: a @ b.T, rand(M, K), rand(N, K)),
    "Dgrad  dy @ w": (lambda a, b: a @ b, rand(M, K), rand(K, N)),
    "Wgrad  dy.T @ x": (lambda a, b: a.T @ b, rand(K, M), rand(K, N)),
}
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, BF16 torch.matmul, M x N x K = {M} x {N} x {K}, "
      f"median of {args.runs} after {args.warmup} warm-up (CUDA events), "
      + (f"idle {args.idle_ms} ms before each measurement" if args.idle_ms else "back to back"))
for name, (fn, a, b) in cases.items():
    if args.idle_ms:
        torch.cuda.synchronize()
        time.sleep(args.idle_ms / 1e3)
    for _ in range(args.warmup):
        fn(a, b)
    times = []
    for _ in range(args.runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    t = statistics.median(times)
    print(f"  {name:18s} {2 * M * N * K / t / 1e12:8.1f} TFLOPS  ({t * 1e3:.3f} ms)")

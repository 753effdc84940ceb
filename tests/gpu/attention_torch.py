#!/usr/bin/env python3
"""attention_torch.py - the comparison point for `fp8moe bench attention` (train/bench_attention.c):
PyTorch's torch.nn.functional.scaled_dot_product_attention(is_causal=True) in BF16 at the same shape,
timed the same way (CUDA events around each of --runs back-to-back calls after 3 warm-up calls, median;
forward and backward separately) and counted with the same FLOP convention:
    forward  = 2 B H (T (T + 1) / 2) (dqk + dv)     backward = 2.5 x forward.

Each SDPA backend (flash, cuDNN, memory-efficient, and PyTorch's own choice) is tried at the real head
dims first. A backend that needs equal head dims for q, k and v (FlashAttention does) is run again with v
zero-padded to dqk columns, and the row says so; its TFLOPS still count the real dv (useful work only),
so padding shows up as a lower number. The backward is the gradient of (q, k, v) for a random dout,
through torch.autograd.grad on a retained graph (the forward is not in the backward's time).

Differences from the fp8moe op that the numbers include: PyTorch's inputs are already BF16 in the
(B, H, T, D) layout it wants, while fp8moe's op takes FP32 (B, T, H, D), converts it in a pre-pass that is
part of its time, and returns FP32; and fp8moe's backward is deterministic (no atomics), PyTorch's flash
backward is not.

Usage (on the GPU machine, from the repo root):
    python3 tests/gpu/attention_torch.py [--B 2] [--T 2048] [--H 16] [--dqk 192] [--dv 128] [--runs 20]
"""
import argparse
import statistics
import sys

WARMUP = 3


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--dqk", type=int, default=192)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    for name in ("B", "T", "H", "dqk", "dv", "runs"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: expected a positive integer")
    return a


def median_ms(torch, fn, runs):
    """Median milliseconds of one call of fn over `runs` back-to-back calls (CUDA events), after WARMUP calls."""
    for _ in range(WARMUP):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(runs + 1)]
    events[0].record()
    for i in range(runs):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(runs))


def time_backend(torch, F, backend, a, pad_v):
    """(forward ms, backward ms) of SDPA restricted to `backend` (None: PyTorch's choice); raises if it cannot run."""
    from contextlib import nullcontext

    gen = torch.Generator(device="cuda").manual_seed(1)
    dev, dt = "cuda", torch.bfloat16

    def rand(*shape, amp=1.0):
        return ((torch.rand(*shape, generator=gen, device=dev, dtype=torch.float32) * 2 - 1) * amp).to(dt)

    q = rand(a.B, a.H, a.T, a.dqk, amp=2.0).requires_grad_()
    k = rand(a.B, a.H, a.T, a.dqk).requires_grad_()
    v_real = rand(a.B, a.H, a.T, a.dv)
    v_width = a.dqk if pad_v else a.dv
    if pad_v:
        v_real = torch.nn.functional.pad(v_real, (0, a.dqk - a.dv))
    v = v_real.detach().requires_grad_()
    dout = rand(a.B, a.H, a.T, v_width)

    ctx = nullcontext() if backend is None else torch.nn.attention.sdpa_kernel([backend])
    with ctx:
        def forward():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        forward()  # raises here when the backend cannot take this shape
        torch.cuda.synchronize()
        fwd = median_ms(torch, forward, a.runs)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def backward():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        backward()
        torch.cuda.synchronize()
        bwd = median_ms(torch, backward, a.runs)
    return fwd, bwd


def main():
    a = parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        print(f"attention_torch.py: needs PyTorch >= 2.3 with CUDA ({e})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("attention_torch.py: torch.cuda.is_available() is False - expected a GPU", file=sys.stderr)
        return 1

    fwd_flop = 2.0 * a.B * a.H * (a.T * (a.T + 1) / 2.0) * (a.dqk + a.dv)
    bwd_flop = 2.5 * fwd_flop
    print(f"attention_torch.py: {torch.cuda.get_device_name()}, torch {torch.__version__}; causal SDPA in BF16, "
          f"B = {a.B}, T = {a.T}, H = {a.H}, dqk = {a.dqk}, dv = {a.dv}")
    print(f"FLOPs: forward = 2 B H (T (T+1) / 2) (dqk + dv) = {fwd_flop:.4g}, backward = 2.5 x forward = "
          f"{bwd_flop:.4g} (real dv, also when v is padded)")
    print(f"time: median of {a.runs} back-to-back runs after {WARMUP} warm-up (CUDA events)\n")
    print(f"{'backend':<16} {'v':<16} {'fwd ms':>9} {'fwd TFLOPS':>11} {'bwd ms':>9} {'bwd TFLOPS':>11}")

    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None)),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("default", None)]
    any_ok = False
    for name, backend in backends:
        if name == "cudnn" and backend is None:
            print(f"{name:<16} not in this torch version")
            continue
        result, why = None, ""
        for pad_v in ([False, True] if a.dv < a.dqk else [False]):
            try:
                result = (pad_v,) + time_backend(torch, F, backend, a, pad_v)
                break
            except RuntimeError as e:  # this backend cannot take the shape (or is not built in)
                why = str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__
                torch.cuda.synchronize()
        if result is None:
            print(f"{name:<16} cannot run: {why}")
            continue
        pad_v, fwd, bwd = result
        vdesc = f"padded to {a.dqk}" if pad_v else f"dv = {a.dv}"
        print(f"{name:<16} {vdesc:<16} {fwd:9.3f} {fwd_flop / (fwd * 1e-3) * 1e-12:11.1f} {bwd:9.3f} "
              f"{bwd_flop / (bwd * 1e-3) * 1e-12:11.1f}")
        any_ok = True
    return 0 if any_ok else 1


if __name__ == "__main__":
    sys.exit(main())

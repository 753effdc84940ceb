#!/usr/bin/env python3
# hf_export.py - the Hugging Face side of tests/gpu/hf_export.sh: loads `fp8moe export` directories with
# transformers' AutoModelForCausalLM, computes the loss of a fixed batch and a greedy continuation, and compares them
# with fp8moe's numbers (given on the command line by hf_export.sh).
#   hf_export.py FP32_DIR BF16_DIR BATCH_FILE T FP8MOE_LOSS STEPS [PROMPT SAMPLE_FILE]...
# BATCH_FILE holds B*T+1 bytes: fp8moe eval --text cuts it into B windows of T+1 tokens at stride T (data/loader.h),
# inputs window[:-1], targets window[1:]; the loss is the mean CE over the B*T targets. Each SAMPLE_FILE is
# `fp8moe sample --temperature 0` output for its PROMPT: the prompt, STEPS bytes, a newline.
# Exit status 0 when the fp32 export's loss is within 1e-4 relative of fp8moe's on every device tried and the
# greedy bytes are identical; the bf16 export's loss is reported (its rounding changes the model) and must load.
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

fp32_dir, bf16_dir, batch_file, T, want, steps = sys.argv[1:7]
T, want, steps = int(T), float(want), int(steps)
samples = list(zip(sys.argv[7::2], sys.argv[8::2]))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")
failed = 0


def load(d, device):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    unexpected = sorted(info.get("unexpected_keys", []))
    missing = sorted(info.get("missing_keys", []))
    print(f"  loaded {d} as {type(m).__name__} on {device}: {len(missing)} missing keys {missing[:4]}, "
          f"{len(unexpected)} unexpected keys (first: {unexpected[:3]}), mismatched {info.get('mismatched_keys', [])}")
    for x in w[:3]:
        print(f"  warning: {x.message}")
    return m.to(device).eval(), missing


data = open(batch_file, "rb").read()
B = (len(data) - 1) // T
assert B * T + 1 == len(data), f"{batch_file}: {len(data)} bytes, expected B*T+1"
windows = torch.tensor([list(data[b * T:b * T + T + 1]) for b in range(B)], dtype=torch.long)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
losses = {}
for device in devices:
    for name, d in (("fp32", fp32_dir), ("bf16", bf16_dir)):
        m, missing = load(d, device)
        if missing:
            print(f"FAIL: {d}: missing keys: transformers initialised {missing[:8]} itself")
            failed = 1
        x = windows.to(device)
        with torch.no_grad():
            logits = m(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="mean").item()
        rel = abs(loss - want) / abs(want)
        losses[(device, name)] = loss
        verdict = "" if name == "bf16" else ("  ok (< 1e-4)" if rel < 1e-4 else "  FAIL (>= 1e-4)")
        print(f"  {device} {name} export: HF loss {loss:.9g} vs fp8moe eval {want:.9g}: rel diff {rel:.3e}{verdict}")
        if name == "fp32" and rel >= 1e-4:
            failed = 1
        for prompt, sample_file in samples if name == "fp32" else []:
            ids = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
            with torch.no_grad():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            hf_bytes = bytes(out[0].tolist())
            fp8 = open(sample_file, "rb").read()
            fp8 = fp8[:-1] if fp8.endswith(b"\n") else fp8
            same = hf_bytes == fp8
            first = next((i for i, (a, b) in enumerate(zip(hf_bytes, fp8)) if a != b), min(len(hf_bytes), len(fp8)))
            print(f"  {device} greedy {steps} bytes after {prompt!r}: HF {len(hf_bytes)} bytes, fp8moe sample "
                  f"{len(fp8)} bytes: {'identical' if same else f'DIFFER from byte {first}'}")
            print(f"    HF:     {hf_bytes[:120]!r}")
            if not same:
                print(f"    fp8moe: {fp8[:120]!r}")
                failed = 1
        del m
for device in devices:
    a, b = losses[(device, "fp32")], losses[(device, "bf16")]
    print(f"  {device}: the bf16 export's loss differs from the fp32 export's by {abs(b - a) / a:.3e} relative "
          f"(the BF16 rounding of the weights)")
print("hf_export.py: " + ("FAILED" if failed else "passed"))
sys.exit(failed)

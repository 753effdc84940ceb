#!/usr/bin/env python3
# hf_export_check.py - checks an `fp8moe export --format hf` against the job it was trained from, with Python's
# standard library only (json, struct, configparser; no torch, no safetensors, no h5py on CI). Run by
# tests/unit/hf_export.sh:
#   hf_export_check.py JOB.ini BF16_DIR FP32_DIR CHECKPOINT_DIR [section.key=value ...]
# where BF16_DIR and FP32_DIR are exports of the same checkpoint with --dtype bf16 and fp32, and the overrides
# are the --set values the job was trained with (those that change [model], [moe], [mtp] or train.seq_len).
# Checks:
#   - config.json: model_type, architectures, and every field against the job's [model] / [moe] / [mtp] keys;
#   - model.safetensors: the 8-byte header length, a JSON header padded to 8 bytes, offsets that tile the data;
#     exactly the tensor names transformers' DeepseekV3ForCausalLM and DeepSeek's MTP layout give for that
#     config, with their shapes, dtype BF16 (F32 for the router biases) or F32 in the fp32 export;
#   - every FP32 tensor's bytes are found in the checkpoint's rank files (the weights as trained, unchanged: small
#     tensors lie whole in one HDF5 chunk), and every BF16 value is that FP32 value rounded to nearest even;
#   - each MTP layer's shared_head.head and embed_tokens equal lm_head and embed_tokens.
import configparser
import glob
import json
import os
import struct
import sys


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail(f"{path}: {len(blob)} bytes, no header")
    (n,) = struct.unpack("<Q", blob[:8])
    if (8 + n) % 8 != 0:
        fail(f"{path}: header of {n} bytes: 8 + n is not a multiple of 8")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    if not meta or meta.get("format") != "pt":
        fail(f"{path}: __metadata__ {meta!r}: expected format pt (transformers refuses others)")
    spans = sorted((t["data_offsets"][0], t["data_offsets"][1], name) for name, t in header.items())
    at = 0
    for b, e, name in spans:
        if b != at:
            fail(f"{path}: tensor {name} starts at {b}, expected {at} (no gap, no overlap)")
        at = e
    if at != len(data):
        fail(f"{path}: the tensors cover {at} bytes of {len(data)}")
    return header, data


def expected_tensors(c):
    """name -> shape, as transformers' DeepseekV3ForCausalLM (plus DeepSeek's MTP layers) names them."""
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    L, first_moe = c["num_hidden_layers"], c["first_k_dense_replace"]
    E, I, S, F = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"], c["intermediate_size"]
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}

    def mlp(p, width):
        t[p + "gate_proj.weight"] = (width, D)
        t[p + "up_proj.weight"] = (width, D)
        t[p + "down_proj.weight"] = (D, width)

    def block(p, moe):
        t[p + "input_layernorm.weight"] = (D,)
        t[p + "post_attention_layernorm.weight"] = (D,)
        a = p + "self_attn."
        if qr:
            t[a + "q_a_proj.weight"] = (qr, D)
            t[a + "q_a_layernorm.weight"] = (qr,)
            t[a + "q_b_proj.weight"] = (H * (dn + dr), qr)
        else:
            t[a + "q_proj.weight"] = (H * (dn + dr), D)
        t[a + "kv_a_proj_with_mqa.weight"] = (kvr + dr, D)
        t[a + "kv_a_layernorm.weight"] = (kvr,)
        t[a + "kv_b_proj.weight"] = (H * (dn + dv), kvr)
        t[a + "o_proj.weight"] = (D, H * dv)
        if not moe:
            mlp(p + "mlp.", F)
            return
        t[p + "mlp.gate.weight"] = (E, D)
        t[p + "mlp.gate.e_score_correction_bias"] = (E,)
        mlp(p + "mlp.shared_experts.", S * I)
        for e in range(E):
            mlp(p + f"mlp.experts.{e}.", I)

    for l in range(L):
        block(f"model.layers.{l}.", l >= first_moe)
    for k in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{L + k}."
        block(p, L > first_moe)
        for n, s in (("enorm.weight", (D,)), ("hnorm.weight", (D,)), ("eh_proj.weight", (D, 2 * D)),
                     ("shared_head.norm.weight", (D,)), ("shared_head.head.weight", (V, D)),
                     ("embed_tokens.weight", (V, D))):
            t[p + n] = s
    return t


def job_config(path, overrides):
    ini = configparser.ConfigParser()
    ini.read(path)
    for o in overrides:
        key, value = o.split("=", 1)
        section, name = key.split(".", 1)
        if not ini.has_section(section):
            ini.add_section(section)
        ini.set(section, name, value)
    return ini


def check_config(c, ini):
    if c.get("model_type") != "deepseek_v3" or c.get("architectures") != ["DeepseekV3ForCausalLM"]:
        fail(f"config.json: model_type {c.get('model_type')!r}, architectures {c.get('architectures')!r}")
    m, e, mtp = ini["model"], ini["moe"], ini["mtp"]
    qr = int(m["q_lora_rank"])
    limited = int(e["n_limited_groups"]) < int(e["n_expert_groups"])
    want = {
        "vocab_size": int(m["vocab_size"]), "hidden_size": int(m["dim"]), "intermediate_size": int(m["inter_dim"]),
        "num_hidden_layers": int(m["n_layers"]), "first_k_dense_replace": int(m["n_dense_layers"]),
        "num_attention_heads": int(m["n_heads"]), "num_key_value_heads": int(m["n_heads"]),
        "q_lora_rank": qr if qr > 0 else None, "kv_lora_rank": int(m["kv_lora_rank"]),
        "qk_nope_head_dim": int(m["qk_nope_head_dim"]), "qk_rope_head_dim": int(m["qk_rope_head_dim"]),
        "v_head_dim": int(m["v_head_dim"]), "rope_theta": float(m["rope_theta"]),
        "moe_intermediate_size": int(e["moe_inter_dim"]), "n_routed_experts": int(e["n_routed_experts"]),
        "n_shared_experts": int(e["n_shared_experts"]), "num_experts_per_tok": int(e["n_activated_experts"]),
        "n_group": int(e["n_expert_groups"]) if limited else 1,
        "topk_group": int(e["n_limited_groups"]) if limited else 1,
        "routed_scaling_factor": float(e["route_scale"]), "num_nextn_predict_layers": int(mtp["depth"]),
        "max_position_embeddings": int(ini["train"]["seq_len"]), "rms_norm_eps": 1e-6,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "rope_interleave": True,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    }
    for k, v in want.items():
        if k not in c or c[k] != v or type(c[k]) is not type(v):
            fail(f"config.json: {k} = {c.get(k)!r}, expected {v!r}")
    for k in ("routed_scaling_factor", "rope_theta", "rms_norm_eps"):  # float fields stay floats in JSON
        if not isinstance(c[k], float):
            fail(f"config.json: {k} = {c[k]!r} is not written as a float")
    return len(want)


def bf16_of(bits):
    """float32 bits -> bfloat16 bits, round to nearest even, NaN kept NaN (kernels/cpu/bf16.c)."""
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return (bits >> 16) | 0x0040
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def main():
    job, bf16_dir, fp32_dir, ckpt = sys.argv[1:5]
    ini = job_config(job, sys.argv[5:])
    with open(os.path.join(bf16_dir, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(fp32_dir, "config.json")) as f:
        c32 = json.load(f)
    n_fields = check_config(c, ini)
    if c.get("torch_dtype") != "bfloat16" or c32.get("torch_dtype") != "float32":
        fail(f"config.json torch_dtype: {c.get('torch_dtype')!r} (bf16), {c32.get('torch_dtype')!r} (fp32)")
    want = expected_tensors(c)
    h16, d16 = read_safetensors(os.path.join(bf16_dir, "model.safetensors"))
    h32, d32 = read_safetensors(os.path.join(fp32_dir, "model.safetensors"))
    for h, what in ((h16, "bf16"), (h32, "fp32")):
        if set(h) != set(want):
            fail(f"{what} export: missing {sorted(set(want) - set(h))[:5]}, unexpected {sorted(set(h) - set(want))[:5]}")
        for name, t in h.items():
            if tuple(t["shape"]) != want[name]:
                fail(f"{what} export: {name} has shape {t['shape']}, expected {list(want[name])}")
            dt = "F32" if what == "fp32" or name.endswith("e_score_correction_bias") else "BF16"
            if t["dtype"] != dt:
                fail(f"{what} export: {name} is {t['dtype']}, expected {dt}")
    ranks = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(ckpt, "rank*.h5"))))
    if not ranks:
        fail(f"{ckpt}: no rank file")
    n_values = n_found = 0
    for name in sorted(want):
        b32 = d32[h32[name]["data_offsets"][0]:h32[name]["data_offsets"][1]]
        f32 = struct.unpack(f"<{len(b32) // 4}I", b32)
        b16 = d16[h16[name]["data_offsets"][0]:h16[name]["data_offsets"][1]]
        if h16[name]["dtype"] == "F32":
            if b16 != b32:
                fail(f"{name}: the bf16 export's FP32 router bias differs from the fp32 export's")
        else:
            got = struct.unpack(f"<{len(b16) // 2}H", b16)
            for i, (x, y) in enumerate(zip(f32, got)):
                if bf16_of(x) != y:
                    fail(f"{name}[{i}]: BF16 0x{y:04x}, expected 0x{bf16_of(x):04x} (FP32 0x{x:08x} rounded)")
        n_values += len(f32)
        if len(b32) <= 1 << 18:  # lies whole in one HDF5 chunk of the rank file
            if b32 not in ranks:
                fail(f"{name}: its {len(f32)} FP32 values are not in the checkpoint's rank files")
            n_found += 1
    L = c["num_hidden_layers"]
    for k in range(c["num_nextn_predict_layers"]):
        for copy, orig in ((f"model.layers.{L + k}.shared_head.head.weight", "lm_head.weight"),
                           (f"model.layers.{L + k}.embed_tokens.weight", "model.embed_tokens.weight")):
            o1, o2 = h32[copy]["data_offsets"], h32[orig]["data_offsets"]
            if d32[o1[0]:o1[1]] != d32[o2[0]:o2[1]]:
                fail(f"{copy} differs from {orig}")
    print(f"ok: config.json ({n_fields} fields), {len(want)} tensors with their names, shapes and dtypes; "
          f"{n_values} BF16 values = the FP32 values rounded; {n_found} tensors' FP32 bytes found in {ckpt}")


main()

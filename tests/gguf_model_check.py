#!/usr/bin/env python3
"""Reads a model file written by upf_model_save_gguf (or `upf export`) with gguf-py, the GGUF tooling
of llama.cpp, and checks it against what llama.cpp expects of the architecture, independently of our
writer: every tensor name is one gguf-py knows for the architecture (MODEL_TENSORS), the tensor set
and every shape follow from the hyper-parameters in the metadata, and the metadata equals the values
given on the command line. Run by the CUnit suite "gguf model" when the venv exists.

  python3 tests/gguf_model_check.py FILE.gguf ARCH KEY=VALUE ...     (e.g. embedding_length=128)

Prints one line per problem; exit status 0 when every check passed, 1 otherwise.
"""
import sys

import gguf
import numpy as np


def main():
    path, arch = sys.argv[1], sys.argv[2]
    want = dict(a.split("=", 1) for a in sys.argv[3:])
    r = gguf.GGUFReader(path)
    problems = []

    def field(key):
        f = r.fields.get(key)
        if f is None:
            problems.append("missing metadata %s" % key)
            return None
        return f.contents()

    if field("general.architecture") != arch:
        problems.append("general.architecture %r, want %r" % (field("general.architecture"), arch))
    for k, v in want.items():
        got = field("%s.%s" % (arch, k))
        if got is not None and abs(float(got) - float(v)) > 1e-6 * max(1.0, abs(float(v))):
            problems.append("%s.%s = %r, want %s" % (arch, k, got, v))
    if field("tokenizer.ggml.model") is None:
        problems.append("no tokenizer.ggml.model (llama.cpp's loader needs one)")

    m = {k: field("%s.%s" % (arch, k)) for k in
         ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
          "attention.key_length", "vocab_size")}
    H, L, Hq, Hkv, D, V = (int(m[k] or 0) for k in
                           ("embedding_length", "block_count", "attention.head_count",
                            "attention.head_count_kv", "attention.key_length", "vocab_size"))
    tensors = {t.name: [int(x) for x in t.shape] for t in r.tensors}

    # the names gguf-py knows for the architecture
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    known = set()
    for t in gguf.MODEL_TENSORS[arch_id]:
        pattern = gguf.TENSOR_NAMES[t]
        known.update({pattern.format(bid=b) + s for b in range(L) for s in (".weight", ".bias", "")})
    for name in tensors:
        if name not in known:
            problems.append("tensor %s is not a %s tensor gguf-py knows" % (name, arch))

    # the shapes llama.cpp's loader asks for (ne order: contiguous dim first)
    expect = {"token_embd.weight": [H, V], "output_norm.weight": [H]}
    if "output.weight" in tensors:
        expect["output.weight"] = [H, V]
    full_interval = int(field("%s.full_attention_interval" % arch) or 1) if arch == "qwen3next" else 1
    for b in range(L):
        p = "blk.%d." % b
        expect[p + "attn_norm.weight"] = [H]
        gdn = arch == "qwen3next" and (b + 1) % full_interval != 0
        if gdn:
            Hk = int(field(arch + ".ssm.group_count")); Dk = int(field(arch + ".ssm.state_size"))
            Hv = int(field(arch + ".ssm.time_step_rank")); inner = int(field(arch + ".ssm.inner_size"))
            K = int(field(arch + ".ssm.conv_kernel")); C = 2 * Hk * Dk + inner
            expect.update({p + "ssm_in.weight": [H, C + inner], p + "ssm_ba.weight": [H, 2 * Hv],
                           p + "ssm_conv1d.weight": [K, C], p + "ssm_a": [Hv], p + "ssm_dt.bias": [Hv],
                           p + "ssm_norm.weight": [inner // Hv], p + "ssm_out.weight": [inner, H]})
        else:
            q_out = Hq * D * (2 if arch == "qwen3next" else 1)
            expect.update({p + "attn_q.weight": [H, q_out], p + "attn_k.weight": [H, Hkv * D],
                           p + "attn_v.weight": [H, Hkv * D], p + "attn_output.weight": [Hq * D, H]})
            if arch in ("gemma3", "qwen3next"):
                expect[p + "attn_q_norm.weight"] = [D]
                expect[p + "attn_k_norm.weight"] = [D]
        if arch == "gemma3":
            expect[p + "post_attention_norm.weight"] = [H]
            expect[p + "post_ffw_norm.weight"] = [H]
        if arch == "qwen3next":
            E = int(field(arch + ".expert_count")); I = int(field(arch + ".expert_feed_forward_length"))
            Is = int(field(arch + ".expert_shared_feed_forward_length"))
            expect.update({p + "post_attention_norm.weight": [H], p + "ffn_gate_inp.weight": [H, E],
                           p + "ffn_gate_exps.weight": [H, I, E], p + "ffn_up_exps.weight": [H, I, E],
                           p + "ffn_down_exps.weight": [I, H, E]})
            if Is:
                expect.update({p + "ffn_gate_shexp.weight": [H, Is], p + "ffn_up_shexp.weight": [H, Is],
                               p + "ffn_down_shexp.weight": [Is, H], p + "ffn_gate_inp_shexp.weight": [H]})
        else:
            I = int(field(arch + ".feed_forward_length"))
            expect.update({p + "ffn_norm.weight": [H], p + "ffn_gate.weight": [H, I],
                           p + "ffn_up.weight": [H, I], p + "ffn_down.weight": [I, H]})
    if "rope_freqs.weight" in tensors:
        expect["rope_freqs.weight"] = [int(field(arch + ".rope.dimension_count")) // 2]
    for name in sorted(set(expect) | set(tensors)):
        if name not in tensors:
            problems.append("missing tensor %s" % name)
        elif name not in expect:
            problems.append("unexpected tensor %s" % name)
        elif tensors[name] != expect[name]:
            problems.append("tensor %s has shape %s, want %s" % (name, tensors[name], expect[name]))
    for t in r.tensors:  # every value readable and finite
        if not np.all(np.isfinite(np.asarray(t.data, dtype=np.float32) if t.tensor_type.name == "F32"
                                  else gguf.quants.dequantize(t.data, t.tensor_type))):
            problems.append("tensor %s holds a non-finite value" % t.name)
    for p in problems:
        print(p)
    print("%s: %d tensors, %d problems" % (path, len(tensors), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

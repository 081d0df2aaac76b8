#!/usr/bin/env python3
"""Every peer's JSON -> the report's peer rows (issue 26): reads what torch_sdpa.py, torch_matmul.py,
fla_gdn.py and vllm_moe.py write, tells which wrote a file by its content, and writes

  {"schema": "uniprefill-peers", "version": 1,
   "rows": [{"id": ID, "peer": NAME, "median_ms": MS, "min_ms": MS}, ...]}

ID is the name prefix of OUR benchmark the peer number stands beside, exactly as bench_upf names it
(`bench_upf --benchmark_list_tests`, less the "/min_time:..." tail), NAME what ran:
  torch_sdpa.py   attn.prefill/torch_sdpa/bf16/<shape>/T:<T>/<backend>
                  -> attn_prefill/cuda/bf16/<family>/B:1/kv:<T>, the fastest backend that ran,
                  "torch SDPA (CUDNN_ATTENTION)" (the backend torch picked, for "default")
                  llama -> llama_causal (Hq 32, Hkv 8, D 128), d64 -> d64_causal (32, 8, 64),
                  gemma_global -> gemma_global (16, 8, 256); a result whose hq/hkv/d differ is left out
  torch_matmul.py gemm/torch/bf16/<proj>/T:<T> -> gemm/cuda/bf16/<proj>/T:<T>;
                  ffn/torch/bf16/<ffn>/T:<T> -> ffn/cuda/bf16/<ffn>/T:<T>;
                  its ceiling matmul/bf16/n:8192 -> gemm_ceiling/cuda/bf16/n:8192; "torch.matmul"
  fla_gdn.py      gdn.scan/fla_chunk_gated_delta_rule/bf16/<case>/T:<T>
                  -> gdn.scan/cuda/bf16/<case>/chunked/T:<T>, "FLA chunk_gated_delta_rule <version>"
                  (", gate precomputed" when FLA refused the in-kernel gate: less work timed)
  vllm_moe.py     results already named by our ids (moe.ffn/cuda/bf16/T:<T>), checked against the
                  Qwen3-Next layer (H 2048, E 512, top-10, I 512, Is 512); "vLLM fused_moe (Triton)"
Only rows whose shape equals one of ours exactly: the ids are those of bench_upf's standard cases
(OUR_IDS below), or of the listing given with --ids FILE (`bench_upf --benchmark_list_tests > FILE`).
Each peer result without a matching benchmark (or with an error) is named on stderr. The same id from
two inputs: the later input's row wins, said on stderr.

Exit status 2, naming the file, for an input that cannot be read, is not JSON, or is of no known format,
an output that names an input or lies in a missing folder; the output is written whole or not at all.
Reads only JSON, so it runs anywhere (python3, no torch):
  python3 perf/peers/peer_rows.py OUT.json PEER.json [PEER.json ...] [--ids FILE]
  python3 perf/peers/peer_rows.py --self-test
"""
import json
import os
import re
import sys
import tempfile

SCHEMA, VERSION = "uniprefill-peers", 1

# bench_upf's ids a peer can stand beside (perf/bench_attn.c, bench_dense.c, bench_gdn.c, bench_moe.c)
OUR_IDS = frozenset(
    [f"attn_prefill/cuda/bf16/llama_causal/B:1/kv:{t}" for t in (4096, 16384, 32768, 131072)]
    + [f"attn_prefill/cuda/bf16/d64_causal/B:1/kv:{t}" for t in (32768, 131072)]
    + [f"attn_prefill/cuda/bf16/gemma_global/B:1/kv:{t}" for t in (8192, 32768, 131072)]
    + [f"gemm/cuda/bf16/{p}/T:{t}" for p in ("llama_qkv", "llama_o", "llama_gate_up", "llama_down")
       for t in (8192, 32768, 131072)]
    + ["gemm_ceiling/cuda/bf16/n:8192"]
    + [f"ffn/cuda/bf16/llama_swiglu/T:{t}" for t in (8192, 16384, 32768, 65536, 131072)]
    + [f"ffn/cuda/bf16/gemma_geglu/T:{t}" for t in (8192, 32768)]
    + [f"gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:{t}" for t in (8192, 32768, 131072)]
    + ["gdn.scan/cuda/bf16/qwen3next_batch16x2K/chunked/T:32768"]
    + [f"moe.ffn/cuda/bf16/T:{t}" for t in (8192, 32768)])

# torch_sdpa.py shape -> (our family, Hq, Hkv, D)
SDPA_SHAPES = {"llama": ("llama_causal", 32, 8, 128), "d64": ("d64_causal", 32, 8, 64),
               "gemma_global": ("gemma_global", 16, 8, 256)}
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
QWEN3_NEXT_MOE = {"hidden": 2048, "experts": 512, "top_k": 10, "inter": 512, "shared_inter": 512}
# the tail bench_upf's listing adds to a name: run options, not shape
RUN_OPTION = re.compile(r"^(min_time|min_warmup_time|repeats|iterations|threads):"
                        r"|^(manual_time|real_time|process_time)$")


class InputError(Exception):
    """An input or output the command refuses (exit 2): the message names it."""


def ms(seconds):
    return round(seconds * 1e3, 6)


def timed(r):
    return isinstance(r, dict) and isinstance(r.get("median_s"), (int, float)) and \
        isinstance(r.get("min_s"), (int, float)) and "error" not in r


# Each converter: (rows [(id, peer, median_s, min_s)], left out [(peer name, why)]) of one file's report.

def from_sdpa(rep):
    rows, left = [], []
    by_case = {}
    for r in rep["results"]:
        m = re.fullmatch(r"attn\.prefill/torch_sdpa/bf16/(\w+)/T:(\d+)/(\w+)", r["name"])
        if not m:
            left.append((r["name"], "not a torch_sdpa.py result name"))
            continue
        shape, T, backend = m.group(1), int(m.group(2)), m.group(3)
        if backend == "best":  # a copy of its backend's entry, which is read itself
            continue
        if not timed(r):
            left.append((r["name"], f"not timed ({r.get('error', 'no median_s/min_s')})"[:160]))
            continue
        by_case.setdefault((shape, T), []).append((backend, r))
    for (shape, T), runs in sorted(by_case.items()):
        backend, r = min(runs, key=lambda br: br[1]["median_s"])
        name = f"attn.prefill/torch_sdpa/bf16/{shape}/T:{T}"
        if shape not in SDPA_SHAPES:
            left.append((name, f"no benchmark of shape '{shape}'"))
            continue
        fam, hq, hkv, d = SDPA_SHAPES[shape]
        got = tuple(r.get(k, want) for k, want in (("hq", hq), ("hkv", hkv), ("d", d)))
        if got != (hq, hkv, d):
            left.append((name, f"heads/dim {got} are not {fam}'s {(hq, hkv, d)}"))
            continue
        kernel = SDPA_BACKENDS.get(backend) or (r.get("picked") if backend == "default" else None) or backend
        if kernel.startswith("unknown"):
            kernel = "default"
        rows.append((f"attn_prefill/cuda/bf16/{fam}/B:1/kv:{T}", f"torch SDPA ({kernel})", r["median_s"], r["min_s"]))
    return rows, left


def from_matmul(rep):
    rows, left = [], []
    results = list(rep["results"])
    if isinstance(rep.get("ceiling"), dict):
        results.append(rep["ceiling"])
    for r in results:
        name = r.get("name", "")
        m = re.fullmatch(r"(gemm|ffn)/torch/bf16/(\w+)/T:(\d+)", name)
        c = re.fullmatch(r"matmul/bf16/n:(\d+)", name)
        if not (m or c):
            left.append((name, "not a torch_matmul.py result name"))
        elif not timed(r):
            left.append((name, "not timed"))
        elif m:
            rows.append((f"{m.group(1)}/cuda/bf16/{m.group(2)}/T:{m.group(3)}", "torch.matmul", r["median_s"],
                         r["min_s"]))
        else:
            rows.append((f"gemm_ceiling/cuda/bf16/n:{c.group(1)}", "torch.matmul", r["median_s"], r["min_s"]))
    return rows, left


def from_fla(rep):
    rows, left = [], []
    version = rep.get("context", {}).get("fla", "unknown")
    for r in rep["results"]:
        m = re.fullmatch(r"gdn\.scan/fla_chunk_gated_delta_rule/bf16/(\w+)/T:(\d+)", r["name"])
        if not m:
            left.append((r["name"], "not a fla_gdn.py result name"))
        elif not timed(r):
            left.append((r["name"], "not timed"))
        else:
            peer = f"FLA chunk_gated_delta_rule {version}"
            if r.get("gate") == "precomputed":
                peer += ", gate precomputed"
            rows.append((f"gdn.scan/cuda/bf16/{m.group(1)}/chunked/T:{m.group(2)}", peer, r["median_s"], r["min_s"]))
    return rows, left


def from_vllm(rep):
    rows, left = [], []
    for r in rep["results"]:
        m = re.fullmatch(r"moe\.ffn/cuda/bf16/T:(\d+)", r["name"])
        shape = {k: r.get(k) for k in QWEN3_NEXT_MOE}
        if not m:
            left.append((r["name"], "not a vllm_moe.py result name"))
        elif not timed(r):
            left.append((r["name"], f"not timed ({r.get('error', 'no median_s/min_s')})"[:160]))
        elif shape != QWEN3_NEXT_MOE:
            left.append((r["name"], f"layer {shape} is not Qwen3-Next's {QWEN3_NEXT_MOE}"))
        else:
            rows.append((r["name"], rep.get("peer", "vLLM fused_moe (Triton)"), r["median_s"], r["min_s"]))
    return rows, left


# format: (what wrote it, does a result name belong to it, converter)
FORMATS = [
    ("torch_sdpa.py", lambda n: n.startswith("attn.prefill/torch_sdpa/"), from_sdpa),
    ("torch_matmul.py", lambda n: re.match(r"(gemm|ffn)/torch/", n) is not None, from_matmul),
    ("fla_gdn.py", lambda n: n.startswith("gdn.scan/fla_"), from_fla),
    ("vllm_moe.py", lambda n: n.startswith("moe.ffn/"), from_vllm),
]


def load(path):
    """(format name, converter, report) of one peer JSON; InputError naming the file otherwise."""
    try:
        with open(path) as f:
            rep = json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not JSON ({e})") from None
    results = rep.get("results") if isinstance(rep, dict) else None
    if not isinstance(results, list) or not results or \
            not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in results):
        raise InputError(f"{path}: unknown format (no 'results' list of named entries: not a peer JSON)")
    names = [r["name"] for r in results]
    hits = [fmt for fmt in FORMATS if all(fmt[1](n) for n in names)]
    if len(hits) != 1:
        raise InputError(f"{path}: unknown format (its results, e.g. '{names[0]}', are not those of "
                         f"{', '.join(f[0] for f in FORMATS)})")
    return hits[0][0], hits[0][2], rep


def read_ids(path):
    """Our benchmark ids from a `bench_upf --benchmark_list_tests` listing (the run options dropped)."""
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError as e:
        raise InputError(f"--ids {path}: cannot read ({e.strerror or e})") from None
    ids = set()
    for ln in lines:
        parts = ln.split("/")
        while parts and RUN_OPTION.match(parts[-1]):
            parts.pop()
        ids.add("/".join(parts))
    if not ids:
        raise InputError(f"--ids {path}: no benchmark names in it")
    return frozenset(ids)


def convert(paths, ours, err):
    """The rows of all inputs in order (a later input's row replaces an earlier one of the same id)."""
    rows = {}
    for path in paths:
        fmt, conv, rep = load(path)
        got, left = conv(rep)
        for name, why in left:
            err.write(f"{path}: {name}: left out, {why}\n")
        for id_, peer, med, mn in got:
            if id_ not in ours:
                err.write(f"{path}: {peer} at {id_}: no benchmark of that id (shape), left out\n")
                continue
            if id_ in rows:
                err.write(f"{path}: {id_}: replaces the row of {rows[id_][0]}\n")
            rows[id_] = (path, {"id": id_, "peer": peer, "median_ms": ms(med), "min_ms": ms(mn)})
        err.write(f"{path}: {fmt}, {sum(1 for i, p, m, n in got if i in ours)} row(s)\n")
    return [row for _, row in rows.values()]


def write_atomic(out, doc):
    folder = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=".peer-rows-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def run(argv, err=sys.stderr):
    """The command; returns its exit status."""
    args, ids_path = [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__)
            return 0
        if a == "--ids":
            if i + 1 >= len(argv):
                err.write("peer_rows.py: --ids needs a file (bench_upf --benchmark_list_tests > FILE)\n")
                return 2
            if ids_path is not None:
                err.write("peer_rows.py: --ids given twice\n")
                return 2
            ids_path, i = argv[i + 1], i + 2
            continue
        if a.startswith("-") and a != "-":
            err.write(f"peer_rows.py: unknown flag {a}\n")
            return 2
        args.append(a)
        i += 1
    if len(args) < 2:
        err.write("usage: peer_rows.py OUT.json PEER.json [PEER.json ...] [--ids FILE]\n")
        return 2
    out, inputs = args[0], args[1:]
    try:
        real = {os.path.realpath(p) for p in inputs}
        if os.path.realpath(out) in real:
            raise InputError(f"{out}: the output names an input")
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise InputError(f"{out}: its folder does not exist")
        ours = read_ids(ids_path) if ids_path else OUR_IDS
        rows = convert(inputs, ours, err)
    except InputError as e:
        err.write(f"peer_rows.py: {e}\n")
        return 2
    write_atomic(out, {"schema": SCHEMA, "version": VERSION, "rows": rows})
    err.write(f"peer_rows.py: {out}: {len(rows)} row(s)\n")
    return 0


# ---------------------------------------------------------------------------- self-test

def self_test():
    """Hand-made inputs of each format, with the rows worked out by hand, and the refusals."""
    import io

    failures = 0

    def check(name, ok, detail=""):
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}")

    sdpa = {"context": {}, "results": [
        {"name": "attn.prefill/torch_sdpa/bf16/llama/T:32768/default", "backend": "default",
         "picked": "CUDNN_ATTENTION", "hq": 32, "hkv": 8, "d": 128, "median_s": 0.0145, "min_s": 0.0144},
        {"name": "attn.prefill/torch_sdpa/bf16/llama/T:32768/flash", "backend": "flash", "median_s": 0.025,
         "min_s": 0.0249},
        {"name": "attn.prefill/torch_sdpa/bf16/llama/T:32768/cudnn", "backend": "cudnn", "median_s": 0.0148,
         "min_s": 0.0140},
        {"name": "attn.prefill/torch_sdpa/bf16/llama/T:32768/best", "backend": "default", "median_s": 0.0145,
         "min_s": 0.0144},
        # no llama_causal benchmark at 8K: left out
        {"name": "attn.prefill/torch_sdpa/bf16/llama/T:8192/cudnn", "median_s": 0.001, "min_s": 0.001},
        # the flash backend fastest here; efficient refused the shape
        {"name": "attn.prefill/torch_sdpa/bf16/d64/T:131072/flash", "median_s": 0.150, "min_s": 0.149},
        {"name": "attn.prefill/torch_sdpa/bf16/d64/T:131072/cudnn", "median_s": 0.155, "min_s": 0.154},
        {"name": "attn.prefill/torch_sdpa/bf16/d64/T:131072/efficient", "error": "refused"},
        # heads not gemma_global's: left out
        {"name": "attn.prefill/torch_sdpa/bf16/gemma_global/T:8192/default", "hq": 32, "hkv": 8, "d": 256,
         "picked": "FLASH_ATTENTION", "median_s": 0.0009, "min_s": 0.0008}]}
    matmul = {"context": {}, "ceiling": {"name": "matmul/bf16/n:8192", "median_s": 0.00144, "min_s": 0.00143},
              "results": [{"name": "gemm/torch/bf16/llama_qkv/T:8192", "median_s": 0.000563, "min_s": 0.000543},
                          {"name": "ffn/torch/bf16/gemma_geglu/T:32768", "median_s": 0.0195, "min_s": 0.0185},
                          {"name": "gemm/torch/bf16/llama_qkv/T:4096", "median_s": 0.0003, "min_s": 0.0003}]}
    fla = {"context": {"fla": "0.6.0"}, "results": [
        {"name": "gdn.scan/fla_chunk_gated_delta_rule/bf16/qwen3next_prefill/T:32768", "median_s": 0.00273,
         "min_s": 0.00262, "gate": "in_kernel"},
        {"name": "gdn.scan/fla_chunk_gated_delta_rule/bf16/qwen3next_batch16x2K/T:32768", "median_s": 0.00297,
         "min_s": 0.00253, "gate": "precomputed"}]}
    layer = dict(QWEN3_NEXT_MOE)
    vllm = {"peer": "vLLM fused_moe (Triton)", "context": {}, "results": [
        dict(layer, name="moe.ffn/cuda/bf16/T:8192", median_s=0.0052, min_s=0.0051),
        dict(layer, name="moe.ffn/cuda/bf16/T:32768", error="not timed: the check failed (nmse 1 > 5e-4)"),
        dict(layer, name="moe.ffn/cuda/bf16/T:32768", top_k=8, median_s=0.01, min_s=0.01)]}
    want = [
        {"id": "attn_prefill/cuda/bf16/d64_causal/B:1/kv:131072", "peer": "torch SDPA (FLASH_ATTENTION)",
         "median_ms": 150.0, "min_ms": 149.0},
        {"id": "attn_prefill/cuda/bf16/llama_causal/B:1/kv:32768", "peer": "torch SDPA (CUDNN_ATTENTION)",
         "median_ms": 14.5, "min_ms": 14.4},
        {"id": "gemm/cuda/bf16/llama_qkv/T:8192", "peer": "torch.matmul", "median_ms": 0.563, "min_ms": 0.543},
        {"id": "ffn/cuda/bf16/gemma_geglu/T:32768", "peer": "torch.matmul", "median_ms": 19.5, "min_ms": 18.5},
        {"id": "gemm_ceiling/cuda/bf16/n:8192", "peer": "torch.matmul", "median_ms": 1.44, "min_ms": 1.43},
        {"id": "gdn.scan/cuda/bf16/qwen3next_prefill/chunked/T:32768", "peer": "FLA chunk_gated_delta_rule 0.6.0",
         "median_ms": 2.73, "min_ms": 2.62},
        {"id": "gdn.scan/cuda/bf16/qwen3next_batch16x2K/chunked/T:32768",
         "peer": "FLA chunk_gated_delta_rule 0.6.0, gate precomputed", "median_ms": 2.97, "min_ms": 2.53},
        {"id": "moe.ffn/cuda/bf16/T:8192", "peer": "vLLM fused_moe (Triton)", "median_ms": 5.2, "min_ms": 5.1}]
    with tempfile.TemporaryDirectory() as d:
        def put(name, doc):
            p = os.path.join(d, name)
            with open(p, "w") as f:
                f.write(doc if isinstance(doc, str) else json.dumps(doc))
            return p

        def go(argv):
            e = io.StringIO()
            return run(argv, e), e.getvalue()

        ins = [put("sdpa.json", sdpa), put("matmul.json", matmul), put("fla.json", fla), put("vllm.json", vllm)]
        out = os.path.join(d, "rows.json")
        rc, msg = go([out] + ins)
        got = json.load(open(out)) if rc == 0 else {}
        check("four formats -> the hand-worked rows", rc == 0 and got.get("schema") == SCHEMA
              and got.get("version") == VERSION and got.get("rows") == want,
              f"rc {rc}, rows {json.dumps(got.get('rows'))}\n{msg}")
        check("left-out results named on stderr", all(s in msg for s in (
            "llama_causal/B:1/kv:8192: no benchmark", "gemma_global/T:8192: left out, heads/dim",
            "llama_qkv/T:4096: no benchmark", "T:32768: left out, not timed (not timed: the check failed",
            "T:32768: left out, layer", "d64/T:131072/efficient: left out, not timed (refused)")), msg)
        ids = put("ids.txt", "moe.ffn/cuda/bf16/T:8192/min_time:0.100/repeats:1/manual_time\n"
                             "gemm/cuda/bf16/llama_qkv/T:8192/min_time:0.100/repeats:1/manual_time\n")
        rc, msg = go([out, ins[1], ins[3], "--ids", ids])
        got = json.load(open(out)) if rc == 0 else {}
        check("--ids restricts to the listing", rc == 0 and [r["id"] for r in got.get("rows", [])] ==
              ["gemm/cuda/bf16/llama_qkv/T:8192", "moe.ffn/cuda/bf16/T:8192"], msg)
        rc, msg = go([out, ins[1], ins[1]])
        check("the same id twice: the later input's row, said", rc == 0 and "replaces the row" in msg, msg)
        before = open(out).read()
        for label, bad, text in [
                ("not JSON", put("broken.json", "{\"results\": ["), "broken.json: not JSON"),
                ("unknown format", put("other.json", {"results": [{"name": "select/cuda/x"}]}),
                 "other.json: unknown format"),
                ("no results", put("empty.json", {"benchmarks": []}), "empty.json: unknown format"),
                ("mixed formats", put("mixed.json", {"results": sdpa["results"][:1] + fla["results"][:1]}),
                 "mixed.json: unknown format"),
                ("missing file", os.path.join(d, "none.json"), "none.json: cannot read")]:
            rc, msg = go([out, ins[0], bad])
            check(f"{label} exits 2 naming the file, output untouched", rc == 2 and text in msg
                  and open(out).read() == before, f"rc {rc}: {msg}")
        rc, msg = go([ins[0], ins[0]])
        check("an output naming an input exits 2", rc == 2 and "names an input" in msg, msg)
        rc, msg = go([os.path.join(d, "no", "rows.json"), ins[0]])
        check("an output in a missing folder exits 2", rc == 2 and "folder does not exist" in msg, msg)
        rc, msg = go([out])
        check("no input exits 2", rc == 2 and "usage" in msg, msg)
        rc, msg = go([out, ins[0], "--bogus"])
        check("an unknown flag exits 2", rc == 2 and "--bogus" in msg, msg)
        check("no temporary file left", not [f for f in os.listdir(d) if f.startswith(".peer-rows-")])
    print(f"{failures} failed" if failures else "self-test passed")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(run(sys.argv[1:]))

#!/usr/bin/env python3
"""A serve-sim trace (JSON lines) for chunked prefill under decode load: DECODES short requests arrive
at t = 0 and decode MAX_NEW tokens each, and one long prompt per LENGTH arrives at t = START (once the
decodes run), LENGTH tokens each, 16 new tokens. What issue 24's serving rows measure: the long
prompts' TTFT and the decodes' TPOT while they prefill.
Usage: chunkserve_trace.py OUT.jsonl LENGTH[,LENGTH...] [--decodes 32] [--decode-prompt 512]
       [--max-new 256] [--start 0.05]"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser(usage=__doc__)
    ap.add_argument("out")
    ap.add_argument("lengths")
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--start", type=float, default=0.05)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",") if x]
    with open(a.out, "w") as f:
        for i in range(a.decodes):
            f.write(json.dumps({"arrival": 0.0, "prompt_len": a.decode_prompt, "seed": i + 1,
                                "max_new": a.max_new, "id": i}) + "\n")
        for k, n in enumerate(lengths):
            f.write(json.dumps({"arrival": a.start * (k + 1), "prompt_len": n, "seed": 1000 + k,
                                "max_new": 16, "id": a.decodes + k}) + "\n")


if __name__ == "__main__":
    main()

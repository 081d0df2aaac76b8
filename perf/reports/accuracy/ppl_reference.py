#!/usr/bin/env python3
"""An independent check of `upf eval --task ppl`: the same token ids (`upf tokenize --out`, the text the
eval reads, joined the same way) through PyTorch transformers, which loads the GGUF file itself (its own
dequantisation and weight conventions) and runs in float32 on the CPU; prints the perplexity of the
first N tokens (the window `upf eval --task ppl --tokens N --windows 1` reads).

    python3 perf/reports/accuracy/ppl_reference.py MODEL_DIR FILE.gguf IDS.npy N
"""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, name, ids_path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ids = torch.tensor(np.load(ids_path)[:n].astype(np.int64))[None]
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=name, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="mean")
    print("%s: %d tokens, ppl %.4f (torch %s, float32)" % (name, ids.shape[1], float(torch.exp(nll)), torch.__version__))


if __name__ == "__main__":
    main()

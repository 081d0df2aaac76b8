#!/usr/bin/env python3
"""chunk_state_kernel (cuda/gdn_chunked.cu): its ldmatrix / stmatrix lane maps enumerated against the scalar
fragment maps of warp_mma (mma_sync.cuh) and the per-element S^T, U and V'^T accesses they stand for, per the PTX
definitions of ldmatrix .x4 and stmatrix .x4 .trans; and the 8x8 row sets checked for bank conflicts. Prints one
line; no GPU."""
LDA, LDB, LDU, CH, D = 136, 72, 40, 64, 128
def ldsm(addr_of_lane):            # -> reg[i][lane] = (elem lo, elem hi) offsets
    reg = [[None]*32 for _ in range(4)]
    for l in range(32):
        for i in range(4):
            rowaddr = addr_of_lane(8*i + l//4)
            reg[i][l] = (rowaddr + 2*(l % 4), rowaddr + 2*(l % 4) + 1)
    return reg
def stsm_trans(addr_of_lane):      # -> reg[i][lane] = (dest lo, dest hi)
    reg = [[None]*32 for _ in range(4)]
    for l in range(32):
        for i in range(4):
            r, c = l//4, 2*(l % 4)
            reg[i][l] = (addr_of_lane(8*i + c) + r, addr_of_lane(8*i + c + 1) + r)
    return reg
ok = True
# warp_mma A and B fragments, every k-step, B n-pairs
for lda in (LDA, LDB):
    for ks in range(0, 128 if lda == LDA else 64, 16):
        A = ldsm(lambda l: (l & 15)*lda + (l >> 4)*8 + ks)
        for l in range(32):
            g, t = l >> 2, l & 3
            scalar = [g*lda+ks+2*t, (g+8)*lda+ks+2*t, g*lda+ks+2*t+8, (g+8)*lda+ks+2*t+8]
            ok &= all(A[i][l] == (scalar[i], scalar[i]+1) for i in range(4))
        for n in (0, 2):
            B = ldsm(lambda l: ((l & 7) + ((l >> 4) << 3))*lda + ((l >> 3) & 1)*8 + n*8*lda + ks)
            for l in range(32):
                g, t = l >> 2, l & 3
                for nn, (r0, r1) in ((n, (0, 1)), (n+1, (2, 3))):
                    br = (8*nn + g)*lda + ks + 2*t
                    ok &= B[r0][l] == (br, br+1) and B[r1][l] == (br+8, br+9)
# S^T stores: per element St[v*LDA + d] = s[nt][c], d = 16w + g + 8(c>>1), v = 8nt + 2t + (c&1)
for w in range(8):
    for p in range(2):
        S = stsm_trans(lambda l: (8*((l >> 3) >> 1) + (l & 7))*LDA + 16*w + 8*((l >> 3) & 1) + 16*p*LDA)
        for l in range(32):
            g, t = l >> 2, l & 3
            for i in range(4):
                nt, hb = 2*p + (i >> 1), i & 1
                want = tuple((8*nt + 2*t + c)*LDA + 16*w + g + 8*hb for c in (0, 1))
                ok &= S[i][l] == want
# U loads and V'^T stores of store_vprime against per-element accesses
for w in range(8):
    i0, cw = 16*(w & 3), 16*(w >> 2)
    U = ldsm(lambda l: (i0 + 8*((l >> 3) & 1) + (l & 7))*LDU + cw + 8*((l >> 3) >> 1))
    V = stsm_trans(lambda l: (cw + 8*((l >> 3) >> 1) + (l & 7))*LDB + i0 + 8*((l >> 3) & 1))
    for l in range(32):
        g, t = l >> 2, l & 3
        for nt in range(2):
            for half in range(2):
                i = i0 + g + 8*half
                ok &= U[2*nt+half][l] == tuple(i*LDU + cw + 8*nt + 2*t + c for c in (0, 1))
                ok &= V[2*nt+half][l] == tuple((cw + 8*nt + 2*t + c)*LDB + i for c in (0, 1))
# bank conflicts: each 8x8 matrix's 8 row addresses (16 bytes each) on distinct 4-bank groups
def conflict_free(rows_bytes):
    banks = set()
    for a in rows_bytes:
        for k in range(4): banks.add((a//4 + k) % 32)
    return len(banks) == 32
for ld in (LDA, LDB, LDU):
    ok &= conflict_free([2*ld*j for j in range(8)])
print("all lane maps match:", ok)

#!/usr/bin/env python3
"""Prototype (not a pack type): how much a codebook 2-bit expert type would gain over q2.

Groups of 8 weights take their magnitudes from a codebook of N vectors over the levels {1, 3, 5}
(index log2 N bits) and their signs free (8 bits, or 7 with the 8th fixed by parity: an odd
count of negatives flips the cheapest element), one scale per 16 weights rounded to 4 bits
against a per-256 scale (fp16 rounding ignored). The codebook is the N most frequent level
patterns of Gaussian 8-vectors at a typical per-16 scale (our own construction, no lattice
tables). Each group's vector is the exact minimiser of its (importance-weighted) error over the
codebook, for each of 33 scales per 16 and the rounded scale's neighbours.

Writes the matrix and importance it used (x_DIST.bin, imp_DIST.bin, float32) so that m3's own
q3/q2 quantizer runs on the same numbers: build/bench/bench_quantize_file x_DIST.bin imp_DIST.bin
3072 (docs/PERFORMANCE.md has the figures).
With the third argument q3: groups of 4 weights, levels {1, 3, ..., 15}, 512 vectors (9 bits),
a sign bit each, a 4-bit scale per 32 or 16 (IQ3_S's budget is 3.4375 bits a weight).
Usage: codebook_q2.py [ROWS] [gauss|t4] [q2|q3]   (numpy; 16 rows take ~5-10 minutes)
"""
import sys

import numpy as np

rng = np.random.default_rng(5)
rows, cols = (int(sys.argv[1]) if len(sys.argv) > 1 else 16), 3072
dist = sys.argv[2] if len(sys.argv) > 2 else "gauss"
q3 = len(sys.argv) > 3 and sys.argv[3] == "q3"
DIM = 4 if q3 else 8
X = (rng.standard_normal((rows, cols)) if dist == "gauss" else rng.standard_t(4, (rows, cols))).astype(np.float32)
# As `m3 bench --quant`: log-normal over 0.5 decades, 1% of the inputs 30x.
imp = (10 ** rng.normal(0, 0.5, cols) * np.where(np.arange(cols) % 100 == 37, 30.0, 1.0)).astype(np.float32)
X.tofile(f"x_{dist}.bin")
imp.tofile(f"imp_{dist}.bin")

LEVELS = np.arange(1.0, 16.0, 2.0) if q3 else np.array([1.0, 3.0, 5.0])
NL, TOP = len(LEVELS), LEVELS[-1]
samples = rng.standard_normal((400000, 32 if q3 else 16))  # a scale block's worth
step = np.abs(samples).max(1, keepdims=True) / TOP
nearest = np.rint((np.abs(samples) / step - 1) / 2).clip(0, NL - 1).astype(int).reshape(-1, DIM)
keys, counts = np.unique((nearest * NL ** np.arange(DIM)).sum(1), return_counts=True)


def codebook(n):
    top = keys[np.argsort(-counts)[:n]]
    return LEVELS[(top[:, None] // NL ** np.arange(DIM)) % NL]  # (n, DIM)


def relative_error(x, w, book, parity, sub=16):
    R, C = x.shape
    xs = x.reshape(R, C // sub, sub)
    ws = np.broadcast_to(w, (R, C)).reshape(R, C // sub, sub)
    mag = np.abs(xs)

    def error_at(scale):  # per (row, sub) block, for scales of shape (R, C // sub)
        a = (mag / scale[..., None]).reshape(R, C // sub, sub // DIM, DIM)
        ww = ws.reshape(R, C // sub, sub // DIM, DIM)
        wa = ww * a
        e = (wa * a).sum(-1)[..., None] - 2 * np.einsum("rcgi,ki->rcgk", wa, book) + np.einsum("rcgi,ki->rcgk", ww, book * book)
        k = e.argmin(-1)
        best = np.take_along_axis(e, k[..., None], -1)[..., 0]
        if parity:
            odd = (xs.reshape(R, C // sub, sub // DIM, DIM) < 0).sum(-1) % 2
            best = best + odd * (4 * wa * book[k]).min(-1)
        return best.sum(-1) * scale * scale

    amax = mag.max(2)
    best, best_scale = np.full(amax.shape, np.inf), np.zeros(amax.shape)
    for f in np.linspace(0.6, 1.4, 33):
        s = np.where(amax > 0, amax / TOP * f, 1e-30)
        e = error_at(s)
        better = e < best
        best, best_scale = np.where(better, e, best), np.where(better, s, best_scale)
    per256 = best_scale.reshape(R, -1, 256 // sub)
    d = per256.max(2, keepdims=True) / 15.0
    total = np.full(per256.shape, np.inf)
    for delta in (-1, 0, 1):
        sc = np.clip(np.rint(per256 / d) + delta, 1, 15)
        total = np.minimum(total, error_at((sc * d).reshape(best_scale.shape)).reshape(per256.shape))
    return total.sum() / (np.broadcast_to(w, x.shape) * x * x).sum()


# (codebook size, sign parity, weights a scale)
configs = ((512, False, 32), (512, False, 16), (256, False, 16)) if q3 else ((256, True, 16), (512, True, 16), (1024, True, 16), (512, False, 16))
for name, w in (("none", np.ones(cols, np.float32)), ("importance", imp)):
    for n, parity, sub in configs:
        bits = (np.log2(n) + DIM - parity) / DIM + 4 / sub + 16 / 256
        err = relative_error(X, w, codebook(n), parity, sub)
        print(f"{dist} {name}: {DIM}-vectors, codebook {n}, parity {parity}, scale per {sub}: {bits:.4f} bits a weight, "
              f"relative error {err:.4e}", flush=True)

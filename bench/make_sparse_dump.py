#!/usr/bin/env python3
# Usage: python bench/make_sparse_dump.py OUT.safetensors [SAMPLES]
# A safetensors dump, sparse on disk: SAMPLES samples (default 16: 3 GB; 160: 30 GB) of 625 response
# tokens, Qwen vocabulary 151,936, bf16 logits (zeros: the file's holes).
import json, struct, sys, numpy as np
out = sys.argv[1]
S, R, P, V = (int(sys.argv[2]) if len(sys.argv) > 2 else 16), 625, 100, 151936
T = P + R
tokens = (np.arange(S * T) % 1000).astype(np.int64)
tl = np.full(S, T, np.int64); rl = np.full(S, R, np.int64)
mask = np.ones(S * R, np.int64); mask[::7] = 0
arrays = [("tokens", "I64", tokens), ("total_lengths", "I64", tl), ("response_lengths", "I64", rl), ("loss_masks", "I64", mask)]
header = {}; off = 0; blobs = []
for name, dt, a in arrays:
    b = a.tobytes(); header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}; off += len(b); blobs.append(b)
lbytes = S * R * V * 2
header["logits"] = {"dtype": "BF16", "shape": [S * R, V], "data_offsets": [off, off + lbytes]}
header["__metadata__"] = {"lossguard.schema": "1"}
h = json.dumps(header).encode(); h += b" " * ((8 - len(h) % 8) % 8)
with open(out, "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    for b in blobs: f.write(b)
    f.truncate(8 + len(h) + off + lbytes)
print(out, 8 + len(h) + off + lbytes)

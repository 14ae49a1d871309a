"""What the neighbours rule costs a nightly run: from a neighbours store's embeddings (one chunk per document here),
for random sets of n changed documents, how many unchanged documents have one of them among their nearest 1 or 2
chunks of other documents, and so are encoded again (a changed chunk's id changes with its text, so the recorded
neighbour no longer matches). 200 draws per n, seeded.
Usage: python cascade.py STORE"""
import sys

import numpy as np

from sparsecache.store import Store

s = Store.open(sys.argv[1])
rows = s.manifest.live_rows()
e = s.column("embeddings")[rows].astype(np.float32)
sims = e @ e.T
np.fill_diagonal(sims, -np.inf)
nearest = np.argsort(-sims, 1)[:, :2]
rng = np.random.default_rng(0)
for n in (6, 32):
    one, two = [], []
    for _ in range(200):
        changed = set(rng.choice(len(rows), n, replace=False).tolist())
        one.append(sum(1 for i in range(len(rows)) if i not in changed and nearest[i, 0] in changed))
        two.append(sum(1 for i in range(len(rows)) if i not in changed and set(nearest[i].tolist()) & changed))
    print(f"{n} documents changed of {len(rows)}: {np.mean(one):.1f} more encoded again with one neighbour, "
          f"{np.mean(two):.1f} with two")

"""Does the codec shrink K/V? The mean per-token norm of a store's decoded K and V against the same
chunks' exact fp16 K/V (computed after the same prefix and wrapper header, `query.raw`), by layer
(#79 item 1: the codes' values are ~6% shorter, which is why scaling values was tried as a lever).

    python scripts/experiments/value_norms.py STORE [--chunks 8]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--chunks", type=int, default=8, help="the store's first N chunks (default 8)")
    args = p.parse_args(argv)

    import sparsecache  # noqa: F401  (before torch)
    import torch

    from sparsecache.query.blend import decode_chunks
    from sparsecache.query.session import Session
    from sparsecache.stopwatch import Stopwatch

    s = Session(args.store)
    ids = [c.id for c in s.store.chunks()[: args.chunks]]
    s.raw.make(s.store, ids, s.model)
    exact = s.raw.chunks(s.store, ids).to("cpu")
    decoded = decode_chunks(s.store, ids, torch.device("cpu"), Stopwatch(torch.device("cpu")), s.model)
    header = len(s.store.header()[0]) if s.store.header() else 0  # the header's K/V is stored exact
    for name, j in (("K", 0), ("V", 1)):
        ratios = torch.stack([d[j][:, header:].norm(dim=-1).mean(1) / e[j][:, header:].norm(dim=-1).mean(1)
                              for e, d in zip(exact.kv, decoded.kv)]).mean(0)
        print(f"{name}: decoded / exact norm by layer: " + " ".join(f"{x:.3f}" for x in ratios.tolist()))
        print(f"{name}: mean over layers 1-{len(ratios) - 1} (layer 0 comes from the tokens): "
              f"{float(ratios[1:].mean()):.3f}")


if __name__ == "__main__":
    main()

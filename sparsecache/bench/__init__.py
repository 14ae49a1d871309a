"""Measurement, not product: what `sparsecache bench ...` and `eval-dict` run.

- `suite`: speed and accuracy runs (OMP, decode, store, passkey, TTFT), each a dict of numbers;
- `frontier`: the compression–quality frontier against the baselines;
- `baselines`: the KV compressors a user would otherwise pick (fp16, fp8, KIVI, SVD);
- `evaluate`: a dictionary's reconstruction and perplexity on held-out text;
- `passkey`: the needle task over retrieved chunks.
"""

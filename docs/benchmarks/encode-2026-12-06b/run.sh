#!/bin/bash
# #82 item 3, 2026-12-06 (second session): numba's OpenMP nesting, one chunk per forward (tried, reverted), and the
# README's demo encode before #82 and now (2-vCPU AMD EPYC, run from the repository root). BENCHMARKS.md, "The CPU
# encode's OMP, phase by phase", says what each file shows.
E=docs/benchmarks/encode-2026-12-06b
# numba's pool turns torch's OpenMP nesting on: a bfloat16 forward before the pool, after it, and with nesting put back
for m in none torchnested; do python $E/nesting_probe.py $m; done
# one chunk per forward against padded batches, by chunk length (short-chunks.json, bt-sweep.json): at 9bb7c56
git worktree add /tmp/sc-9bb7c56 9bb7c56
(cd /tmp/sc-9bb7c56 && PYTHONPATH=. python "$OLDPWD/$E/short_chunks.py")
(cd /tmp/sc-9bb7c56 && PYTHONPATH=. python "$OLDPWD/$E/bt_sweep.py" /tmp/bt-sweep.json 512,128,32 float32,bfloat16)
# the demo encode, fresh stores, one after the other: before #82 (d4c1bf6^, its numba cache warm), the default, auto
git worktree add /tmp/sc-before d4c1bf6^
(cd /tmp/sc-before && PYTHONPATH=. python -m sparsecache.cli.main encode-corpus builtin:heldout --store /tmp/b.store --json) \
  > $E/demo-encode-before-82.json
sparsecache encode-corpus builtin:heldout --store /tmp/def.store --json > $E/demo-encode-default.json
sparsecache encode-corpus builtin:heldout --store /tmp/auto.store --forward-dtype auto --json > $E/demo-encode-auto.json
# the README's query from a fresh process, nesting put back against left on, two runs each (query-ttft-nesting.json)
for i in 1 2; do
  python $E/nested_on.py scripts/experiments/cold_query.py /tmp/def.store --repeats 3 --json /tmp/cold-nested-$i.json
  python scripts/experiments/cold_query.py /tmp/def.store --repeats 3 --json /tmp/cold-fixed-$i.json
done
# demo-encode-*-nesting-fixed-batched.json ran earlier at 9bb7c56 on a slower hour of the host, and
# demo-encode-before-82-cold-numba-cache.json is that hour's before-#82 run, its kernels compiling first

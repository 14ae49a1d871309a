#!/bin/bash
# #82 item 3, 2026-12-06 (second session): the README's demo encode before #82 and now, and the two changes that
# moved it (2-vCPU AMD EPYC, nothing else running; run from the repository root). BENCHMARKS.md, "The CPU encode's
# OMP, phase by phase", says what each file shows.
E=docs/benchmarks/encode-2026-12-06b
# numba's pool turns torch's OpenMP nesting on: a bfloat16 forward before the pool, after it, and with nesting put back
for m in none torchnested; do python $E/nesting_probe.py $m; done
# one chunk per forward against padded batches (run at 9bb7c56, the last commit where a CPU forward batched chunks)
git worktree add /tmp/sc-9bb7c56 9bb7c56 && (cd /tmp/sc-9bb7c56 && PYTHONPATH=. python "$OLDPWD/$E/batch_probe.py")
# the demo encode, fresh stores, one after the other: before #82 (d4c1bf6^, its numba cache warm), the default, float32
git worktree add /tmp/sc-before d4c1bf6^
(cd /tmp/sc-before && PYTHONPATH=. python -m sparsecache.cli.main encode-corpus builtin:heldout --store /tmp/b.store --json) \
  > $E/demo-encode-before-82.json
sparsecache encode-corpus builtin:heldout --store /tmp/now.store --json > $E/demo-encode-default.json
sparsecache encode-corpus builtin:heldout --store /tmp/f32.store --forward-dtype float32 --json > $E/demo-encode-float32.json
# the README's query from a fresh process, nesting put back against left on (as before 9bb7c56), two runs each
for i in 1 2; do
  python $E/nested_on.py scripts/experiments/cold_query.py /tmp/now.store --repeats 3 --json /tmp/cold-nested-$i.json
  python scripts/experiments/cold_query.py /tmp/now.store --repeats 3 --json /tmp/cold-fixed-$i.json
done   # query-ttft-nesting.json gathers these (and two more runs of the fixed side, cold-1 and cold-2)
# demo-encode-*-batched.json (the nesting fixed, chunks still batched) ran at 9bb7c56; *-alone.json at fc2a053 with
# --forward-dtype given; *-cold-numba-cache.json is the before-#82 run whose kernels compiled first

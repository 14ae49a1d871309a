#!/bin/bash
# #80 item 4 / #79 item 7: Qwen2.5-Coder-0.5B (its shipped L12-s64 dictionary, a plain store: Qwen's default) on the test
# splits of formats (a) and (b), read once, and (b)'s dev split; one job at a time, torch's default threads (2 cores).
# (a) entities: the first 240 questions of the test suite SmolLM2's test read (1000 questions, 160 entities, filler 4),
#     two-chunk questions placed (both needed chunks among retrieval's look-alikes, the 3rd and 5th of 8: the default
#     for new workdirs); full prefill and the default on every question, the other rows on the confident ones.
# (b) records (held out): dev, the first 100, every row on the confident ones; test, the 44 SmolLM2's test read, every row
#     on every question. Summaries: python summarise.py WORKDIR/results.json OUT.json
W=${1:-/work/runs}
lscpu | grep "Model name"; date
A="--model qwen2.5-coder-0.5b --workdir $W/qent-test --k 8 --questions 1000 --entities 160 --filler 4 --split test --limit 240"
sparsecache bench fidelity $A --methods "infoflow+ttft_budget=0.5" --json > $W/qent-test-1.json
R="--model qwen2.5-coder-0.5b --format records --k 8 --questions 300 --entities 40"
sparsecache bench fidelity $R --workdir $W/qrec-dev --split dev --limit 100 --confident-only \
  --methods "infoflow+ttft_budget=0.5,infoflow:0.1,none,raw,infoflow:1.0" --json > $W/qrec-dev.json
sparsecache bench fidelity $R --workdir $W/qrec-test --split test --limit 44 \
  --methods "infoflow+ttft_budget=0.5,infoflow:0.1,none" --json > $W/qrec-test.json
# (the run named infoflow:1.0 too and was stopped when it reached it, for time)
sparsecache bench fidelity $A --confident-only --methods "infoflow:0.1,none" --json > $W/qent-test-2.json
sparsecache bench fidelity $A --confident-only --wrapper shipped --methods "none@wrapped" --json > $W/qent-test-3.json  # later, 2026-12-06

"""One shard of `bench fidelity`: a subset of a suite's questions, question by question.

`run_fidelity` goes label by label over all its questions; a shard instead answers each of its
questions with full prefill and then every method before the next question, so that a run cut
short (a GPU lease running out) leaves complete rows for a prefix of the questions rather than
full prefill's answers alone. Shards with disjoint questions run as parallel processes on one
GPU (`scripts/gpu_run.sh shards`); their result files merge into one `results.json`.

    python scripts/experiments/fidelity_shard.py WORK RESULTS --k 8 --shard 3/14 \
        --methods infoflow:0.25,superposition:0.5+paths=2,none@wrapped [--wrapper shipped] \
        [--seed FILE...] [--device cuda]

Several `--job K:METHODS` may replace `--k`/`--methods`: they run in order, each over the shard.
"""

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path, help="a `bench fidelity` workdir (suite and store)")
    p.add_argument("results", type=Path, help="this shard's results file (resumed if it exists)")
    p.add_argument("--job", action="append", default=[], help="K:METHODS, run in order")
    p.add_argument("--k", type=int)
    p.add_argument("--methods")
    p.add_argument("--shard", default="0/1", help="I/N: the questions whose index is I modulo N")
    p.add_argument("--limit", type=int, default=None, help="only the shard's first N questions of each k")
    p.add_argument("--seed", action="append", default=[], help="result files whose rows count as done")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="default")
    p.add_argument("--wrapper", default=None, help="for @wrapped methods: a wrapper directory or 'shipped' "
                   "(WORK/store-wrapped is encoded with it, as `bench fidelity --wrapper` does)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (shards share the cores)")
    args = p.parse_args()

    from sparsecache.measure.suite import load_suite
    from sparsecache.bench.fidelity import parse_configs, run_fidelity  # before torch (its OpenMP setup)
    from sparsecache.bench.suite import wrapped_session
    from sparsecache.errors import StoreLocked
    from sparsecache.query.session import Session

    import torch

    torch.set_num_threads(args.threads)
    jobs = [(int(j.split(":", 1)[0]), j.split(":", 1)[1]) for j in args.job] or [(args.k, args.methods)]
    i, n = (int(x) for x in args.shard.split("/"))
    suite = load_suite(args.work)
    # seed rows for this shard's questions only, so the merge stays small; on a rerun (a larger
    # --limit, say) the seeds of questions new to the shard join the rows already answered
    ids = {q.id for k, _ in jobs for q in suite[k][i::n][:args.limit]}
    done = json.loads(args.results.read_text())["rows"] if args.results.exists() else []
    rows = {(r["k"], r["label"], r["question"]): r
            for f in args.seed if Path(f).exists() for r in json.loads(Path(f).read_text())["rows"] if r["question"] in ids}
    rows |= {(r["k"], r["label"], r["question"]): r for r in done}
    if len(rows) > len(done):
        tmp = args.results.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": list(rows.values())}))
        shutil.move(tmp, args.results)
    session = Session(args.work / "store", args.model, args.device)
    wrapped = None
    for _ in range(720) if args.wrapper else ():  # shards started together all bring store-wrapped up to date:
        try:  # one at a time (the store's writer lock); the others wait for it, up to an hour
            wrapped = wrapped_session(args.work, session, args.wrapper, args.device)
            break
        except StoreLocked as e:
            print(f"waiting: {e}", flush=True)
            time.sleep(5)
    if args.wrapper and wrapped is None:
        raise SystemExit(f"{args.work / 'store-wrapped'} stayed locked for an hour")
    for k, spec in jobs:
        methods = parse_configs(spec)
        for q in suite[k][i::n][:args.limit]:
            run_fidelity(session, {k: [q]}, methods, args.results, wrapped=wrapped)


if __name__ == "__main__":
    main()

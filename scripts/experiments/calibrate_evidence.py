"""Does `calibrate` predict? Its *kept*, estimated from cloze questions over a fidelity suite's own
documents, against the *kept* `bench fidelity` measured on that suite's questions, per
configuration (#70 item 3).

The suite's corpus is encoded as `bench fidelity` encodes it, with the default model's shipped
wrapper (the `@wrapped` rows, the default kind of store; `--plain` also encodes a store without
it for the plain rows), calibrate measures the configurations the suite's results hold on each
(nothing recorded; every configuration on every confident question: no target, no TTFT budget),
and the script reports the rank correlation (Spearman) across configurations and,
for a range of targets, the configuration calibrate would choose on the wrapped store (the
default kind of store) under a 0.5x TTFT budget and whether the kept measured for it on
`--test` reaches that target.

    python scripts/experiments/calibrate_evidence.py SUITE_DIR WORK OUT.json [--test TEST_DIR] [--questions 100] [--plain]

SUITE_DIR holds a `bench fidelity` run (corpus.jsonl, suite.json, results.json), e.g.
docs/benchmarks/fidelity69-2026-11-29/dev-entities. WORK keeps the stores and each store's
calibration rows, so a rerun resumes.
"""

import argparse
import json
import shutil
from pathlib import Path

PLAIN = "none,infoflow:0.15"  # the configurations #69's dev run measured, by store
WRAPPED = "none,infoflow:0.1,infoflow:0.15,cacheblend:0.15,superposition:0.5+paths=2"
TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    a, b = ranks(xs), ranks(ys)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return round(cov / var, 3) if var else float("nan")


def measured(suite_dir: Path, k: int = 8) -> dict:
    from sparsecache.bench.fidelity import table

    rows = json.loads((suite_dir / "results.json").read_text())["rows"]
    return {r["label"]: r for r in table(rows) if r["k"] == k and r["label"] != "full"}


def calibrated(work: Path, session, spec: str, questions: int) -> dict:
    from sparsecache.query.calibrate import CalibrateConfig, calibrate

    out = work / f"calibrate-{session.store.root.name}.json"
    if out.exists():
        return json.loads(out.read_text())
    # every configuration on every confident question: a target any candidate can reach never stops one
    result = calibrate(session, CalibrateConfig(target=1e-9, ttft_budget=1e9, questions=questions, candidates=spec))
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--test", type=Path, help="the suite's test-split run, whose kept a choice is checked against")
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--budget", type=float, default=0.5, help="the TTFT budget the choices are made under")
    p.add_argument("--plain", action="store_true", help="also a store without the wrapper, for the plain rows")
    args = p.parse_args()

    from sparsecache.measure.machine import cpu_model
    from sparsecache.query.calibrate import choose
    from sparsecache.codec.dictionary import Dictionary, shipped_dictionary
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.model import load_model
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig
    from sparsecache.wrapper.apply import load_wrapper

    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    if not corpus.exists():
        shutil.copy(args.suite / "corpus.jsonl", corpus)
    model = load_model("default")
    dictionary = Dictionary.load(shipped_dictionary(model.fingerprint()))
    w = load_wrapper("shipped", model.fingerprint())  # as `bench fidelity --wrapper shipped` encodes store-wrapped
    encode_with([str(corpus)], args.work / "store-wrapped", dictionary, model, StoreConfig(wrapper=w.digest()),
                wrapper=w)
    wrapped = Session(args.work / "store-wrapped", model)
    stores = [(wrapped, WRAPPED, "@wrapped")]
    if args.plain:
        encode_with([str(corpus)], args.work / "store", dictionary, model, StoreConfig())
        stores.insert(0, (Session(args.work / "store", model), PLAIN, ""))
    estimates = {}
    for session, spec, suffix in stores:
        result = calibrated(args.work, session, spec, args.questions)
        for r in result["rows"]:
            if not r["exact"]:
                estimates[r["label"] + suffix] = {**r, "confident_questions": result["confident"]}
        if suffix:
            wrapped_result = result
    dev = measured(args.suite)
    common = [label for label in estimates if label in dev and "kept" in dev[label] and "kept" in estimates[label]]
    table = [{"label": label, "calibrate_kept": estimates[label]["kept"], "calibrate_ci95": estimates[label]["kept_ci95"],
              "calibrate_confident": estimates[label]["confident"], "ttft_vs_full": estimates[label]["ttft_vs_full"],
              "suite_kept": dev[label]["kept"], "suite_ci95": dev[label]["kept_ci95"],
              "suite_confident": dev[label]["confident"]} for label in common]
    test = measured(args.test) if args.test else {}
    choices = []
    for target in TARGETS:
        rows = []
        for r in wrapped_result["rows"]:
            r = dict(r)
            r["within_budget"] = r["ttft_vs_full"] <= args.budget
            if "kept_ci95" in r:
                r["meets_target"] = r["exact"] or r["kept_ci95"][0] >= target
            rows.append(r)
        chosen, best = choose(rows)
        got = test.get(f"{chosen}@wrapped") if chosen else None
        choices.append({"target": target, "chosen": chosen, "best": best,
                        "test_kept": got and got.get("kept"), "test_ci95": got and got.get("kept_ci95"),
                        "test_confident": got and got.get("confident"),
                        "meets_on_test": None if got is None or "kept" not in got else got["kept"] >= target})
    checked = [c for c in choices if c["meets_on_test"] is not None]
    out = {"suite": str(args.suite), "test": str(args.test) if args.test else None, "questions": args.questions,
           "cpu": cpu_model(), "budget": args.budget, "configurations": table,
           "spearman": spearman([t["calibrate_kept"] for t in table], [t["suite_kept"] for t in table])
           if len(table) > 2 else None,
           "choices": choices, "choices_meeting_target_on_test": [sum(c["meets_on_test"] for c in checked), len(checked)],
           "calibrations": {suffix or "plain": {k: v for k, v in json.loads(
               (args.work / f"calibrate-{session.store.root.name}.json").read_text()).items() if k != "rows"}
               for session, _, suffix in stores}}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'configuration':<34}{'calibrate kept':>22}{'suite kept':>22}")
    for t in table:
        print(f"{t['label']:<34}{t['calibrate_kept']:>8.2f} of {t['calibrate_confident']:<4} "
              f"{str(t['calibrate_ci95']):>10}{t['suite_kept']:>8.2f} of {t['suite_confident']:<4}{str(t['suite_ci95']):>10}")
    print(f"Spearman across {len(table)} configurations: {out['spearman']}")
    for c in choices:
        print(f"target {c['target']:g}: chosen {c['chosen']}, test kept {c['test_kept']} -> {c['meets_on_test']}")


if __name__ == "__main__":
    main()

"""#69's dev suite's rows as they were recorded (full prefill on all 682 questions, each candidate on the
confident ones or on all): one results.json for a workdir rebuilt from the suite's files, so a run
answers only the new labels. Usage: python merge_rows.py OUT/results.json ROWS.json..."""
import json
import sys

out, *sources = sys.argv[1:]
rows, seen = [], set()
for path in sources:
    data = json.load(open(path))
    for r in data["rows"] if isinstance(data, dict) else data:
        key = (r["k"], r["label"], r["question"])
        if key not in seen:
            seen.add(key)
            rows.append(r)
json.dump({"rows": rows}, open(out, "w"))
print(len(rows), "rows ->", out)

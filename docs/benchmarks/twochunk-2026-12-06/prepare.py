"""#79 item 4: the two-chunk questions of #69's dev entity suite (i5-dev), their contexts placed
(both needed chunks among retrieval's look-alikes, at fixed ranks) instead of retrieval's top k.
Same corpus and stores as i5-dev; one-chunk questions left out (their contexts would not change).
Usage (in the runs directory): python prepare.py N. Now levers-2026-12-07/prepare_model.py with SmolLM2's
arguments (i5-dev -> s2c-dev, the default model), which does the same for any model and workdir."""
import runpy
import sys
from pathlib import Path

sys.argv = [sys.argv[0], "i5-dev", "s2c-dev", sys.argv[1], "default"]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "levers-2026-12-07" / "prepare_model.py"), run_name="__main__")

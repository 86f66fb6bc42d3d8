#!/usr/bin/env bash
# Fuzzes one file reader (or all) with libFuzzer: scripts/fuzz.sh TARGET [SECONDS] [JOBS]
#   TARGET  npy | safetensors | llama2c | tokenizer | all
#   SECONDS run time per target (default 30; a long run: scripts/fuzz.sh npy 3600)
#   JOBS    parallel fuzzing processes per target (default 1)
# Builds build-fuzz (clang, -fsanitize=fuzzer,address,undefined) when needed. The seeds in
# tests/fuzz/corpus/<target> are read only; the growing corpus lives in build-fuzz/corpus/<target>
# and crashing inputs are written to build-fuzz/artifacts/<target>/. Exits 1 if any target crashed;
# turn each crash into a regression test in tests/test_fuzz_regressions.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/fuzz.sh npy|safetensors|llama2c|tokenizer|all [SECONDS] [JOBS]}
seconds=${2:-30}
jobs=${3:-1}
build=${QKV_FUZZ_BUILD_DIR:-build-fuzz}
if [ "$target" = all ]; then targets=(npy safetensors llama2c tokenizer); else targets=("$target"); fi

CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DQKV_FUZZ=ON -DQKV_BUILD_TESTS=OFF \
  -DQKV_BUILD_BENCH=OFF -DQKV_BUILD_CLI=OFF >/dev/null
cmake --build "$build" -j2 --target "${targets[@]/#/fuzz_}"

parallel=()
((jobs > 1)) && parallel=(-jobs="$jobs" -workers="$jobs")
status=0
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t" artifacts="$build/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  echo "fuzz: $t for ${seconds}s"
  # -rss_limit_mb: a reader that allocates what a hostile header declares is a bug, not a pass.
  if ! "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
       "${parallel[@]}" -print_final_stats=1 -artifact_prefix="$artifacts/" \
       "$corpus" "tests/fuzz/corpus/$t" >"$build/fuzz_$t.log" 2>&1; then
    echo "fuzz: $t FAILED; log $build/fuzz_$t.log, inputs in $artifacts/" >&2
    grep -E "ERROR|SUMMARY" "$build/fuzz_$t.log" | head -5 >&2 || true
    status=1
  else
    grep -E "^stat::number_of_executed_units|DONE" "$build/fuzz_$t.log" | tail -1 || true
  fi
done
exit $status

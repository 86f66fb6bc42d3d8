#!/usr/bin/env bash
# The whole test suite: installs dependencies, then
#   1. Release build (build/) and every test with CTest;
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build (build-asan/, gcc, -O1) and every unit
#      and Python test in it (the Python tests run the instrumented qkv binary as a subprocess, so
#      they need no LD_PRELOAD; only the package tests, which build consumer projects, are left out;
#      the Python package and its pytest suites are not built in sanitizer builds, whose extension
#      could not be imported into an uninstrumented python3);
#   3. ThreadSanitizer build (build-tsan/, clang + libomp) of the thread tests (CTest label
#      "threads"), with LLVM's Archer tool so that OpenMP's own synchronisation is understood;
#   4. each libFuzzer target (build-fuzz/, scripts/fuzz.sh) for QKV_FUZZ_SECONDS (default 30) s.
# QKV_TEST_QUICK=1 runs step 1 only. Each step prints its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

step() { printf '\n==== %s\n' "$*"; step_start=$SECONDS; }
done_step() { printf '==== done in %ds\n' $((SECONDS - step_start)); }

step "Release build and all tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2
done_step
[ "${QKV_TEST_QUICK:-0}" = 1 ] && exit 0

step "AddressSanitizer + UndefinedBehaviorSanitizer: unit and Python tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
  -DQKV_SANITIZE=address,undefined -DQKV_BUILD_BENCH=OFF -DQKV_BUILD_CLI=ON >/dev/null
cmake --build build-asan -j2
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j2 -E '^package\.'
done_step

step "ThreadSanitizer: thread tests"
CC=clang CXX=clang++ cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DQKV_SANITIZE=thread -DQKV_BUILD_BENCH=OFF \
  -DQKV_BUILD_CLI=OFF >/dev/null
cmake --build build-tsan -j2 --target test_concurrency
# Archer (LLVM's OpenMP tool for TSan) tells TSan about libomp's barriers and tasks; libraries
# that are not instrumented (OpenBLAS, libomp itself) are ignored instead of reported.
archer="$(dirname "$(readlink -f "$(command -v clang)")")/../lib/libarcher.so"
OMP_TOOL_LIBRARIES="$archer" TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1" \
  ctest --test-dir build-tsan --output-on-failure -L threads
done_step

step "libFuzzer: every file reader for ${QKV_FUZZ_SECONDS:-30}s"
scripts/fuzz.sh all "${QKV_FUZZ_SECONDS:-30}"
done_step
printf '\nall steps passed in %ds\n' "$SECONDS"

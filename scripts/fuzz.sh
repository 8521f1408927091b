#!/usr/bin/env bash
# A longer fuzzing campaign over every reader of user files (tests/fuzz.rs): the model config
# parser, the schedule reader, the safetensors and .npy readers and the checkpoint loader.
#
#   scripts/fuzz.sh [MINUTES] [CASES_PER_ROUND]     (defaults: 10 minutes, 2000 cases)
#
# CARGO_FLAGS (e.g. --release) is passed to cargo: the default reuses the test build.
#
# Runs rounds of the properties with a new seed each round until the time is up, then prints
# the cases per minute of each reader and every failure with the seed that reproduces it:
#   PROTRAIN_FUZZ_SEED=SEED PROTRAIN_FUZZ_CASES=N cargo test --test fuzz
# Memory is capped (ulimit -v) so that an allocation sized by a number in a file fails the
# round instead of taking the machine; a round that runs past its time limit counts as a hang.
set -u
cd "$(dirname "$0")/.."
minutes=${1:-10}
cases=${2:-2000}
deadline=$(( $(date +%s) + minutes * 60 ))
log=$(mktemp)
trap 'rm -f "$log"' EXIT

cargo test ${CARGO_FLAGS:-} --test fuzz --no-run >/dev/null 2>&1 || {
    echo "fuzz: the fuzz tests do not build; run cargo test --test fuzz" >&2
    exit 2
}
declare -A total_cases total_secs
failures=0
rounds=0
while [ "$(date +%s)" -lt "$deadline" ]; do
    seed=$(( (RANDOM << 30) ^ (RANDOM << 15) ^ RANDOM ^ $(date +%s) ))
    rounds=$((rounds + 1))
    ( ulimit -v $((8 * 1024 * 1024)); \
      PROTRAIN_FUZZ_SEED=$seed PROTRAIN_FUZZ_CASES=$cases \
      timeout 900 cargo test ${CARGO_FLAGS:-} --test fuzz -- --nocapture --test-threads 2 ) >"$log" 2>&1
    status=$?
    while read -r _ name n _ _ secs _; do
        name=${name%:}
        total_cases[$name]=$(( ${total_cases[$name]:-0} + n ))
        total_secs[$name]=$(awk -v a="${total_secs[$name]:-0}" -v b="$secs" 'BEGIN { print a + b }')
    done < <(grep -E '^fuzz [a-z]+: [0-9]+ cases in' "$log")
    if [ "$status" -ne 0 ]; then
        failures=$((failures + 1))
        what="failed"
        [ "$status" -eq 124 ] && what="hung (no end within 900 s)"
        echo "round $rounds $what: PROTRAIN_FUZZ_SEED=$seed PROTRAIN_FUZZ_CASES=$cases"
        grep -E "panicked|fuzz [a-z]+ failed|minimal failing input" "$log" | head -20 | sed 's/^/  /'
    fi
done

echo "fuzz campaign: $rounds rounds in $minutes min, $failures failed"
for name in "${!total_cases[@]}"; do
    awk -v n="$name" -v c="${total_cases[$name]}" -v s="${total_secs[$name]}" \
        'BEGIN { printf "  %-12s %9d cases  %10.0f cases/min\n", n, c, (s > 0 ? c / s * 60 : 0) }'
done
[ "$failures" -eq 0 ]

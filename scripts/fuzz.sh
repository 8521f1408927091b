#!/usr/bin/env bash
# A longer fuzzing campaign over every reader of user files (tests/it/fuzz.rs): the model config
# parser, the schedule reader (its bytes, and its counts), the hardware profile and tokenizer
# readers, the safetensors and .npy readers and the checkpoint loader.
#
#   scripts/fuzz.sh [MINUTES] [CASES_PER_ROUND]     (defaults: 10 minutes, 2000 cases)
#
# CARGO_FLAGS (e.g. --release) is passed to cargo: the default reuses the test build.
#
# Runs rounds of the properties with a new seed each round until the time is up, then prints
# the cases per minute of each reader, the failures, the hangs and the peak memory of a round,
# and every failure with the seed that reproduces it:
#   PROTRAIN_FUZZ_SEED=SEED PROTRAIN_FUZZ_CASES=N cargo test --test it -- fuzz::
# Memory is capped (ulimit -v) so that an allocation sized by a number in a file fails the
# round instead of taking the machine; a round that runs past its time limit counts as a hang.
# Peak memory is the largest resident set of a round's test process (GNU time's %M), when
# /usr/bin/time is there.
set -u
cd "$(dirname "$0")/.."
minutes=${1:-10}
cases=${2:-2000}
log=$(mktemp)
rss=$(mktemp)
trap 'rm -f "$log" "$rss"' EXIT

# Each round runs the test binary itself, not `cargo test`: cargo would check the build and
# take the target directory's lock every round, waiting behind any other build there.
built=$(cargo test ${CARGO_FLAGS:-} --test it --no-run 2>&1) || {
    echo "fuzz: the fuzz tests do not build; run cargo test --test it -- fuzz::" >&2
    exit 2
}
binary=$(sed -n 's/^ *Executable tests\/it\/main\.rs (\(.*\))$/\1/p' <<<"$built" | tail -n 1)
[ -x "$binary" ] || {
    echo "fuzz: cargo built the fuzz tests but did not say where: $built" >&2
    exit 2
}
# The clock starts once the tests are built: a slow build must not eat the campaign.
started=$(date +%s)
deadline=$(( started + minutes * 60 ))
measure=()
[ -x /usr/bin/time ] && measure=(/usr/bin/time -f '%M' -o "$rss")
declare -A total_cases total_secs
failures=0
hangs=0
rounds=0
peak_kib=0
peak_round=0
while [ "$(date +%s)" -lt "$deadline" ]; do
    seed=$(( (RANDOM << 30) ^ (RANDOM << 15) ^ RANDOM ^ $(date +%s) ))
    rounds=$((rounds + 1))
    : >"$rss"
    ( ulimit -v $((8 * 1024 * 1024)); \
      PROTRAIN_FUZZ_SEED=$seed PROTRAIN_FUZZ_CASES=$cases \
      "${measure[@]}" timeout 900 "$binary" fuzz:: --nocapture --test-threads 2 ) >"$log" 2>&1
    status=$?
    kib=$(tail -n 1 "$rss" 2>/dev/null)
    if [[ "$kib" =~ ^[0-9]+$ ]] && [ "$kib" -gt "$peak_kib" ]; then
        peak_kib=$kib
        peak_round=$rounds
    fi
    while read -r _ name n _ _ secs _; do
        name=${name%:}
        total_cases[$name]=$(( ${total_cases[$name]:-0} + n ))
        total_secs[$name]=$(awk -v a="${total_secs[$name]:-0}" -v b="$secs" 'BEGIN { print a + b }')
    done < <(grep -E '^fuzz [a-z]+: [0-9]+ cases in' "$log")
    if [ "$status" -ne 0 ]; then
        what="failed"
        if [ "$status" -eq 124 ]; then
            what="hung (no end within 900 s)"
            hangs=$((hangs + 1))
        else
            failures=$((failures + 1))
        fi
        echo "round $rounds $what: PROTRAIN_FUZZ_SEED=$seed PROTRAIN_FUZZ_CASES=$cases"
        grep -E "panicked|fuzz [a-z]+ failed|minimal failing input|memory allocation" "$log" | head -20 | sed 's/^/  /'
    fi
done

elapsed=$(( $(date +%s) - started ))
echo "fuzz campaign: $rounds rounds in $(awk -v s="$elapsed" 'BEGIN { printf "%.1f", s / 60 }') min, $failures failed, $hangs hung"
if [ "${#measure[@]}" -gt 0 ]; then
    awk -v k="$peak_kib" -v r="$peak_round" \
        'BEGIN { printf "  peak memory  %.0f MiB (round %d)\n", k / 1024, r }'
fi
all=0
for name in "${!total_cases[@]}"; do
    all=$(( all + total_cases[$name] ))
    awk -v n="$name" -v c="${total_cases[$name]}" -v s="${total_secs[$name]}" \
        'BEGIN { printf "  %-12s %9d cases  %10.0f cases/min\n", n, c, (s > 0 ? c / s * 60 : 0) }'
done
awk -v c="$all" -v s="$elapsed" \
    'BEGIN { printf "  %-12s %9d cases  %10.0f cases/min of campaign\n", "all", c, (s > 0 ? c / s * 60 : 0) }'
if [ "$rounds" -eq 0 ]; then
    echo "fuzz: no round ran; give more minutes" >&2
    exit 1
fi
[ "$failures" -eq 0 ] && [ "$hangs" -eq 0 ]

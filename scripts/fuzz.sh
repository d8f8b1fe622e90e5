#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer) of every decoder of outside input; targets in fuzz/.
#
#   scripts/fuzz.sh --smoke              bounded run of every target (scripts/test.sh runs it):
#                                        fixed seed, fixed exec count, fails on any crash
#   scripts/fuzz.sh [TARGET] [SECONDS]   longer run of one target or all (default: all, 120 s
#                                        each), keeps going past crashes and writes the results
#                                        to docs/fuzz.md
#   scripts/fuzz.sh --build              only builds the targets
#
# Builds with stable rustc: sanitizer-coverage passes through -C flags, so no nightly is needed.
# Build output goes to target-fuzz/ (cached between runs); crashing inputs to
# target-fuzz/artifacts/<target>/, whose paths the output names. The openai_body target reads the
# Qwen3 tokenizer fixture from $KVROUTE_TOKENIZER_DIR (scripts/setup.sh, .cache/env.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"

# Every target, and the smoke's exec count for each (a few seconds each on one core; the body
# target tokenizes with the real Qwen3 vocabulary, so it runs fewer).
TARGETS=(zmq_events zmtp_stream trtllm_drain replica_codec rule_json openai_body route_question filter_answer filter_config kube_watch)
declare -A SMOKE_RUNS=(
    [zmq_events]=100000 [zmtp_stream]=200000 [trtllm_drain]=100000 [replica_codec]=200000 [rule_json]=100000
    [openai_body]=5000 [route_question]=200000 [filter_answer]=200000 [filter_config]=200000
    [kube_watch]=100000
)
# Largest input per target (libFuzzer -max_len); openai_body matches its MAX_BODY.
declare -A MAX_LEN=([openai_body]=65536)
SMOKE_SEED=1
SMOKE_MAX_SECONDS=20
# An input taking longer than this is reported as a hang (a crash).
TIMEOUT_SECONDS=1

OUT="$REPO/target-fuzz"
ARTIFACTS="$OUT/artifacts"
DOC="$REPO/docs/fuzz.md"

die() {
    echo "fuzz.sh: $*" >&2
    exit 1
}

HOST="$(rustc -vV | sed -n 's/^host: //p')"
[[ -n "$HOST" ]] || die "cannot read the host triple from rustc -vV"
BIN_DIR="$OUT/$HOST/release"

build() {
    # --target makes RUSTFLAGS apply to the targets only, not to build scripts and proc macros.
    echo "fuzz.sh: building fuzz targets into $OUT"
    # CARGO_ENCODED_RUSTFLAGS, when set at all, would replace RUSTFLAGS.
    unset CARGO_ENCODED_RUSTFLAGS
    RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cforce-frame-pointers" \
        cargo build -q --release --manifest-path fuzz/Cargo.toml --target "$HOST" \
        --target-dir "$OUT" --bins
}

tokenizer_env() {
    if [[ -z "${KVROUTE_TOKENIZER_DIR:-}" && -f "$KVROUTE_CACHE/env.sh" ]]; then
        # shellcheck source=/dev/null
        source "$KVROUTE_CACHE/env.sh"
    fi
    [[ -f "${KVROUTE_TOKENIZER_DIR:-}/tokenizer.json" ]] ||
        die "KVROUTE_TOKENIZER_DIR has no tokenizer.json: run scripts/setup.sh and source .cache/env.sh"
    export KVROUTE_TOKENIZER_DIR
}

# run_target NAME LOG ARGS...: runs one target on a scratch corpus dir seeded from fuzz/corpus.
# libFuzzer writes new inputs into the first corpus dir only, so the repository's seeds stay
# untouched.
run_target() {
    local name="$1" log="$2" work="$3"
    shift 3
    mkdir -p "$ARTIFACTS/$name" "$work"
    local args=(-timeout="$TIMEOUT_SECONDS" -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$ARTIFACTS/$name/")
    if [[ -n "${MAX_LEN[$name]:-}" ]]; then
        args+=(-max_len="${MAX_LEN[$name]}")
    fi
    "$BIN_DIR/$name" "${args[@]}" "$@" "$work" "fuzz/corpus/$name" >"$log" 2>&1
}

# The first line of a panic in a libFuzzer log, or libFuzzer's own verdict.
crash_reason() {
    local log="$1" line
    line="$(grep -m1 -E "panicked at|^thread '.*' panicked" -A1 "$log" | tr '\n' ' ' || true)"
    [[ -n "$line" ]] || line="$(grep -m1 -E "ERROR: libFuzzer|SUMMARY: libFuzzer" "$log" || true)"
    echo "${line:-unknown (see $log)}"
}

smoke() {
    local passed=0 failed=0 name log start
    for name in "${TARGETS[@]}"; do
        log="$OUT/logs/smoke-$name.log"
        mkdir -p "$OUT/logs"
        rm -rf "$OUT/smoke/$name"
        start=$SECONDS
        if run_target "$name" "$log" "$OUT/smoke/$name" -seed="$SMOKE_SEED" \
            -runs="${SMOKE_RUNS[$name]}" -max_total_time="$SMOKE_MAX_SECONDS"; then
            passed=$((passed + 1))
            echo "fuzz.sh: $name ok: $(grep -m1 -oE 'stat::number_of_executed_units: [0-9]+' "$log" |
                grep -oE '[0-9]+$') execs in $((SECONDS - start)) s"
        else
            failed=$((failed + 1))
            echo "fuzz.sh: $name FAILED: $(crash_reason "$log")"
            grep -E "Test unit written to|artifact_prefix" "$log" | sed 's/^/fuzz.sh:   /' || true
            echo "fuzz.sh:   log: $log; reproduce: $BIN_DIR/$name <input>"
        fi
    done
    echo "fuzz: $passed passed, $failed failed"
    ((failed == 0))
}

# long TARGET SECONDS: one target in fork mode (keeps going after a crash); prints one summary
# line "name execs cov ft corpus crashes timeouts ooms secs" and the artifacts it wrote.
long() {
    local name="$1" secs="$2" log="$OUT/logs/long-$name.log" before after rc=0
    mkdir -p "$OUT/logs" "$ARTIFACTS/$name"
    before="$(mktemp)"
    ls "$ARTIFACTS/$name" >"$before"
    echo "fuzz.sh: $name for $secs s (log $log)" >&2
    run_target "$name" "$log" "$OUT/corpus/$name" -fork=1 -ignore_crashes=1 -ignore_timeouts=1 \
        -ignore_ooms=1 -max_total_time="$secs" || rc=$?
    after="$(ls "$ARTIFACTS/$name" | grep -vxF -f "$before" || true)"
    rm -f "$before"
    python3 - "$name" "$log" "$rc" "$secs" <<'EOF'
import re, sys
name, log, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
text = open(log, errors="replace").read()
# Fork mode: "#N: cov: C ft: F corp: K exec/s: E oom/timeout/crash: O/T/X time: Ss job: J ..."
rows = re.findall(r"#(\d+): cov: (\d+) ft: (\d+) corp: (\d+) exec/s: (\d+) "
                  r"oom/timeout/crash: (\d+)/(\d+)/(\d+) time: (\d+)s", text)
if rows:
    execs, cov, ft, corp, _, oom, tmo, crash, t = rows[-1]
else:
    execs = cov = ft = corp = oom = tmo = crash = "?"
    t = secs
print(f"{name} {execs} {cov} {ft} {corp} {crash} {tmo} {oom} {t} {rc}")
EOF
    if [[ -n "$after" ]]; then
        echo "$after" | sed "s|^|artifact $ARTIFACTS/$name/|"
    fi
}

# write_doc RESULTS: the results table in docs/fuzz.md (rows of targets not run this time kept).
write_doc() {
    python3 "$REPO/scripts/report.py" fuzz "$DOC" "$1"
}

case "${1:-}" in
--build)
    build
    ;;
--smoke)
    tokenizer_env
    build
    smoke
    ;;
-h | --help)
    sed -n '2,15p' "$0"
    ;;
*)
    target="${1:-all}"
    secs="${2:-120}"
    [[ "$secs" =~ ^[0-9]+$ ]] || die "SECONDS must be a whole number, got '$secs'"
    if [[ "$target" == all ]]; then
        run=("${TARGETS[@]}")
    elif [[ " ${TARGETS[*]} " == *" $target "* ]]; then
        run=("$target")
    else
        die "unknown target '$target'; allowed: all ${TARGETS[*]}"
    fi
    tokenizer_env
    build
    results="$(mktemp)"
    trap 'rm -f "$results"' EXIT
    for name in "${run[@]}"; do
        long "$name" "$secs" | tee -a "$results"
    done
    write_doc "$results"
    echo "fuzz.sh: wrote $DOC"
    ;;
esac

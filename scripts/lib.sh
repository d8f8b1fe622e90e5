# Shell helpers shared by the scripts: waiting for processes (stack.sh, bench_gateways.sh), the
# simulator fleet of the gateway benches (bench_gateways.sh, bench_epp_ratio.sh), installing
# Debian packages (setup.sh, build-images.sh) and earlier builds of the service for benches to
# measure beside this one (bench-route.sh, bench-ingest.sh). Source it after defining `die MESSAGE`
# (prints and exits).

# poll LOG CMD...: runs CMD every 0.2 s until it succeeds, at most 60 s; on timeout prints LOG's
# tail and returns 1.
poll() {
    local log=$1 deadline=$((SECONDS + 60))
    shift
    until "$@"; do
        if ((SECONDS > deadline)); then
            tail -20 "$log" >&2 || true
            return 1
        fi
        sleep 0.2
    done
}

# wait_http URL NAME LOG: polls until URL answers 2xx, at most 60 s, or dies with the log's tail.
wait_http() {
    local url=$1 name=$2 log=$3
    poll "$log" curl -fs -o /dev/null --max-time 2 "$url" ||
        die "$name did not become ready at $url within 60 s (log: $log)"
}

# healthy_engines ADMIN_URL: how many hosts of Envoy's `engines` cluster pass their health check.
healthy_engines() {
    curl -fs --max-time 2 "$1/clusters" | grep -c '^engines::.*::health_flags::healthy$' || true
}

# engines_healthy ADMIN_URL N: at least N of them do.
engines_healthy() {
    (($(healthy_engines "$1") >= $2))
}

# wait_envoy_healthy ADMIN_URL N LOG: polls Envoy's /clusters until N hosts of the `engines`
# cluster pass their active health check, at most 60 s, or dies with the log's tail. Until then
# Envoy ignores the filter's pins (stateful_session falls back to the cluster's load balancer),
# so a workload started earlier measures Envoy's balancing, not kvroute's.
wait_envoy_healthy() {
    local admin=$1 want=$2 log=$3
    poll "$log" engines_healthy "$admin" "$want" ||
        die "Envoy reports $(healthy_engines "$admin") of $want engines healthy after 60 s ($admin/clusters; log: $log)"
}

# apt_missing PKG...: prints those of the Debian packages PKG that are not installed, one a line.
apt_missing() {
    local pkg
    for pkg in "$@"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" != *"install ok installed"* ]]; then
            echo "$pkg"
        fi
    done
}

# apt_install WHAT ARG...: apt-get install ARG... (packages and options) as root or through sudo,
# dying with WHAT; the apt log goes to $SCRATCH/apt.log.
apt_install() {
    local what="$1"
    shift
    local sudo=""
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "$what: need root or sudo to apt-get install $*"
        sudo="sudo"
    fi
    $sudo apt-get update -qq >"$SCRATCH/apt.log" 2>&1 ||
        die "$what: apt-get update failed (log: $(tail -n 1 "$SCRATCH/apt.log"))"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >>"$SCRATCH/apt.log" 2>&1 ||
        die "$what: apt-get install $* failed (log: $(tail -n 1 "$SCRATCH/apt.log"))"
}

# free_port: a TCP port free on 127.0.0.1 right now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# stop_bench_processes: kills and reaps every pid in PIDS and INV_PID (the gateway benches' EXIT trap).
stop_bench_processes() {
    trap - EXIT INT TERM
    local p
    for p in "${PIDS[@]}" $INV_PID; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}" $INV_PID; do wait "$p" 2>/dev/null || true; done
}

# sim_fleet RUN SIM_BIN MODEL SLUG VIP_PORT IP...: stages the Qwen3 tokenizer under RUN/tokenizers/SLUG,
# starts one vLLM simulator per IP (the small preset's 96 KV blocks, events over ZMQ) on SIM_PORT,
# adds their pids to PIDS, waits until each answers, and writes RUN/rules.json: one kvroute rule
# on 127.0.0.1:VIP_PORT over them. Sets SIM_PORT, ZMQ_PORT and REPLAY_PORT.
sim_fleet() {
    local run=$1 bin=$2 model=$3 slug=$4 vip=$5 ip endpoints=""
    shift 5
    mkdir -p "$run/tokenizers/$slug" "$run/logs"
    cp "$KVROUTE_TOKENIZER_DIR"/tokenizer.json "$KVROUTE_TOKENIZER_DIR"/tokenizer_config.json "$run/tokenizers/$slug/"
    SIM_PORT=$(free_port)
    ZMQ_PORT=$(free_port)
    REPLAY_PORT=$(free_port)
    for ip in "$@"; do
        "$bin" --listen "$ip:$SIM_PORT" --engine vllm --seed 0 --block-size 16 \
            --kv-blocks 96 --zmq-port "$ZMQ_PORT" --replay-port "$REPLAY_PORT" \
            --prefill-us-per-token 40 --decode-us-per-token 400 --max-concurrency 4 \
            --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --model "$model" --name "sim-$ip" \
            >"$run/logs/sim-$ip.log" 2>&1 &
        PIDS+=($!)
    done
    for ip in "$@"; do wait_http "http://$ip:$SIM_PORT/health" "simulator $ip" "$run/logs/sim-$ip.log"; done
    for ip in "$@"; do endpoints+="${endpoints:+,}{\"endpointIP\":\"$ip\",\"targetPort\":$SIM_PORT,\"weight\":1}"; done
    cat >"$run/rules.json" <<EOF
[{"serviceArguments":{"externalIP":"127.0.0.1","port":$vip,"protocol":"tcp","sel":0,"mode":4,
"kvExactMode":3,"kvEngineType":"vllm","kvHashAlgo":"sha256_cbor","kvBlockSize":16,"kvZmqPort":$ZMQ_PORT,
"kvReplayPort":$REPLAY_PORT,"kvModel":"$model"},"endpoints":[$endpoints]}]
EOF
}

# baseline_inventory REV: prints the path of a release `kvroute-inventory` built from git revision
# REV (cached in $REPO/.cache/bench; built once in a temporary worktree with its own target
# directory, $REPO/target/baseline: cargo names a workspace member's artifacts without its path, so
# a worktree building into this checkout's target directory would replace this build's binary).
# Needs REPO set.
baseline_inventory() {
    local rev bin wt
    rev="$(git -C "$REPO" rev-parse --short "$1")" || die "unknown revision $1"
    bin="$REPO/.cache/bench/kvroute-inventory-$rev"
    if [[ ! -x "$bin" ]]; then
        wt="$(mktemp -d)/kvroute-$rev"
        git -C "$REPO" worktree add -q --detach "$wt" "$rev" >&2
        (cd "$wt" && CARGO_TARGET_DIR="$REPO/target/baseline" cargo build --release -q -p kvroute-inventory --bin kvroute-inventory) >&2
        mkdir -p "$REPO/.cache/bench"
        cp "$REPO/target/baseline/release/kvroute-inventory" "$bin"
        git -C "$REPO" worktree remove --force "$wt" >&2
    fi
    echo "$bin"
}

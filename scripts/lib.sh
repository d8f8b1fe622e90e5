# Shell helpers shared by the scripts: waiting for processes (stack.sh, bench_gateways.sh) and
# installing Debian packages (setup.sh, build-images.sh). Source it after defining `die MESSAGE`
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

#!/usr/bin/env bash
# smc_run against plain TCP, side by side, with real programs on this host
# (both ends on 127.0.0.1, the shared-memory device on lo):
#   sockperf ping-pong latency and throughput, redis-benchmark SET/GET,
#   wrk against nginx (master and 2 workers), iperf3 both directions.
# Usage: crates/smc-preload/bench.sh [SECONDS]   (root; a release build is
# made first). Not a test: it prints a table, nothing is asserted.
# Each placement gets its table (PLACES, default "cross same"): cross = the
# server's processes pinned to CPU 0 and the client's to CPU 1, same = both
# on CPU 0, free = not pinned (the scheduler's choice, which moves ratios
# between runs). The library's threads run where their process is pinned.
# SMC_RUN names another build's smc_run (it loads the library next to it),
# to compare builds.
set -euo pipefail
T=${1:-3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/crates/smc-preload/bench_lib.sh"
need python3 taskset sockperf redis-server redis-benchmark nginx wrk iperf3
cargo build -q --release -p smc-preload --manifest-path "$ROOT/Cargo.toml"
# (the one-core round trip's floor: two context switches between processes)
cargo build -q --release -p smc-bench --example switch_cost --manifest-path "$ROOT/Cargo.toml"
SMC_RUN=${SMC_RUN:-$ROOT/target/release/smc_run}
W=$(mktemp -d /tmp/smc-bench.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; sleep 0.3; rm -rf "$W"' EXIT
mkdir -p "$W/run" "$W/conf" "$W/www" "$W/tmp"
printf 'rundir %s/run\ndevice shm-lo netdev lo\n' "$W" >"$W/shm.conf"
export SMC_RDMA_SHM_CONFIG="$W/shm.conf" SMC_RS_CONFIG_DIR="$W/conf" SMC_RUN_STATE="$W/state"
echo "hello over SMC-R" >"$W/www/index.html"

# run MODE CMD...: CMD plainly or under smc_run, on the CPU that $PIN names
# (empty: anywhere)
run() {
  local pin=()
  [ -n "$PIN" ] && pin=(taskset -c "$PIN")
  if [ "$1" = smc ]; then shift; exec "${pin[@]}" "$SMC_RUN" "$@"; else shift; exec "${pin[@]}" "$@"; fi
}
# server and client CPUs of a placement
srv_cpu() { case $1 in cross|same) echo 0 ;; *) echo "" ;; esac; }
cli_cpu() { case $1 in cross) echo 1 ;; same) echo 0 ;; *) echo "" ;; esac; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ratio() { python3 -c "import sys; a,b=float(sys.argv[1] or 0),float(sys.argv[2] or 0); print(f'{b/a:.2f}x' if a else '-')" "$1" "$2"; }
row() { printf '%-34s %12s %12s %8s\n' "$1" "${R[tcp,$2]:-?}" "${R[smc,$2]:-?}" "$(ratio "${R[tcp,$2]:-0}" "${R[smc,$2]:-0}")"; }

for place in ${PLACES:-cross same}; do
declare -A R=()
SP=$(srv_cpu $place); CP=$(cli_cpu $place)
for mode in tcp smc; do
  # sockperf
  p=$(port)
  PIN=$SP run $mode sockperf sr --tcp -i 127.0.0.1 -p "$p" >/dev/null 2>&1 &
  srv=$!
  sleep 0.5
  R[$mode,lat]=$(PIN=$CP run $mode sockperf pp --tcp -i 127.0.0.1 -p "$p" -t "$T" 2>&1 | sed -n 's/.*Summary: Latency is \([0-9.]*\) usec.*/\1/p')
  R[$mode,sptp]=$(PIN=$CP run $mode sockperf tp --tcp -i 127.0.0.1 -p "$p" -t "$T" -m 1400 2>&1 | sed -n 's/.*BandWidth is [0-9.]* MBps (\([0-9.]*\) Mbps).*/\1/p')
  kill $srv; wait $srv 2>/dev/null || true

  # redis
  p=$(port)
  PIN=$SP run $mode redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  srv=$!
  sleep 0.5
  out=$(PIN=$CP run $mode redis-benchmark -p "$p" -t set,get -n 200000 -c 50 -q 2>&1 | tr '\r' '\n')
  R[$mode,set]=$(echo "$out" | sed -n 's/^SET: \([0-9.]*\) requests per second.*/\1/p')
  R[$mode,get]=$(echo "$out" | sed -n 's/^GET: \([0-9.]*\) requests per second.*/\1/p')
  kill $srv; wait $srv 2>/dev/null || true

  # nginx + wrk
  p=$(port)
  nginx_conf "$W" "$p"
  PIN=$SP run $mode nginx -c "$W/nginx.conf" -p "$W" >/dev/null 2>&1 &
  srv=$!
  sleep 1
  R[$mode,wrk]=$(PIN=$CP run $mode wrk -t 2 -c 50 -d "$T" "http://127.0.0.1:$p/index.html" 2>&1 | sed -n 's/^Requests\/sec: *\([0-9.]*\).*/\1/p')
  kill -TERM $srv; wait $srv 2>/dev/null || true

  # iperf3
  for dir in fwd rev; do
    p=$(port)
    PIN=$SP run $mode iperf3 -s -1 -B 127.0.0.1 -p "$p" >/dev/null 2>&1 &
    srv=$!
    sleep 0.5
    flag=""; [ $dir = rev ] && flag=-R
    R[$mode,ip$dir]=$(PIN=$CP run $mode iperf3 -c 127.0.0.1 -p "$p" -t "$T" $flag -f g 2>&1 | sed -n 's/.* \([0-9.]*\) Gbits\/sec.*receiver.*/\1/p')
    wait $srv 2>/dev/null || true
  done
done

echo "placement: $place (server CPU ${SP:-any}, client CPU ${CP:-any})"
printf '%-34s %12s %12s %8s\n' "" "TCP" "smc_run" "smc/TCP"
row "sockperf ping-pong latency (us)" lat
row "sockperf throughput (Mbit/s)" sptp
row "redis-benchmark SET (req/s)" set
row "redis-benchmark GET (req/s)" get
row "nginx + wrk, 50 conns (req/s)" wrk
row "iperf3 (Gbit/s)" ipfwd
row "iperf3 -R (Gbit/s)" iprev
if [ "$SP" = "$CP" ] && [ -n "$SP" ]; then
  # No transport's ping-pong between two processes on one CPU beats two
  # context switches; its ratio to TCP's latency is the best any can show.
  fl=$("$ROOT/target/release/examples/switch_cost" 1000000 "$SP" | sed -n 's/.*needs two: \([0-9.]*\) us/\1/p')
  printf '%-34s %12s %12s %8s\n' "floor: 2 process switches (us)" "-" "${fl:-?}" "$(ratio "${R[tcp,lat]:-0}" "${fl:-0}")"
fi
echo
done
echo "(connections under smc_run: $(grep -c ' SMC-R$' "$W/state" || true) SMC-R, $(grep -vc ' SMC-R$' "$W/state" || true) other)"

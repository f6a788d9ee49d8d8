#!/usr/bin/env bash
# Per-request counts of a server and its client, threads included (perf stat
# over each whole process), beside bench.sh's rates:
#   crates/smc-preload/bench_counts.sh MODE TEST   (root; release build first)
#   MODE: smc (both under smc_run) or tcp;  TEST: redis (redis-benchmark -t get
#   -n 100000 -c 50 against redis-server), pp (sockperf ping-pong, 3 s) or wrk
#   (wrk -t 2 -c 50 -d 3 against nginx with 2 workers, a 100-byte page).
#   EV=perf,events,... replaces the default events. SRV_CPUS / CLI_CPUS pin
#   the server / client (taskset CPU lists; unpinned if unset). SMC_RUN names
#   another build's smc_run (it loads the library next to it), to compare.
# Prints each side's counts divided by the requests (round trips for pp).
set -euo pipefail
MODE=$1; TEST=$2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/crates/smc-preload/bench_lib.sh"
need python3 perf
case $TEST in redis) need redis-server redis-benchmark ;; pp) need sockperf ;; wrk) need nginx wrk ;; esac
cargo build -q --release -p smc-preload --manifest-path "$ROOT/Cargo.toml"
SMC_RUN=${SMC_RUN:-$ROOT/target/release/smc_run}
W=$(mktemp -d /tmp/smc-counts.XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/run" "$W/conf"
printf 'rundir %s/run\ndevice shm-lo netdev lo\n' "$W" >"$W/shm.conf"
export SMC_RDMA_SHM_CONFIG="$W/shm.conf" SMC_RS_CONFIG_DIR="$W/conf" SMC_RUN_STATE="$W/state"
EV=${EV:-task-clock,context-switches,syscalls:sys_enter_futex,raw_syscalls:sys_enter}
pre=""; [ "$MODE" = smc ] && pre="$SMC_RUN"
spin=(); [ -n "${SRV_CPUS:-}" ] && spin=(taskset -c "$SRV_CPUS")
cpin=(); [ -n "${CLI_CPUS:-}" ] && cpin=(taskset -c "$CLI_CPUS")
p=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
if [ "$TEST" = redis ]; then
  "${spin[@]}" perf stat -x, -e "$EV" -o "$W/srv" $pre redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  perfpid=$!
  N=100000
  sleep 0.7
  "${cpin[@]}" perf stat -x, -e "$EV" -o "$W/cli" $pre redis-benchmark -p "$p" -t get -n $N -c 50 -q 2>&1 | tr '\r' '\n' | grep -a "GET:" | tail -1
elif [ "$TEST" = wrk ]; then
  nginx_conf "$W" "$p"
  head -c 100 /dev/zero >"$W/www/index.html"
  "${spin[@]}" perf stat -x, -e "$EV" -o "$W/srv" $pre nginx -c "$W/nginx.conf" -p "$W" >/dev/null 2>&1 &
  perfpid=$!
  sleep 1
  out=$("${cpin[@]}" perf stat -x, -e "$EV" -o "$W/cli" $pre wrk -t 2 -c 50 -d 3 "http://127.0.0.1:$p/index.html" 2>&1)
  echo "$out" | grep -a "Requests/sec"
  N=$(echo "$out" | sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
else
  "${spin[@]}" perf stat -x, -e "$EV" -o "$W/srv" $pre sockperf sr --tcp -i 127.0.0.1 -p "$p" >/dev/null 2>&1 &
  perfpid=$!
  sleep 0.7
  out=$("${cpin[@]}" perf stat -x, -e "$EV" -o "$W/cli" $pre sockperf pp --tcp -i 127.0.0.1 -p "$p" -t 3 2>&1)
  echo "$out" | grep -a "Summary: Latency is" | sed 's/.*Summary/Summary/'
  N=$(echo "$out" | sed -n 's/.*\[Valid Duration\].*ReceivedMessages=\([0-9]*\).*/\1/p' | head -1)
fi
# the server's counts come when it exits
child=$(pgrep -P $perfpid || true)
[ -n "$child" ] && kill -TERM $child
wait $perfpid 2>/dev/null || true
for f in srv cli; do
  awk -F, -v n="$N" -v who=$f '$3!=""{printf "%s %s %.4f/req  ", who, $3, $1/n} END{print ""}' "$W/$f"
done
echo "requests $N (task-clock in ms)"

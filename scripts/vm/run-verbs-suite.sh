#!/bin/bash
# run-verbs-suite.sh — the smc-verbs provider conformance suite and benchmark
# across two qemu (TCG) VMs joined by a virtual wire, over Soft-RoCE (rxe).
#
# One command on a fresh Debian 12 machine (root):
#   scripts/vm/run-verbs-suite.sh            # install, build/reuse images, run, exit 0 on PASS
#   scripts/vm/run-verbs-suite.sh --prepare  # only install packages and build the images
#
# Steps: (1) apt: qemu 7.2 (pinned qemu-utils, see QEMU_UTILS) + debootstrap;
# (2) rootfs (debootstrap bookworm + rdma-core + 6.12 bookworm-backports kernel),
#     reused from $SMCV_WORKDIR when present; (3) cargo build --release of the
#     smc-verbs binaries on the host (host and guest share glibc 2.36);
# (4) a small payload disk with the binaries and the guest script; (5) boot two VMs
#     (1 vCPU each), each brings up rxe0 on its data NIC; VM "passive" serves the
#     passive side over TCP on a second (control) NIC, VM "active" runs the suite
#     and the benchmark; (6) results are read from the serial logs on the host.
#
# Environment: SMCV_WORKDIR (default /var/tmp/smc-verbs-vm), SMCV_VM_TIMEOUT (s,
# default 1200), SMCV_MEM (MiB per VM, default 1024), SMCV_PORT (UDP base port,
# default 47101), MIRROR (Debian archive URI; default: the host's apt source),
# SMCV_CASES (comma-separated case names; default all), SMCV_REBUILD=1 (rebuild images).
set -euo pipefail

W=${SMCV_WORKDIR:-/var/tmp/smc-verbs-vm}
VM_TIMEOUT=${SMCV_VM_TIMEOUT:-1200}
MEM=${SMCV_MEM:-1024}
PORT=${SMCV_PORT:-47101}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
T0=$(date +%s)
PREPARE_ONLY=0
[ "${1:-}" = --prepare ] && PREPARE_ONLY=1

log() { echo "[run-verbs-suite +$(( $(date +%s) - T0 ))s] $*"; }
die() { log "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (apt, debootstrap, chroot)"

cleanup() { # on any exit: no qemu of this run and no chroot mount is left behind
  local f p
  for f in "$W"/results/*.pid; do
    [ -r "$f" ] || continue
    p=$(cat "$f" 2>/dev/null || true)
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  for m in "$R/proc" "$R/dev"; do mountpoint -q "$m" 2>/dev/null && umount "$m" || true; done
}
trap cleanup EXIT

step_packages
step_rootfs
[ $PREPARE_ONLY = 1 ] && { log "prepared in $(( $(date +%s) - T0 )) s"; exit 0; }

# ------------------------------------------------------------------ 3. binaries
step_build() {
  log "build: cargo build --release -p smc-verbs (host glibc == guest glibc 2.36)"
  (cd "$REPO" && timeout 1800 cargo build --release -q -p smc-verbs --bins) || die "cargo build failed"
  BIN=$REPO/target/release/verbs-conformance
  [ -x "$BIN" ] || die "no $BIN"
}

# ------------------------------------------------------------------ 4. payload disk
write_guest_script() {
  cat > "$1" <<'GUEST'
#!/bin/bash
# Runs inside each VM (from the payload disk): network, rxe0, then the role.
set -u
P=/opt/smcv
role=none; id=0; cases=; rttn=500; wmib=32
for a in $(cat /proc/cmdline); do case $a in
  smcv.role=*) role=${a#*=};; smcv.id=*) id=${a#*=};; smcv.cases=*) cases=${a#*=};;
  smcv.rttn=*) rttn=${a#*=};; smcv.wmib=*) wmib=${a#*=};; esac; done
log() { echo "SMCV[$role +$(cut -d' ' -f1 /proc/uptime)s]: $*"; }
fail() { echo "SMCV-RESULT: FAIL ($role) $*"; exit 1; }
nic_by_mac() { local d; for d in /sys/class/net/*; do [ "$(cat "$d/address" 2>/dev/null)" = "$1" ] && basename "$d"; done; }
modprobe virtio_net; modprobe rdma_rxe || fail "modprobe rdma_rxe"
DATA=; CTRL=
for _ in $(seq 100); do
  DATA=$(nic_by_mac 52:54:00:5c:01:0$id); CTRL=$(nic_by_mac 52:54:00:5c:02:0$id)
  [ -n "$DATA" ] && [ -n "$CTRL" ] && break; sleep 0.2
done
[ -n "$DATA" ] && [ -n "$CTRL" ] || fail "NICs not found: $(ls /sys/class/net)"
ip link set lo up
# rxe's GID 0 is the IPv6 link-local RoCE v2 GID; without DAD the address is
# usable (neighbour discovery answers) as soon as the link is up, also after
# the suite's link down/up cases.
sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0 "net.ipv6.conf.$DATA.accept_dad=0"
ip addr add 10.99.0.$id/24 dev "$DATA"; ip link set "$DATA" up
ip addr add 10.98.0.$id/24 dev "$CTRL"; ip link set "$CTRL" up
rdma link add rxe0 type rxe netdev "$DATA" || fail "rdma link add"
for _ in $(seq 200); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && break; sleep 0.1; done
log "data NIC $DATA (10.99.0.$id), control NIC $CTRL (10.98.0.$id), rxe0 $(cat /sys/class/infiniband/rxe0/ports/1/state)"
$P/verbs-conformance devices | sed 's/^/SMCV-DEV: /'
case $role in
passive)
  $P/verbs-conformance passive --listen 10.98.0.1:7471 --device rxe0 --netdev "$DATA"
  log "passive side exited ($?)";;
active)
  log "suite starts"
  $P/verbs-conformance suite --peer 10.98.0.1:7471 --device rxe0 --netdev "$DATA" ${cases:+--cases "$cases"}
  rc=$?
  log "suite done (rc=$rc); rxe0 counters: $(cd /sys/class/infiniband/rxe0/ports/1/hw_counters 2>/dev/null && grep -s . * | grep -v ':0$' | tr '\n' ' ')"
  log "benchmark starts"
  timeout 300 $P/verbs-conformance bench --peer 10.98.0.1:7471 --device rxe0 --rtt-n "$rttn" --write-mib "$wmib" \
    || echo "SMCV-BENCH: FAILED (rc=$?)"
  $P/verbs-conformance shutdown --peer 10.98.0.1:7471
  log "done";;
*) fail "unknown role $role";;
esac
GUEST
  chmod 0755 "$1"
}

step_payload() {
  local st=$W/payload
  rm -rf "$st" "$W/payload.img"; mkdir -p "$st"
  cp "$BIN" "$st/verbs-conformance"; strip --strip-debug "$st/verbs-conformance" 2>/dev/null || true
  write_guest_script "$st/guest.sh"
  truncate -s 64M "$W/payload.img"
  mkfs.ext4 -q -F -L smcvpayload -d "$st" "$W/payload.img" || die "mkfs.ext4 payload"
  log "payload: $W/payload.img ($(du -h "$st/verbs-conformance" | cut -f1) binary)"
}

# ------------------------------------------------------------------ 5. boot both VMs
vm() { # role id data-netdev-spec ctrl-netdev-spec
  local role=$1 id=$2
  smcv_qemu "$W/results/$role.log" "$W/results/$role.pid" "$W/payload.img" \
    "smcv.role=$role smcv.id=$id smcv.cases=${SMCV_CASES:-} smcv.rttn=${SMCV_RTT_N:-500} smcv.wmib=${SMCV_WRITE_MIB:-32}" \
    -netdev socket,id=d0,"$3" -device virtio-net-pci,netdev=d0,mac=52:54:00:5c:01:0$id \
    -netdev socket,id=c0,"$4" -device virtio-net-pci,netdev=c0,mac=52:54:00:5c:02:0$id
}

step_run() {
  rm -rf "$W/results"; mkdir -p "$W/results"
  local t=$(date +%s) a=127.0.0.1
  log "boot: two VMs (TCG, 1 vCPU, ${MEM} MiB each), timeout ${VM_TIMEOUT}s; logs in $W/results/"
  vm passive 1 "udp=$a:$((PORT+1)),localaddr=$a:$PORT" "udp=$a:$((PORT+3)),localaddr=$a:$((PORT+2))" & local pa=$!
  vm active 2 "udp=$a:$PORT,localaddr=$a:$((PORT+1))" "udp=$a:$((PORT+2)),localaddr=$a:$((PORT+3))" & local pb=$!
  # live progress from the active VM's serial console
  local seen=0 ra=0 rb=0 new
  while kill -0 $pb 2>/dev/null || kill -0 $pa 2>/dev/null; do
    sleep 2
    new=$(grep -aE '^(SMCV-(CASE|RESULT|BENCH)|SMCV\[|SMCV: )' "$W/results/active.log" 2>/dev/null | tail -n +$((seen + 1)) || true)
    if [ -n "$new" ]; then
      printf '%s\n' "$new" | sed 's/^/    active| /'
      seen=$((seen + $(printf '%s\n' "$new" | wc -l)))
    fi
  done
  wait $pb || rb=$?
  wait $pa || ra=$?
  rm -f "$W"/results/*.pid
  log "VMs exited (active rc=$rb, passive rc=$ra) after $(( $(date +%s) - t )) s"
  if [ $rb = 124 ] || [ $ra = 124 ]; then log "a VM hit the ${VM_TIMEOUT}s timeout"; fi
}

# ------------------------------------------------------------------ 6. results
step_results() {
  local A=$W/results/active.log S=$W/results/summary.txt
  {
    echo "smc-verbs conformance across two VMs over rxe — $(date -u +%FT%TZ)"
    echo "kernel $(cat "$W/kernel-version"), qemu $(qemu-system-x86_64 --version | head -1 | awk '{print $4}') TCG"
    grep -E '^SMCV-DEV: ' "$A" | head -20 || true
    grep -E '^SMCV-CASE ' "$A" || true
    grep -E '^SMCV-RESULT' "$A" "$W/results/passive.log" || true
    grep -E '^SMCV-BENCH' "$A" || true
    echo "total wall time: $(( $(date +%s) - T0 )) s"
  } > "$S"
  log "summary ($S):"; sed 's/^/    /' "$S"
  if grep -q '^SMCV-RESULT: PASS' "$A" && ! grep -q '^SMCV-RESULT: FAIL' "$A" "$W/results/passive.log"; then
    log "PASS"; exit 0
  fi
  die "conformance suite did not pass (see $W/results/active.log and passive.log)"
}

step_build
step_payload
step_run
step_results

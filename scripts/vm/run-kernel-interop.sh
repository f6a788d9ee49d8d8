#!/bin/bash
# run-kernel-interop.sh — smc-rs against the Linux kernel's AF_SMC, across two qemu (TCG)
# VMs joined by a virtual wire, over Soft-RoCE (rxe), on the verbs suite's images
# (Linux 6.12, rdma-core; built by scripts/vm/run-verbs-suite.sh, reused here).
#
#   scripts/vm/run-kernel-interop.sh           # every default case; exit 0 iff all PASS
#   SMCI_CASES='smcr.kr,wire.*' scripts/vm/run-kernel-interop.sh
#
# VM "kern" (10.99.0.1) runs the kernel's AF_SMC through kpeer (scripts/vm/interop/kpeer.c);
# VM "rs" (10.99.0.2) runs smc-rs through smc-iop-peer (crates/smc-interop), or kpeer for the
# control cases. Both VMs load smc + smc_diag and put rxe0 on their data NIC. The host drives
# the cases one phase at a time (prep, run, post) over each VM's second serial port, captures
# the wire of each case with qemu's filter-dump (both directions), reads the results from the
# serial logs and judges every case PASS or FAIL with its reasons. The case list and what each
# checks: scripts/vm/interop/cases.sh and scripts/vm/interop/README.md.
#
# Environment:
#   SMCI_CASES          comma-separated case names, or shell patterns over the default
#                       cases (all but idle.*), e.g. SMCI_CASES='smcr.kr,*.kc'
#   SMCI_BYTES          bytes each way of the first connection of smcr.* (default 64M)
#   SMCI_REUSE_BYTES    ... of the second and third (default 4M)
#   SMCI_CONC_BYTES     ... of each of the 20 concurrent ones (default 1M)
#   SMCI_URG_BYTES      ... of each connection of urg.* (default 4M)
#   SMCI_DECLINE_BYTES  ... of the UEID cases' connection (default 8M)
#   SMCI_FAULT_BYTES    ... in the kill/rxedel cases (default 4G: still moving when hit)
#   SMCI_REDUND_FIRST   ... of the first connection of redund.* (default 4M: the second link
#                       forms meanwhile)
#   SMCI_REDUND_BYTES   ... of each of the 4 connections of redund.* that see the link cut
#                       (default 8M)
#                       (emulated VMs move data slowly: the sizes keep a run to minutes)
#   SMCI_RS_DEVICE      smc-rs's devices: verbs (default: the library's own choice among the
#                       libibverbs devices, rxe0), or shm (a shared-memory device on the data NIC
#                       as well: one process with both kinds, the library must pass over the shm
#                       device for the other VM and use rxe0)
#   SMCI_RS_ENV         extra VAR=VALUE words for the smc-rs process
#   SMCI_TESTLINK       net.smc.smcr_testlink_time in both VMs (default 5; the kernel's is 30)
#   SMCI_WORKDIR        payload, logs, captures (default /var/tmp/smc-kernel-interop)
#   SMCV_WORKDIR        the images (default /var/tmp/smc-verbs-vm)
#   SMCI_PORT           UDP base port of the virtual wire on 127.0.0.1 (default 47301)
#   SMCI_MEM, SMCI_SNAPLEN (bytes captured per frame, default 300), SMCI_IDLE_WAIT (s, 640)
# Results: $SMCI_WORKDIR/results/{kern,rs}.log (serial consoles), cases/CASE.pcap (captures),
# summary.txt.
set -euo pipefail

W=${SMCV_WORKDIR:-/var/tmp/smc-verbs-vm}
I=${SMCI_WORKDIR:-/var/tmp/smc-kernel-interop}
MEM=${SMCI_MEM:-1024}
PORT=${SMCI_PORT:-47301}
SNAP=${SMCI_SNAPLEN:-300}
VM_TIMEOUT=${SMCI_VM_TIMEOUT:-7200}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
T0=$(date +%s)
RES=$I/results

log() { echo "[run-kernel-interop +$(( $(date +%s) - T0 ))s] $*"; }
die() { log "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (qemu, images)"

# the run's parameters; the guests get them as params.sh on the payload disk
SMCI_BYTES=${SMCI_BYTES:-64M}
SMCI_REUSE_BYTES=${SMCI_REUSE_BYTES:-4M}
SMCI_CONC_BYTES=${SMCI_CONC_BYTES:-1M}
SMCI_URG_BYTES=${SMCI_URG_BYTES:-4M}
SMCI_DECLINE_BYTES=${SMCI_DECLINE_BYTES:-8M}
SMCI_FAULT_BYTES=${SMCI_FAULT_BYTES:-4G}
SMCI_RS_DEVICE=${SMCI_RS_DEVICE:-verbs}
SMCI_RS_ENV=${SMCI_RS_ENV:-}
SMCI_TESTLINK=${SMCI_TESTLINK:-5}
SMCI_IDLE_WAIT=${SMCI_IDLE_WAIT:-640}
SMCI_IDLE_MIN=${SMCI_IDLE_MIN:-570} # an idle link group ending sooner died
SMCI_CASE_TIMEOUT=${SMCI_CASE_TIMEOUT:-300}
SMCI_FAULT_DELAY=${SMCI_FAULT_DELAY:-3}
# a fault case whose connection is not SMC-R goes on over TCP: its peers give up after this
SMCI_FAULT_TIMEOUT=${SMCI_FAULT_TIMEOUT:-120}
SMCI_LGR_WAIT=${SMCI_LGR_WAIT:-90}
SMCI_MAC_PREFIX=52:54:00:5c:31
SMCI_MAC_PREFIX2=52:54:00:5c:32 # the second NICs (redund cases)
SMCI_REDUND_FIRST=${SMCI_REDUND_FIRST:-4M}
SMCI_REDUND_BYTES=${SMCI_REDUND_BYTES:-8M}
SMCI_CUT_MARK_PORT=6999 # redund.*: a SYN to this closed port marks the cut in the capture
# shellcheck source=interop/cases.sh
. "$HERE/interop/cases.sh"

QEMU_PIDS=()
declare -A VM_PID # NAME -> the pid of the subshell that runs its qemu (gone when qemu is)
cleanup() { # on any exit: no qemu and no helper process of this run is left behind
  local p
  for p in "${QEMU_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in kern rs; do
    [ -r "$RES/$p.pid" ] && kill "$(cat "$RES/$p.pid")" 2>/dev/null || true
  done
  jobs -p | xargs -r kill 2>/dev/null || true
}
trap cleanup EXIT

# ------------------------------------------------------------------ cases
select_cases() { # names pick any case; patterns (e.g. '*.kc', 'smcr.*') only default ones
  local sel=${SMCI_CASES:-} c p out=
  if [ -z "$sel" ]; then echo "$SMCI_DEFAULT"; return; fi
  for p in ${sel//,/ }; do
    local hit=0 pool=$SMCI_DEFAULT
    case " $SMCI_KNOWN " in *" $p "*) pool=$p;; esac
    for c in $pool; do
      # shellcheck disable=SC2053
      if [[ $c == $p ]]; then hit=1; case " $out " in *" $c "*) ;; *) out="$out $c";; esac; fi
    done
    [ $hit = 1 ] || die "SMCI_CASES: no case matches '$p' (cases: $SMCI_KNOWN)"
  done
  # run in the canonical order
  local ordered=
  for c in $SMCI_KNOWN; do case " $out " in *" $c "*) ordered="$ordered $c";; esac; done
  echo "${ordered# }"
}
CASES=$(select_cases)
for c in $CASES; do case_def "$c" || die "case $c: not a valid case"; done

# ------------------------------------------------------------------ build
step_build() {
  log "build: kpeer (gcc), smc-iop-peer and smc-iop-pcap (cargo --release; host glibc == guest glibc 2.36)"
  mkdir -p "$I/bin"
  gcc -O2 -Wall -Wextra -pthread -o "$I/bin/kpeer" "$HERE/interop/kpeer.c" || die "gcc kpeer.c"
  (cd "$REPO" && timeout 1800 cargo build --release -q -p smc-interop --bins) || die "cargo build failed"
  PEER_BIN=$REPO/target/release/smc-iop-peer
  PCAP_BIN=$REPO/target/release/smc-iop-pcap
  [ -x "$PEER_BIN" ] && [ -x "$PCAP_BIN" ] || die "no smc-iop-peer / smc-iop-pcap"
}

# sha256 of stream SEED's first BYTES bytes, cached by (seed, bytes)
expected_sha() {
  local key="$1 $2" h
  h=$(grep -m1 "^$key " "$I/sha-cache" 2>/dev/null | cut -d' ' -f3 || true)
  if [ -z "$h" ]; then
    h=$("$I/bin/kpeer" gen "$1" "$2" | sha256sum | cut -d' ' -f1)
    echo "$key $h" >> "$I/sha-cache"
  fi
  echo "$h"
}

# conn_bytes: "ID BYTES" per connection of the current case (its rounds)
conn_bytes() {
  local r id=0 k n b
  for r in ${ROUNDS//,/ }; do
    n=${r%%x*}; b=$BYTES; [ "$r" != "$n" ] && b=${r#*x}
    for k in $(seq "$n"); do id=$((id + 1)); echo "$id $b"; done
  done
}

step_hashes() {
  local c n=0
  for c in $CASES; do
    case_def "$c"
    [ "$EXPECT" = fault ] && continue
    while read -r id b; do
      expected_sha $((2 * id)) "$b" >/dev/null; expected_sha $((2 * id + 1)) "$b" >/dev/null; n=$((n + 2))
    done < <(conn_bytes)
  done
  log "expected SHA-256 of $n streams ready ($I/sha-cache)"
}

# ------------------------------------------------------------------ payload disk
step_payload() {
  local st=$I/payload
  rm -rf "$st" "$I/payload.img"; mkdir -p "$st"
  cp "$I/bin/kpeer" "$PEER_BIN" "$HERE/interop/guest.sh" "$HERE/interop/cases.sh" "$st/"
  strip --strip-debug "$st/smc-iop-peer" 2>/dev/null || true
  {
    for v in SMCI_BYTES SMCI_REUSE_BYTES SMCI_CONC_BYTES SMCI_URG_BYTES SMCI_DECLINE_BYTES SMCI_FAULT_BYTES SMCI_RS_DEVICE SMCI_RS_ENV SMCI_TESTLINK SMCI_IDLE_WAIT \
             SMCI_CASE_TIMEOUT SMCI_FAULT_DELAY SMCI_FAULT_TIMEOUT SMCI_LGR_WAIT SMCI_MAC_PREFIX SMCI_MAC_PREFIX2 \
             SMCI_REDUND_FIRST SMCI_REDUND_BYTES SMCI_CUT_MARK_PORT; do
      printf '%s=%q\n' "$v" "${!v}"
    done
  } > "$st/params.sh"
  truncate -s 64M "$I/payload.img"
  mkfs.ext4 -q -F -L smcipayload -d "$st" "$I/payload.img" || die "mkfs.ext4 payload"
}

# ------------------------------------------------------------------ VMs
# Each VM: console ttyS0 -> $RES/NAME.log; commands from the host on ttyS1 (FIFO
# $RES/NAME.ctl.in); the monitor (HMP) on FIFO $RES/NAME.mon.in, for the captures.
boot() { # NAME ID NETDEV-SPEC NETDEV2-SPEC (the second NIC: its own wire, for redund.*)
  local name=$1 id=$2 f
  for f in ctl.in ctl.out mon.in mon.out; do rm -f "$RES/$name.$f"; mkfifo "$RES/$name.$f"; done
  smcv_qemu "$RES/$name.log" "$RES/$name.pid" "$I/payload.img" "smci.role=$name" \
    -chardev pipe,id=ctl,path="$RES/$name.ctl" -serial chardev:ctl \
    -chardev pipe,id=mon,path="$RES/$name.mon" -mon chardev=mon,mode=readline \
    -netdev socket,id=d0,"$3" -device virtio-net-pci,netdev=d0,mac=$SMCI_MAC_PREFIX:0$id \
    -netdev socket,id=d1,"$4" -device virtio-net-pci,netdev=d1,mac=$SMCI_MAC_PREFIX2:0$id &
  QEMU_PIDS+=($!)
  VM_PID[$name]=$!
  # keep qemu's side of the FIFOs drained
  cat "$RES/$name.ctl.out" > /dev/null &
  cat "$RES/$name.mon.out" > "$RES/$name.monitor.log" &
}

vm_alive() { kill -0 "$1" 2>/dev/null; }
# to_fifo VM FIFO LINE: a line to one of a VM's FIFOs. Once its qemu is gone nothing
# reads the FIFO and open(2) for writing would block for ever (the run would hang
# until CI's own time limit): a dead VM is skipped, and the write is bounded anyway
# (qemu may die between the check and the open).
to_fifo() {
  vm_alive "${VM_PID[$1]}" || { log "  ($1 VM gone: not sent to $2: $3)"; return 0; }
  timeout 10 bash -c 'printf "%s\n" "$2" > "$1"' _ "$RES/$2" "$3" \
    || log "  ($1 VM: could not write to $2 within 10 s: $3)"
}
send() { to_fifo "$1" "$1.ctl.in" "$2"; } # send VM LINE
hmp() { to_fifo kern kern.mon.in "$1"; }
# died: what a VM that is gone printed last (a guest panic powers qemu off: -no-reboot)
died() {
  local v
  for v in kern rs; do
    vm_alive "${VM_PID[$v]}" && continue
    log "$v VM is gone; the last lines of its console ($RES/$v.log):"
    tail -n 40 "$RES/$v.log" | cut -c1-300 | sed 's/^/    | /'
  done
}

# guest_panicked: whether a VM's console shows a kernel panic since the current attempt began
guest_panicked() {
  tail -n "+$FROM_K" "$RES/kern.log" 2>/dev/null | grep -aq 'Kernel panic - not syncing' \
    || tail -n "+$FROM_R" "$RES/rs.log" 2>/dev/null | grep -aq 'Kernel panic - not syncing'
}

# wait_for PATTERN SECONDS: until both logs have a line matching PATTERN (grep -E)
# since the current attempt began (FROM_K, FROM_R: a case run again must not take
# its first attempt's answers for its own); 1 on timeout, 2 if a VM died or
# reported a fatal error
wait_for() {
  local pat=$1 until=$(( $(date +%s) + $2 )) v ok from
  while :; do
    ok=1
    for v in kern rs; do
      from=$FROM_K; [ "$v" = rs ] && from=$FROM_R
      tail -n "+$from" "$RES/$v.log" 2>/dev/null | grep -qE "$pat" || ok=0
    done
    [ $ok = 1 ] && return 0
    grep -q '^SMCI-FATAL' "$RES/kern.log" "$RES/rs.log" 2>/dev/null && return 2
    for v in "${QEMU_PIDS[@]}"; do vm_alive "$v" || return 2; done
    [ "$(date +%s)" -ge "$until" ] && return 1
    sleep 0.5
  done
}

step_boot() {
  rm -rf "$RES" "$I/cases"; mkdir -p "$RES" "$I/cases"
  log "boot: two VMs (TCG, 1 vCPU, ${MEM} MiB each); logs in $RES/"
  boot_vms
}

boot_vms() {
  local a=127.0.0.1
  # (fresh consoles: every line is new)
  FROM_K=1; FROM_R=1
  boot kern 1 "udp=$a:$((PORT + 1)),localaddr=$a:$PORT" "udp=$a:$((PORT + 3)),localaddr=$a:$((PORT + 2))"
  boot rs 2 "udp=$a:$PORT,localaddr=$a:$((PORT + 1))" "udp=$a:$((PORT + 2)),localaddr=$a:$((PORT + 3))"
  local rc=0
  wait_for '^SMCI-READY' 300 || rc=$?
  [ $rc = 0 ] || { grep -h 'SMCI-FATAL' "$RES"/*.log || true; die "VMs not ready (rc $rc); see $RES/kern.log, $RES/rs.log"; }
  grep -h '^SMCI-READY' "$RES/kern.log" "$RES/rs.log" | sed 's/^/    /'
  log "VMs ready"
}

# reboot_vms: two fresh VMs after a control case that a VM did not survive or that hung
# (the old consoles are kept as NAME.bootN.log)
REBOOTS=0
reboot_vms() {
  local v p
  for v in kern rs; do send "$v" quit; done
  for p in "${QEMU_PIDS[@]}"; do
    for _ in $(seq 60); do vm_alive "$p" || break; sleep 0.5; done
  done
  for v in kern rs; do [ -r "$RES/$v.pid" ] && kill "$(cat "$RES/$v.pid")" 2>/dev/null || true; done
  for p in "${QEMU_PIDS[@]}"; do
    for _ in $(seq 40); do vm_alive "$p" || break; sleep 0.5; done
  done
  REBOOTS=$((REBOOTS + 1))
  for v in kern rs; do mv "$RES/$v.log" "$RES/$v.boot$REBOOTS.log"; rm -f "$RES/$v.pid"; done
  QEMU_PIDS=()
  log "reboot: two fresh VMs (the old consoles: $RES/{kern,rs}.boot$REBOOTS.log)"
  boot_vms
}

declare -A CASE_SECS CASE_ABORT RETRIED
FROM_K=1; FROM_R=1
# phase CASE PHASE TIMEOUT: sends the phase to both VMs and waits for both answers
phase() {
  local c=$1 ph=$2 rc=0
  send kern "$ph $c"; send rs "$ph $c"
  wait_for "^SMCI-ACK $ph $c " "$3" || rc=$?
  if [ $rc != 0 ]; then
    CASE_ABORT[$c]="phase $ph: $([ $rc = 1 ] && echo "no answer within $3 s" || echo "a VM died or failed")"
    if [ $rc = 2 ]; then
      died
      grep -h '^SMCI-FATAL' "$RES/kern.log" "$RES/rs.log" 2>/dev/null | head -5 | sed 's/^/    /' || true
    fi
    return 1
  fi
}

# attempt CASE CAPTURE-ID: one run of a case (capture, phases, verdict); 1 if it was cut
# short (a phase unanswered or a VM gone)
attempt() {
  local c=$1 t capfile= rc=0
  t=$(date +%s)
  unset "CASE_ABORT[$c]"
  if [ "$CAPTURE" = 1 ]; then
    capfile=$I/cases/$c.pcap
    hmp "object_add filter-dump,id=$2,netdev=d0,file=$capfile,maxlen=$SNAP"
    for _ in $(seq 50); do [ -s "$capfile" ] && break; sleep 0.1; done
    [ -s "$capfile" ] || log "  capture did not start (see $RES/kern.monitor.log)"
  fi
  # the judge reads this attempt's lines only (a control case may run twice)
  FROM_K=$(( $(wc -l < "$RES/kern.log") + 1 )); FROM_R=$(( $(wc -l < "$RES/rs.log") + 1 ))
  phase "$c" prep 60 && phase "$c" run $((TIMEOUT + 120)) && phase "$c" post $((SMCI_LGR_WAIT + 90)) || rc=1
  [ -n "$capfile" ] && hmp "object_del $2"
  CASE_SECS[$c]=$(( $(date +%s) - t ))
  judge "$c" | tee -a "$RES/judged.txt"
  return $rc
}

step_cases() {
  local c i=0 aborted=
  for c in $CASES; do
    i=$((i + 1))
    if [ -n "$aborted" ]; then CASE_ABORT[$c]="not run: the run stopped at $aborted"; continue; fi
    case_def "$c"
    log "case $c ($i of $(wc -w <<< "$CASES")): $SCEN, $DIR, $CONNS connection(s)"
    attempt "$c" "cap$i" || aborted=$c
    # A control case (the kernel on both VMs) proves the harness and pins the
    # kernel's own behaviour; it does not test smc-rs. Linux 6.12 over rxe under
    # emulation has failed such cases: a kernel<->kernel transfer ended in EOF on one
    # side while the other hung, and a guest kernel has panicked in smcr.kc (slab
    # corruption under rxe_requester's skb allocation). Such a case runs again, up to
    # twice more, and every attempt is reported; when a VM died or stopped answering,
    # on two fresh VMs. If every attempt ended in a guest kernel panic, the case is
    # reported as KERNEL-PANIC (the kernel's own crash with no smc-rs in it), not
    # counted as a failure, and the run goes on with fresh VMs.
    # An smc-rs case runs again only when a guest kernel panicked in the failed
    # attempt: the same slab corruption has brought down the kernel VM in the run
    # phase of an smc-rs case before its fault was applied, and the RoCE packets the
    # guest kernel handles are built by the other guest's kernel rxe driver, not by
    # smc-rs. It too gets up to two more attempts on fresh VMs; if it panics in every
    # attempt it stays FAIL (a crash that follows a case is the case's to explain).
    # (not redund.*: its second device is set up once per attempt, and what it finds is
    # the kernel's, see its checks)
    local tries=0 panics=0 control=0 why
    [ "$VM2_IMPL" = kernel ] && [ "$FAULT" != linkcut ] && control=1
    while [ "$(tail -1 "$RES/verdicts")" = "$c FAIL" ] && [ "$tries" -lt 2 ]; do
      if guest_panicked; then
        why="a guest kernel panicked"
      elif [ "$control" = 1 ]; then
        why="kernel <-> kernel"
      else
        break
      fi
      tries=$((tries + 1))
      [ "$why" = "a guest kernel panicked" ] && panics=$((panics + 1))
      RETRIED[$c]=1
      sed -i '$ s/ FAIL$/ FAIL-RETRIED/' "$RES/verdicts"
      log "case $c failed ($why): running it again ($tries of 2)"
      echo "    (case failed, $why; running it again$([ -n "$aborted" ] && echo ", on two fresh VMs"))" >> "$RES/judged.txt"
      if [ -n "$aborted" ]; then reboot_vms; aborted=; fi
      [ "$CAPTURE" = 1 ] && rm -f "$I/cases/$c.pcap"
      attempt "$c" "capr$i.$tries" || aborted=$c
    done
    if [ "$control" = 1 ] && [ "$tries" -gt 0 ] && [ "$(tail -1 "$RES/verdicts")" = "$c FAIL" ] \
       && guest_panicked && [ "$panics" = "$tries" ]; then
      sed -i '$ s/ FAIL$/ KERNEL-PANIC/' "$RES/verdicts"
      log "control case $c: a guest kernel panicked in every attempt (kernel <-> kernel): not counted"
      echo "    (control case $c: a guest kernel panicked in each of its $((tries + 1)) attempts; kernel <-> kernel, not counted)" >> "$RES/judged.txt"
      if [ -n "$aborted" ]; then reboot_vms; aborted=; fi
    fi
  done
  send kern quit; send rs quit
  local p
  for p in "${QEMU_PIDS[@]}"; do
    for _ in $(seq 60); do vm_alive "$p" || break; sleep 0.5; done
  done
}

# ------------------------------------------------------------------ judging
# Lines of case C from VM V's log: "SMCI-... case=C ..."
lines() { # (from the current attempt's first line on: FROM_K, FROM_R)
  local from=$FROM_K; [ "$2" = rs ] && from=$FROM_R
  tail -n "+$from" "$RES/$2.log" | grep -aF " case=$1 " | grep -a '^SMCI-' || true
}
kv() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<< " $1" | head -1; } # kv LINE KEY

# What the capture (first NIC: the link that survives the redund.* cut) shows of the closes
# and the failover, from `smc-iop-pcap --list` (its lines: "+T frame N SRC:P > DST:P CLC
# ACCEPT|CONFIRM ... token=0xT", "... SEND qp=.. psn=.. CDC seq=S token=0xT prod=W:C ...
# ProducerFlags(..) ConnStateFlags(..)", "... LLCv2 DELETE_LINK req"). A CDC carries the
# receiver's token; a connection's tokens come from its CLC Accept (server) and Confirm
# (client). Prints "KEY=VALUE ..." on one line:
#  conns, late (connections after the first FIRST, those of the cut round), cli_close /
#  srv_close (connections whose client / server sent a CDC with peer_conn_closed or an abort,
#  of all), late_cli_close / late_srv_close (of the late ones), late_cli_missing /
#  late_srv_missing (their client ports), and for the failover: del_at (the last DELETE_LINK
#  request before the first failover validation CDC, s into the capture: the first sign of
#  the cut on the surviving link), del_from (its sender), moved (connections with a
#  validation CDC), and per moved connection "SRVTOKEN/CLITOKEN:cli_ms/srv_ms/data_ms": its
#  client's and its server's validation CDC, and the client's first CDC after its
#  validation (the data flowing again), in ms after del_at (- if none); mark_at (the rs VM's
#  SYN to port MARK sent right before it took its second NIC down), mark_to_del_ms, and
#  cut_to_traffic_ms: from the mark to the last moved connection's client CDC after its
#  validation (an upper bound: the mark precedes the cut by the SYN's round trip and the
#  start of `ip link set down`).
wire_closes() { # PCAP FIRST
  "$PCAP_BIN" --list "$1" 2>/dev/null | awk -v first="$2" -v mark="$SMCI_CUT_MARK_PORT" '
    function ip(a) { sub(/:[0-9]+$/, "", a); return a }
    function tok(   i) { for (i = 1; i <= NF; i++) if ($i ~ /^token=/) return substr($i, 7); return "" }
    function ms(t) { return t == "" ? "-" : sprintf("%.1f", (t - del) * 1000) }
    { t = substr($1, 2); sub(/s$/, "", t); t += 0 }
    $7 == "CLC" && $8 == "ACCEPT" { k = $6; if (!(k in sv)) order[++n] = k; sv[k] = tok(); svip = ip($4); next }
    $7 == "CLC" && $8 == "CONFIRM" { k = $4; if (!(k in sv)) order[++n] = k; cl[k] = tok(); clip = ip($4); next }
    $7 == "SYN" && $6 ~ (":" mark "$") && mark_at == "" { mark_at = t; next }
    / LLCv2 DELETE_LINK req/ { lastdel = t; lastdelfrom = ip($4); next }
    / CDC / {
      src = ip($4); k = src "/" tok()
      if (/peer_conn_closed|peer_conn_abort/) closed[k] = 1
      if (/failover_validation/) {
        if (del == "") { del = lastdel != "" ? lastdel : t; delfrom = lastdel != "" ? lastdelfrom : "none" }
        if (!(k in val)) val[k] = t
      } else if ((k in val) && !(k in data)) data[k] = t
    }
    END {
      late = n - first; if (late < 0) late = 0
      for (i = 1; i <= n; i++) {
        k = order[i]; c = closed[clip "/" sv[k]]; s = closed[svip "/" cl[k]]
        cc += c; sc += s
        if (i > first) { lc += c; ls += s; if (!c) lcm = lcm "," k; if (!s) lsm = lsm "," k }
        ck = clip "/" sv[k]; sk = svip "/" cl[k]
        if (del != "" && ((ck in val) || (sk in val))) {
          mv++; mvs = mvs "," sv[k] "/" cl[k] ":" ms(val[ck]) "/" ms(val[sk]) "/" ms(data[ck])
          if (mark_at != "" && data[ck] != "") { d = (data[ck] - mark_at) * 1000; if (d > cut) cut = d }
        }
      }
      printf "conns=%d late=%d cli_close=%d srv_close=%d late_cli_close=%d late_srv_close=%d", n, late, cc, sc, lc, ls
      printf " late_cli_missing=%s late_srv_missing=%s", (lcm == "" ? "-" : substr(lcm, 2)), (lsm == "" ? "-" : substr(lsm, 2))
      printf " del_at=%s del_from=%s moved=%d moved_ms=%s", (del == "" ? "-" : sprintf("%.3f", del)), (delfrom == "" ? "-" : delfrom), mv, (mvs == "" ? "-" : substr(mvs, 2))
      printf " mark_at=%s mark_to_del_ms=%s cut_to_traffic_ms=%s\n", (mark_at == "" ? "-" : sprintf("%.3f", mark_at)), \
        (mark_at == "" || del == "" ? "-" : sprintf("%.1f", (del - mark_at) * 1000)), (cut == "" ? "-" : sprintf("%.1f", cut))
    }'
}

CHECKS=; CASE_FAIL=0; CASE_SKIP=
check() { # check ok|FAIL TEXT
  CHECKS+="    $(printf '%-4s' "$1") $2"$'\n'
  [ "$1" = ok ] || CASE_FAIL=1
}
skip() { # skip REASON: the case cannot test what it is for here (SKIP unless a check failed)
  CHECKS+="    SKIP $1"$'\n'
  CASE_SKIP=$1
}

# The Decline each UEID case must see, as the kernel sends it, and the fallback reason
# each end must then report (kernel: smc_diag; smc-rs: Mode::Tcp), "fb/peer_fb":
#  - the kern VM's kernel without a UEID proposes no SMC-R v2 as a client (v2 needs a UEID,
#    net/smc/af_smc.c smc_find_proposal_devices) and has no v1 device (rxe has no RoCE v1
#    GID): it declines NOSMCDEV before any Proposal. As a server it finds no v2 device for
#    the Proposal (smc_find_rdma_v2_device_serv: smc_clc_match_eid fails) nor a v1 one:
#    NOSMCDEV again (smc_listen_find_device). Either way the kern VM declines.
#  - with another UEID the kern VM's kernel proposes v2 as a client, and the server end
#    (rs VM) finds no matching UEID: it declines NOSMCDEV, as the kernel server does; as a
#    server the kern VM's kernel declines NOSMCDEV itself.
expect_decline() { # CASE -> "CODE KERN_FB KERN_PEERFB VM2_FB VM2_PEERFB"
  local d=$SMCI_DECL_NOSMCDEV p=$SMCI_DECL_PEERDECL z=0x00000000
  case $1 in
    noueid.*|otherueid.rk|otherueid.ck) echo "$d $d $z $p $d";; # the kern VM declines
    otherueid.kr|otherueid.kc) echo "$d $p $d $d $z";;         # the rs VM's server declines
  esac
}

judge() {
  # (runs in a subshell of its own: a grep that finds nothing is an answer, not an error)
  set +e +o pipefail
  local c=$1
  case_def "$c"
  CHECKS=; CASE_FAIL=0; CASE_SKIP=
  if [ -n "${CASE_ABORT[$c]:-}" ]; then check FAIL "${CASE_ABORT[$c]}"; fi
  local K R
  K=$(lines "$c" kern); R=$(lines "$c" rs)
  local ALL="$K"$'\n'"$R"
  local vm2=smc-rs; [ "$VM2_IMPL" = kernel ] && vm2="kernel(rs VM)"
  # who is who
  local cl sv
  if [ "$CLIENT_VM" = kern ]; then cl=$K; sv=$R; else cl=$R; sv=$K; fi

  # --- connections: one up and one end line per id and side
  local ends ups hang n_ok=0 bad= line id side want sha exp b eof res
  ends=$(grep -a ' ev=end ' <<< "$ALL" || true)
  ups=$(grep -a ' ev=up ' <<< "$ALL" || true)
  hang=$(grep -ac 'result=hang' <<< "$ends" || true)
  # (redund.*: the kernel server ends that got every byte but not the close, below)
  if [ "$FAULT" = linkcut ]; then
    hang=$(grep -a 'result=hang' <<< "$ends" | awk '{ r = ""; w = ""; s = ""
        for (i = 1; i <= NF; i++) { if ($i ~ /^recv=/) r = substr($i, 6); if ($i ~ /^want_recv=/) w = substr($i, 11)
                                    if ($i ~ /^side=/) s = substr($i, 6) }
        if (s != "server" || r != w) n++ } END { print n + 0 }')
  fi
  [ "$hang" = 0 ] || check FAIL "$hang connection end(s) hung (watchdog): $(grep -a 'result=hang' <<< "$ends" | head -2 | cut -c1-200)"

  # (redund.*: the closes and the failover as the capture of the surviving link shows them)
  local wc=
  if [ "$FAULT" = linkcut ] && [ "$CAPTURE" = 1 ] && [ -s "$I/cases/$c.pcap" ]; then
    local lastr=${ROUNDS##*,}
    wc=$(wire_closes "$I/cases/$c.pcap" $((CONNS - ${lastr%%x*})))
  fi

  if [ "$EXPECT" != fault ]; then
    local closehang=
    while read -r id b; do
      for side in client server; do
        line=$(grep -a " side=$side id=$id ev=end " <<< "$ends" | head -1)
        if [ -z "$line" ]; then bad+=" $side#$id:no-end"; continue; fi
        res=$(kv "$line" result); want=$(kv "$line" want_recv); sha=$(kv "$line" sha256); eof=$(kv "$line" eof)
        # Linux (6.12 over rxe) never gives the server of a connection that the link cut
        # moved its EOF when the client closes first: every byte in, the close not, with a
        # kernel client as with smc-rs (see README.md); the end is told apart, not failed
        if [ "$FAULT" = linkcut ] && [ "$side" = server ] && [ "$res" = hang ] && [ "$(kv "$line" recv)" = "$want" ] \
           && grep -qxF -- "$line" <<< "$K"; then
          closehang+=" #$id"; n_ok=$((n_ok + 1)); continue
        fi
        if [ "$side" = server ]; then exp=$(expected_sha $((2 * id)) "$b"); else exp=$(expected_sha $((2 * id + 1)) "$b"); fi
        if [ "$res" != ok ]; then bad+=" $side#$id:$res/$(kv "$line" err)@$(kv "$line" at)"
        elif [ "$(kv "$line" recv)" != "$want" ] || [ "$sha" != "$exp" ]; then bad+=" $side#$id:sha-mismatch"
        elif [ "$(kv "$line" close)" = passive ] && [ "$eof" != yes ]; then bad+=" $side#$id:eof=$eof"
        else n_ok=$((n_ok + 1)); fi
      done
    done < <(conn_bytes)
    if [ -n "$closehang" ]; then
      # Whether the client's close reached the wire of the surviving link, and the kernel
      # server answered it with its own close (its application saw EOF and called close()),
      # for every connection of the cut round (the capture cannot tell which token is #N)
      local late; late=$(kv "$wc" late)
      local hung; hung=$(grep -a '^SMCI-DMESG' <<< "$K" | grep -ao 'smc_cdc_wait_pend_tx_wr\|smc_wr_tx_wait_no_pending_sends' | sort -u | tr '\n' ' ')
      if [ -z "$wc" ]; then
        skip "kernel: the server end of connection(s)$closehang received every byte, its end never came (no capture to tell whether the close reached it)"
      elif [ "$(kv "$wc" late_cli_close)" != "$late" ]; then
        [ "$VM2_IMPL" = rs ] || skip "kernel: the server end of connection(s)$closehang received every byte, its end never came; the kernel client's close CDC is not on the surviving link for client port(s) $(kv "$wc" late_cli_missing)"
      elif [ "$(kv "$wc" late_srv_close)" = "$late" ]; then
        skip "kernel: the server end of connection(s)$closehang received every byte and the client's close, but its close() never returned: both closes of all $late connections of the cut round are on the wire of the surviving link, the kernel's answering the client's (its application saw EOF, then close() blocked$([ -n "$hung" ] && echo "; dmesg hung tasks in: ${hung% }"): Linux waits for the completion of sends it posted on the dead link; kernel <-> kernel too)"
      else
        skip "kernel: the server end of connection(s)$closehang received every byte but never answered the client's close, which is on the wire of the surviving link for all $late connections of the cut round (kernel server closes: $(kv "$wc" late_srv_close)/$late)"
      fi
    fi
    if [ -z "$bad" ]; then
      check ok "$CONNS/$CONNS connections intact both ways (SHA-256 of what each end received = of what the other sent$([ -n "$closehang" ] && echo "; the kernel server ends of$closehang: byte counts, their end never came"), closes: $CLOSE"
    else
      check FAIL "$n_ok of $((2 * CONNS)) connection ends intact; bad:$(cut -c1-400 <<< "$bad")"
    fi
  fi

  # --- urgent data: each end got the other's byte out of band (the checksums above
  # show it stayed out of the streams)
  if [ "$URGENT" = 1 ]; then
    local urg nurg badurg
    urg=$(grep -a '^SMCI-URG' <<< "$ALL" || true)
    nurg=$(grep -ac ' ok=yes ' <<< "$urg" || true); [ -z "$urg" ] && nurg=0
    if [ "$nurg" = $((2 * CONNS)) ]; then
      check ok "urgent data: $nurg of $((2 * CONNS)) ends received the peer's MSG_OOB byte out of band (client 0xc1, server 0x5e)"
    else
      badurg=$(grep -av ' ok=yes ' <<< "$urg" | sed -n 's/.* impl=\([a-z]*\) side=\([a-z]*\) id=\([0-9]*\) .* got=\([^ ]*\) .* err=\([^ ]*\).*/\1-\2#\3:got=\4,err=\5/p' | tr '\n' ' ')
      check FAIL "urgent data: $nurg of $((2 * CONNS)) ends got the peer's byte; bad: ${badurg:-no SMCI-URG lines} "
    fi
  fi

  # --- modes
  local nup nsmcr modes
  nup=$(grep -ac . <<< "$ups" || true); [ -z "$ups" ] && nup=0
  nsmcr=$(grep -ac ' mode=SMCR ' <<< "$ups" || true)
  modes=$(sed -n 's/.* impl=\([a-z]*\) side=\([a-z]*\) .* mode=\([A-Za-z]*\) fb=\([0-9a-fx]*\) peer_fb=\([0-9a-fx]*\).*/\1-\2:\3:\4\/\5/p' <<< "$ups" | sort | uniq -c | tr -s ' ' | tr '\n' ';')
  case $EXPECT in
    smcr|fault)
      if [ "$nup" -gt 0 ] && [ "$nsmcr" = "$nup" ]; then
        check ok "SMC-R on both ends of every connection ($nup ends: kernel smc_diag mode SMCR$([ "$VM2_IMPL" = rs ] && echo ", smc-rs Mode::SmcR"))"
      else
        check FAIL "$([ "$EXPECT" = fault ] && echo "precondition: ")not SMC-R everywhere: $nsmcr of $nup ends; (count impl-side:mode:fb/peer_fb)$modes"
      fi;;
    decline)
      local e code kfb kpf vfb vpf wrong=
      e=$(expect_decline "$c"); read -r code kfb kpf vfb vpf <<< "$e"
      while read -r line; do
        [ -z "$line" ] && continue
        local impl m fb pf
        impl=$(kv "$line" impl); m=$(kv "$line" mode); fb=$(kv "$line" fb); pf=$(kv "$line" peer_fb)
        if grep -qxF -- "$line" <<< "$K"; then
          [ "$m/$fb/$pf" = "TCP/$kfb/$kpf" ] || wrong+=" kern:$m/$fb/$pf(want TCP/$kfb/$kpf)"
        else
          [ "$m/$fb/$pf" = "TCP/$vfb/$vpf" ] || wrong+=" $impl@rs:$m/$fb/$pf(want TCP/$vfb/$vpf)"
        fi
      done <<< "$ups"
      if [ "$nup" -gt 0 ] && [ -z "$wrong" ]; then
        check ok "TCP fallback on both ends ($nup ends): kernel reason $kfb/peer $kpf, $vm2 reason $vfb/peer $vpf"
      else
        check FAIL "fallback reasons: $nup ends up;$(cut -c1-400 <<< "$wrong")"
      fi;;
  esac

  # --- link groups: which the kernel (kern VM) created during the case
  local start new
  start=$(grep -a 'SMCI-KLGR when=prep' <<< "$K" | head -1 | sed -n 's/.* ids=\([^ ]*\).*/\1/p' | tr ',' '\n' | cut -d: -f1)
  new=$(grep -a 'SMCI-KLGR' <<< "$K" | grep -v 'when=prep' | sed -n 's/.* ids=\([^ ]*\).*/\1/p' | tr ',' '\n' | cut -d: -f1 \
        | grep -v '^-$' | sort -u | grep -vxF -f <(echo "${start:-none}") || true)
  local nnew; nnew=$(grep -c . <<< "$new" || true); [ -z "$new" ] && nnew=0
  case $EXPECT in
    smcr)
      # a fresh smc-rs process is a new peer (its own system ID): one new group; two
      # kernels may still share the group of an earlier control case (10 min idle)
      if [ "$nnew" = 1 ]; then
        check ok "kernel: one new link group for all $CONNS connections (id $new; the others reused it)"
      elif [ "$nnew" = 0 ] && [ "$VM2_IMPL" = kernel ]; then
        check ok "kernel: all $CONNS connections reused the link group of an earlier case"
      else
        check FAIL "kernel: $nnew new link groups during the case (want $([ "$VM2_IMPL" = rs ] && echo 1 || echo '0 or 1')): ${new//$'\n'/,}"
      fi
      if [ "$VM2_IMPL" = rs ]; then
        local st badst
        st=$(grep -a '^SMCI-RSSTATE' <<< "$R" | grep -v 'when=start' || true)
        badst=$(grep -av ' lgrs=1 ' <<< "$st" | grep -av 'when=linger' || true)
        if [ -n "$st" ] && [ -z "$badst" ]; then
          check ok "smc-rs: one link group after every round (smc::state)"
        else
          check FAIL "smc-rs: link groups after the rounds: $(sed -n 's/.* when=\([^ ]*\).* lgrs=\([0-9]*\).*/\1:\2/p' <<< "$st" | tr '\n' ' ')"
        fi
      fi;;
    decline)
      [ "$nnew" = 0 ] && check ok "kernel: no link group created" || check FAIL "kernel: $nnew link groups created by a declined case";;
  esac

  # --- link redundancy (redund.*): two links before the cut, connections on both, then on
  # the surviving one (the data checks above: nothing lost, nothing duplicated)
  if [ "$FAULT" = linkcut ]; then
    local nosec f r1 samples both moved maxl back
    nosec=$(grep -a '^SMCI-SECOND' <<< "$ALL" | grep -a ' up=no ' | head -1)
    if [ -n "$nosec" ]; then
      skip "no second device in a VM: $(cut -d' ' -f2- <<< "$nosec")"
    else
      # (a fresh pair of VMs: the kern VM's first ADD_LINK over rxe1 fails in its QP's
      # modify to RTR, EINVAL, whatever the peer; later ones succeed, see README.md)
      local addfail; addfail=$(grep -a '^SMCI-DMESG' <<< "$K" | grep -a 'rxe1: .*rxe_modify_qp: returned err' | head -1)
      f=$(grep -a '^SMCI-FAULT' <<< "$R" | head -1)
      if [ "$(kv "$f" rc)" = 0 ]; then check ok "link cut: $(cut -d' ' -f3- <<< "$f")"
      else check FAIL "link cut not applied: ${f:-no SMCI-FAULT line}"; fi
      # the rs VM's own clock around the cut: the mark (see wire_closes), `ip link set
      # down`, and smc-rs's events (SMC_LOG, stamped as the guest read them)
      local mk; mk=$(kv "$f" mark_up)
      if [ -n "$mk" ] && [ "$VM2_IMPL" = rs ]; then
        local ev; ev=$(grep -a '^SMCI-RSEV' <<< "$R" | awk -v m="$mk" '{ u = ""; for (i = 1; i <= NF; i++) if ($i ~ /^up=/) u = substr($i, 4) + 0
            if (u < m) next
            if (/ link down / && down == "") down = u; if (/moved/) { mv = u; n++ } }
          END { printf "%s %s %d", (down == "" ? "-" : sprintf("+%.0f", (down - m) * 1000)), (mv == "" ? "-" : sprintf("+%.0f", (mv - m) * 1000)), n }')
        local edown emv en; read -r edown emv en <<< "$ev"
        CHECKS+="    info rs VM clock, ms after the mark: ip link set down from +$(awk -v a="$(kv "$f" down_up)" -v m="$mk" 'BEGIN { printf "%.0f", (a - m) * 1000 }') to +$(awk -v a="$(kv "$f" up)" -v m="$mk" 'BEGIN { printf "%.0f", (a - m) * 1000 }'); smc-rs link down $edown, $en connection(s) moved, the last $emv"$'\n'
      fi
      # the client's own view after the first round, before the cut
      if [ "$VM2_IMPL" = rs ]; then
        r1=$(grep -a '^SMCI-RSSTATE' <<< "$R" | grep -a ' when=round-1 ' | head -1)
        if [ "$(kv "$r1" links)/$(kv "$r1" second)" = 2/1 ]; then
          check ok "smc-rs: two links after the first round, one on its second device (smc::state links=2 second=1)"
        elif [ -n "$addfail" ]; then
          skip "the kern VM's ADD_LINK failed in its own rxe1 ($(sed 's/.*role=kern //' <<< "$addfail" | cut -c1-90)): no second link to cut (run redund.ck first)"
        else
          check FAIL "smc-rs: after the first round links=$(kv "$r1" links) second=$(kv "$r1" second) (want 2, 1 of them on rxe1)"
        fi
      else
        r1=$(grep -a '^SMCI-KLGR' <<< "$R" | grep -a ' when=round-1 ' | head -1)
        if [ "$(kv "$r1" links)" = 2 ] && grep -q 'rxe1' <<< "$(kv "$r1" lconns)"; then
          check ok "kernel (rs VM): two links after the first round ($(kv "$r1" lconns))"
        elif [ -n "$addfail" ]; then
          skip "the kern VM's ADD_LINK failed in its own rxe1 ($(sed 's/.*role=kern //' <<< "$addfail" | cut -c1-90)): no second link to cut"
        else
          check FAIL "kernel (rs VM): after the first round links=$(kv "$r1" links) lconns=$(kv "$r1" lconns) (want 2, over rxe0 and rxe1)"
        fi
      fi
      # the kern VM's samples while the case ran: connections on both devices' links,
      # later all on rxe0
      samples=$(grep -a 'SMCI-KLGR when=sample' <<< "$K" | sed -n 's/.* lconns=\([^ ]*\).*/\1/p')
      maxl=$(grep -a 'SMCI-KLGR when=sample' <<< "$K" | sed -n 's/.* links=\([0-9]*\).*/\1/p' | sort -n | tail -1)
      read -r both moved <<< "$(awk -F, '{ a = 0; b = 0
          for (i = 1; i <= NF; i++) { split($i, x, ":"); if (x[1] == "rxe0") a += x[2]; else if (x[1] == "rxe1") b += x[2] }
          if (a > 0 && b > 0 && both == "") both = a "/" b
          if (both != "" && moved == "" && a > 0 && b == 0) moved = a }
          END { print (both == "" ? "no" : both), (moved == "" ? "no" : moved) }' <<< "$samples")"
      if [ "$both" != no ]; then
        check ok "kernel: $maxl links in the group while it ran; connections on both (rxe0/rxe1: $both), so the cut hit some"
      elif [ -n "$addfail" ]; then
        [ -n "$CASE_SKIP" ] || skip "the kern VM's ADD_LINK failed in its own rxe1 ($(sed 's/.*role=kern //' <<< "$addfail" | cut -c1-90)); no connection was on the second link when it was cut"
      else
        check FAIL "kernel: never connections on both rxe0 and rxe1 (max links ${maxl:-?}; samples: $(tr '\n' ' ' <<< "$samples" | cut -c1-300))"
      fi
      if [ "$moved" != no ]; then
        check ok "kernel: after the cut every connection on rxe0 ($moved), none on rxe1"
      elif [ -n "$CASE_SKIP" ]; then :
      else
        check FAIL "kernel: the connections did not all move to rxe0 (samples: $(tr '\n' ' ' <<< "$samples" | cut -c1-300))"
      fi
      back=$(grep -a 'SMCI-KLGR when=nic-back' <<< "$K" | head -1)
      [ -n "$back" ] && CHECKS+="    info the second NIC back up: kernel links $(kv "$back" links) after $(kv "$back" after_s) s: $(kv "$back" lconns)"$'\n'
    fi
  fi

  # --- faults (on an SMC-R connection; over TCP they prove nothing)
  local pre=1
  [ "$EXPECT" = fault ] && { [ "$nup" -gt 0 ] && [ "$nsmcr" = "$nup" ] || pre=0; }
  [ $pre = 0 ] && check FAIL "fault checks skipped: the connection was not SMC-R"
  if [ "$EXPECT" = fault ] && [ $pre = 1 ]; then
    local f ke ve
    f=$(grep -a '^SMCI-FAULT' <<< "$ALL" | head -1)
    if grep -qE 'what=(sigkill pid=|rxedel rc=0)' <<< "$f"; then check ok "fault applied: $(cut -d' ' -f3- <<< "$f")"
    else check FAIL "fault not applied: ${f:-no SMCI-FAULT line}"; fi
    ke=$(grep -a ' ev=end ' <<< "$K" | head -1)
    ve=$(grep -a ' ev=end ' <<< "$R" | head -1)
    if [ "$FAULT" = kill ]; then
      if [ -n "$ve" ]; then check FAIL "the smc-rs end finished before the SIGKILL: $(cut -c1-200 <<< "$ve")"; fi
      if [ "$(kv "$ke" result)" = error ]; then
        check ok "kernel: the connection ended with an error ($(kv "$ke" err) at $(kv "$ke" at), $(kv "$ke" stall_s) s without progress)"
      else
        check FAIL "kernel: the connection did not end with an error: ${ke:-no end line}"
      fi
    else
      local err stall okerr
      err=$(kv "$ve" err); stall=$(kv "$ve" stall_s)
      # smc-rs must say reset/aborted; the kernel (control) reports an SMC-R connection
      # killed under it as a premature EOF (smc_rx_recvmsg after smc_conn_kill)
      okerr=$([ "$VM2_IMPL" = rs ] && echo 'ConnectionReset|ConnectionAborted' || echo 'ECONNRESET|ECONNABORTED|EOF')
      if [ "$(kv "$ve" result)" = error ] && grep -qxE "$okerr" <<< "$err" && awk -v s="$stall" 'BEGIN{exit !(s <= 30)}'; then
        check ok "$vm2: the connection ended with $err $stall s after its last progress (limit 30 s)"
      else
        check FAIL "$vm2: want an end with $okerr within 30 s: ${ve:-no end line (hang?)}"
      fi
      [ -n "$ke" ] && [ "$(kv "$ke" result)" != hang ] && check ok "kernel: its end finished too ($(kv "$ke" result) $(kv "$ke" err))" \
        || check FAIL "kernel: its end did not finish: ${ke:-no end line}"
    fi
  fi
  if { [ "$FAULT" = kill ] || [ "$FAULT" = rxedel ]; } && [ $pre = 1 ]; then
    local g; g=$(grep -a '^SMCI-LGRGONE' <<< "$K" | head -1)
    if [ "$(kv "$g" gone)" = yes ]; then check ok "kernel: the case's link groups are gone ($(kv "$g" after_s) s after the programs ended)"
    else check FAIL "kernel: link groups left: ${g:-no SMCI-LGRGONE line}"; fi
  fi
  if [ "$SCEN" = idle ]; then
    # freed by the idle timer (Linux: 600 s server, 610 s client; smc-rs: 600 s), not
    # before: an early end means the link died while idle (a TEST_LINK unanswered)
    local g a; g=$(grep -a '^SMCI-LGRIDLE' <<< "$K" | head -1); a=$(kv "$g" after_s)
    if [ "$nnew" != 1 ]; then check FAIL "kernel: the idle check needs the case's own link group ($nnew new; run idle.kc before other kc cases)"
    elif [ "$(kv "$g" gone)" = yes ] && [ "${a:-0}" -ge "$SMCI_IDLE_MIN" ]; then
      check ok "kernel: the link group was freed $a s after the last connection closed (its idle time), not before"
    else check FAIL "kernel: link group idle end: ${g:-no SMCI-LGRIDLE line} (want gone after ${SMCI_IDLE_MIN}..$((SMCI_IDLE_WAIT + 60)) s)"; fi
    if [ "$VM2_IMPL" = rs ]; then
      local first last
      first=$(grep -a '^SMCI-RSSTATE' <<< "$R" | grep -a 'when=linger' | grep -a ' lgrs=0 ' | head -1)
      last=$(grep -a '^SMCI-RSSTATE' <<< "$R" | grep -a 'when=linger' | tail -1)
      a=$(kv "$first" when); a=${a#linger-}; a=${a%s}
      if [ -n "$first" ] && [ "$(kv "$last" lgrs)" = 0 ] && [ "$a" -ge "$SMCI_IDLE_MIN" ]; then
        check ok "smc-rs: its link group was freed after $a s idle (smc::state), not before"
      else
        check FAIL "smc-rs: link groups while idle: $(sed -n 's/.* when=linger-\([0-9]*s\) lgrs=\([0-9]*\).*/\1:\2/p' <<< "$(grep -a '^SMCI-RSSTATE' <<< "$R")" | tr '\n' ' ' | cut -c1-300) (want 1, then 0 from ${SMCI_IDLE_MIN} s on)"
      fi
    fi
  fi

  # --- nothing left behind
  local kd vd rst
  kd=$(grep -a '^SMCI-KDIAG' <<< "$K" | tail -1)
  [ "$(kv "$kd" socks)" = 0 ] && check ok "kernel (kern VM): no AF_SMC socket left (smc_diag)" \
    || check FAIL "kernel (kern VM): smc_diag still lists sockets: ${kd:-no SMCI-KDIAG line} $(grep -a '^SMCI-KSOCK' <<< "$K" | head -3 | cut -c1-160 | tr '\n' ';')"
  if [ "$VM2_IMPL" = kernel ]; then
    vd=$(grep -a '^SMCI-KDIAG' <<< "$R" | tail -1)
    [ "$(kv "$vd" socks)" = 0 ] && check ok "kernel (rs VM): no AF_SMC socket left" \
      || check FAIL "kernel (rs VM): smc_diag still lists sockets: ${vd:-no SMCI-KDIAG line}"
  elif [ "$FAULT" != kill ]; then
    rst=$(grep -a '^SMCI-RSSTATE' <<< "$R" | grep -a 'when=end' | tail -1)
    [ "$(kv "$rst" conns)" = 0 ] && check ok "smc-rs: no connection left (smc::state; link groups: $(kv "$rst" lgrs), freed after their idle time)" \
      || check FAIL "smc-rs: connections left: ${rst:-no end report}"
  fi
  local kl; kl=$(grep -a 'SMCI-KLGR when=post' <<< "$K" | head -1)
  [ -n "$kl" ] && CHECKS+="    info kernel link groups after the case: $(kv "$kl" lgrs) ($(kv "$kl" ids); idle ones are freed after 10 min: SMC_LGR_FREE_DELAY_SERV/CLNT, no sysctl in 6.12)"$'\n'

  # --- the wire
  if [ "$CAPTURE" = 1 ] && [ -z "${CASE_ABORT[$c]:-}" ]; then
    local w; w=$("$PCAP_BIN" --tag "$c" "$I/cases/$c.pcap" 2>&1 | tail -1)
    echo "$w" >> "$RES/wire.txt"
    if [ "$FAULT" = linkcut ]; then
      # (the capture sees the first NIC only: the second link's traffic is not in it)
      CHECKS+="    info wire (first NIC): $(cut -d' ' -f3- <<< "$w" | cut -c1-300)"$'\n'
      if [ -n "$wc" ]; then
        # every connection of the cut round ends on the surviving link: a close of smc-rs's
        # that is not on its wire was lost (or never sent), whatever the kernel end reports
        if [ "$VM2_IMPL" = rs ]; then
          local late; late=$(kv "$wc" late)
          if [ "$(kv "$wc" late_cli_close)" = "$late" ]; then
            check ok "wire: smc-rs's close CDC of all $late connections of the cut round on the surviving link (the kernel's: $(kv "$wc" late_srv_close)/$late)"
          else
            check FAIL "wire: smc-rs's close CDC missing on the surviving link for client port(s) $(kv "$wc" late_cli_missing) ($(kv "$wc" late_cli_close)/$late; $I/cases/$c.pcap)"
          fi
        fi
        # the failover as the surviving link shows it (the cut itself is on the other NIC):
        # from the first DELETE_LINK request to each moved connection's validation CDCs and
        # its client's next CDC
        CHECKS+="    info failover on the wire (first NIC): cut mark (rs VM's SYN) to the moved connections' traffic: $(kv "$wc" cut_to_traffic_ms) ms at most (mark to the first DELETE_LINK req, from $(kv "$wc" del_from): $(kv "$wc" mark_to_del_ms) ms); $(kv "$wc" moved) moved connection(s), SRVTOKEN/CLITOKEN:client validation/server validation/client's next CDC in ms after the DELETE_LINK: $(kv "$wc" moved_ms)"$'\n'
      fi
    elif ! grep -q '^SMCI-WIRE' <<< "$w"; then check FAIL "capture: $w"
    else
      local wbad=
      [ "$(kv "$w" errors)" = 0 ] || wbad+=" $(kv "$w" errors) undecodable messages (smc-iop-pcap --list $I/cases/$c.pcap);"
      [ "$(kv "$w" tcp_cut)" = 0 ] || wbad+=" CLC cut by the snap length;"
      [ "$(kv "$w" synack_smc)" = "$CONNS" ] || wbad+=" SYN-ACKs with the SMC option $(kv "$w" synack_smc) (want $CONNS);"
      case $EXPECT in
        smcr)
          [ "$(kv "$w" proposals)/$(kv "$w" accepts)/$(kv "$w" confirms)" = "$CONNS/$CONNS/$CONNS" ] \
            || wbad+=" Proposal/Accept/Confirm $(kv "$w" proposals)/$(kv "$w" accepts)/$(kv "$w" confirms) (want $CONNS each);"
          # first contacts and CONFIRM_LINKs on the wire = link groups the kernel created
          [ "$(kv "$w" accepts_fc)/$(kv "$w" confirms_fc)" = "$nnew/$nnew" ] \
            || wbad+=" first-contact Accept/Confirm $(kv "$w" accepts_fc)/$(kv "$w" confirms_fc) but $nnew new link groups in the kernel's dump (must be equal);"
          local cl; cl=$(tr ',' '\n' <<< "$(kv "$w" llc)" | sed -n 's/^confirm_link=//p'); cl=${cl:-0/0}
          [ "$cl" = "$nnew/$nnew" ] || wbad+=" CONFIRM_LINK req/resp $cl but $nnew new link groups (want one pair each);"
          [ "$(kv "$w" declines)" = - ] || wbad+=" Declines $(kv "$w" declines);"
          [ "$(kv "$w" cdc_data)" -gt 0 ] && [ "$(kv "$w" rdma_writes)" -gt 0 ] || wbad+=" no data (CDC/RDMA WRITE);"
          if [ "$URGENT" = 1 ]; then
            [ "$(kv "$w" cdc_urg)" -ge $((2 * CONNS)) ] || wbad+=" $(kv "$w" cdc_urg) CDCs with urg_data_present (want at least $((2 * CONNS)): one per urgent byte);"
          fi
          [ -z "$wbad" ] && check ok "wire: $CONNS x Proposal/Accept/Confirm, first contact and CONFIRM_LINK $cl (= new link groups), $(kv "$w" rdma_writes) RDMA WRITEs, $(kv "$w" cdc_data) data CDCs ($(kv "$w" cdc_urg) with urg_data_present), LLC $(kv "$w" llc)";;
        decline)
          local want; want=$(for _ in $(seq "$CONNS"); do printf '%s,' "$(cut -d' ' -f1 <<< "$(expect_decline "$c")")"; done)
          [ "$(kv "$w" declines)," = "$want" ] || wbad+=" Declines $(kv "$w" declines) (want ${want%,});"
          # (idle link groups of earlier cases may exchange TEST_LINKs meanwhile)
          local llc; llc=$(kv "$w" llc)
          [ "$(kv "$w" accepts)/$(kv "$w" confirms)/$(kv "$w" cdc)" = 0/0/0 ] && ! grep -qE 'confirm_(link|rkey)' <<< "$llc" \
            || wbad+=" Accept/Confirm/CDC $(kv "$w" accepts)/$(kv "$w" confirms)/$(kv "$w" cdc), LLC $llc (want no SMC-R);"
          [ -z "$wbad" ] && check ok "wire: Decline $(kv "$w" declines), no Accept, no SMC-R (LLC: $llc)";;
      esac
      [ -z "$wbad" ] || check FAIL "wire:$wbad ($I/cases/$c.pcap)"
    fi
  fi

  local verdict=PASS; [ -n "$CASE_SKIP" ] && verdict=SKIP; [ $CASE_FAIL = 1 ] && verdict=FAIL
  echo "CASE $c $verdict (${CASE_SECS[$c]:-?} s)"
  printf '%s' "$CHECKS"
  echo "$c $verdict" >> "$RES/verdicts"
}

# ------------------------------------------------------------------ main
step_packages
step_rootfs
step_build
step_hashes
step_payload
step_boot
step_cases
pass=$(grep -c ' PASS$' "$RES/verdicts" || true); fail=$(grep -c ' FAIL$' "$RES/verdicts" || true)
skipped=$(grep ' SKIP$' "$RES/verdicts" | cut -d' ' -f1 | tr '\n' ' ' || true)
{
  echo "smc-rs <-> Linux AF_SMC interop — $(date -u +%FT%TZ); kernel $(cat "$W/kernel-version"), qemu $(qemu-system-x86_64 --version | head -1 | awk '{print $4}') TCG"
  echo "smc-rs device: $SMCI_RS_DEVICE; bytes $SMCI_BYTES each way (concurrent: $SMCI_CONC_BYTES); testlink $SMCI_TESTLINK s"
  cat "$RES/judged.txt"
  echo "$pass passed, $fail failed: $(grep ' FAIL$' "$RES/verdicts" | cut -d' ' -f1 | tr '\n' ' ')"
  [ -n "$skipped" ] && echo "skipped (the reason is in the case's lines above): $skipped"
  retried=$(grep ' FAIL-RETRIED$' "$RES/verdicts" | cut -d' ' -f1 | tr '\n' ' ' || true)
  [ -n "$retried" ] && echo "cases that failed and ran again (control cases, or a guest kernel panicked): $retried"
  panicked=$(grep ' KERNEL-PANIC$' "$RES/verdicts" | cut -d' ' -f1 | tr '\n' ' ' || true)
  [ -n "$panicked" ] && echo "control cases in which a guest kernel panicked in every attempt (kernel <-> kernel, no smc-rs; not counted): $panicked"
  echo "total wall time: $(( $(date +%s) - T0 )) s"
} > "$RES/summary.txt"
log "summary: $RES/summary.txt"
tail -2 "$RES/summary.txt" | sed 's/^/    /'
[ "$fail" = 0 ] && [ "$pass" -gt 0 ] && { log "PASS"; exit 0; }
die "$fail case(s) failed"

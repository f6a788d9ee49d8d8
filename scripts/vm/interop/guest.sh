#!/bin/bash
# guest.sh — runs in each VM of scripts/vm/run-kernel-interop.sh, from the payload disk
# (/opt/smcv), started by the image's /sbin/smcv-init. Sets the VM up (the kernel's smc
# and smc_diag modules, rxe0 on the data NIC, the kernel UEID, the BPF mounts smc-rs
# needs), then does what the host asks on the second serial port (/dev/ttyS1), one line
# at a time: "prep CASE", "run CASE", "post CASE" or "quit". Each answer is a line
# "SMCI-ACK <phase> <case> rc=N" on the console (ttyS0), after the phase's own SMCI lines.
set -u
P=/opt/smcv
# shellcheck source=/dev/null
. $P/params.sh
# shellcheck source=cases.sh
. $P/cases.sh

role=
for a in $(cat /proc/cmdline); do case $a in smci.role=*) role=${a#*=};; esac; done
case $role in kern) id=1;; rs) id=2;; *) echo "SMCI-FATAL role=$role unknown role"; exit 1;; esac
ME=10.99.0.$id PEER=10.99.0.$((3 - id))
say() { echo "SMCI-LOG role=$role up=$(cut -d' ' -f1 /proc/uptime) $*"; }
fatal() { echo "SMCI-FATAL role=$role $*"; exit 1; }

modprobe virtio_net
for m in rdma_rxe smc smc_diag; do modprobe $m || fatal "modprobe $m"; done
IF=
for _ in $(seq 100); do
  for d in /sys/class/net/*; do [ "$(cat "$d/address" 2>/dev/null)" = "$SMCI_MAC_PREFIX:0$id" ] && IF=${d##*/}; done
  [ -n "$IF" ] && break; sleep 0.2
done
[ -n "$IF" ] || fatal "data NIC not found: $(ls /sys/class/net)"
# the second NIC (redund cases): down and without an address until a case wants it
IF2=
for d in /sys/class/net/*; do [ "$(cat "$d/address" 2>/dev/null)" = "$SMCI_MAC_PREFIX2:0$id" ] && IF2=${d##*/}; done
ME2=10.99.0.1$id PEER2=10.99.0.1$((3 - id))
ip link set lo up
# rxe's GID 0 is the link-local RoCE v2 GID: usable without DAD once the link is up
sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0 "net.ipv6.conf.$IF.accept_dad=0"
ip addr add $ME/24 dev "$IF"; ip link set "$IF" up

rxe_up() { # rxe0 on the data NIC, ACTIVE
  rdma link add rxe0 type rxe netdev "$IF" || return 1
  for _ in $(seq 200); do grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
rxe_up || fatal "rxe0 did not come up"

# The redund cases' second device: rxe1 on the second NIC (its own virtual wire). Its
# address is on the data NIC's subnet: a kernel v2 link group's alternate device needs a
# RoCE v2 GID whose interface has an address in the subnet of the group's source address
# (net/smc/smc_ib.c smc_ib_determine_gid_rcu, reached from smc_llc.c smc_llc_srv_add_link
# through smc_pnet.c smc_pnet_find_alt_roce); on another subnet the kernel never adds the
# link. The subnet's route through it has a higher metric, so TCP (the CLC) stays on the
# first NIC, and rxe1 reaches the peer through its own interface (rxe routes with the
# netdev as the output interface); what leaves from its address goes through it too (a
# rule), so the peer's answers to it (ping, here) do not take the first NIC.
# arp_ignore=1: an ARP for one NIC's address is not answered on the other wire.
second_up() {
  [ -n "$IF2" ] || { echo "no second NIC"; return 1; }
  sysctl -qw net.ipv4.conf.all.arp_ignore=1 "net.ipv6.conf.$IF2.accept_dad=0"
  ip addr add "$ME2/24" dev "$IF2" noprefixroute || { echo "ip addr add $ME2"; return 1; }
  ip link set "$IF2" up
  ip route add 10.99.0.0/24 dev "$IF2" src "$ME2" metric 100 || { echo "ip route add"; return 1; }
  ip route add 10.99.0.0/24 dev "$IF2" src "$ME2" table 100 && ip rule add from "$ME2" lookup 100 \
    || { echo "ip rule add"; return 1; }
  rdma link add rxe1 type rxe netdev "$IF2" || { echo "rdma link add rxe1"; return 1; }
  local i
  for i in $(seq 200); do grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null && break; sleep 0.1; done
  grep -q ACTIVE /sys/class/infiniband/rxe1/ports/1/state || { echo "rxe1 not ACTIVE"; return 1; }
  for i in $(seq 30); do ping -c1 -W1 -I "$IF2" "$PEER2" >/dev/null 2>&1 && return 0; done
  echo "peer $PEER2 unreachable over $IF2"; return 1
}
second_down() {
  [ -n "$IF2" ] || return 0
  # (after a connection of the case hung, the kernel can block deleting the device: wait
  # 30 s, then go on and say so)
  if [ -e /sys/class/infiniband/rxe1 ]; then
    rdma link delete rxe1 &
    local i
    for i in $(seq 30); do [ -e /sys/class/infiniband/rxe1 ] || break; sleep 1; done
    [ -e /sys/class/infiniband/rxe1 ] && echo "SMCI-SECOND case=$NAME role=$role down=hung (rdma link delete rxe1 still running)"
  fi
  ip rule del from "$ME2" lookup 100; ip route flush table 100
  ip addr flush dev "$IF2"; ip link set "$IF2" down
  sysctl -qw net.ipv4.conf.all.arp_ignore=0
}
# TEST_LINK after this many idle seconds (net/smc/smc_sysctl.c; default 30): a dead
# peer's link group goes away sooner
sysctl -qw net.smc.smcr_testlink_time="$SMCI_TESTLINK" || fatal "net.smc.smcr_testlink_time"
$P/kpeer ueid add SMC-TEST-UEID >/dev/null || fatal "kernel UEID"
# smc-rs: the SYN-option rendezvous is a cgroup BPF program (cgroup2 + bpffs)
mkdir -p /sys/fs/cgroup /sys/fs/bpf
mount -t cgroup2 none /sys/fs/cgroup; mount -t bpf bpf /sys/fs/bpf
mkdir -p /run/smci/rs-conf /run/smci/rundir
echo SMC-TEST-UEID > /run/smci/rs-conf/ueid.conf
printf 'rundir /run/smci/rundir\ndevice shm0 netdev %s\n' "$IF" > /run/smci/shm.conf
for i in $(seq 60); do ping -c1 -W1 $PEER >/dev/null 2>&1 && break; done
ping -c1 -W1 $PEER >/dev/null 2>&1 || fatal "peer $PEER unreachable"

# the environment of the smc-rs process: its device configuration (SMCI_RS_DEVICE) and UEID
case $SMCI_RS_DEVICE in
  # a shared-memory device bound to the data NIC besides the libibverbs devices (it cannot
  # reach another host: the library must choose rxe0 for the other VM)
  shm) RS_ENV=(env SMC_RDMA_SHM_CONFIG=/run/smci/shm.conf SMC_RS_CONFIG_DIR=/run/smci/rs-conf);;
  # whatever the library finds itself (verbs: the libibverbs devices)
  *) RS_ENV=(env -u SMC_RDMA_SHM_CONFIG SMC_RS_CONFIG_DIR=/run/smci/rs-conf);;
esac
# shellcheck disable=SC2206
RS_ENV+=($SMCI_RS_ENV)

lgr_ids() { # the kernel's SMC-R link group ids, one per line
  $P/kpeer lgr | sed -n 's/.* ids=\([^ ]*\).*/\1/p' | tr ',' '\n' | cut -d: -f1 | grep -v '^-$' || true
}

# the case's programs: kernel (kpeer) or smc-rs (smc-iop-peer), client or server
prog_args() {
  local impl=$1 side=$2
  if [ "$impl" = rs ]; then PROG=("${RS_ENV[@]}" $P/smc-iop-peer); else PROG=($P/kpeer); fi
  # (link redundancy: smc-rs adds the second link's QP on its second device, rxe1)
  # (SMC_LOG: its link down / connection moved events, stamped by rs_events, time the cut)
  if [ "$impl" = rs ] && [ "$SCEN" = redund ]; then PROG=("${RS_ENV[@]}" SMC_REDUNDANCY=1 SMC_LOG=info $P/smc-iop-peer); fi
  if [ "$side" = server ]; then
    ARGS=(server --port "$PORT" --conns "$CONNS")
  else
    ARGS=(client --connect "$PEER:$PORT" --rounds "$ROUNDS" --bytes "$BYTES" --close "$CLOSE" --retry 60)
    if [ "$URGENT" = 1 ]; then ARGS+=(--urgent); fi
  fi
  ARGS+=(--case "$NAME" --timeout "$TIMEOUT")
  if [ "$impl" = rs ] && [ "$SCEN" = idle ]; then ARGS+=(--linger "$SMCI_IDLE_WAIT"); fi
}

wait_up() { # wait_up FILE PID: until the program reports a connection up, or exits
  for _ in $(seq 1200); do
    grep -q ' ev=up ' "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# smc-rs's SMC_LOG lines about links and moves as "SMCI-RSEV case=C up=UPTIME ...", the rest
# as they are (a builtin read of /proc/uptime per line: no fork, the stamp stays close)
rs_events() {
  local l up _
  while IFS= read -r l; do
    case $l in
      "smc-rs "*"link "*|"smc-rs "*"moved"*)
        read -r up _ < /proc/uptime; printf 'SMCI-RSEV case=%s up=%s %s\n' "$NAME" "$up" "${l#smc-rs }";;
      *) printf '%s\n' "$l";;
    esac
  done
}

do_prep() {
  if [ "$FAULT" = linkcut ]; then
    local why
    if why=$(second_up 2>&1); then
      echo "SMCI-SECOND case=$NAME role=$role up=yes if=$IF2 addr=$ME2 rxe1=$(tr -d ' ' < /sys/class/infiniband/rxe1/ports/1/state)" \
        "gids=$(cat /sys/class/infiniband/rxe1/ports/1/gids/0 /sys/class/infiniband/rxe1/ports/1/gids/1 | tr '\n' ' ')"
    else
      echo "SMCI-SECOND case=$NAME role=$role up=no reason=${why//[$'\n' ]/_}"
    fi
  fi
  [ $role = kern ] || return 0
  lgr_ids > /tmp/lgr-start
  $P/kpeer lgr --case "$NAME" | sed 's/SMCI-KLGR /SMCI-KLGR when=prep /'
  case $KUEID in
    none) $P/kpeer ueid flush --case "$NAME";;
    other) $P/kpeer ueid flush --case "$NAME"; $P/kpeer ueid add SMC-OTHER-UEID --case "$NAME";;
  esac
  $P/kpeer ueid list --case "$NAME"
}

do_run() {
  local impl=kernel side=server out=/tmp/out-$NAME pid rc
  [ $role = rs ] && impl=$VM2_IMPL
  [ "$CLIENT_VM" = $role ] && side=client
  prog_args $impl $side
  say "case $NAME: $impl $side: ${PROG[*]} ${ARGS[*]}"
  if [ "$FAULT" = kill ] && [ $role = rs ]; then
    "${PROG[@]}" "${ARGS[@]}" > >(tee "$out") 2>&1 &
    pid=$!
    if wait_up "$out" $pid; then
      sleep "$SMCI_FAULT_DELAY"
      if kill -0 $pid 2>/dev/null; then
        kill -KILL $pid
        echo "SMCI-FAULT case=$NAME what=sigkill pid=$pid up=$(cut -d' ' -f1 /proc/uptime)"
      else
        echo "SMCI-FAULT case=$NAME what=sigkill done=no reason=exited-before"
      fi
    else
      echo "SMCI-FAULT case=$NAME what=sigkill done=no reason=never-up"
    fi
    wait $pid; rc=$?
  elif [ "$FAULT" = rxedel ] && [ $role = kern ]; then
    "${PROG[@]}" "${ARGS[@]}" > >(tee "$out") 2>&1 &
    pid=$!
    if wait_up "$out" $pid && ! grep -q ' ev=up .*mode=SMCR' "$out"; then
      # over TCP rxe0 does not matter: end the case instead of waiting for the watchdogs
      kill -KILL $pid
      echo "SMCI-FAULT case=$NAME what=rxedel done=no reason=not-smc-r"
    elif grep -q ' ev=up ' "$out"; then
      sleep "$SMCI_FAULT_DELAY"
      rdma link delete rxe0
      echo "SMCI-FAULT case=$NAME what=rxedel rc=$? up=$(cut -d' ' -f1 /proc/uptime)"
    else
      echo "SMCI-FAULT case=$NAME what=rxedel done=no reason=never-up"
    fi
    wait $pid; rc=$?
    if [ ! -e /sys/class/infiniband/rxe0 ]; then
      rxe_up; echo "SMCI-FAULT case=$NAME what=rxe-restored state=$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null | tr -d ' ')"
    fi
  elif [ "$FAULT" = linkcut ] && [ $role = rs ]; then
    # the second round's connections up: their data moves over both links; then the
    # second NIC goes down under them
    timeout -k 5 $((TIMEOUT + 30)) "${PROG[@]}" "${ARGS[@]}" > >(rs_events | tee "$out") 2>&1 &
    pid=$!
    for _ in $(seq 1200); do
      grep -q ' id=2 ev=up ' "$out" 2>/dev/null && break
      kill -0 $pid 2>/dev/null || break
      sleep 0.1
    done
    if grep -q ' id=2 ev=up ' "$out"; then
      sleep "$SMCI_FAULT_DELAY"
      # a mark in the capture of the first NIC right before the cut (the second NIC is not
      # captured): a SYN to a closed port of the kern VM (answered RST), which the host's
      # judge takes as the time of the cut (an upper bound of cut-to-traffic)
      local mark_up down_up rc2 _
      read -r mark_up _ < /proc/uptime
      timeout 2 bash -c "exec 3<>/dev/tcp/$PEER/$SMCI_CUT_MARK_PORT" 2>/dev/null
      read -r down_up _ < /proc/uptime
      ip link set "$IF2" down; rc2=$?
      echo "SMCI-FAULT case=$NAME what=linkcut dev=$IF2 rc=$rc2 up=$(cut -d' ' -f1 /proc/uptime) mark_up=$mark_up down_up=$down_up rxe1=$(tr -d ' ' < /sys/class/infiniband/rxe1/ports/1/state 2>/dev/null)"
    else
      echo "SMCI-FAULT case=$NAME what=linkcut done=no reason=round-2-never-up"
    fi
    wait $pid; rc=$?
  elif [ "$FAULT" = linkcut ] && [ $role = kern ]; then
    # the kernel's links while the case runs: a sample whenever they change
    timeout -k 5 $((TIMEOUT + 30)) "${PROG[@]}" "${ARGS[@]}" 2>&1 &
    pid=$!
    local last= cur
    while kill -0 $pid 2>/dev/null; do
      cur=$($P/kpeer lgr --case "$NAME" 2>&1)
      if [ "${cur#* lgrs=}" != "${last#* lgrs=}" ]; then
        sed "s/SMCI-KLGR /SMCI-KLGR when=sample up=$(cut -d' ' -f1 /proc/uptime) /" <<< "$cur"
        last=$cur
      fi
      sleep 1
    done
    wait $pid; rc=$?
  else
    timeout -k 5 $((TIMEOUT + 30)) "${PROG[@]}" "${ARGS[@]}" 2>&1; rc=$?
  fi
  if [ "$SCEN" = idle ] && [ $role = kern ]; then
    # how long the case's link group outlives its last connection (the kernel frees an
    # idle one after SMC_LGR_FREE_DELAY_SERV/CLNT, 600/610 s; earlier means it died)
    local t0=$SECONDS left=
    while :; do
      left=$(lgr_ids | grep -vxF -f /tmp/lgr-start | tr '\n' ',' || true)
      [ -z "$left" ] && break
      [ $((SECONDS - t0)) -ge $((SMCI_IDLE_WAIT + 60)) ] && break
      sleep 2
    done
    echo "SMCI-LGRIDLE case=$NAME gone=$([ -z "$left" ] && echo yes || echo no) after_s=$((SECONDS - t0)) left=${left:--}"
  fi
  return $rc
}

do_post() {
  if [ $role = kern ] || [ "$VM2_IMPL" = kernel ]; then
    $P/kpeer diag --wait-empty 20 --case "$NAME"
  fi
  if [ "$FAULT" = linkcut ]; then
    # the second NIC back: does the group add its second link again? (reported, the
    # case does not depend on it) Then the second device goes.
    [ $role = rs ] && ip link set "$IF2" up
    # (the kernels that keep the group: the kern VM's, and the rs VM's in ck; an smc-rs
    # process has ended with its group)
    if [ $role = kern ] || [ "$VM2_IMPL" = kernel ]; then
      local t0=$SECONDS
      while [ $((SECONDS - t0)) -lt 10 ]; do
        $P/kpeer lgr --case "$NAME" | grep -q 'lconns=.*rxe1' && break
        sleep 1
      done
      $P/kpeer lgr --case "$NAME" | sed "s/SMCI-KLGR /SMCI-KLGR when=nic-back after_s=$((SECONDS - t0)) /"
    fi
    second_down
  fi
  [ $role = kern ] || return 0
  if [ "$FAULT" = kill ] || [ "$FAULT" = rxedel ]; then
    # the link groups this case created must go (TEST_LINK, QP errors or the device's
    # removal end them)
    local t0=$SECONDS left=
    while :; do
      left=$(lgr_ids | grep -vxF -f /tmp/lgr-start | tr '\n' ',' || true)
      [ -z "$left" ] && break
      [ $((SECONDS - t0)) -ge "$SMCI_LGR_WAIT" ] && break
      sleep 1
    done
    echo "SMCI-LGRGONE case=$NAME gone=$([ -z "$left" ] && echo yes || echo no) after_s=$((SECONDS - t0)) left=${left:--}"
  fi
  $P/kpeer lgr --case "$NAME" | sed 's/SMCI-KLGR /SMCI-KLGR when=post /'
  if [ "$KUEID" != keep ]; then
    $P/kpeer ueid flush --case "$NAME" >/dev/null; $P/kpeer ueid add SMC-TEST-UEID --case "$NAME" >/dev/null
  fi
  $P/kpeer stats --case "$NAME"
}

DMESG_SEEN=0
dmesg_new() { # the kernel's SMC and rxe messages since the last call
  local all
  all=$(dmesg | grep -iE 'smc|rxe|rdma' || true)
  [ -n "$all" ] && tail -n +$((DMESG_SEEN + 1)) <<< "$all" | sed "s/^/SMCI-DMESG case=$NAME role=$role /"
  DMESG_SEEN=$(grep -c . <<< "$all")
}

# the host's commands arrive on the second serial port
stty -F /dev/ttyS1 raw -echo || fatal "no /dev/ttyS1"
exec 3< /dev/ttyS1
NAME=boot dmesg_new
echo "SMCI-LOG role=$role net.smc sysctls: $(cd /proc/sys/net/smc && grep -H . * | tr '\n' ' ')"
echo "SMCI-READY role=$role kernel=$(uname -r) if=$IF addr=$ME rxe0=$(tr -d ' ' < /sys/class/infiniband/rxe0/ports/1/state)" \
  "gids=$(cat /sys/class/infiniband/rxe0/ports/1/gids/0 /sys/class/infiniband/rxe0/ports/1/gids/1 | tr '\n' ' ')" \
  "testlink=$(sysctl -n net.smc.smcr_testlink_time) rsdev=$SMCI_RS_DEVICE"
while read -r -u 3 phase NAME _; do
  phase=${phase//$'\r'/}; NAME=${NAME//$'\r'/}
  [ "$phase" = quit ] && break
  if ! case_def "$NAME"; then echo "SMCI-ACK $phase $NAME rc=unknown-case"; continue; fi
  case $phase in
    prep) do_prep; rc=$?;;
    run) do_run; rc=$?;;
    post) do_post; rc=$?; dmesg_new;;
    *) rc=unknown-phase;;
  esac
  echo "SMCI-ACK $phase $NAME rc=$rc"
done
say "quit"

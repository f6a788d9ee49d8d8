# cases.sh — the cases of scripts/vm/run-kernel-interop.sh. Sourced by the host
# script (which judges them) and by guest.sh in both VMs (which runs them), after
# params.sh (the run's sizes, written by the host).
#
# A case is SCENARIO.DIR. VM "kern" (10.99.0.1) always runs the kernel's AF_SMC
# (kpeer); VM "rs" (10.99.0.2) runs smc-rs (smc-iop-peer), or for the control
# directions the kernel too:
#   kr  kernel client (kern) -> smc-rs server (rs)
#   rk  smc-rs client (rs)   -> kernel server (kern)
#   kc  kernel client (kern) -> kernel server on the rs VM   (control: kernel <-> kernel)
#   ck  kernel client on the rs VM -> kernel server (kern)   (control)
# Scenarios (what each checks: see the judge in run-kernel-interop.sh and README.md):
#   smcr       one process each side: a first connection of SMCI_BYTES each way, two
#              more one after the other (SMCI_REUSE_BYTES; link group reuse), then 20 at
#              once (SMCI_CONC_BYTES each); closes alternate between client and server
#   wire       two connections of 128 KiB (first contact, then reuse): the capture
#              whose flow the host checks message by message (and the one to commit)
#   urg        two connections (first contact, then reuse): right after the header each
#              end sends one urgent byte (MSG_OOB; the client first, the server once it
#              has the client's), then the streams of SMCI_URG_BYTES each way; the urgent
#              bytes must arrive out of band and stay out of the streams
#   noueid     the kern VM's kernel has no UEID: its Decline, TCP both ways, data intact
#   otherueid  the kern VM's kernel has another UEID (SMC-OTHER-UEID)
#   kill       the rs VM's peer process is SIGKILLed mid-transfer
#   rxedel     the kern VM deletes rxe0 (`rdma link delete`) mid-transfer
#   redund     link redundancy: both VMs put rxe1 on their second NIC (an address on the
#              data subnet: a v2 group's alternate device must have one, smc_ib.c
#              smc_ib_determine_gid_rcu); the kernel server adds a second link over it
#              (ADD_LINK), smc-rs with SMC_REDUNDANCY=1; a first connection of
#              SMCI_REDUND_FIRST bytes, then 4 at once of SMCI_REDUND_BYTES each way; the
#              rs VM takes its second NIC down mid-stream: the connections on that link
#              move to the other, nothing lost
#   idle       one connection, then the rs side stays alive past the link groups'
#              idle time (10 min, not a sysctl in 6.12): both ends free the group
#              (opt-in: ~11 min)

# every case, in the order they run when selected
SMCI_KNOWN="wire.kc wire.ck smcr.kc smcr.ck wire.kr wire.rk smcr.kr smcr.rk urg.kc urg.ck urg.kr urg.rk \
noueid.kc noueid.ck noueid.kr noueid.rk otherueid.kc otherueid.ck otherueid.kr otherueid.rk \
kill.kr kill.rk rxedel.kc rxedel.ck rxedel.kr rxedel.rk redund.ck redund.rk idle.kc idle.kr idle.rk"
# the default selection: everything but idle.* and redund.* (opt-in: redund.rk fails,
# see README.md, and the kern VM's first ADD_LINK over rxe1 after boot fails)
SMCI_DEFAULT="${SMCI_KNOWN% redund.ck redund.rk idle.kc idle.kr idle.rk}"

# The kernel's Decline codes (net/smc/smc_clc.h, SMC_CLC_DECL_*):
SMCI_DECL_PEERDECL=0x05000000   # SMC_CLC_DECL_PEERDECL: "peer declined during handshake"
SMCI_DECL_NOSMCDEV=0x03030000   # SMC_CLC_DECL_NOSMCDEV: no SMC device found (R or D)

# case_def NAME: sets the case's fields; returns 1 for an unknown name.
#   SCEN DIR PORT               scenario, direction, TCP port (unique per case)
#   VM2_IMPL                    rs | kernel (what the rs VM runs)
#   CLIENT_VM SERVER_VM         kern | rs
#   ROUNDS BYTES CLOSE CONNS    the client's rounds (COUNT[xBYTES],...), default bytes
#                               each way, who closes first (client|server|alt), total
#   URGENT                      1: the client asks for the urgent-byte exchange
#   KUEID                       keep | none | other: the kern VM's kernel UEID table
#   FAULT                       none | kill | rxedel | linkcut (the rs VM's second NIC down)
#   EXPECT                      smcr | decline | fault
#   CAPTURE                     1: the host captures the wire during the case
#   TIMEOUT                     seconds for the peers' watchdogs
case_def() {
  local n=$1 i=0 c
  SCEN=${n%%.*}; DIR=${n#*.}
  PORT=
  for c in $SMCI_KNOWN; do i=$((i + 1)); [ "$c" = "$n" ] && PORT=$((6100 + i)); done
  [ -n "$PORT" ] || return 1
  case $DIR in
    kr) VM2_IMPL=rs;     CLIENT_VM=kern; SERVER_VM=rs;;
    rk) VM2_IMPL=rs;     CLIENT_VM=rs;   SERVER_VM=kern;;
    kc) VM2_IMPL=kernel; CLIENT_VM=kern; SERVER_VM=rs;;
    ck) VM2_IMPL=kernel; CLIENT_VM=rs;   SERVER_VM=kern;;
    *) return 1;;
  esac
  ROUNDS=1; BYTES=$SMCI_BYTES; CLOSE=client; URGENT=0; KUEID=keep; FAULT=none; EXPECT=smcr; CAPTURE=1
  TIMEOUT=$SMCI_CASE_TIMEOUT
  case $SCEN in
    smcr) ROUNDS="1,1x$SMCI_REUSE_BYTES,1x$SMCI_REUSE_BYTES,20x$SMCI_CONC_BYTES"; CLOSE=alt;;
    wire) ROUNDS=1,1; BYTES=128K; CLOSE=alt;;
    urg) ROUNDS=1,1; BYTES=${SMCI_URG_BYTES:-4M}; CLOSE=alt; URGENT=1;;
    noueid) KUEID=none; EXPECT=decline; BYTES=$SMCI_DECLINE_BYTES;;
    otherueid) KUEID=other; EXPECT=decline; BYTES=$SMCI_DECLINE_BYTES;;
    kill) FAULT=kill; EXPECT=fault; BYTES=$SMCI_FAULT_BYTES; CAPTURE=0; TIMEOUT=$SMCI_FAULT_TIMEOUT;;
    rxedel) FAULT=rxedel; EXPECT=fault; BYTES=$SMCI_FAULT_BYTES; CAPTURE=0; TIMEOUT=$SMCI_FAULT_TIMEOUT;;
    # (after the rxedel cases in a full run: they end every link group, so rxe1 coming
    # up adds no link to a group of an earlier case)
    redund) ROUNDS="1x$SMCI_REDUND_FIRST,4"; BYTES=$SMCI_REDUND_BYTES; CLOSE=alt; FAULT=linkcut;;
    idle) BYTES=1M; TIMEOUT=$((SMCI_IDLE_WAIT + 300));;
    *) return 1;;
  esac
  [ "$FAULT" = kill ] && [ "$VM2_IMPL" != rs ] && return 1 # SIGKILL of smc-rs only
  CONNS=0
  local r
  for r in ${ROUNDS//,/ }; do CONNS=$((CONNS + ${r%%x*})); done
  return 0
}

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
QEMU_UTILS=${QEMU_UTILS:-1:7.2+dfsg-7+deb12u18+b3}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
T0=$(date +%s)
PREPARE_ONLY=0
[ "${1:-}" = --prepare ] && PREPARE_ONLY=1

log() { echo "[run-verbs-suite +$(( $(date +%s) - T0 ))s] $*"; }
die() { log "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (apt, debootstrap, chroot)"
R=$W/rootfs

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

# ------------------------------------------------------------------ 1. packages
step_packages() {
  if command -v qemu-system-x86_64 >/dev/null && command -v debootstrap >/dev/null \
     && command -v mkfs.ext4 >/dev/null; then
    log "packages: qemu $(qemu-system-x86_64 --version | head -1 | awk '{print $4}'), debootstrap present"
    return
  fi
  log "packages: installing qemu-system-x86, qemu-utils=$QEMU_UTILS, debootstrap"
  timeout 900 apt-get update -q >/dev/null
  # qemu-utils 10 from backports (preinstalled here) conflicts with bookworm's qemu 7.2.
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends \
    --allow-downgrades qemu-system-x86 "qemu-utils=$QEMU_UTILS" debootstrap e2fsprogs >/dev/null \
    || die "apt-get install failed"
  log "packages: done"
}

# ------------------------------------------------------------------ 2. rootfs
apt_mirror() { # first enabled deb URI of the host whose suites include "bookworm"
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk 'function flush() { if (deb && !off && uri != "" && (" " s " ") ~ / bookworm /) { print uri; exit }
                            deb = 0; off = 0; uri = ""; s = "" }
         /^[ \t]*#/ { next } /^[ \t]*$/ { flush(); next }
         tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
         tolower($1) == "uris:" { uri = $2 }
         tolower($1) == "suites:" { for (i = 2; i <= NF; i++) s = s " " $i }
         tolower($1) == "enabled:" { if (tolower($2) == "no") off = 1 }
         END { flush() }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '
    $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                  if ($(i + 1) == "bookworm") { print $i; exit } }' || true
}

STUB_VERSION=1
write_stub() { # PID 1 of the guest: mounts the payload disk and runs its guest.sh
  cat > "$1" <<'STUB'
#!/bin/bash
# smcv-init (stub v1): mount the payload disk (/dev/vdb) and run its guest.sh.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /opt/smcv; mount -t devpts devpts /dev/pts
mount -t tmpfs tmp /tmp; mount -t tmpfs run /run; mount -o remount,rw / 2>/dev/null
echo "SMCV: userspace up at $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r)"
if mount -o ro /dev/vdb /opt/smcv; then bash /opt/smcv/guest.sh; else echo "SMCV-RESULT: FAIL no payload disk"; fi
echo "SMCV: powering off at $(cut -d' ' -f1 /proc/uptime) s"
sync; echo o > /proc/sysrq-trigger; sleep 10
STUB
  chmod 0755 "$1"
}

step_rootfs() {
  mkdir -p "$W"
  if [ "${SMCV_REBUILD:-0}" = 1 ]; then rm -rf "$R" "$W/rootfs.img"; fi
  if [ ! -e "$R/.smcv-rootfs-done" ]; then
    local mirror=${MIRROR:-$(apt_mirror | head -1)}
    mirror=${mirror%/}
    [ -n "$mirror" ] || die "no bookworm apt source on this host: set MIRROR=<Debian archive URI>"
    log "rootfs: debootstrap bookworm from the host's Debian mirror (~3 min)"
    rm -rf "$R"
    timeout 1800 debootstrap --variant=minbase \
      --include=initramfs-tools,kmod,udev,iproute2,rdma-core,ibverbs-providers,libibverbs1,ibverbs-utils,procps,iputils-ping \
      bookworm "$R" "$mirror" > "$W/debootstrap.log" 2>&1 || die "debootstrap failed, see $W/debootstrap.log"
    log "rootfs: bookworm-backports kernel (6.12)"
    echo "deb $mirror bookworm-backports main" > "$R/etc/apt/sources.list.d/backports.list"
    mount --bind /dev "$R/dev"; mount -t proc proc "$R/proc"
    local rc=0
    timeout 1200 chroot "$R" bash -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -t bookworm-backports linux-image-amd64 && apt-get clean' \
      > "$W/kernel-install.log" 2>&1 || rc=$?
    umount "$R/proc" "$R/dev"
    [ $rc = 0 ] || die "kernel install failed ($rc), see $W/kernel-install.log"
    ls "$R/lib/modules" | grep -q '^6\.12' || die "no 6.12 kernel in the rootfs"
    touch "$R/.smcv-rootfs-done"
  fi
  local kv
  kv=$(ls "$R/lib/modules" | sort -V | grep '^6\.12' | tail -1)
  [ -n "$kv" ] || die "no 6.12 kernel in $R (SMCV_REBUILD=1 to rebuild)"
  if [ ! -e "$W/rootfs.img" ] || [ "$(cat "$W/stub-version" 2>/dev/null)" != "$STUB_VERSION" ]; then
    log "rootfs: writing $W/rootfs.img (kernel $kv)"
    write_stub "$R/sbin/smcv-init"
    echo smcv > "$R/etc/hostname"
    cp "$R/boot/vmlinuz-$kv" "$W/vmlinuz"; cp "$R/boot/initrd.img-$kv" "$W/initrd.img"
    rm -f "$W/rootfs.img.tmp"; truncate -s 2G "$W/rootfs.img.tmp"
    mkfs.ext4 -q -F -L smcvroot -d "$R" "$W/rootfs.img.tmp" || die "mkfs.ext4 rootfs"
    mv "$W/rootfs.img.tmp" "$W/rootfs.img"
    echo "$STUB_VERSION" > "$W/stub-version"; echo "$kv" > "$W/kernel-version"
  fi
  log "rootfs: $W/rootfs.img, kernel $(cat "$W/kernel-version")"
}

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
  timeout --kill-after=10 "$VM_TIMEOUT" qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max \
    -smp 1 -m "$MEM" -nographic -no-reboot -snapshot -pidfile "$W/results/$role.pid" -kernel "$W/vmlinuz" -initrd "$W/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 init=/sbin/smcv-init smcv.role=$role smcv.id=$id smcv.cases=${SMCV_CASES:-} smcv.rttn=${SMCV_RTT_N:-500} smcv.wmib=${SMCV_WRITE_MIB:-32} panic=-1 quiet loglevel=4" \
    -drive file="$W/rootfs.img",format=raw,if=virtio,file.locking=off \
    -drive file="$W/payload.img",format=raw,if=virtio,file.locking=off \
    -netdev socket,id=d0,"$3" -device virtio-net-pci,netdev=d0,mac=52:54:00:5c:01:0$id \
    -netdev socket,id=c0,"$4" -device virtio-net-pci,netdev=c0,mac=52:54:00:5c:02:0$id \
    < /dev/null 2>&1 | sed -u 's/\r$//' > "$W/results/$role.log"
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

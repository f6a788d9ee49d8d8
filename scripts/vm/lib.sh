# lib.sh — the parts of the VM harnesses that both use (sourced by run-verbs-suite.sh
# and run-kernel-interop.sh): packages, the guest images, and one qemu VM.
#
# The sourcing script sets W (image directory), VM_TIMEOUT (s), MEM (MiB) and
# defines log and die. Images: $W/rootfs.img (Debian 12, rdma-core, the 6.12
# bookworm-backports kernel, PID 1 = /sbin/smcv-init, which mounts the payload disk
# /dev/vdb on /opt/smcv and runs its guest.sh), $W/vmlinuz, $W/initrd.img. They are
# built once (about 3 min) and reused; SMCV_REBUILD=1 rebuilds them.

R=$W/rootfs
QEMU_UTILS=${QEMU_UTILS:-1:7.2+dfsg-7+deb12u18+b3}

# ------------------------------------------------------------------ packages
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

# ------------------------------------------------------------------ rootfs
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

# ------------------------------------------------------------------ one VM
# smcv_qemu LOG PIDFILE PAYLOAD_IMG CMDLINE [qemu args...]: boots one VM (TCG, 1 vCPU,
# $MEM MiB, the rootfs as a throw-away snapshot, PAYLOAD_IMG as /dev/vdb), serial
# console ttyS0 into LOG (CRs stripped); returns when the VM powers off or after
# $VM_TIMEOUT s. CMDLINE is added to the kernel command line (the guest script reads it).
smcv_qemu() {
  local log=$1 pidfile=$2 payload=$3 append=$4
  shift 4
  timeout --kill-after=10 "$VM_TIMEOUT" qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max \
    -smp 1 -m "$MEM" -display none -serial stdio -monitor none -no-reboot -snapshot -pidfile "$pidfile" \
    -kernel "$W/vmlinuz" -initrd "$W/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 init=/sbin/smcv-init $append panic=-1 quiet loglevel=4" \
    -drive file="$W/rootfs.img",format=raw,if=virtio,file.locking=off \
    -drive file="$payload",format=raw,if=virtio,file.locking=off \
    "$@" < /dev/null 2>&1 | sed -u 's/\r$//' > "$log"
}

#!/bin/sh
# Installs smc_run and libsmc_preload.so where a distribution puts them:
#   PREFIX/bin/smc_run
#   PREFIX/lib/<multiarch>/libsmc_preload.so   (e.g. /usr/lib/x86_64-linux-gnu)
# smc_run finds the library there (../lib/<multiarch>/ from its own directory).
#
# usage: install.sh [--prefix PREFIX] [--destdir DESTDIR] [--from DIR]
#   --prefix   default /usr/local
#   --destdir  staging root for packagers (files go to DESTDIR/PREFIX/...)
#   --from     a directory holding an existing build (smc_run, and the
#              library in it or in deps/); default: `cargo build --release
#              -p smc-preload` in this workspace, then target/release
set -eu
prefix=/usr/local
destdir=
from=
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --destdir) destdir=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option: $1" >&2; exit 2 ;;
    esac
done
if [ -z "$from" ]; then
    here=$(cd "$(dirname "$0")" && pwd)
    (cd "$here" && cargo build --release --locked -p smc-preload)
    from=$(cd "$here" && cargo metadata --format-version 1 --no-deps |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release
fi
lib=$from/libsmc_preload.so
[ -f "$lib" ] || lib=$from/deps/libsmc_preload.so
[ -f "$from/smc_run" ] || { echo "install.sh: no smc_run in $from" >&2; exit 1; }
[ -f "$lib" ] || { echo "install.sh: no libsmc_preload.so in $from" >&2; exit 1; }
case "$(uname -m)" in
    x86_64) arch=x86_64 ;; aarch64) arch=aarch64 ;; i?86) arch=i386 ;;
    ppc64le) arch=powerpc64le ;; s390x) arch=s390x ;; *) arch=$(uname -m) ;;
esac
libdir=$destdir$prefix/lib/$arch-linux-gnu
bindir=$destdir$prefix/bin
install -d "$bindir" "$libdir"
install -m 0755 "$from/smc_run" "$bindir/smc_run"
install -m 0644 "$lib" "$libdir/libsmc_preload.so"
echo "installed $bindir/smc_run and $libdir/libsmc_preload.so"

# Shared by bench.sh and bench_counts.sh (sourced).
# need PROGRAM...: exits with a message naming Debian's packages when one of
# the programs a benchmark runs is missing (a script that ran on without one
# would print an empty table, its rates read from a failed run).
need() {
  local miss=() p
  for p in "$@"; do
    command -v "$p" >/dev/null 2>&1 || [ -x "/usr/sbin/$p" ] || miss+=("$p")
  done
  if ((${#miss[@]})); then
    echo "$(basename "$0"): not installed: ${miss[*]}" >&2
    echo "  (Debian: apt-get install redis-server redis-tools nginx wrk iperf3 sockperf linux-perf python3)" >&2
    exit 2
  fi
}
# nginx_conf DIR PORT: writes DIR/nginx.conf for nginx in the foreground,
# master and 2 workers, serving DIR/www on 127.0.0.1:PORT, its state in DIR.
nginx_conf() {
  local W=$1 p=$2
  mkdir -p "$W/www" "$W/tmp"
  cat >"$W/nginx.conf" <<EOF
daemon off; master_process on; worker_processes 2; user root;
pid $W/nginx.pid; error_log $W/error.log;
events { worker_connections 1024; }
http { access_log off; sendfile on;
  client_body_temp_path $W/tmp; proxy_temp_path $W/tmp; fastcgi_temp_path $W/tmp;
  uwsgi_temp_path $W/tmp; scgi_temp_path $W/tmp;
  server { listen 127.0.0.1:$p; root $W/www; } }
EOF
}

# Shared by bench.sh and bench_counts.sh (sourced).
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

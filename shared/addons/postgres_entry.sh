#!/bin/sh
# The entry of a managed PostgreSQL add-on instance (docs/addons.md). Runs as the environment's own user
# (the process runtime's sandbox): PostgreSQL refuses root. POSIX sh only (dash): every value it is given
# comes from the environment, never from an argument, so no password ever shows in a process listing.
#
# In:  ZATTERA_VOLUME_DATA      the data volume (PGDATA is its pgdata/; the socket directory its run/)
#      ZATTERA_VOLUME_BACKUPS   the backups volume: the pgBackRest repository (repo1, posix) and its config
#      HOST, PORT_POSTGRES      where to listen (the agent's bind address and port)
#      POSTGRES_PASSWORD        the superuser's password (sealed secret)
#      APP_PASSWORD             the app role's password (sealed secret)
#      ZATTERA_PG_BIN           the server's binaries (default /usr/lib/postgresql/15/bin)
#      ZATTERA_PG_STANZA        the pgBackRest stanza (the database's name)
#      ZATTERA_PG_ARCHIVE_TIMEOUT  seconds (default 60): the RPO bound
#      ZATTERA_PG_BACKUP_INTERVAL  seconds between full base backups (default 86400)
#      ZATTERA_PG_APP_USER, ZATTERA_PG_APP_DB  the app role and its database (default app, app)
#      ZATTERA_PG_REPO2_*       optional: an S3 repository (repo2: type, bucket, endpoint, region, path);
#                               its keys in PGBACKREST_REPO2_S3_KEY / _KEY_SECRET (secrets, read by pgBackRest)
# Fork (point-in-time restore into this new database, the origin untouched):
#      ZATTERA_PG_RESTORE_REPO  the origin's repository directory (read only); default, when the agent copied
#                               it (ZATTERA_ADDON_RESTORE_VOLUME set): $ZATTERA_VOLUME_BACKUPS/origin-repo
#      ZATTERA_ADDON_RESTORE_SNAPSHOT  set on a fork from off-site: this backups volume holds the origin's
#                               (restored from a snapshot): its repo/ is the origin's repository
#      ZATTERA_PG_RESTORE_STANZA  the origin's stanza
#      ZATTERA_PG_RESTORE_TARGET  "latest" or a timestamp PostgreSQL reads ("2026-12-02 17:00:00+00")
set -eu
umask 077

BIN="${ZATTERA_PG_BIN:-/usr/lib/postgresql/15/bin}"
DATA="${ZATTERA_VOLUME_DATA:?no data volume}"
REPO="${ZATTERA_VOLUME_BACKUPS:?no backups volume}"
PGDATA="$DATA/pgdata"
SOCK="$DATA/run"
PORT="${PORT_POSTGRES:-${PORT:-5432}}"
LISTEN="${HOST:-127.0.0.1}"
STANZA="${ZATTERA_PG_STANZA:-db}"
APP_USER="${ZATTERA_PG_APP_USER:-app}"
APP_DB="${ZATTERA_PG_APP_DB:-app}"
CONF="$REPO/pgbackrest.conf"
BACKUP_INTERVAL="${ZATTERA_PG_BACKUP_INTERVAL:-86400}"
export PGDATA

say() { printf '%s\n' "zattera-postgres: $*" >&2; }

if [ "$(id -u)" = 0 ]; then
  say "PostgreSQL cannot run as root: run the agent with its sandbox (ZATTERA_AGENT_SANDBOX=on)"
  exit 78
fi
if [ ! -x "$BIN/postgres" ] || ! command -v pgbackrest >/dev/null 2>&1; then
  say "no PostgreSQL server ($BIN/postgres) or pgbackrest here: the node needs its packages (make install-system); under the docker runtime the add-ons' base image holds the node's"
  exit 78
fi
if [ -n "${ZATTERA_ADDON_RESTORE_SNAPSHOT:-}" ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  # A fork from off-site: this backups volume was restored from a snapshot of the origin's. Its repository
  # becomes origin-repo (restored from below, then removed); the origin's config, log and locks go.
  if [ -d "$REPO/repo" ] && [ ! -e "$REPO/origin-repo" ]; then
    mv "$REPO/repo" "$REPO/origin-repo"
    rm -rf "$REPO/log" "$REPO/lock" "$REPO/spool" "$REPO/pgbackrest.conf" "$REPO/origin.conf"
  fi
  ZATTERA_PG_RESTORE_REPO="${ZATTERA_PG_RESTORE_REPO:-$REPO/origin-repo}"
fi
mkdir -p "$SOCK" "$REPO/repo" "$REPO/log" "$REPO/lock" "$REPO/spool"
rm -f "$DATA/ready"  # left by a crash: not ready until this start says so

write_conf() {  # the pgBackRest configuration of THIS database (repo1 posix, repo2 s3 when configured)
  {
    echo "[global]"
    echo "repo1-path=$REPO/repo"
    echo "repo1-retention-full=${ZATTERA_PG_RETENTION_FULL:-7}"
    if [ -n "${ZATTERA_PG_REPO2_S3_BUCKET:-}" ]; then
      echo "repo2-type=s3"
      echo "repo2-s3-bucket=$ZATTERA_PG_REPO2_S3_BUCKET"
      echo "repo2-s3-endpoint=${ZATTERA_PG_REPO2_S3_ENDPOINT:-s3.amazonaws.com}"
      echo "repo2-s3-region=${ZATTERA_PG_REPO2_S3_REGION:-us-east-1}"
      echo "repo2-path=${ZATTERA_PG_REPO2_PATH:-/pgbackrest}"
      echo "repo2-s3-uri-style=path"
      echo "repo2-retention-full=${ZATTERA_PG_RETENTION_FULL:-7}"
      [ -n "${ZATTERA_PG_REPO2_S3_VERIFY_TLS:-}" ] && echo "repo2-storage-verify-tls=$ZATTERA_PG_REPO2_S3_VERIFY_TLS"
      [ -n "${ZATTERA_PG_REPO2_S3_PORT:-}" ] && echo "repo2-storage-port=$ZATTERA_PG_REPO2_S3_PORT"
    fi
    echo "lock-path=$REPO/lock"
    echo "log-path=$REPO/log"
    echo "spool-path=$REPO/spool"
    echo "log-level-console=warn"
    echo "log-level-file=info"
    echo "start-fast=y"
    echo "archive-check=y"
    echo "[$STANZA]"
    echo "pg1-path=$PGDATA"
    echo "pg1-port=$PORT"
    echo "pg1-socket-path=$SOCK"
    echo "pg1-user=postgres"
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
}

server_conf() {  # settings that follow this start's port and address (postgresql.auto.conf is ALTER SYSTEM's)
  {
    echo "listen_addresses = '$LISTEN'"
    echo "port = $PORT"
    echo "unix_socket_directories = '$SOCK'"
    echo "wal_level = replica"
    echo "archive_mode = on"
    echo "archive_command = 'pgbackrest --config=$CONF --stanza=$STANZA archive-push %p'"
    echo "archive_timeout = ${ZATTERA_PG_ARCHIVE_TIMEOUT:-60}"
    echo "max_wal_senders = 3"
    echo "password_encryption = scram-sha-256"
    echo "logging_collector = off"
    echo "log_line_prefix = '%m [%p] %q%u@%d '"
  } >"$PGDATA/zattera.conf"
}

# A local (socket) connection as postgres without a password: the socket directory is the database's own
# user's (0700), so only its processes (the health check, pgBackRest, this script) reach it.
psql_local() { "$BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PORT" -U postgres "$@"; }

wait_ready() {
  i=0
  until "$BIN/pg_isready" -q -h "$SOCK" -p "$PORT" -U postgres; do
    i=$((i + 1)); [ "$i" -gt 600 ] && { say "not ready after 60 s"; return 1; }
    sleep 0.1
  done
}

start_temp() { "$BIN/pg_ctl" -D "$PGDATA" -w -t 600 -o "-c listen_addresses=''" -l "$DATA/first-start.log" start >/dev/null; }
stop_temp() { "$BIN/pg_ctl" -D "$PGDATA" -w -t 600 -m fast stop >/dev/null; }

first_start=0
if [ -n "${ZATTERA_ADDON_RESTORE_VOLUME:-}" ] && [ -z "${ZATTERA_PG_RESTORE_REPO:-}" ]; then
  ZATTERA_PG_RESTORE_REPO="$REPO/origin-repo"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  first_start=1
  if [ -n "${ZATTERA_PG_RESTORE_REPO:-}" ]; then
    # A fork: the origin's base backup plus its WAL up to the target, through the origin's repository,
    # read with a configuration of its own (nothing of the origin is written).
    src_conf="$REPO/origin.conf"
    {
      echo "[global]"
      echo "repo1-path=$ZATTERA_PG_RESTORE_REPO"
      echo "lock-path=$REPO/lock"
      echo "log-path=$REPO/log"
      echo "spool-path=$REPO/spool"
      echo "log-level-console=warn"
      echo "[$ZATTERA_PG_RESTORE_STANZA]"
      echo "pg1-path=$PGDATA"
    } >"$src_conf"
    target="${ZATTERA_PG_RESTORE_TARGET:-latest}"
    mkdir -p "$PGDATA"
    chmod 700 "$PGDATA"
    if [ "$target" = latest ]; then
      pgbackrest --config="$src_conf" --stanza="$ZATTERA_PG_RESTORE_STANZA" --type=default restore
    else
      pgbackrest --config="$src_conf" --stanza="$ZATTERA_PG_RESTORE_STANZA" --type=time \
        --target="$target" --target-action=promote restore
    fi
    server_conf
    grep -q "include_if_exists = 'zattera.conf'" "$PGDATA/postgresql.conf" \
      || echo "include_if_exists = 'zattera.conf'" >>"$PGDATA/postgresql.conf"
    # Recovery archives nothing into the fork's own repository until it is promoted.
    "$BIN/pg_ctl" -D "$PGDATA" -w -t 3600 -o "-c listen_addresses='' -c archive_mode=off" \
      -l "$DATA/first-start.log" start >/dev/null
    i=0
    until [ "$(psql_local -Atc 'select pg_is_in_recovery()' postgres)" = f ]; do
      i=$((i + 1)); [ "$i" -gt 36000 ] && { say "recovery did not end"; exit 1; }
      sleep 0.1
    done
    # The fork's roles keep their names, with the fork's own passwords (its secrets), through stdin.
    printf "ALTER ROLE postgres PASSWORD '%s';\nALTER ROLE \"%s\" PASSWORD '%s';\n" \
      "$(printf '%s' "${POSTGRES_PASSWORD:?no superuser password}" | sed "s/'/''/g")" "$APP_USER" \
      "$(printf '%s' "${APP_PASSWORD:?no app password}" | sed "s/'/''/g")" | psql_local -d postgres -f -
    stop_temp
    rm -f "$src_conf"
    rm -rf "$REPO/origin-repo"
    sed -i "/^restore_command/d" "$PGDATA/postgresql.auto.conf" 2>/dev/null || true
  else
    pwfile="$DATA/.pw"
    printf '%s\n' "${POSTGRES_PASSWORD:?no superuser password}" >"$pwfile"
    "$BIN/initdb" -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth-host=scram-sha-256 --auth-local=trust \
      -E UTF8 --locale=C.UTF-8 >"$DATA/initdb.log" 2>&1 || { rm -f "$pwfile"; cat "$DATA/initdb.log" >&2; exit 1; }
    rm -f "$pwfile"
    echo "include_if_exists = 'zattera.conf'" >>"$PGDATA/postgresql.conf"
    # Any address may try (the forwarder connects from the node's addresses), always with a password.
    echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "host all all ::/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
    server_conf
    start_temp
    # The password goes through stdin (printf is the shell's builtin): never an argument.
    printf "CREATE ROLE \"%s\" LOGIN PASSWORD '%s';\nCREATE DATABASE \"%s\" OWNER \"%s\";\n" \
      "$APP_USER" "$(printf '%s' "${APP_PASSWORD:?no app password}" | sed "s/'/''/g")" "$APP_DB" "$APP_USER" \
      | psql_local -d postgres -f -
    stop_temp
  fi
fi

write_conf
server_conf
"$BIN/postgres" -D "$PGDATA" &
pg=$!
trap 'kill -INT "$pg" 2>/dev/null' TERM INT
wait_ready
# Wake the checkpointer now that the server runs. PostgreSQL 15 starts it before recovery (after a crash, or
# any start): when its loop comes round while the startup process has not yet marked recovery done, it sleeps
# for checkpoint_timeout (5 min) without the archive_timeout term, and nothing written wakes it, so no WAL
# segment is switched (nor archived) until then: the RPO bound is lost after a restart. A reload sets its
# latch; it then sees recovery over and honours archive_timeout from here on (docs/addons.md).
psql_local -d postgres -Atc 'select pg_reload_conf()' >/dev/null 2>&1 || say "could not wake the checkpointer"
if [ "$first_start" = 1 ] || ! pgbackrest --config="$CONF" --stanza="$STANZA" info --output=json 2>/dev/null \
  | grep -q '"label"'; then
  pgbackrest --config="$CONF" --stanza="$STANZA" stanza-create >/dev/null 2>&1 || \
    pgbackrest --config="$CONF" --stanza="$STANZA" stanza-upgrade >/dev/null 2>&1 || true
  pgbackrest --config="$CONF" --stanza="$STANZA" --type=full backup || say "first base backup failed"
fi
report() {  # what `zattera addons backups` reads from the instance's log: the repository, the archive's end
  printf 'zattera-addon-backups %s\n' "$(pgbackrest --config="$CONF" --stanza="$STANZA" info --output=json 2>/dev/null \
    | tr -d '\n')" >&2
  # the newest segment in the repository and when it was archived (its file's time: survives a crash,
  # which resets pg_stat_archiver); the archiver's failures since the server started
  newest=$(find "$REPO/repo/archive/$STANZA" -type f -name '0*' -printf '%T@ %f\n' 2>/dev/null | sort -n | tail -1)
  failed=$(psql_local -d postgres -Atc "select failed_count from pg_stat_archiver" 2>/dev/null || echo 0)
  printf 'zattera-addon-archived time=%s wal=%s failed=%s\n' "${newest%% *}" "${newest#* }" "${failed:-0}" >&2
}
report
(
  # Scheduled base backups: a full one every interval, in the background of the server's life; the
  # archiver's progress reported every REPORT_INTERVAL seconds.
  next_backup=$(( $(date +%s) + BACKUP_INTERVAL ))
  # the sleep dies with this loop: nothing of it is left in the sandbox once the server is gone
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while sleep "${ZATTERA_PG_REPORT_INTERVAL:-60}" & nap=$!; wait "$nap"; do
    if [ "$(date +%s)" -ge "$next_backup" ]; then
      pgbackrest --config="$CONF" --stanza="$STANZA" --type=full backup || say "scheduled base backup failed"
      next_backup=$(( $(date +%s) + BACKUP_INTERVAL ))
    fi
    report
  done
) &
backups=$!
: >"$DATA/ready"
set +e
wait "$pg"
code=$?
# a trapped signal ends the first wait early: wait for the server to finish its shutdown
while kill -0 "$pg" 2>/dev/null; do wait "$pg"; code=$?; done
kill "$backups" 2>/dev/null
rm -f "$DATA/ready"
exit "$code"

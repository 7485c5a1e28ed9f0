# The health check of every Zattera container (compose.yaml): `sh shared/health.sh FILE`.
# Healthy when the process touched its heartbeat file FILE (ZATTERA_HEALTH_FILE: every 5 s while it runs
# connected to NATS, shared/health.py) since the previous check, which FILE.checked remembers; the first
# check asks only that FILE exists. A shell and no interpreter: a `docker exec` of sh costs half the CPU
# of one of python. The check interval must be longer than the heartbeat's 5 s.
beat=$1
checked=$1.checked
if [ -e "$checked" ]; then test "$beat" -nt "$checked"; else test -e "$beat"; fi
ok=$?
: > "$checked"
[ $ok -eq 0 ] || echo "no heartbeat in $beat since the previous check: not running, cut off from NATS, or stuck"
exit $ok

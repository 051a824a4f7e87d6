#!/usr/bin/env bash
# Stop and remove the rpycdl containers of this host: servers, the monitor, the registry, then job containers.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: scripts/stop_servers.sh [--timeout SECONDS] [--dry-run]

Stop the server containers (SIGTERM, then SIGKILL after --timeout, default 10 s), the monitor
and the registry that scripts/start_servers.sh or `rpycdl up` started, then remove any job
container the generic server left. Containers are found by their rpycdl.role label.
USAGE
}

TIMEOUT=10
DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout) TIMEOUT=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

for role in server monitor registry job; do
    mapfile -t ids < <(docker ps -aq --filter "label=rpycdl.role=$role")
    [ ${#ids[@]} -gt 0 ] || continue
    [ "$role" = job ] || run docker stop -t "$TIMEOUT" "${ids[@]}"
    run docker rm --force "${ids[@]}"
done

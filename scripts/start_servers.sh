#!/usr/bin/env bash
# Start the rpycdl registry, service containers and monitor on this host.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: scripts/start_servers.sh [OPTIONS] SERVICE[:VERSION] ...

Start a registry container and one server container per SERVICE[:VERSION], from the images
rpycdl-SERVICE:VERSION (tag latest without VERSION) that scripts/build_images.sh builds (never
pulled). Every container uses the host network: a server registers from the address it listens
on, so that is the address the registry hands to clients. All servers share the host's GPUs
through one lock directory, bind-mounted at the same path in each container, and the host's
process namespace (--pid host): every server sharing a lock directory must see the processes of
every job on the host, to check that nothing of a crashed job still runs before its GPUs are
granted again, and for the memory watchdog, which reads the host pids NVML reports.

Then the host's monitor (rpycdl-monitor: `rpycdl monitor`, from the first server's image) is
started beside them, and its address printed: it serves the GPUs, grants, queue and jobs of the
lock directory for Prometheus (/metrics; /healthz for the engine's health check), published on
127.0.0.1 only (on --host only with --insecure: it has no authentication, and the metrics name
users and jobs). It shares the lock directory and the host's pids, and reads real GPUs through
NVML only (the driver's utility capability: it never initialises CUDA).

Starting again is harmless: a container that runs already is left as it is, a stale one of the
same name (created, exited) is replaced. If a container cannot start, the engine's error is
printed and every container this run started is removed again (exit code 1).

  scripts/start_servers.sh pytorch:2.4 pytorch:2.5 tensorflow deeplearning
  scripts/start_servers.sh --gpus fake:4 pytorch        # simulated GPUs, no GPU access

Options:
  --registry HOST:PORT  registry the servers announce to (default: 127.0.0.1:18811)
  --no-registry         do not start a registry container (use the site's, at --registry)
  --host ADDR           address the servers listen on and clients are handed
                        (default: 127.0.0.1; anything else also needs --insecure)
  --insecure            let servers listen on a non-loopback address without authentication:
                        whoever reaches them can run code there; the monitor is published on
                        --host too, instead of 127.0.0.1
  --secret-file FILE    shared secret the servers require (see rpycdl serve --secret-file)
  --tls-cert FILE, --tls-key FILE, --tls-ca FILE
                        mutual TLS: the servers' certificate and key, and the CA of the
                        client certificates they accept (make them with `rpycdl certs`)
                        Credential files are mounted read-only under /run/rpycdl and must be
                        readable by the servers' user (uid 1000 unless --user): chown them.
  --policy NAME, --placement NAME
                        the servers' scheduling (see rpycdl serve --help; default: fcfs, pack)
  --fair-share FILE     with --policy fair: the site's fair-share file (mounted read-only, as
                        the credential files are)
  --user-map FILE       with --user 0: servers run as root and each job as its owner's account,
                        mapped by this file (identities to "uid:gid", as the image has no site
                        accounts; see rpycdl serve --user-map); mounted read-only
  --port PORT           first server port, one more per further server (default: 18861)
  --gpus all|fake:N     every GPU of the host through the NVIDIA runtime (default: all),
                        or a simulated inventory without GPU access
  --lock-dir DIR        host lock directory (default: /tmp/rpycdl-locks; made mode 1777, or 2751 root's
                        for --user 0)
  --user UID[:GID]      user the servers run as (default: the image's, uid 1000); every
                        server sharing a lock directory must run as the same user
  --shm-size SIZE       shared memory per server, for data loaders (default: 8g)
  --monitor-port PORT   host port of the monitor, 0 to start none (default: 18870)
  --no-ulimits          keep the engine's ulimits instead of asking for memlock=-1, stack=64 MiB;
                        an engine that refuses them (rootless or sandboxed ones: "error setting
                        rlimit") gets its own anyway, and a line says so
  --dry-run             print the docker commands a Docker host would run, run nothing
  -h, --help            this help

The deeplearning server also gets the Docker engine's socket ($DOCKER_HOST if it is unix://PATH,
else /var/run/docker.sock), to run jobs in their own containers (whoever can use it is root on
this host: give it only to a trusted network).
Stop everything, the monitor too, with scripts/stop_servers.sh; check with
`rpycdl status --registry HOST:PORT`.
USAGE
}

REGISTRY=127.0.0.1:18811
START_REGISTRY=1
HOST=127.0.0.1
INSECURE=0
PORT=18861
GPUS=all
LOCK_DIR=/tmp/rpycdl-locks
RUN_AS=""
SHM_SIZE=8g
MONITOR_PORT=18870
ULIMITS=(--ulimit memlock=-1 --ulimit stack=67108864)
DRY_RUN=0
SPECS=()
CREDENTIALS=()  # pairs: option name, host file
SCHEDULING=()
while [ $# -gt 0 ]; do
    case "$1" in
        --registry) REGISTRY=$2; shift 2 ;;
        --no-registry) START_REGISTRY=0; shift ;;
        --host) HOST=$2; shift 2 ;;
        --insecure) INSECURE=1; shift ;;
        --secret-file|--tls-cert|--tls-key|--tls-ca|--fair-share|--user-map) CREDENTIALS+=("${1#--}" "$2"); shift 2 ;;
        --policy|--placement) SCHEDULING+=("$1=$2"); shift 2 ;;
        --port) PORT=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --lock-dir) LOCK_DIR=$2; shift 2 ;;
        --user) RUN_AS=$2; shift 2 ;;
        --shm-size) SHM_SIZE=$2; shift 2 ;;
        --monitor-port) MONITOR_PORT=$2; shift 2 ;;
        --no-ulimits) ULIMITS=(); shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) SPECS+=("$1"); shift ;;
    esac
done
[ ${#SPECS[@]} -gt 0 ] || { usage >&2; exit 2; }
[[ $REGISTRY =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || { echo "--registry must be HOST:PORT" >&2; exit 2; }
[[ $PORT =~ ^[0-9]+$ ]] || { echo "--port must be a number" >&2; exit 2; }
if ! [[ $MONITOR_PORT =~ ^[0-9]{1,5}$ && $MONITOR_PORT -le 65535 ]]; then
    echo "--monitor-port must be a TCP port, or 0 for no monitor" >&2
    exit 2
fi
[[ $GPUS == all || $GPUS =~ ^fake:[0-9]+(x[0-9A-Za-z.]+)?$ ]] || { echo "--gpus must be all or fake:N" >&2; exit 2; }
[[ $LOCK_DIR == /* ]] || { echo "--lock-dir must be an absolute path" >&2; exit 2; }
credential_options=()
credential_args=()
tls=0 auth=0
for ((i = 0; i < ${#CREDENTIALS[@]}; i += 2)); do
    name=${CREDENTIALS[i]} file=${CREDENTIALS[i + 1]}
    [[ $file == /* && -f $file ]] || { echo "--$name must be an absolute path to a file: $file" >&2; exit 2; }
    [[ $name == tls-* ]] && tls=$((tls + 1))
    [[ $name == tls-* || $name == secret-file ]] && auth=$((auth + 1))
    credential_options+=(-v "$file:/run/rpycdl/$name:ro")
    credential_args+=("--$name" "/run/rpycdl/$name")
done
[[ $tls == 0 || $tls == 3 ]] || { echo "TLS needs all three of --tls-cert, --tls-key and --tls-ca" >&2; exit 2; }
if [[ $auth == 0 && $INSECURE == 0 && $HOST != 127.* && $HOST != localhost && $HOST != ::1 ]]; then
    echo "servers on $HOST need authentication: --tls-cert/--tls-key/--tls-ca or --secret-file (or --insecure)" >&2
    exit 2
fi
loopback=0
[[ $HOST != 127.* && $HOST != localhost && $HOST != ::1 ]] || loopback=1
MONITOR_HOST=127.0.0.1  # the monitor has no authentication, and its metrics name users and jobs
[[ $INSECURE == 0 || $loopback == 1 ]] || MONITOR_HOST=$HOST
if [[ $MONITOR_PORT != 0 && $INSECURE == 0 && $loopback == 0 ]]; then
    echo "the monitor listens on 127.0.0.1 only: it has no authentication, and its metrics name users and jobs" \
         "(--insecure publishes it on $HOST too)" >&2
fi

# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

ENGINE_SOCKET=/var/run/docker.sock
[[ ${DOCKER_HOST:-} != unix://* ]] || ENGINE_SOCKET=${DOCKER_HOST#unix://}
ERRORS=$(mktemp)
trap 'rm -f "$ERRORS"' EXIT
STARTED=()  # containers this run started: removed again if a later one cannot start

# keep NAME: true if container NAME runs already (left as it is); a stale one (created, exited) is removed.
keep() {
    local state
    [ "$DRY_RUN" = 0 ] || return 1
    state=$(docker container inspect --format '{{.State.Status}}' "$1" 2>/dev/null) || return 1
    if [ "$state" = running ]; then
        echo "$1 runs already: left as it is (to change its options, remove it first: docker rm -f $1)" >&2
        return 0
    fi
    echo "replacing the stale $1 ($state)" >&2
    docker rm --force "$1" >/dev/null
    return 1
}

# launch NAME DOCKER_RUN_ARGUMENTS...: docker run --name NAME ...; if it fails, the engine's words are in
# $ERRORS and the container it created is removed (a retry would meet its name), and launch fails.
launch() {
    local name=$1
    shift
    if run docker run --name "$name" "$@" 2>"$ERRORS"; then
        cat "$ERRORS" >&2  # the engine's warnings, if any
        [ "$DRY_RUN" = 1 ] || STARTED+=("$name")
        return 0
    fi
    docker rm --force "$name" >/dev/null 2>&1 || true
    return 1
}

# engine_words FILE: the telling part of an engine's refusal of the ulimits in FILE, such as
# "error setting rlimit type 8: operation not permitted": the last part that names rlimit or ulimit, and the next.
engine_words() {
    awk -F': ' 'tolower($0) ~ /rlimit|ulimit/ {
        for (i = NF; i > 0; i--) if (tolower($i) ~ /rlimit|ulimit/) break
        words = $i; if (i < NF) words = words ": " $(i + 1)
        sub(/[.]$/, "", words); print words; exit
    }' "$1"
}

# fail: print the engine's words, remove every container this run started, exit 1.
fail() {
    cat "$ERRORS" >&2
    if grep -q "No such image" "$ERRORS"; then
        echo "build the image first: scripts/build_images.sh SERVICE[:VERSION]" >&2
    fi
    if [ ${#STARTED[@]} -gt 0 ]; then
        echo "removing the containers this run started: ${STARTED[*]}" >&2
        docker rm --force "${STARTED[@]}" >/dev/null
    fi
    exit 1
}

ROOT_SERVERS=0
[[ ${RUN_AS%%:*} == 0 || ${RUN_AS%%:*} == root ]] && ROOT_SERVERS=1
if [ ! -d "$LOCK_DIR" ]; then
    run mkdir -p "$LOCK_DIR"
    # servers of uid 1000 share it with every container user; root servers keep it root's (rpycdl up alike)
    if [ "$ROOT_SERVERS" = 1 ]; then run chmod 2751 "$LOCK_DIR"; else run chmod 1777 "$LOCK_DIR"; fi
fi

common=(--detach --pull never --network host --restart unless-stopped)
for spec in "${SPECS[@]}"; do parse_spec "$spec"; done  # all of them before starting anything
first=${SPECS[0]}
if [ "$START_REGISTRY" = 1 ] && ! keep rpycdl-registry; then
    launch rpycdl-registry "${common[@]}" --label rpycdl.role=registry --entrypoint rpycdl \
        "rpycdl-${first%%:*}:$( [[ $first == *:* ]] && echo "${first#*:}" || echo latest)" \
        registry --host "${REGISTRY%:*}" --port "${REGISTRY##*:}" || fail
fi

port=$PORT
for spec in "${SPECS[@]}"; do
    parse_spec "$spec"
    name="rpycdl-$service${version:+-$version}"
    args=(--host "$HOST" --port "$port" --registry "$REGISTRY" --lock-dir "$LOCK_DIR" "${credential_args[@]}"
          "${SCHEDULING[@]}")
    port=$((port + 1))
    ! keep "$name" || continue
    options=(--label rpycdl.role=server --label "rpycdl.service=$service" --pid host
             -v "$LOCK_DIR:$LOCK_DIR" "${credential_options[@]}" --shm-size "$SHM_SIZE")
    [ -z "$RUN_AS" ] || options+=(--user "$RUN_AS")
    [ "$GPUS" != all ] || options+=(--gpus all)
    if [ "$service" = deeplearning ]; then  # runs jobs in their own containers, through the host's engine
        options+=(-v "$ENGINE_SOCKET:/var/run/docker.sock")
        [ ! -S "$ENGINE_SOCKET" ] || options+=(--group-add "$(stat -c %g "$ENGINE_SOCKET")")
    fi
    [ "$GPUS" = all ] || args+=(--gpus "$GPUS")
    [ "$INSECURE" = 0 ] || args+=(--insecure)
    image=("rpycdl-$service:${version:-latest}" "${args[@]}")
    if ! launch "$name" "${common[@]}" "${options[@]}" "${ULIMITS[@]}" "${image[@]}"; then
        if [ ${#ULIMITS[@]} -eq 0 ] || ! grep -qiE 'rlimit|ulimit' "$ERRORS"; then
            fail
        fi
        refused=$(engine_words "$ERRORS")
        echo "the engine refused the ulimits memlock=-1, stack=64 MiB ($refused):" \
             "the servers run with the engine's own instead (--no-ulimits skips asking)" >&2
        ULIMITS=()
        launch "$name" "${common[@]}" "${options[@]}" "${image[@]}" || fail
    fi
done

# monitor_url HOST PORT: the address the monitor is published at.
monitor_url() {
    if [[ $1 == *:* ]]; then echo "http://[$1]:$2/metrics"; else echo "http://$1:$2/metrics"; fi
}

if [ "$MONITOR_PORT" != 0 ]; then
    if keep rpycdl-monitor; then  # it keeps the address it was published at
        read -r bound_host bound_port < <(docker container inspect --format \
            '{{range $p, $b := .HostConfig.PortBindings}}{{range $b}}{{.HostIp}} {{.HostPort}}{{end}}{{end}}' \
            rpycdl-monitor) || true
        echo "monitor on $(monitor_url "${bound_host:-0.0.0.0}" "$bound_port")"
    else
        # `rpycdl monitor` listens on every address of its own network; the engine publishes it on MONITOR_HOST
        # alone. It reads real GPUs through NVML only: the driver's utility capability mounts no CUDA library.
        publish=$MONITOR_HOST
        [[ $publish != *:* ]] || publish="[$publish]"
        health="import urllib.request; urllib.request.urlopen('http://127.0.0.1:$MONITOR_PORT/healthz', timeout=5)"
        monitor=(--label rpycdl.role=monitor --pid host -v "$LOCK_DIR:$LOCK_DIR"
                 -p "$publish:$MONITOR_PORT:$MONITOR_PORT" --health-cmd "python3 -c \"$health\""
                 --health-interval 10s --health-timeout 5s --health-retries 3 --health-start-period 10s)
        if [ "$ROOT_SERVERS" = 1 ]; then  # a reader of root servers' directories, through their group (nobody)
            monitor+=(--user "65534:$(stat -c %g "$LOCK_DIR" 2>/dev/null || echo 0)")
        elif [ -n "$RUN_AS" ]; then
            monitor+=(--user "$RUN_AS")
        fi
        inventory=$GPUS
        if [ "$GPUS" = all ]; then
            monitor+=(--gpus "all,capabilities=utility" -e NVIDIA_DRIVER_CAPABILITIES=utility)
            inventory=nvml
        fi
        monitor_image="rpycdl-${first%%:*}:$( [[ $first == *:* ]] && echo "${first#*:}" || echo latest)"
        if ! launch rpycdl-monitor --detach --pull never --restart unless-stopped "${monitor[@]}" \
                --entrypoint rpycdl "$monitor_image" monitor --host 0.0.0.0 --insecure --port "$MONITOR_PORT" \
                --lock-dir "$LOCK_DIR" --gpus "$inventory"; then
            echo "cannot start the monitor: --monitor-port picks another port, 0 starts none" >>"$ERRORS"
            fail
        fi
        echo "monitor on $(monitor_url "$MONITOR_HOST" "$MONITOR_PORT")"
    fi
fi

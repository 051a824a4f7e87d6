# Shared by build_images.sh, start_servers.sh and stop_servers.sh: sourced, never run.

# run CMD...: print the command; run it unless DRY_RUN=1.
run() {
    printf '%q ' "$@"; echo
    [ "$DRY_RUN" = 1 ] || "$@"
}

# parse_spec SERVICE[:VERSION]: set $service and $version, or exit 2 on a bad spec.
parse_spec() {
    service=${1%%:*}
    version=""
    [ "$service" = "$1" ] || version=${1#*:}
    if ! [[ $service =~ ^[a-z][a-z0-9_-]*$ && $version =~ ^[A-Za-z0-9._-]*$ ]]; then
        echo "bad spec '$1': SERVICE[:VERSION] (see --help)" >&2
        exit 2
    fi
}

#!/usr/bin/env bash
# CI setup for the container tests, idempotent, as root on a Debian machine: install Docker
# and debootstrap from the machine's apt sources, start the daemon if it is not running,
# build the base image once (a minimal Debian root file system; cached in .ci-cache), then
# the wheelhouse and the service images the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=${SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-rpycdl-base:$SUITE}
CACHE=${CI_CACHE:-/var/cache/rpycdl-ci}  # outside the clone: later CI runs on this machine reuse it
ROOTFS_TAR=$CACHE/rootfs-$SUITE.tar
mkdir -p "$CACHE"

log() { echo "ci/docker: $*" >&2; }

# The first apt source of $SUITE: deb822 .sources stanzas, then one-line .list entries.
apt_mirror() {
    local files=(/etc/apt/sources.list.d/*.sources)
    [ -e "${files[0]}" ] && awk -v suite="$SUITE" '
        BEGIN { RS = "" }
        {
            uri = ""; ok = 0; deb = 0; off = 0
            n = split($0, line, "\n")
            for (i = 1; i <= n; i++) {
                v = line[i]
                if (v ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", v); split(v, u, /[ \t]+/); uri = u[1] }
                else if (v ~ /^Suites:/) { sub(/^Suites:/, "", v); if ((v " ") ~ ("[ \t]" suite "[ \t]")) ok = 1 }
                else if (v ~ /^Types:/) { if ((v " ") ~ /[ \t]deb[ \t]/) deb = 1 }
                else if (v ~ /^Enabled:[ \t]*no/) off = 1
            }
            if (uri != "" && ok && deb && !off) { print uri; exit }
        }' "${files[@]}" | grep . && return 0
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk -v suite="$SUITE" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while ($i !~ /\]$/) i++; if ($2 ~ /^\[/) i++;
                                    if ($(i + 1) == suite) { print $i; exit } }' | grep .
}

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing docker.io and debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap python3-venv >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: $CACHE/dockerd.log)"
    nohup dockerd >"$CACHE/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$CACHE/dockerd.log" >&2; log "dockerd did not start"; exit 1; }
fi

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [ ! -s "$ROOTFS_TAR" ]; then
        mirror=${MIRROR:-$(apt_mirror)} || { log "no apt source for $SUITE: set MIRROR"; exit 1; }
        log "debootstrap $SUITE from $mirror"
        rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        keyring=()
        [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] \
            && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
        debootstrap --variant=minbase --include=python3,python3-pip "${keyring[@]}" \
            "$SUITE" "$rootfs" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$ROOTFS_TAR.tmp" .
        mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
        rm -rf "$rootfs"
    fi
    log "importing $ROOTFS_TAR as $BASE_IMAGE"
    docker import --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' "$ROOTFS_TAR" "$BASE_IMAGE" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
log "building the wheelhouse and the service images on $BASE_IMAGE"
bash scripts/build_images.sh --python .venv/bin/python --base-image "$BASE_IMAGE" \
    pytorch:2.4 pytorch:2.5 pytorch tensorflow jax deeplearning

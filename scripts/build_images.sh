#!/usr/bin/env bash
# Build the wheelhouse and the rpycdl service images.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
Usage: scripts/build_images.sh [OPTIONS] [SPEC ...]

Build a wheelhouse of rpycdl and its dependencies on this machine, then one image per SPEC
from dockerfiles/Dockerfile, installing rpycdl from the wheelhouse only (no network in the
build). SPEC is SERVICE[:VERSION][=BASE_IMAGE]:

  pytorch                                   rpycdl-pytorch:latest on the vendor image
  pytorch:2.5                               rpycdl-pytorch:2.5, announced as PYTORCH-2.5
  pytorch:2.4=pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime

VERSION is the framework version the server announces; without it the server reads it from
the framework installed in the image. Default SPECs: pytorch tensorflow deeplearning (jax needs jax=BASE_IMAGE).

Options:
  --base-image IMAGE   base image of every SPEC without its own (default: the vendor image
                       of each framework; tests use a local one, e.g. rpycdl-base:bookworm)
  --wheelhouse DIR     where the wheels go (default: .whl)
  --skip-wheelhouse    reuse the wheels already in the wheelhouse
  --python PYTHON      Python whose pip builds the wheels (default: .venv/bin/python, else python3)
  --uid UID            user id the image runs as (default: 1000)
  --dry-run            print the commands, run nothing
  -h, --help           this help
USAGE
}

vendor_base() {
    case "$1" in
        pytorch|deeplearning) echo "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime" ;;
        tensorflow) echo "tensorflow/tensorflow:2.17.0-gpu" ;;
        jax) echo "no public JAX GPU image is assumed: pass jax=BASE_IMAGE (an image with jax[cuda])" >&2; return 1 ;;
        *) echo "no default base image for service '$1': pass --base-image or SPEC=BASE_IMAGE" >&2; return 1 ;;
    esac
}

BASE_IMAGE=""
WHEELHOUSE=.whl
SKIP_WHEELHOUSE=0
PYTHON=""
RPYCDL_UID=1000
DRY_RUN=0
SPECS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --base-image) BASE_IMAGE=$2; shift 2 ;;
        --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
        --skip-wheelhouse) SKIP_WHEELHOUSE=1; shift ;;
        --python) PYTHON=$2; shift 2 ;;
        --uid) RPYCDL_UID=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) SPECS+=("$1"); shift ;;
    esac
done
[ ${#SPECS[@]} -gt 0 ] || SPECS=(pytorch tensorflow deeplearning)
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

if [ "$SKIP_WHEELHOUSE" = 0 ]; then
    run mkdir -p "$WHEELHOUSE"
    run find "$WHEELHOUSE" -name 'rpycdl-*.whl' -delete  # always the working tree's rpycdl
    run "$PYTHON" -m pip wheel --quiet --disable-pip-version-check -w "$WHEELHOUSE" ".[all]"
fi

for spec in "${SPECS[@]}"; do
    name=${spec%%=*}
    base=$BASE_IMAGE
    [ "$name" = "$spec" ] || base=${spec#*=}
    parse_spec "$name"
    [ -n "$base" ] || base=$(vendor_base "$service")
    run docker build --quiet -f dockerfiles/Dockerfile \
        --build-arg "BASE_IMAGE=$base" --build-arg "SERVICE=$service" \
        --build-arg "FRAMEWORK_VERSION=$version" --build-arg "RPYCDL_UID=$RPYCDL_UID" \
        --label "rpycdl.base-image=$base" \
        -t "rpycdl-$service:${version:-latest}" "$WHEELHOUSE"
done

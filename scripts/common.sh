# Shared by the scripts (build_images, start_servers, stop_servers, quickstart, test): sourced, never run.

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

# install_editable PYTHON SPEC [PIP_OPTION...]: pip install -e SPEC (".", ".[test]") into PYTHON's environment.
# editable_mode=compat puts the checkout on sys.path (a .pth file) instead of pip's default import hook, which
# loses to a directory named rpycdl on sys.path before it: a script next to the clone (~/work/myscript.py beside
# ~/work/rpycdl) would import the clone's root as an empty namespace package ("module 'rpycdl' has no attribute
# 'connect'"). Setuptools calls compat transitional; if it ever refuses it, editable_mode=strict fixes the same
# case (a tree of links under build/, which needs a reinstall when a module is added).
install_editable() {
    local python=$1 spec=$2
    shift 2
    if [[ $("$python" -m pip install --help) != *--config-settings* ]]; then  # pip before 22.1
        "$python" -m pip install -q --disable-pip-version-check --upgrade pip
    fi
    "$python" -m pip install -q --disable-pip-version-check --config-settings editable_mode=compat "$@" -e "$spec"
}

#!/usr/bin/env bash
# Runs ndtrain's ReFrame checks on this machine: installs ReFrame (the version they were tested
# with) into a virtual environment the first time, then runs every check of this folder that
# the system's partitions and environments allow (by features) with the settings. Extra
# arguments go to reframe (e.g. `-S steps=60`, `-t ci`, `-n NdtrainScalingCheck`). It fails
# when no check was selected: a filter or a settings file that matches nothing is an error,
# not a pass.
#
#   jobscripts/reframe/run.sh                                  # the newest build in target/
#   NDTRAIN_BIN=target/debug/ndtrain jobscripts/reframe/run.sh # that binary's folder on PATH
#
# NDTRAIN_REFRAME_VENV: where the virtual environment lives (default /opt/ndtrain-reframe).
# NDTRAIN_REFRAME_SETTINGS: the site configuration (default settings.py beside this script).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${NDTRAIN_REFRAME_VENV:-/opt/ndtrain-reframe}
version=4.10.4
if [ "$("$venv/bin/reframe" --version 2>/dev/null)" != "$version" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "reframe-hpc==$version"
fi
# The settings' prefix, where ReFrame writes its log: settings.py makes no folder itself.
mkdir -p "${NDTRAIN_REFRAME_PREFIX:-$here/../../out/reframe}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
"$venv/bin/reframe" -C "${NDTRAIN_REFRAME_SETTINGS:-$here/settings.py}" -c "$here/ndtrain_check.py" -r "$@" 2>&1 | tee "$log" || rc=$?
if ! grep -qE 'Ran [1-9][0-9]*/[0-9]+ test case' "$log"; then
    echo "error: no ReFrame check ran (none selected for this system, its environments and the filters given)" >&2
    exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# Runs ndtrain's ReFrame checks on this machine: installs ReFrame (the version they were tested
# with) into a virtual environment the first time, then runs every check of this folder with
# the local settings. Extra arguments go to reframe (e.g. `-S steps=60`, `--system mysite`).
#
#   jobscripts/reframe/run.sh                                  # the newest build in target/
#   NDTRAIN_BIN=target/debug/ndtrain jobscripts/reframe/run.sh # a given binary
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
exec "$venv/bin/reframe" -C "${NDTRAIN_REFRAME_SETTINGS:-$here/settings.py}" -c "$here/ndtrain_check.py" -r "$@"

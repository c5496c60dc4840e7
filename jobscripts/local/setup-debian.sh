#!/usr/bin/env bash
# Installs the system packages ndtrain builds against on Debian 12 / Ubuntu 22.04 or newer:
# Open MPI, parallel HDF5 (Open MPI flavour) with its tools (h5dump), libclang (rsmpi
# generates its MPI bindings), pkg-config, and Debian's python3-h5py (the checkpoint tests
# read checkpoints with h5py as users do), fonts-dejavu-core (the font `ndtrain report`
# draws its plots with), shellcheck (the tests lint every job script with it), qemu-user
# (tests/portability.rs runs the build on emulated older CPUs) and python3-venv (CI installs
# ReFrame and the CUDA compilers into virtual environments), iproute2, procps and util-linux
# (ip, tc, sysctl, nsenter: the emulated cluster of cluster-local.sh) and stress-ng (the suite
# run beside a full load: test-under-load.sh). Rust (>= 1.85, with rustfmt and
# clippy) must already be installed.
set -euo pipefail

PACKAGES="${PACKAGES:-openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools python3-h5py fonts-dejavu-core shellcheck qemu-user python3-venv iproute2 procps util-linux stress-ng libclang-dev pkg-config build-essential}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

echo "+ apt-get install -y $PACKAGES"
$SUDO apt-get update -q
# shellcheck disable=SC2086 # a list of package names, split at spaces
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $PACKAGES

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found: install Rust >= 1.85 with rustup (components rustfmt, clippy), then rerun" >&2
    exit 1
fi
cargo --version

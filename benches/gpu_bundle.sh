#!/usr/bin/env bash
# Packs a CUDA build of ndtrain with the shared libraries it runs on (Open MPI with its
# plugins and PMIx, parallel HDF5 and their dependencies, all from this Debian machine) and
# Open MPI's launcher (`mpirun`/`mpiexec`, which are `orterun`, its daemon `orted`, and
# `ompi_info`) into one archive, for a GPU machine that has the NVIDIA driver, CUDA and Python
# but none of these (and no network to install them): copy or carry the archive, then there
#     tar xf ndtrain-gpu.tar.xz && . ndtrain-gpu/env.sh && mpirun -n 2 ndtrain gpu-check
# `env.sh` puts the bundled programs first on PATH and the bundled libraries first on
# LD_LIBRARY_PATH and relocates Open MPI (OPAL_PREFIX) and PMIx, so a singleton `ndtrain` and
# `mpirun` of several ranks on the machine run. Checked here with Open
# MPI, PMIx and HDF5 hidden from a mount namespace (tmpfs over their folders): the tiny deck
# trains and `gpu-check` reports the missing CUDA libraries. The CUDA libraries are not bundled:
# ndtrain opens the machine's own at run time. benches/gpu_check.sh uses the archive.
#   benches/gpu_bundle.sh [OUT_DIR]          # default .gpu_bundle (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.gpu_bundle}"
NAME=ndtrain-gpu
B="$OUT/$NAME"
ARCH_LIB=/usr/lib/x86_64-linux-gnu

echo "+ cargo build --release --features cuda (no debug info: the archive must stay small)"
CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda
rm -rf "$B" && mkdir -p "$B/bin" "$B/lib" "$B/usr/bin" "$B/usr/lib/x86_64-linux-gnu" "$B/usr/share"
cp target/release/ndtrain "$B/bin/ndtrain" && strip "$B/bin/ndtrain"

# Every library the binary loads, but the C runtime's own (the target's glibc is used).
ldd target/release/ndtrain | awk '/=>/ {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libresolv.so.*) ;;
        *) cp -L "$lib" "$B/lib/" ;;
    esac
done
# Open MPI's plugins, help texts and orted (a singleton MPI_Init starts one), PMIx's plugins,
# in Debian's layout under a relocated prefix; and what the plugins themselves load.
cp -rL "$ARCH_LIB/openmpi" "$ARCH_LIB/pmix2" "$B/usr/lib/x86_64-linux-gnu/"
cp -rL /usr/share/openmpi "$B/usr/share/"
for prog in orted orterun ompi_info; do
    cp -L "/usr/bin/$prog" "$B/usr/bin/"
done
ln -s orterun "$B/usr/bin/mpirun"
ln -s orterun "$B/usr/bin/mpiexec"
for so in "$B"/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$B"/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix/*.so "$B"/usr/bin/*; do
    ldd "$so" 2>/dev/null | awk '/=>/ {print $3}'
done | sort -u | while read -r lib; do
    [ -n "$lib" ] || continue
    case "$(basename "$lib")" in
        libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libresolv.so.*) ;;
        *) [ -e "$B/lib/$(basename "$lib")" ] || cp -L "$lib" "$B/lib/" ;;
    esac
done
cat > "$B/env.sh" <<'EOF'
# Source me: the bundled ndtrain and its libraries (benches/gpu_bundle.sh).
NDTRAIN_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PATH="$NDTRAIN_BUNDLE/bin:$NDTRAIN_BUNDLE/usr/bin:$PATH"
export LD_LIBRARY_PATH="$NDTRAIN_BUNDLE/lib:$NDTRAIN_BUNDLE/usr/lib/x86_64-linux-gnu/openmpi/lib:$NDTRAIN_BUNDLE/usr/lib/x86_64-linux-gnu/pmix2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$NDTRAIN_BUNDLE/usr"
export PMIX_INSTALL_PREFIX="$NDTRAIN_BUNDLE/usr/lib/x86_64-linux-gnu/pmix2"
export PMIX_MCA_mca_base_component_path="$NDTRAIN_BUNDLE/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
# The ranks of one machine: shared memory and self are all the transports needed.
export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_mca_base_component_show_load_errors=0
EOF
echo "+ packing $OUT/$NAME.tar.xz"
tar -C "$OUT" -cJf "$OUT/$NAME.tar.xz" "$NAME"
du -sh "$B" "$OUT/$NAME.tar.xz"
# Only the archive travels (the device tool carries at most 64 MiB).
rm -rf "$B"

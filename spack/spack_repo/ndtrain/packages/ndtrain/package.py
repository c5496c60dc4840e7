# Copyright the ndtrain developers.
# SPDX-License-Identifier: Apache-2.0
"""Spack recipe for ndtrain (a Rust crate built with cargo).

A Spack 1.x package repository (layout `api: v2`): add it with
`spack repo add <ndtrain checkout>/spack/spack_repo/ndtrain`; see spack/README.md for what has
been verified.
"""

import os

from spack_repo.builtin.build_systems.cargo import CargoPackage
from spack_repo.builtin.build_systems.cuda import CudaPackage

from spack.package import *

#: Spack microarchitecture names (archspec) whose rustc `-C target-cpu` name differs or that
#: rustc knows; others build for the family's baseline.
RUSTC_CPU = {
    "x86_64_v2": "x86-64-v2",
    "x86_64_v3": "x86-64-v3",
    "x86_64_v4": "x86-64-v4",
    "haswell": "haswell",
    "broadwell": "broadwell",
    "skylake": "skylake",
    "skylake_avx512": "skylake-avx512",
    "cascadelake": "cascadelake",
    "cooperlake": "cooperlake",
    "icelake": "icelake-server",
    "sapphirerapids": "sapphirerapids",
    "zen": "znver1",
    "zen2": "znver2",
    "zen3": "znver3",
    "zen4": "znver4",
    "zen5": "znver5",
    "neoverse_n1": "neoverse-n1",
    "neoverse_v1": "neoverse-v1",
    "neoverse_v2": "neoverse-v2",
    "a64fx": "a64fx",
}


def rustc_target_cpu(target):
    """The `-C target-cpu` for a Spack target: its own name where rustc has one, else the
    nearest ancestor rustc knows, else None (the toolchain's default)."""
    for t in [target] + list(getattr(target, "ancestors", [])):
        name = str(getattr(t, "name", t))
        if name in RUSTC_CPU:
            return RUSTC_CPU[name]
    return None


class Ndtrain(CargoPackage, CudaPackage):
    """SPMD MPI trainer for Llama-style transformers with N-dimensional parallelism
    (DP, FSDP, HSDP, TP, CP), sharded parallel-HDF5 checkpoints and per-rank timing logs."""

    homepage = "https://github.com/ndtrain/ndtrain"
    git = "https://github.com/ndtrain/ndtrain.git"
    # Release tarballs are made by spack/make-release.sh (every crate vendored: they build
    # offline). PLACEHOLDER HOST: no public release address exists yet; a centre puts the
    # tarball into a Spack source mirror as <mirror>/ndtrain/ndtrain-<version>.tar.gz
    # (spack/README.md), where Spack looks before this url.
    url = "https://releases.invalid/ndtrain/ndtrain-0.1.0.tar.gz"

    license("Apache-2.0")

    version("main", branch="main")
    # The tarball spack/make-release.sh makes of commit 957bf13b2f8a (see spack/README.md).
    version("0.1.0", sha256="7a3a634f07ee9a5455d8b42be86d6eab8279e5ce370b878f6df44ab09f14489c")

    # CudaPackage brings the `cuda` variant (off by default: the NVIDIA GPU backend, cuBLAS,
    # NVRTC kernels and NCCL) and `cuda_arch`. ndtrain compiles its kernels at run time for the
    # GPU it finds, so cuda_arch does not change its own build; NCCL is compiled for it.

    depends_on("rust@1.85:", type="build")
    # rsmpi builds a small C shim with the MPI compiler wrapper; HDF5's sys crate links C.
    depends_on("c", type="build")
    # rsmpi generates its MPI bindings with bindgen, which needs libclang.
    depends_on("llvm+clang", type="build")
    depends_on("pkgconfig", type="build")
    depends_on("mpi")
    # Checkpoints are written collectively through parallel HDF5 (MPI-IO).
    depends_on("hdf5@1.10:+mpi~java")
    # CUDA 12: the driver API, NVRTC and cuBLAS calls the GPU backend makes.
    depends_on("cuda@12:", when="+cuda")
    depends_on("nccl", when="+cuda")
    # NCCL for the GPUs the spec names (nccl is a CudaPackage and refuses cuda_arch=none).
    for arch in CudaPackage.cuda_arch_values:
        depends_on(f"nccl+cuda cuda_arch={arch}", when=f"+cuda cuda_arch={arch}")
    conflicts(
        "cuda_arch=none",
        when="+cuda",
        msg="ndtrain+cuda builds NCCL for the GPUs it runs on: set cuda_arch (e.g. cuda_arch=80 for A100, "
        "cuda_arch=90 for H100/GH200)",
    )

    @property
    def build_args(self):
        # CargoBuilder runs `cargo install --root out --path . -j <make_jobs>` followed by these;
        # it passes neither --locked nor --offline, and -j must not come twice.
        args = ["--locked"]
        # A release tarball carries vendor/ and a .cargo/config.toml that replaces crates.io
        # with it: build without network (Spack's CARGO_HOME is an empty folder in the stage).
        # A git checkout (`main`, `spack develop`) has no vendor/ and fetches its crates.
        if os.path.isdir(join_path(self.stage.source_path, "vendor")):
            args.append("--offline")
        if self.spec.satisfies("+cuda"):
            args += ["--features", "cuda"]
        return args

    def setup_build_environment(self, env):
        spec = self.spec
        # hdf5-metno-sys finds the library here; rsmpi asks the MPI compiler wrapper.
        env.set("HDF5_DIR", spec["hdf5"].prefix)
        env.set("MPICC", spec["mpi"].mpicc)
        env.set("LIBCLANG_PATH", spec["llvm"].prefix.lib)
        # CPU flags from the spec's target (`target=zen4`, `target=x86_64_v3`, ...), as Spack
        # does for C and C++ through its compiler wrappers; never the build host's CPU.
        cpu = rustc_target_cpu(spec.target)
        env.set("RUSTFLAGS", f"-C target-cpu={cpu}" if cpu else "")
        if spec.satisfies("+cuda"):
            env.set("CUDA_ROOT", spec["cuda"].prefix)

    def setup_run_environment(self, env):
        # cudarc opens the CUDA libraries at run time (dynamic loading): put them on the path.
        if self.spec.satisfies("+cuda"):
            env.prepend_path("LD_LIBRARY_PATH", self.spec["cuda"].prefix.lib64)
            env.prepend_path("LD_LIBRARY_PATH", self.spec["nccl"].prefix.lib)

    @run_after("install")
    def install_data(self):
        """Example decks, studies, job scripts and docs under share/ndtrain."""
        share = join_path(self.prefix.share, "ndtrain")
        for d in ("inputs", "jobscripts", "docs"):
            install_tree(d, join_path(share, d))

    def test_version(self):
        """ndtrain --version names the installed version"""
        ndtrain = which(self.prefix.bin.ndtrain)
        out = ndtrain("--version", output=str.split, error=str.split)
        assert "ndtrain" in out

    def test_plan(self):
        """ndtrain plan validates the shipped tiny deck for 4 ranks without MPI"""
        ndtrain = which(self.prefix.bin.ndtrain)
        deck = join_path(self.prefix.share, "ndtrain", "inputs", "tiny.toml")
        out = ndtrain("plan", deck, "--ranks", "4", "--set", "parallel.tp=2", output=str.split, error=str.split)
        assert "is valid for 4 ranks" in out

    def test_sweep(self):
        """ndtrain sweep expands the shipped tiny strong-scaling study outside the source tree"""
        ndtrain = which(self.prefix.bin.ndtrain)
        study = join_path(self.prefix.share, "ndtrain", "inputs", "studies", "tiny_strong.toml")
        out = ndtrain("sweep", study, "--out", "ndtrain-sweep", output=str.split, error=str.split)
        # One folder with a deck and a job script per point: 1, 2 and 4 ranks.
        points = [d for d in os.listdir("ndtrain-sweep") if os.path.isfile(join_path("ndtrain-sweep", d, "deck.toml"))]
        assert len(points) == 3, out
        for d in points:
            assert os.path.isfile(join_path("ndtrain-sweep", d, "job.sh")), out

    def test_train(self):
        """ndtrain trains the tiny deck for 3 steps on 2 ranks and writes its logs"""
        mpirun = which(self.spec["mpi"].prefix.bin.mpirun) or which(self.spec["mpi"].prefix.bin.mpiexec)
        deck = join_path(self.prefix.share, "ndtrain", "inputs", "tiny.toml")
        out = mpirun(
            "-n", "2", self.prefix.bin.ndtrain, "train", deck,
            "--set", "run.steps=3", "--set", "optim.warmup_steps=1",
            "--set", 'run.out_dir="ndtrain-smoke"',
            output=str.split, error=str.split,
        )
        assert "final loss" in out

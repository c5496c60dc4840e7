# Copyright the ndtrain developers.
# SPDX-License-Identifier: Apache-2.0
"""Spack recipe for ndtrain (a Rust crate built with cargo).

Use this repository of recipes with `spack repo add <ndtrain checkout>/spack`; see
spack/README.md for what has been verified.
"""

from spack.package import *


class Ndtrain(CargoPackage):
    """SPMD MPI trainer for Llama-style transformers with N-dimensional parallelism
    (DP, FSDP, HSDP, TP, CP), sharded parallel-HDF5 checkpoints and per-rank timing logs."""

    homepage = "https://github.com/ndtrain/ndtrain"
    git = "https://github.com/ndtrain/ndtrain.git"

    license("Apache-2.0")

    version("main", branch="main")

    variant("cuda", default=False, description="NVIDIA GPU backend (cuBLAS, NVRTC kernels, NCCL)")
    variant(
        "native",
        default=False,
        description="Optimise for the CPU of the build host (-C target-cpu=native); off, the "
        "binary runs on any CPU of the family and the GEMM picks its kernels at run time",
    )

    depends_on("rust@1.85:", type="build")
    # rsmpi generates its MPI bindings with bindgen, which needs libclang.
    depends_on("llvm+clang", type="build")
    depends_on("pkgconfig", type="build")
    depends_on("mpi")
    # Checkpoints are written collectively through parallel HDF5 (MPI-IO).
    depends_on("hdf5@1.10:+mpi~java")
    depends_on("cuda", when="+cuda")
    depends_on("nccl", when="+cuda")

    @property
    def build_args(self):
        args = ["-j", str(make_jobs), "--locked"]
        if self.spec.satisfies("+cuda"):
            args += ["--features", "cuda"]
        return args

    def setup_build_environment(self, env):
        spec = self.spec
        # hdf5-metno-sys finds the library here; rsmpi asks the MPI compiler wrapper.
        env.set("HDF5_DIR", spec["hdf5"].prefix)
        env.set("MPICC", spec["mpi"].mpicc)
        env.set("LIBCLANG_PATH", spec["llvm"].prefix.lib)
        # The repository's .cargo/config.toml builds for the host CPU; a Spack build may run
        # on a login node of another CPU, so that is opt-in (+native).
        env.set("RUSTFLAGS", "-C target-cpu=native" if spec.satisfies("+native") else "")
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

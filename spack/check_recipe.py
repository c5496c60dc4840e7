#!/usr/bin/env python3
"""Checks the Spack recipe's declarations without Spack (which needs its own installation and
network): small stand-ins for the classes and directives the recipe imports record what its
class body declares, and this script holds the record to what the recipe must say.

    python3 spack/check_recipe.py        # CI runs it; exit 1 with one line per finding

What it checks: the recipe is a CargoPackage and a CudaPackage (no `cuda` variant of its own,
which would shadow CudaPackage's); `+cuda` requires `cuda@12:` and NCCL, with one
`depends_on("nccl+cuda cuda_arch=A", when="+cuda cuda_arch=A")` per architecture CudaPackage
offers; `+cuda cuda_arch=none` is refused with a message that says to set cuda_arch; MPI and
parallel HDF5 are required; every version has a sha256 or a branch; `build_args` asks cargo
for `--features cuda` exactly with `+cuda`; the files the stand-alone tests and the install
step use exist in the source tree; every stand-alone test has a docstring. It cannot check
that Spack concretizes the spec: only a Spack installation can (spack/README.md).
"""

import importlib.util
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(HERE)
RECIPE = os.path.join(HERE, "spack_repo", "ndtrain", "packages", "ndtrain", "package.py")

#: What each directive of the recipe's class body was called with, in order.
RECORD = []


def directive(kind):
    def record(*args, **kwargs):
        RECORD.append((kind, args, kwargs))

    return record


class CargoPackage:
    """Stand-in for spack_repo.builtin.build_systems.cargo.CargoPackage."""


class CudaPackage:
    """Stand-in for spack_repo.builtin.build_systems.cuda.CudaPackage: the variants it
    declares and a sample of its architecture values (the real list is longer; the recipe
    must loop over whatever it holds)."""

    cuda_arch_values = ("60", "70", "75", "80", "86", "89", "90", "90a", "100", "120")
    variants = {"cuda": False, "cuda_arch": "none"}


def install_modules():
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    for name in ("spack_repo", "spack_repo.builtin", "spack_repo.builtin.build_systems", "spack"):
        module(name)
    module("spack_repo.builtin.build_systems.cargo", CargoPackage=CargoPackage)
    module("spack_repo.builtin.build_systems.cuda", CudaPackage=CudaPackage)
    package = {
        kind: directive(kind)
        for kind in ("version", "variant", "depends_on", "conflicts", "requires", "license", "provides", "patch", "resource")
    }
    package.update(
        join_path=os.path.join,
        which=lambda *a, **k: None,
        install_tree=lambda *a, **k: None,
        run_after=lambda *a, **k: (lambda f: f),
        run_before=lambda *a, **k: (lambda f: f),
    )
    package["__all__"] = list(package)
    module("spack.package", **package)


class Spec:
    """Enough of a concrete spec for `build_args`: `satisfies` on the variants given."""

    def __init__(self, *variants):
        self.variants = set(variants)

    def satisfies(self, constraint):
        return all(part in self.variants for part in constraint.split())


def main():
    install_modules()
    spec = importlib.util.spec_from_file_location("ndtrain_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cls = recipe.Ndtrain
    problems = []

    def need(ok, message):
        if not ok:
            problems.append(message)

    def calls(kind):
        return [(a, k) for (t, a, k) in RECORD if t == kind]

    need(issubclass(cls, CargoPackage) and issubclass(cls, CudaPackage), "Ndtrain must derive from CargoPackage and CudaPackage")
    need(not any(a and a[0] == "cuda" for a, _ in calls("variant")), "a variant('cuda') of its own shadows CudaPackage's")
    deps = [(a[0], k.get("when")) for a, k in calls("depends_on")]
    need(("cuda@12:", "+cuda") in deps, "missing depends_on('cuda@12:', when='+cuda')")
    need(("mpi", None) in deps, "missing depends_on('mpi')")
    need(any(d.startswith("hdf5") and "+mpi" in d for d, _ in deps), "missing a parallel HDF5 (hdf5+mpi)")
    for arch in CudaPackage.cuda_arch_values:
        want = (f"nccl+cuda cuda_arch={arch}", f"+cuda cuda_arch={arch}")
        need(want in deps, f"missing depends_on({want[0]!r}, when={want[1]!r}): NCCL must be built for the spec's GPUs")
    refusals = [k for a, k in calls("conflicts") if a and a[0] == "cuda_arch=none" and k.get("when") == "+cuda"]
    need(refusals and "cuda_arch" in refusals[0].get("msg", "") and "set" in refusals[0].get("msg", ""),
         "missing conflicts('cuda_arch=none', when='+cuda', msg=...) telling to set cuda_arch")
    for a, k in calls("version"):
        sha = k.get("sha256", "")
        need(bool(re.fullmatch(r"[0-9a-f]{64}", sha)) or "branch" in k or "tag" in k,
             f"version {a[0]!r} has neither a sha256 nor a branch or tag")

    # build_args with and without +cuda (a stage without vendor/: a git checkout).
    for variants, features in ((("+cuda",), True), ((), False)):
        pkg = cls.__new__(cls)
        pkg.spec = Spec(*variants)
        pkg.stage = types.SimpleNamespace(source_path=SOURCE)
        args = pkg.build_args
        has = any(args[i:i + 2] == ["--features", "cuda"] for i in range(len(args)))
        need(has == features, f"build_args {args} with variants {variants}: --features cuda {'missing' if features else 'unexpected'}")
        need("--locked" in args, f"build_args {args}: --locked missing")

    # The files the install step and the stand-alone tests use.
    text = open(RECIPE).read()
    for d in ("inputs", "jobscripts", "docs"):
        need(os.path.isdir(os.path.join(SOURCE, d)), f"install_data installs {d}/, which is not in the source tree")
    for rel in re.findall(r'"inputs",\s*((?:"[^"]+",\s*)*"[^"]+\.toml")', text):
        path = os.path.join(SOURCE, "inputs", *re.findall(r'"([^"]+)"', rel))
        need(os.path.isfile(path), f"a stand-alone test uses {os.path.relpath(path, SOURCE)}, which does not exist")
    tests = [n for n in dir(cls) if n.startswith("test_")]
    for name in ("test_version", "test_plan", "test_sweep", "test_train"):
        need(name in tests, f"stand-alone test {name} missing")
    for name in tests:
        need(bool((getattr(cls, name).__doc__ or "").strip()), f"{name} has no docstring (spack test list shows it)")

    for p in problems:
        print(f"spack/check_recipe.py: {p}")
    if problems:
        return 1
    print(f"spack/check_recipe.py: the recipe's declarations hold ({len(RECORD)} directives, "
          f"{len(CudaPackage.cuda_arch_values)} cuda_arch values, tests {', '.join(sorted(tests))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

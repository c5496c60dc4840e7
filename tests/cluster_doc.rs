//! `docs/cluster.md` stays runnable: every command of its `bash` blocks is mapped here to the
//! test or CI step that runs it, or to the reason it cannot run on the build machine (Spack,
//! Apptainer, Lustre, an aarch64 toolchain), which the page must then say plainly. A command
//! added to the page without an entry here, an entry whose test or CI step is gone, or a
//! command the page no longer has, fails.

mod common;

use common::repo;

/// Where a command of the page is run.
enum Run {
    /// A test: the file holds this text (the test's function, or the argument it passes).
    Test(&'static str, &'static str),
    /// CI: `.ci/run` holds this text.
    Ci(&'static str),
    /// Not on the build machine, for want of this (the page must say "not run here" about it).
    NotHere(&'static str),
}

use Run::*;

const INSTALLED: Run = Test("tests/jobscripts.rs", "fn installed_job_scripts_run_from_any_folder()");

fn runs() -> Vec<(&'static str, Vec<Run>)> {
    vec![
        ("spack repo add /path/to/ndtrain/spack/spack_repo/ndtrain", vec![NotHere("Spack"), Ci("python3 spack/check_recipe.py")]),
        ("spack install ndtrain ^openmpi ^hdf5+mpi", vec![NotHere("Spack"), Ci("python3 spack/check_recipe.py")]),
        ("spack install ndtrain+cuda cuda_arch=90 ^openmpi", vec![NotHere("Spack"), Ci("python3 spack/check_recipe.py")]),
        ("spack load ndtrain", vec![NotHere("Spack"), INSTALLED]),
        ("spack/make-release.sh -o dist", vec![Ci("spack/make-release.sh -o target/dist --check")]),
        // make-release.sh --check builds the unpacked tarball with exactly this cargo command.
        ("cargo build --release --offline --locked", vec![Ci("spack/make-release.sh -o target/dist --check")]),
        ("ndtrain plan my.toml --ranks 8 --ranks-per-node 8", vec![Test("tests/plan.rs", "\"--ranks-per-node\"")]),
        (
            "sbatch --nodes=1 --ntasks-per-node=8 --cpus-per-task=4 --mem=64G --time=01:00:00 --export=ALL,DECK=my.toml \
             \"$(spack location -i ndtrain)/share/ndtrain/jobscripts/slurm/train.sbatch\"",
            vec![Test("tests/slurm.rs", "fn a_slurm_job_trains_and_checkpoints_and_a_second_job_resumes()"), INSTALLED],
        ),
        (
            "qsub -l select=1:ncpus=32:mpiprocs=8:ompthreads=4 -l walltime=01:00:00 -v DECK=my.toml \
             \"$(spack location -i ndtrain)/share/ndtrain/jobscripts/pbs/train.pbs\"",
            vec![
                INSTALLED,
                Test("tests/jobscripts.rs", "fn the_pbs_script_sources_the_setup_hook_and_resubmits_with_the_users_qsub_options()"),
            ],
        ),
        ("NRANKS=4 \"$(spack location -i ndtrain)/share/ndtrain/jobscripts/local/train.sh\" my.toml", vec![INSTALLED]),
        ("ndtrain sweep study.toml", vec![Test("tests/sweep.rs", "\"sweep\"")]),
        ("ndtrain sweep submit out/studies/my_study", vec![Test("tests/sweep.rs", "\"submit\"")]),
        ("ndtrain sweep status out/studies/my_study", vec![Test("tests/sweep.rs", "\"status\"")]),
        ("ndtrain report --study out/studies/my_study", vec![Test("tests/sweep.rs", "\"--study\"")]),
        ("lfs setstripe -c -1 -S 16M /scratch/me/run/ckpt", vec![NotHere("Lustre")]),
        ("apptainer build --build-arg VERSION=0.1.0 ndtrain.sif jobscripts/apptainer/ndtrain.def", vec![NotHere("Apptainer")]),
        ("srun --mpi=pmix apptainer exec ndtrain.sif ndtrain train my.toml", vec![NotHere("Apptainer")]),
    ]
}

/// The commands of the page's `bash` blocks, one per line (comments and blank lines skipped).
fn commands(page: &str) -> Vec<String> {
    let mut out = vec![];
    let mut in_bash = false;
    for line in page.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_bash = !in_bash && t == "```bash";
            continue;
        }
        if in_bash && !t.is_empty() && !t.starts_with('#') {
            out.push(t.to_string());
        }
    }
    out
}

#[test]
fn every_command_of_the_cluster_page_is_run_by_a_test_or_ci_or_said_not_to_run_here() {
    let page = std::fs::read_to_string(repo().join("docs/cluster.md")).unwrap();
    let ci = std::fs::read_to_string(repo().join(".ci/run")).unwrap();
    let cmds = commands(&page);
    assert!(cmds.len() >= 10, "{cmds:?}");
    let runs = runs();
    let mut problems = vec![];
    for c in &cmds {
        match runs.iter().find(|(cmd, _)| cmd == c) {
            None => problems.push(format!("{c}: no test, CI step or reason in tests/cluster_doc.rs")),
            Some((_, how)) => {
                for r in how {
                    match r {
                        Test(file, text) => {
                            let body = std::fs::read_to_string(repo().join(file)).unwrap_or_default();
                            if !body.contains(text) {
                                problems.push(format!("{c}: {file} does not hold {text}"));
                            }
                        }
                        Ci(text) => {
                            if !ci.contains(text) {
                                problems.push(format!("{c}: .ci/run does not hold {text}"));
                            }
                        }
                        NotHere(what) => {
                            let said = page.split("\n\n").any(|para| para.contains("**not run here**") && para.contains(what))
                                || page.lines().any(|l| l.contains("**no**") && l.contains(what));
                            if !said {
                                problems.push(format!("{c}: the page does not say that {what} is not run here"));
                            }
                        }
                    }
                }
            }
        }
    }
    for (cmd, _) in &runs {
        if !cmds.iter().any(|c| c == cmd) {
            problems.push(format!("{cmd}: mapped here, not on the page"));
        }
    }
    assert!(problems.is_empty(), "docs/cluster.md:\n{}", problems.join("\n"));
}

/// The README's usage section points to the quick start first.
#[test]
fn the_readme_usage_section_links_the_cluster_page_first() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let usage = readme.split("## Using it").nth(1).expect("a usage section");
    let first = usage.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
    assert!(first.contains("docs/cluster.md"), "first line of the usage section: {first}");
}

//! Build facts the program records about itself (`run.json`, the console banner): the git
//! commit it was built from, the cargo profile, the target triple and the compiler.
//!
//! The commit is read from `.git` directly (no `git` command is needed): `HEAD`, the branch it
//! names, or `packed-refs`. `NDTRAIN_GIT_COMMIT` in the build's environment overrides it (a
//! source tarball, a Spack build); without either it is `unknown`. Cargo reruns this script
//! only when `HEAD`, the branch's ref, `packed-refs` or the override change, so builds stay
//! incremental.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NDTRAIN_GIT_COMMIT");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let (commit, from) = match std::env::var("NDTRAIN_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => (c.trim().to_string(), "env"),
        _ => match git_dir(&manifest).and_then(|g| commit_of(&g)) {
            Some(c) => (c, "git"),
            None => ("unknown".into(), "none"),
        },
    };
    println!("cargo:rustc-env=NDTRAIN_GIT_COMMIT={commit}");
    // Where it came from: `git`, `env` (the override) or `none`.
    println!("cargo:rustc-env=NDTRAIN_GIT_COMMIT_FROM={from}");
    for (name, key) in [("PROFILE", "NDTRAIN_BUILD_PROFILE"), ("TARGET", "NDTRAIN_BUILD_TARGET")] {
        println!("cargo:rustc-env={key}={}", std::env::var(name).unwrap_or_else(|_| "unknown".into()));
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=NDTRAIN_BUILD_RUSTC={version}");
    cpu_check();
}

/// The start-up CPU feature check (`src/backend/cpu/cpu_check.c`), compiled for baseline
/// x86-64 whatever the Rust code targets, and told the features the Rust code may use.
fn cpu_check() {
    println!("cargo:rerun-if-changed=src/backend/cpu/cpu_check.c");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return;
    }
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    cc::Build::new()
        .file("src/backend/cpu/cpu_check.c")
        .flag("-march=x86-64")
        .flag("-mtune=generic")
        .define("NDTRAIN_FEATURES", format!("\"{features}\"").as_str())
        .compile("ndtrain_cpu_check");
}

/// The repository's git directory: `.git`, or where a `.git` file points (a worktree).
fn git_dir(root: &Path) -> Option<PathBuf> {
    let dot = root.join(".git");
    if dot.is_dir() {
        return Some(dot);
    }
    let text = std::fs::read_to_string(&dot).ok()?;
    let target = PathBuf::from(text.strip_prefix("gitdir:")?.trim());
    Some(if target.is_absolute() { target } else { root.join(target) })
}

/// The commit `HEAD` points at (directly, through a loose ref, or through `packed-refs`), with
/// the files it was read from registered for reruns.
fn commit_of(git: &Path) -> Option<String> {
    let head_path = git.join("HEAD");
    println!("cargo:rerun-if-changed={}", head_path.display());
    let head = std::fs::read_to_string(&head_path).ok()?;
    let head = head.trim();
    let Some(name) = head.strip_prefix("ref:").map(str::trim) else {
        return is_hash(head).then(|| head.to_string());
    };
    // A worktree keeps its HEAD apart but shares the refs with the main repository.
    let common = std::fs::read_to_string(git.join("commondir")).ok().map(|c| git.join(c.trim())).unwrap_or_else(|| git.to_path_buf());
    let loose = common.join(name);
    let packed = common.join("packed-refs");
    // Cargo reruns every build for a path that does not exist: watch only what is there (the
    // ref's folder while the ref is only packed, so that its first loose write is seen).
    let ref_watch = if loose.exists() { Some(loose.as_path()) } else { loose.parent().filter(|d| d.exists()) };
    for path in ref_watch.into_iter().chain(packed.exists().then_some(packed.as_path())) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    if let Ok(c) = std::fs::read_to_string(&loose) {
        let c = c.trim();
        return is_hash(c).then(|| c.to_string());
    }
    let packed = std::fs::read_to_string(packed).ok()?;
    packed.lines().find_map(|l| {
        let (hash, r) = l.split_once(' ')?;
        (r.trim() == name && is_hash(hash)).then(|| hash.to_string())
    })
}

fn is_hash(s: &str) -> bool {
    (40..=64).contains(&s.len()) && s.chars().all(|c| c.is_ascii_hexdigit())
}

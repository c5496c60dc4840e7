//! The CPU features this binary was compiled to use, against those of the CPU it runs on. A
//! binary built for a newer CPU (`-C target-cpu=native` on a login node of another generation)
//! would otherwise die of SIGILL somewhere in its first kernel; checked first thing instead, it
//! ends with one line naming the missing features (as GROMACS checks its SIMD level at start).

/// The x86-64 features a `-C target-cpu` can switch on that the kernels and the compiler's
/// code may use, each with whether this build may use it.
#[cfg(target_arch = "x86_64")]
const COMPILED: &[(&str, bool)] = &[
    ("sse4.2", cfg!(target_feature = "sse4.2")),
    ("popcnt", cfg!(target_feature = "popcnt")),
    ("avx", cfg!(target_feature = "avx")),
    ("avx2", cfg!(target_feature = "avx2")),
    ("fma", cfg!(target_feature = "fma")),
    ("bmi1", cfg!(target_feature = "bmi1")),
    ("bmi2", cfg!(target_feature = "bmi2")),
    ("f16c", cfg!(target_feature = "f16c")),
    ("lzcnt", cfg!(target_feature = "lzcnt")),
    ("movbe", cfg!(target_feature = "movbe")),
    ("avx512f", cfg!(target_feature = "avx512f")),
    ("avx512bw", cfg!(target_feature = "avx512bw")),
    ("avx512cd", cfg!(target_feature = "avx512cd")),
    ("avx512dq", cfg!(target_feature = "avx512dq")),
    ("avx512vl", cfg!(target_feature = "avx512vl")),
    ("avx512vnni", cfg!(target_feature = "avx512vnni")),
    ("avx512bf16", cfg!(target_feature = "avx512bf16")),
    ("avx512vbmi", cfg!(target_feature = "avx512vbmi")),
    ("avx512vbmi2", cfg!(target_feature = "avx512vbmi2")),
    ("avx512bitalg", cfg!(target_feature = "avx512bitalg")),
    ("avx512vpopcntdq", cfg!(target_feature = "avx512vpopcntdq")),
    ("avx512ifma", cfg!(target_feature = "avx512ifma")),
    ("gfni", cfg!(target_feature = "gfni")),
    ("vaes", cfg!(target_feature = "vaes")),
    ("vpclmulqdq", cfg!(target_feature = "vpclmulqdq")),
];

#[cfg(not(target_arch = "x86_64"))]
const COMPILED: &[(&str, bool)] = &[];

/// `NDTRAIN_DEBUG_CPU_FEATURES`: a comma-separated feature list that replaces what the CPU
/// reports (to test the check on a CPU that has everything; `docs/debugging.md`).
pub const CPU_FEATURES_ENV: &str = "NDTRAIN_DEBUG_CPU_FEATURES";

/// The features this build may use, of those [`COMPILED`] names.
pub fn compiled() -> Vec<&'static str> {
    COMPILED.iter().filter(|(_, on)| *on).map(|(name, _)| *name).collect()
}

/// Whether the running CPU has `feature` (one of [`COMPILED`]'s names).
#[cfg(target_arch = "x86_64")]
fn detected(feature: &str) -> bool {
    use std::arch::is_x86_feature_detected as has;
    match feature {
        "sse4.2" => has!("sse4.2"),
        "popcnt" => has!("popcnt"),
        "avx" => has!("avx"),
        "avx2" => has!("avx2"),
        "fma" => has!("fma"),
        "bmi1" => has!("bmi1"),
        "bmi2" => has!("bmi2"),
        "f16c" => has!("f16c"),
        "lzcnt" => has!("lzcnt"),
        "movbe" => has!("movbe"),
        "avx512f" => has!("avx512f"),
        "avx512bw" => has!("avx512bw"),
        "avx512cd" => has!("avx512cd"),
        "avx512dq" => has!("avx512dq"),
        "avx512vl" => has!("avx512vl"),
        "avx512vnni" => has!("avx512vnni"),
        "avx512bf16" => has!("avx512bf16"),
        "avx512vbmi" => has!("avx512vbmi"),
        "avx512vbmi2" => has!("avx512vbmi2"),
        "avx512bitalg" => has!("avx512bitalg"),
        "avx512vpopcntdq" => has!("avx512vpopcntdq"),
        "avx512ifma" => has!("avx512ifma"),
        "gfni" => has!("gfni"),
        "vaes" => has!("vaes"),
        "vpclmulqdq" => has!("vpclmulqdq"),
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detected(_feature: &str) -> bool {
    true
}

/// The compiled-in features `has` says the CPU lacks.
fn missing(has: impl Fn(&str) -> bool) -> Vec<&'static str> {
    compiled().into_iter().filter(|f| !has(f)).collect()
}

/// Ok when this CPU has every feature the build may use; else the one line to end with.
pub fn check() -> Result<(), String> {
    let injected = std::env::var(CPU_FEATURES_ENV).ok();
    let lacking = match &injected {
        Some(list) => missing(|f| list.split(',').any(|g| g.trim() == f)),
        None => missing(detected),
    };
    if lacking.is_empty() {
        return Ok(());
    }
    Err(format!(
        "this ndtrain was built for CPU features this CPU lacks: {} (built for: {}). Rebuild on this \
         machine's CPU type, or with the portable default (`cargo build --release` without RUSTFLAGS: x86-64-v3, \
         AVX2 + FMA), or for the oldest CPU of the cluster (e.g. RUSTFLAGS=\"-C target-cpu=x86-64-v3\")",
        lacking.join(" "),
        compiled().join(" ")
    ))
}

/// The features of the x86-64 microarchitecture levels, each beyond the one below.
const LEVEL_V2: &[&str] = &["sse4.2", "popcnt"];
const LEVEL_V3: &[&str] = &["avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "lzcnt", "movbe"];
const LEVEL_V4: &[&str] = &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"];

/// A short name of what the build targets, for the banner: the x86-64 level its features
/// reach (`x86-64-v4` with AVX-512, `x86-64-v3` with AVX2 and FMA, …) and what it has beyond.
pub fn build_target() -> String {
    let c = compiled();
    let reaches = |level: &[&str]| level.iter().all(|f| c.contains(f));
    let level = if reaches(LEVEL_V4) {
        "x86-64-v4"
    } else if reaches(LEVEL_V3) {
        "x86-64-v3"
    } else if reaches(LEVEL_V2) {
        "x86-64-v2"
    } else {
        std::env::consts::ARCH
    };
    let named = |f: &&str| [LEVEL_V2, LEVEL_V3, LEVEL_V4].iter().any(|l| l.contains(f));
    let extra: Vec<&str> = c.iter().copied().filter(|f| !named(f)).collect();
    if extra.is_empty() {
        level.to_string()
    } else {
        format!("{level} +{}", extra.join(" +"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_without_a_compiled_feature_is_named() {
        // This build's own CPU has what it was built for.
        assert!(missing(detected).is_empty(), "{:?}", missing(detected));
        // A CPU reporting nothing lacks everything the build uses.
        assert_eq!(missing(|_| false), compiled());
        if compiled().contains(&"avx2") {
            assert!(missing(|f| f != "avx2").contains(&"avx2"));
        }
    }
}

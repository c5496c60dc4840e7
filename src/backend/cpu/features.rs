//! The CPU features this binary was compiled to use, against those of the CPU it runs on. A
//! binary built for a newer CPU (`-C target-cpu=native` on a login node of another generation)
//! would otherwise die of SIGILL somewhere in its first instructions; checked before `main`
//! instead (in `cpu_check.c`, built for baseline x86-64 by `build.rs`), it ends with one line
//! naming the missing features (as GROMACS checks its SIMD level at start).

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

#[cfg(target_arch = "x86_64")]
extern "C" {
    /// Set by the check in `cpu_check.c`, which the loader runs before `main`.
    static ndtrain_cpu_check_passed: std::ffi::c_int;
    #[cfg(test)]
    fn ndtrain_cpu_has(name: *const std::ffi::c_char) -> std::ffi::c_int;
}

/// Whether the start-up check passed. It runs in C before `main` (`cpu_check.c`, compiled for
/// baseline x86-64): the Rust code, this function included, is compiled for the build's level
/// and could already fault on a CPU without it. A CPU that lacks a feature never gets here:
/// the check prints one line naming the missing features (and what the build uses) and ends
/// the process with code 2. Calling this keeps the check linked into every binary.
#[cfg(target_arch = "x86_64")]
pub fn check_passed() -> bool {
    // SAFETY: a C int written once, by the constructor, before any Rust code runs.
    unsafe { std::ptr::read_volatile(&raw const ndtrain_cpu_check_passed) != 0 }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn check_passed() -> bool {
    true
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The C check reads CPUID and XGETBV itself: it agrees with the standard library's
    /// detection on every feature the table names.
    #[test]
    fn the_start_up_check_sees_the_features_the_standard_library_sees() {
        use std::arch::is_x86_feature_detected as has;
        let std_says = |f: &str| match f {
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
            other => panic!("no standard detection named for {other}"),
        };
        for (name, _) in COMPILED {
            let c_name = std::ffi::CString::new(*name).unwrap();
            // SAFETY: a NUL-terminated string, read only.
            let c_says = unsafe { ndtrain_cpu_has(c_name.as_ptr()) } != 0;
            assert_eq!(c_says, std_says(name), "{name}");
        }
        assert!(check_passed(), "this build runs on its build machine");
    }
}

fn main() {
    // System OpenBLAS (Debian: libopenblas-dev -> libopenblas0-pthread).
    println!("cargo:rustc-link-lib=openblas");
    println!("cargo:rerun-if-changed=build.rs");
}

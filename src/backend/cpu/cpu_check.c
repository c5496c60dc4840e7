/*
 * The CPU feature check, run before anything else of the program: a constructor the loader
 * calls before `main`, compiled for the baseline x86-64 instruction set (`build.rs`). The Rust
 * code is compiled for the build's level (x86-64-v3 by default), so any of it — the check
 * itself included — may already use AVX2; on an older CPU it would die of SIGILL before it
 * could say why. This file reads the CPU's features with CPUID (and XGETBV: whether the
 * operating system saves the AVX and AVX-512 registers), compares them with those the build
 * uses (NDTRAIN_FEATURES, from cargo's target features) and, when some are missing, prints one
 * line and exits with code 2. NDTRAIN_DEBUG_CPU_FEATURES (a comma-separated list) replaces
 * what the CPU reports, so the path is testable on any machine (docs/debugging.md).
 */
#include <cpuid.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef NDTRAIN_FEATURES
#define NDTRAIN_FEATURES ""
#endif

enum { EAX, EBX, ECX, EDX };

/* XCR0 bits the OS must enable: SSE and AVX state (0x6); with AVX-512, opmask and ZMM (0xe6). */
#define XCR0_AVX 0x6u
#define XCR0_AVX512 0xe6u

struct feature {
    const char *name; /* rustc's name */
    unsigned leaf, subleaf;
    int reg;
    unsigned bit;
    unsigned xcr0;
};

static const struct feature FEATURES[] = {
    {"sse4.2", 1, 0, ECX, 20, 0},
    {"popcnt", 1, 0, ECX, 23, 0},
    {"avx", 1, 0, ECX, 28, XCR0_AVX},
    {"avx2", 7, 0, EBX, 5, XCR0_AVX},
    {"fma", 1, 0, ECX, 12, XCR0_AVX},
    {"bmi1", 7, 0, EBX, 3, 0},
    {"bmi2", 7, 0, EBX, 8, 0},
    {"f16c", 1, 0, ECX, 29, XCR0_AVX},
    {"lzcnt", 0x80000001u, 0, ECX, 5, 0},
    {"movbe", 1, 0, ECX, 22, 0},
    {"avx512f", 7, 0, EBX, 16, XCR0_AVX512},
    {"avx512bw", 7, 0, EBX, 30, XCR0_AVX512},
    {"avx512cd", 7, 0, EBX, 28, XCR0_AVX512},
    {"avx512dq", 7, 0, EBX, 17, XCR0_AVX512},
    {"avx512vl", 7, 0, EBX, 31, XCR0_AVX512},
    {"avx512vnni", 7, 0, ECX, 11, XCR0_AVX512},
    {"avx512bf16", 7, 1, EAX, 5, XCR0_AVX512},
    {"avx512vbmi", 7, 0, ECX, 1, XCR0_AVX512},
    {"avx512vbmi2", 7, 0, ECX, 6, XCR0_AVX512},
    {"avx512bitalg", 7, 0, ECX, 12, XCR0_AVX512},
    {"avx512vpopcntdq", 7, 0, ECX, 14, XCR0_AVX512},
    {"avx512ifma", 7, 0, EBX, 21, XCR0_AVX512},
    {"gfni", 7, 0, ECX, 8, 0},
    {"vaes", 7, 0, ECX, 9, XCR0_AVX},
    {"vpclmulqdq", 7, 0, ECX, 10, XCR0_AVX},
};

/* Whether `name` is an item of the comma-separated `list`. */
static int listed(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        while (len > 0 && *p == ' ') { p++; len--; }
        while (len > 0 && p[len - 1] == ' ') len--;
        if (len == n && strncmp(p, name, n) == 0) return 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

static unsigned xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* no OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return lo;
}

static int detected(const struct feature *f, unsigned os_state) {
    unsigned r[4] = {0, 0, 0, 0};
    if (!__get_cpuid_count(f->leaf, f->subleaf, &r[EAX], &r[EBX], &r[ECX], &r[EDX])) return 0;
    return (r[f->reg] >> f->bit & 1u) && (os_state & f->xcr0) == f->xcr0;
}

static void say(const char *s) {
    ssize_t unused = write(2, s, strlen(s));
    (void)unused;
}

/* Whether this CPU (and its OS) has feature `name`, as the check sees it (for a test against
 * the standard library's detection); 0 for a name the table does not know. */
int ndtrain_cpu_has(const char *name) {
    for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
        if (strcmp(FEATURES[i].name, name) == 0) return detected(&FEATURES[i], xcr0());
    }
    return 0;
}

/* Set once the check has passed: what the Rust side reads to keep this object linked in. */
int ndtrain_cpu_check_passed = 0;

__attribute__((constructor)) static void ndtrain_cpu_check(void) {
    const char *injected = getenv("NDTRAIN_DEBUG_CPU_FEATURES");
    unsigned os_state = xcr0();
    char line[2048] = "error: this ndtrain was built for CPU features this CPU lacks:";
    int missing = 0;
    for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
        const struct feature *f = &FEATURES[i];
        if (!listed(NDTRAIN_FEATURES, f->name)) continue;
        int has = injected ? listed(injected, f->name) : detected(f, os_state);
        if (!has) {
            strcat(line, " ");
            strcat(line, f->name);
            missing = 1;
        }
    }
    if (!missing) {
        ndtrain_cpu_check_passed = 1;
        return;
    }
    strcat(line, " (built for:");
    for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
        if (listed(NDTRAIN_FEATURES, FEATURES[i].name)) {
            strcat(line, " ");
            strcat(line, FEATURES[i].name);
        }
    }
    strcat(line, "). Rebuild on this machine's CPU type, or with the portable default (`cargo build --release` "
                 "without RUSTFLAGS: x86-64-v3, AVX2 + FMA), or for the oldest CPU of the cluster "
                 "(e.g. RUSTFLAGS=\"-C target-cpu=x86-64-v3\")\n");
    say(line);
    _exit(2);
}

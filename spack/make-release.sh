#!/usr/bin/env bash
# Build the release source tarball ndtrain-<version>.tar.gz from a committed tree, with every
# crate dependency vendored, so that it builds with `cargo build --offline --locked` on a
# machine without network access or a ~/.cargo registry (a Spack build, an air-gapped cluster).
#
#   spack/make-release.sh [REF] [-o DIR] [--check [-- CARGO-BUILD-ARGS...]]
#
# REF          the commit, tag or branch to package (default HEAD). Only what is committed there
#              goes in (`git archive`): uncommitted changes in the working tree never do.
# -o DIR       where to write the tarball and its .sha256 file (default target/dist).
# --check      then unpack the tarball into a temporary folder and build it there with
#              `cargo build --offline --locked` (plus any CARGO-BUILD-ARGS, e.g. `--release`
#              or `--features cuda`) under an empty CARGO_HOME with CARGO_NET_OFFLINE=true,
#              and run the binary's `--version`. It builds in the unpacked tree's own target/
#              (CARGO_TARGET_DIR is ignored), removed afterwards: vendored crates are found
#              under other paths than registry ones, so cargo would rebuild every one of them
#              in a shared target folder anyway, overwriting the artifacts kept there.
#
# The tarball holds one folder ndtrain-<version>/ (the version is the one in REF's Cargo.toml):
# the tree at REF, including Cargo.lock; vendor/, every package of Cargo.lock as `cargo vendor`
# writes it (all of them, whatever the platform or feature: the optional `cuda` feature's
# cudarc too); and .cargo/config.toml, REF's own (target rustflags, [env]) with cargo's
# source-replacement tables appended and the commit recorded as NDTRAIN_GIT_COMMIT in [env]
# (an NDTRAIN_GIT_COMMIT set in the build's environment still wins).
#
# Reproducible: the same REF gives the same bytes (names sorted, every mtime the commit's date,
# owner and group 0, normalised modes, `gzip -n`), given the same tar, gzip and cargo vendor.
# It prints the sha256 and the `version(...)` line for the Spack recipe (spack/README.md).
set -euo pipefail
umask 022
export LC_ALL=C

die() { echo "make-release: $*" >&2; exit 2; }

ref=HEAD
outdir=
check=0
build_args=()
while (($#)); do
    case $1 in
        -o | --out) (($# >= 2)) || die "$1 needs a folder"; outdir=$2; shift 2 ;;
        --check) check=1; shift ;;
        --) shift; build_args=("$@"); break ;;
        -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) ref=$1; shift ;;
    esac
done
((check)) || ((${#build_args[@]} == 0)) || die "cargo build arguments after -- need --check"

for tool in git cargo tar gzip sha256sum; do
    command -v "$tool" >/dev/null || die "$tool not found"
done

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse --verify --quiet "$ref^{commit}") || die "$ref is not a commit"
epoch=$(git -C "$repo" log -1 --format=%ct "$commit")
# The [package] version of REF's Cargo.toml.
version=$(git -C "$repo" show "$commit:Cargo.toml" | awk '
    /^\[/ { in_pkg = ($0 ~ /^\[package\][[:space:]]*$/) }
    in_pkg && /^version[[:space:]]*=/ { v = $0; sub(/^[^"]*"/, "", v); sub(/".*/, "", v); print v; exit }')
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.+-]+)?$ ]] || die "no [package] version in $ref's Cargo.toml"
name=ndtrain-$version
outdir=${outdir:-$repo/target/dist}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
tarball=$outdir/$name.tar.gz

work=$(mktemp -d "${TMPDIR:-/tmp}/ndtrain-release.XXXXXX")
trap 'rm -rf "$work"' EXIT
src=$work/$name

echo "make-release: $name from $commit ($(git -C "$repo" log -1 --format=%cI "$commit"))" >&2
git -C "$repo" archive --format=tar --prefix="$name/" "$commit" | tar -x -C "$work"
[[ -f $src/Cargo.lock ]] || die "$ref has no committed Cargo.lock"
config=$src/.cargo/config.toml
if [[ -f $config ]] && grep -q '^[[:space:]]*\[source[].]' "$config"; then
    die "$ref's .cargo/config.toml already has [source] tables: merge them by hand"
fi

# Vendor what Cargo.lock names, exactly (--locked: never re-resolve). The crates come from the
# local registry cache or, for those never downloaded here, from crates.io.
(cd "$src" && cargo vendor --locked vendor) >"$work/sources.toml" 2>"$work/vendor.log" ||
    { cat "$work/vendor.log" >&2; die "cargo vendor failed"; }
grep -q '^\[source\.crates-io\]' "$work/sources.toml" || die "cargo vendor printed no source replacement"

# REF's config with the commit appended to its [env] table (a new table if it has none), then
# cargo's tables.
mkdir -p "$src/.cargo"
touch "$config"
awk -v commit="$commit" '
    function entry() {
        print "# The commit this release tarball was made from (spack/make-release.sh)."
        printf "NDTRAIN_GIT_COMMIT = { value = \"%s\", force = false }\n", commit
        done = 1
    }
    # Blank and comment lines after the [env] table belong to the next table: held back.
    in_env && /^[[:space:]]*(#.*)?$/ { held = held $0 "\n"; next }
    /^[[:space:]]*\[/ { if (in_env) entry(); in_env = ($0 ~ /^\[env\][[:space:]]*(#.*)?$/) }
    { printf "%s", held; held = ""; print }
    END {
        if (in_env) entry()
        printf "%s", held
        if (!done) { print ""; print "[env]"; entry() }
    }
' "$config" >"$work/config.toml"
{
    cat "$work/config.toml"
    echo
    echo "# Crates come from vendor/ (added by spack/make-release.sh): builds need no network."
    cat "$work/sources.toml"
} >"$config"

tar --create --format=gnu --sort=name --mtime="@$epoch" \
    --owner=0 --group=0 --numeric-owner --mode='u+rw,go=u-w' \
    -C "$work" "$name" | gzip -9 -n >"$tarball.part"
mv "$tarball.part" "$tarball"
sum=$(sha256sum "$tarball" | cut -d' ' -f1)
(cd "$outdir" && echo "$sum  $name.tar.gz" >"$name.tar.gz.sha256")

echo "tarball: $tarball ($(du -h "$tarball" | cut -f1), $(find "$src/vendor" -mindepth 1 -maxdepth 1 -type d | wc -l) vendored crates)"
echo "commit:  $commit"
echo "sha256:  $sum"
echo "spack:   version(\"$version\", sha256=\"$sum\")"

if ((check)); then
    # A fresh unpack of the tarball itself, an empty CARGO_HOME and no network: what a Spack
    # build or an air-gapped machine sees.
    rm -rf "$src"
    mkdir "$work/check" "$work/cargo-home"
    tar -xzf "$tarball" -C "$work/check"
    echo "+ cargo build --offline --locked ${build_args[*]}   (unpacked tarball, empty CARGO_HOME, CARGO_NET_OFFLINE=true)" >&2
    start=$SECONDS
    (
        cd "$work/check/$name"
        # No incremental state for a tree that is thrown away afterwards.
        export CARGO_HOME=$work/cargo-home CARGO_NET_OFFLINE=true CARGO_INCREMENTAL=0
        unset CARGO_TARGET_DIR CARGO_BUILD_TARGET_DIR
        cargo build --offline --locked "${build_args[@]}"
        cargo run --quiet --offline --locked "${build_args[@]}" --bin ndtrain -- --version
    )
    echo "make-release: the tarball builds offline ($((SECONDS - start)) s)" >&2
fi

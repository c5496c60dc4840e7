//! The real binary on bad input, alone and under `mpirun`: every rank exits non-zero, one `error:` line, no panic, no hang.
//!
//! What this holds and `tests/deck_errors.rs` (the wording of the library's deck messages) does
//! not: the process's side of a failure — the exit code, one line without panic or backtrace,
//! said once by rank 0 or by the one failing rank naming itself, no rank left waiting — and bad
//! input beyond the deck: token files, HDF5 datasets, paths the deck names, a CPU without the
//! build's features. Its deck cases check only one substring of each message.
//!
//! `every_bad_input_fails_cleanly_on_every_rank` runs one table of malformed or inconsistent
//! inputs under `mpirun -n 2`: llm.c `.bin` and HDF5 token files the test writes (bad headers,
//! sizes, ids, dtypes, shapes, names, patterns), deck files (not UTF-8, TOML errors) and
//! overrides (NaN, infinite, negative, too large), and paths named by the deck (resume,
//! init_from, out_dir).

mod common;
use common::*;
use ndtrain::data::{BIN_MAGIC_GPT2, BIN_MAGIC_LLAMA3, BIN_VERSION_GPT2, BIN_VERSION_LLAMA3};
use ndtrain::io::hdf5::{write_tokens, TokenSlice};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Generous bound for a run that should fail at start-up; a hang would hit it.
const FAIL_FAST_SECS: u64 = 60;

/// Each entry: a name, the `--set` overrides that break the tiny deck, and a substring the
/// error must contain.
const BAD_DECKS: &[(&str, &[&str], &str)] = &[
    ("unknown key", &["model.n_head=4"], "n_heads"),
    ("unknown table", &["modle.d_model=64"], "[model]"),
    ("wrong type", &["model.d_model=\"big\""], "[model] d_model"),
    ("bad enum", &["optim.schedule=\"exp\""], "cosine"),
    ("d_model % n_heads", &["model.d_model=60"], "n_heads"),
    ("n_heads % n_kv_heads", &["model.n_kv_heads=3"], "n_kv_heads"),
    ("seq_len > max_seq_len", &["train.seq_len=512"], "max_seq_len"),
    ("world size", &["parallel.dp_shard=2"], "but the job has 1 rank"),
    ("global batch", &["train.global_batch=15"], "global_batch(15)"),
    ("negative lr", &["optim.lr=-1.0"], "[optim] lr"),
    ("min_lr above lr", &["optim.min_lr=1.0"], "min_lr"),
    ("beta out of range", &["optim.beta2=1.0"], "beta2"),
    ("zero steps", &["run.steps=0"], "steps"),
    ("missing data path", &["data.source=\"bin\""], "path"),
    ("tp does not divide heads", &["parallel.tp=3", "parallel.dp_shard=1"], "tp"),
];

fn assert_clean_failure(name: &str, o: &std::process::Output, timed_out: bool, want: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!timed_out, "{name}: hung\n{}", text(o));
    assert!(!o.status.success(), "{name}: exited 0\n{}", text(o));
    assert!(stderr.contains("error:"), "{name}: no `error:` line\n{}", text(o));
    assert!(stderr.contains(want), "{name}: message lacks {want:?}\n{}", text(o));
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "{name}: panic or backtrace\n{}", text(o));
    let error_line = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(error_line.len() > 20, "{name}: error line too terse: {error_line}");
}

#[test]
fn bad_decks_fail_with_one_clear_line() {
    let deck = tiny_deck();
    for (name, sets, want) in BAD_DECKS {
        let mut cmd = Command::new(bin());
        mpi_env(&mut cmd).arg("train").arg(&deck);
        for s in *sets {
            cmd.args(["--set", s]);
        }
        let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
        assert_clean_failure(name, &o, timed_out, want);
        assert_eq!(o.status.code(), Some(2), "{name}: bad input exits with code 2\n{}", text(&o));
    }
}

/// `[run] device = "cuda"` in a build without the `cuda` feature is bad input, found before
/// any work (a build with it opens the GPU or names the missing CUDA library instead).
#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_training_without_the_cuda_feature_is_a_clear_error() {
    let mut cmd = Command::new(bin());
    mpi_env(&mut cmd).arg("train").arg(tiny_deck()).args(["--set", "run.device=\"cuda\""]);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("cuda without the feature", &o, timed_out, "built without the `cuda` feature");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn bad_deck_fails_on_every_rank_under_mpirun() {
    let deck = tiny_deck();
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "2", bin(), "train"]).arg(&deck).args(["--set", "model.n_kv_heads=3"]);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("mpirun bad deck", &o, timed_out, "n_kv_heads");
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Both ranks found it; said once, by rank 0, without a rank prefix.
    assert_eq!(stderr.matches("error:").count(), 1, "said once\n{}", text(&o));
    assert!(!stderr.contains("error: rank "), "{}", text(&o));
}

/// A deck only some ranks can read (here: a path that exists for rank 0 only, as on a node
/// that does not mount the file system) stops every rank with code 2, the failing rank naming
/// itself; nobody waits.
#[test]
fn a_deck_one_rank_cannot_read_stops_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let deck = dir.path().join("deck.toml");
    std::fs::copy(tiny_deck(), &deck).unwrap();
    let script = dir.path().join("only_rank0.sh");
    // Rank 1 is handed a path that does not exist.
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nif [ \"${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}\" = 0 ]; then exec {} train {}; else exec {} train {}.missing; fi\n",
            bin(),
            deck.display(),
            bin(),
            deck.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "2", "sh"]).arg(&script);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("deck rank 1 cannot read", &o, timed_out, "cannot read deck");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let reports: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(reports.len(), 1, "{}", text(&o));
    assert!(reports[0].starts_with("error: rank 1: cannot read deck"), "{}", text(&o));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// A data file that does not exist is found by every rank's preflight check, before the mesh
/// is built: every rank finds it and exits with code 2 (said once); nothing is left waiting.
#[test]
fn a_missing_data_file_stops_every_rank_before_training() {
    let deck = tiny_deck();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.bin");
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd)
        .args(["--oversubscribe", "-n", "2", bin(), "train"])
        .arg(&deck)
        .args(["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=1"])
        .args(["--set", "data.source=\"bin\"", "--set", &format!("data.path=\"{}\"", missing.display())])
        .args(["--set", &format!("run.out_dir=\"{}\"", dir.path().join("out").display())]);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("missing data file", &o, timed_out, "missing.bin");
    assert_eq!(String::from_utf8_lossy(&o.stderr).matches("error:").count(), 1, "said once\n{}", text(&o));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// Mesh errors are found on every rank before any communication: the degrees and the world
/// size said once, every rank exits non-zero, nothing hangs.
#[test]
fn mesh_errors_fail_on_every_rank() {
    let cases: &[(&str, usize, &[&str], &str)] = &[
        ("product is not the world", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=4"], "but the job has 4 ranks"),
        ("dp_shard = -1 cannot fill", 3, &["parallel.dp_replicate=2"], "dp_shard"),
        ("degree does not divide the batch", 3, &["parallel.dp_shard=3"], "global_batch"),
        ("seq_len not divisible by 2·cp", 2, &["parallel.cp=2", "train.seq_len=66"], "seq_len"),
        ("tp does not divide the kv heads", 2, &["parallel.tp=2", "model.n_kv_heads=1"], "n_kv_heads"),
        ("tp does not divide the heads", 4, &["parallel.tp=4", "model.n_heads=6", "model.n_kv_heads=2", "model.d_model=48"], "n_heads"),
    ];
    for (name, ranks, sets, want) in cases {
        let mut cmd = Command::new("mpirun");
        mpi_env(&mut cmd).args(["--oversubscribe", "-n", &ranks.to_string(), bin(), "train"]).arg(tiny_deck());
        for s in *sets {
            cmd.args(["--set", s]);
        }
        let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
        assert_clean_failure(name, &o, timed_out, want);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(stderr.matches("error:").count(), 1, "{name}: every rank found it, rank 0 says it\n{}", text(&o));
    }
}

// ---------------------------------------------------------------------------------------------
// One table of malformed or inconsistent decks and data files, each under `mpirun -n 2`.

/// What a case runs: the deck (`None` = the tiny deck) and the `--set` overrides.
type Input = (Option<PathBuf>, Vec<String>);

/// A bad input under `mpirun -n 2`.
struct BadInput {
    name: &'static str,
    /// Writes the case's files into its own folder and says what to run.
    make: fn(&Path) -> Input,
    /// A substring of the error message.
    want: &'static str,
    /// Which ranks find it. Either way it is found before the first collective of training
    /// (reading the deck, or the preflight checks of the files it names) and every rank exits
    /// with code 2.
    found: Found,
}

enum Found {
    /// Every rank finds it (the deck, a file every rank reads): rank 0 alone says it, once.
    EveryRank,
    /// Only this rank finds it (a bad token in its own first samples): it alone prints it,
    /// naming itself.
    OnlyRank(usize),
}
use Found::*;

/// Tokens of a valid file: 4000 ids below the tiny deck's vocabulary of 128 (61 samples of 64).
fn good_tokens() -> Vec<u16> {
    (0..4000).map(|i| (i % 128) as u16).collect()
}

/// An llm.c `.bin`: the 256-int32 header (magic, version, token count) and `tokens` as uint16.
fn bin_bytes(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut header = [0i32; ndtrain::data::BIN_HEADER_INTS];
    header[..3].copy_from_slice(&[magic, version, count]);
    let mut b: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    b.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    b
}

/// A GPT-2 `.bin` whose header count is the true one.
fn gpt2_bin(tokens: &[u16]) -> Vec<u8> {
    bin_bytes(BIN_MAGIC_GPT2, BIN_VERSION_GPT2, tokens.len() as i32, tokens)
}

fn path_set(key: &str, p: &Path) -> String {
    format!("{key}={}", toml::Value::String(p.to_string_lossy().into_owned()))
}

/// Writes `bytes` as `dir/name` and reads it as the `.bin` source.
fn bin_input(dir: &Path, name: &str, bytes: &[u8]) -> Input {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &p)])
}

/// The HDF5 source reading dataset `dataset` of `dir/name`, which `write` creates.
fn h5_input(dir: &Path, name: &str, dataset: &str, write: impl FnOnce(&Path)) -> Input {
    let p = dir.join(name);
    write(&p);
    (None, vec!["data.source=\"hdf5\"".into(), path_set("data.path", &p), format!("data.dataset=\"{dataset}\"")])
}

/// Writes a deck file of these bytes.
fn deck_input(dir: &Path, bytes: &[u8]) -> Input {
    let p = dir.join("deck.toml");
    std::fs::write(&p, bytes).unwrap();
    (Some(p), vec![])
}

fn sets_input(sets: &[&str]) -> Input {
    (None, sets.iter().map(|s| s.to_string()).collect())
}

/// A regular file, to be used where a folder is expected (root may write anywhere else).
fn a_file(dir: &Path) -> PathBuf {
    let p = dir.join("a_file");
    std::fs::write(&p, "not a folder").unwrap();
    p
}

/// A checkpoint of the tiny deck after one step (one rank, `sets` on top), written under `dir`.
fn written_checkpoint(dir: &Path, sets: &[&str]) -> PathBuf {
    let mut all = vec!["run.steps=1", "optim.warmup_steps=0", "checkpoint.every=1", "run.threads=1", "hardware.peak_flops_per_rank=1e9"];
    all.extend_from_slice(sets);
    train_losses(dir, "writer", &tiny_deck(), None, &all);
    dir.join("writer/ckpt/step_00000001.h5")
}

fn bad_inputs() -> Vec<BadInput> {
    let case = |name, make, want, found| BadInput { name, make, want, found };
    vec![
        // llm.c `.bin` files.
        case("empty .bin", |d| bin_input(d, "empty.bin", &[]), "0 bytes, shorter than the 1024-byte llm.c .bin header", EveryRank),
        case("short .bin", |d| bin_input(d, "short.bin", &[0; 100]), "100 bytes, shorter than the 1024-byte", EveryRank),
        case("wrong magic", |d| bin_input(d, "magic.bin", &bin_bytes(1234, 1, 4000, &good_tokens())), "header magic is 1234", EveryRank),
        case(
            "unsupported version",
            |d| bin_input(d, "version.bin", &bin_bytes(BIN_MAGIC_GPT2, 3, 4000, &good_tokens())),
            "header version is 3 for magic 20240520",
            EveryRank,
        ),
        case(
            "count above the file",
            |d| bin_input(d, "long.bin", &bin_bytes(BIN_MAGIC_GPT2, 1, 5000, &good_tokens())),
            "header says 5000 tokens of 2 bytes",
            EveryRank,
        ),
        case(
            "count below the file (extra bytes)",
            |d| bin_input(d, "extra.bin", &bin_bytes(BIN_MAGIC_GPT2, 1, 3000, &good_tokens())),
            "header says 3000 tokens of 2 bytes",
            EveryRank,
        ),
        case(
            "negative count",
            |d| bin_input(d, "negative.bin", &bin_bytes(BIN_MAGIC_GPT2, 1, -1, &good_tokens())),
            "header token count is -1, negative",
            EveryRank,
        ),
        case(
            "uint32 shard with an odd body",
            |d| bin_input(d, "llama3.bin", &bin_bytes(BIN_MAGIC_LLAMA3, BIN_VERSION_LLAMA3, 2000, &good_tokens()[..3999])),
            "header says 2000 tokens of 4 bytes",
            EveryRank,
        ),
        case(
            // Found when rank 0 reads sample 0, the first of its first micro-batch; rank 1's
            // samples are fine.
            "token id above the vocabulary",
            |d| {
                let mut t = good_tokens();
                t[0] = 500;
                bin_input(d, "oov.bin", &gpt2_bin(&t))
            },
            "token at position 0 is 500, not below [model] vocab_size 128",
            OnlyRank(0),
        ),
        case(
            "fewer tokens than one sample",
            |d| bin_input(d, "few.bin", &gpt2_bin(&good_tokens()[..64])),
            "fewer tokens than one sample of seq_len 64 + 1",
            EveryRank,
        ),
        case("one token", |d| bin_input(d, "one.bin", &gpt2_bin(&[1])), "a sample needs at least 2", EveryRank),
        case(
            "pattern matching no file",
            |d| (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &d.join("train_*.bin"))]),
            "matches no file",
            EveryRank,
        ),
        case(
            "star in the folder part",
            |d| (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &d.join("s*").join("train.bin"))]),
            "'*' is only supported in the file-name part",
            EveryRank,
        ),
        case(
            "one bad shard in a pattern",
            |d| {
                std::fs::write(d.join("s_0.bin"), gpt2_bin(&good_tokens())).unwrap();
                std::fs::write(d.join("s_1.bin"), vec![0u8; 2048]).unwrap();
                (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &d.join("s_*.bin"))])
            },
            "s_1.bin: header magic is 0",
            EveryRank,
        ),
        case(
            "HDF5 file read as .bin",
            |d| {
                let p = d.join("tokens.h5");
                write_tokens(&p, "tokens", TokenSlice::U16(&good_tokens()), 128).unwrap();
                (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &p)])
            },
            "not an llm.c token file",
            EveryRank,
        ),
        // HDF5 files.
        case(
            "HDF5 dataset name wrong",
            |d| h5_input(d, "t.h5", "nope", |p| write_tokens(p, "tokens", TokenSlice::U16(&good_tokens()), 128).unwrap()),
            "has no dataset 'nope'",
            EveryRank,
        ),
        case(
            "HDF5 file of random bytes",
            |d| {
                h5_input(d, "junk.h5", "tokens", |p| {
                    std::fs::write(p, (0..3000u32).map(|i| (i * 7919 % 251) as u8).collect::<Vec<_>>()).unwrap()
                })
            },
            "cannot open HDF5 file",
            EveryRank,
        ),
        case(
            ".bin file read as HDF5",
            |d| h5_input(d, "t.bin", "tokens", |p| std::fs::write(p, gpt2_bin(&good_tokens())).unwrap()),
            "cannot open HDF5 file",
            EveryRank,
        ),
        case(
            "HDF5 token id above the vocabulary",
            |d| {
                h5_input(d, "oov.h5", "tokens", |p| {
                    let t: Vec<u16> = (0..4000).map(|i| (i % 256) as u16).collect();
                    write_tokens(p, "tokens", TokenSlice::U16(&t), 256).unwrap()
                })
            },
            "not below [model] vocab_size 128",
            EveryRank,
        ),
        case(
            "HDF5 float dataset",
            |d| {
                h5_input(d, "f.h5", "tokens", |p| {
                    let f = hdf5::File::create(p).unwrap();
                    f.new_dataset::<f32>().shape([4000]).create("tokens").unwrap().write_raw(&vec![1.0f32; 4000][..]).unwrap();
                })
            },
            "token ids must be integers",
            EveryRank,
        ),
        case(
            "HDF5 2-D dataset",
            |d| {
                h5_input(d, "2d.h5", "tokens", |p| {
                    let f = hdf5::File::create(p).unwrap();
                    f.new_dataset::<u16>().shape([2, 2000]).create("tokens").unwrap();
                })
            },
            "token ids must be a 1-D dataset",
            EveryRank,
        ),
        case(
            "HDF5 empty dataset",
            |d| h5_input(d, "e.h5", "tokens", |p| write_tokens(p, "tokens", TokenSlice::U16(&[]), 128).unwrap()),
            "holds 0 tokens; a sample needs at least 2",
            EveryRank,
        ),
        // Decks.
        case("deck not UTF-8", |d| deck_input(d, b"\xff\xfe[run]\nsteps = 2\n"), "stream did not contain valid UTF-8", EveryRank),
        case("deck syntax error", |d| deck_input(d, b"[run]\nsteps = 2\n[model\n"), "TOML syntax error at line 3", EveryRank),
        case("deck duplicate key", |d| deck_input(d, b"[run]\nsteps = 2\nsteps = 3\n"), "duplicate key `steps`", EveryRank),
        case("deck file missing", |d| (Some(d.join("missing.toml")), vec![]), "cannot read deck", EveryRank),
        case("NaN learning rate", |_| sets_input(&["optim.lr=nan"]), "[optim] lr must be a finite number > 0, but it is NaN", EveryRank),
        case("infinite eps", |_| sets_input(&["optim.eps=inf"]), "[optim] eps must be a finite number > 0, but it is inf", EveryRank),
        case("negative steps", |_| sets_input(&["run.steps=-5"]), "[run] steps must be a whole number ≥ 0", EveryRank),
        case(
            "integer too large for TOML",
            |_| sets_input(&["model.d_model=99999999999999999999"]),
            "[model] d_model must be a whole number ≥ 0",
            EveryRank,
        ),
        case(
            "HDF5 without a dataset name",
            |_| sets_input(&["data.source=\"hdf5\"", "data.path=\"x.h5\"", "data.dataset=\"\""]),
            "needs dataset",
            EveryRank,
        ),
        case("layout for another world", |_| sets_input(&["parallel.dp_shard=3"]), "but the job has 2 ranks", EveryRank),
        case(
            "GPU training on two ranks of a build without the GPU backend",
            |_| sets_input(&["run.device=\"cuda\"", "parallel.comm_backend=\"nccl\""]),
            "built without the `cuda` feature",
            EveryRank,
        ),
        // Files and folders named by the deck, checked before training by every rank.
        case(
            "resume from a missing checkpoint",
            |d| (None, vec![path_set("checkpoint.resume", &d.join("step_00000010.h5"))]),
            "no such checkpoint file",
            EveryRank,
        ),
        case(
            "resume from a file that is not HDF5",
            |d| {
                let p = d.join("ckpt.h5");
                std::fs::write(&p, b"not a checkpoint").unwrap();
                (None, vec![path_set("checkpoint.resume", &p)])
            },
            "cannot open HDF5 file",
            EveryRank,
        ),
        case(
            "resume a checkpoint of another model",
            |d| (None, vec![path_set("checkpoint.resume", &written_checkpoint(d, &["model.ffn_hidden=128"]))]),
            "the deck has [model] ffn_hidden = 192, the checkpoint's model has ffn_hidden = 128",
            EveryRank,
        ),
        case(
            "resume a checkpoint of a newer format",
            |d| {
                let p = written_checkpoint(d, &[]);
                let py = "import h5py, numpy, sys\nwith h5py.File(sys.argv[1], 'r+') as f: f.attrs['format_version'] = numpy.uint64(99)";
                let ok = Command::new("/usr/bin/python3").args(["-c", py]).arg(&p).status().expect("Debian's python3 with h5py");
                assert!(ok.success(), "h5py could not set format_version");
                (None, vec![path_set("checkpoint.resume", &p)])
            },
            "has format_version 99; this ndtrain reads versions up to",
            EveryRank,
        ),
        case(
            "init_from a missing folder",
            |d| (None, vec![path_set("checkpoint.init_from", &d.join("no_hf"))]),
            "no_hf/config.json",
            EveryRank,
        ),
        case("init_from a regular file", |d| (None, vec![path_set("checkpoint.init_from", &a_file(d))]), "Not a directory", EveryRank),
        case(
            "out_dir under a regular file",
            |d| (None, vec![path_set("run.out_dir", &a_file(d).join("out"))]),
            "[run] out_dir: cannot write to",
            EveryRank,
        ),
        case(
            "export_hf under a regular file",
            |d| (None, vec![path_set("checkpoint.export_hf", &a_file(d).join("hf"))]),
            "[checkpoint] export_hf: cannot write to",
            EveryRank,
        ),
        // Found by the first run of this table and fixed: a directory named as such, one rank
        // prefix, control characters escaped.
        case(
            "a directory as the .bin path",
            |d| {
                std::fs::create_dir(d.join("shards")).unwrap();
                (None, vec!["data.source=\"bin\"".into(), path_set("data.path", &d.join("shards"))])
            },
            "directory",
            EveryRank,
        ),
        case(
            "checkpoint dir under a regular file",
            |d| (None, vec![path_set("checkpoint.dir", &a_file(d).join("ckpt")), "checkpoint.every=1".into()]),
            "[checkpoint] dir: cannot write to",
            EveryRank,
        ),
        case(
            "a NUL byte in the data path",
            |d| (None, vec!["data.source=\"bin\"".into(), format!("data.path=\"{}/a\\u0000b.bin\"", d.display())]),
            "unexpected NUL byte",
            EveryRank,
        ),
    ]
}

/// Every error line: no control character (a path or name quoted raw) and no rank prefix
/// given twice.
fn assert_error_lines_clean(name: &str, o: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    for line in stderr.lines().filter(|l| l.starts_with("error:")) {
        assert!(!line.chars().any(char::is_control), "{name}: control character in {line:?}\n{}", text(o));
        let doubled = line.split("rank ").filter_map(|s| s.split_once(": ")).map(|(r, _)| r).collect::<Vec<_>>();
        assert!(!doubled.windows(2).any(|w| w[0] == w[1] && w[0].parse::<usize>().is_ok()), "{name}: rank prefix doubled in {line:?}");
    }
}

/// Runs one case under `mpirun -n 2` (out_dir in its own folder, 2 short steps) and checks
/// the failure: no hang, non-zero exit, `error:` with the expected text on the ranks that
/// found it, no panic, no backtrace.
fn run_bad_input(c: &BadInput) {
    let dir = tempfile::tempdir().unwrap();
    let (deck_path, sets) = (c.make)(dir.path());
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "2", bin(), "train"]).arg(deck_path.unwrap_or_else(tiny_deck));
    let common = [
        path_set("run.out_dir", &dir.path().join("out")),
        "run.steps=2".into(),
        "optim.warmup_steps=0".into(),
        "run.threads=1".into(),
        // No GEMM probe at start.
        "hardware.peak_flops_per_rank=1e9".into(),
    ];
    for s in common.iter().chain(&sets) {
        cmd.args(["--set", s]);
    }
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure(c.name, &o, timed_out, c.want);
    assert_error_lines_clean(c.name, &o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let reports: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    match c.found {
        EveryRank => {
            assert_eq!(reports.len(), 1, "{}: both ranks found it, said once\n{}", c.name, text(&o));
            assert!(!reports[0].starts_with("error: rank "), "{}: no rank prefix: {}", c.name, reports[0]);
        }
        OnlyRank(r) => {
            assert_eq!(reports.len(), 1, "{}: only rank {r} reports\n{}", c.name, text(&o));
            assert!(reports[0].starts_with(&format!("error: rank {r}: ")), "{}: names rank {r}: {}", c.name, reports[0]);
        }
    }
    assert_eq!(o.status.code(), Some(2), "{}: bad input exits with code 2 on every rank\n{}", c.name, text(&o));
    // Nothing but the folders of the run was written: no deck copy, no logs, no checkpoint.
    let out = dir.path().join("out");
    if out.is_dir() {
        let written: Vec<_> = walk(&out).into_iter().filter(|p| p.is_file()).collect();
        assert!(written.is_empty(), "{}: files written before the run failed: {written:?}", c.name);
    }
}

/// Every path under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// Runs every case (a failing one does not stop the others) and fails naming those that failed.
fn run_bad_inputs(cases: &[&BadInput]) {
    let mut failed = Vec::new();
    for c in cases {
        let start = std::time::Instant::now();
        let ok = std::panic::catch_unwind(|| run_bad_input(c)).is_ok();
        eprintln!("{}: {} in {:.1} s", c.name, if ok { "ok" } else { "FAILED" }, start.elapsed().as_secs_f64());
        if !ok {
            failed.push(c.name);
        }
    }
    assert!(failed.is_empty(), "{} of {} cases failed (messages above): {failed:?}", failed.len(), cases.len());
}

#[test]
fn every_bad_input_fails_cleanly_on_every_rank() {
    let all = bad_inputs();
    let cases: Vec<&BadInput> = all.iter().collect();
    let scratch = tempfile::tempdir().unwrap();
    let data_files = cases
        .iter()
        .enumerate()
        .filter(|(i, c)| {
            let d = scratch.path().join(i.to_string());
            std::fs::create_dir(&d).unwrap();
            (c.make)(&d).1.iter().any(|s| s.starts_with("data.path") && !s.contains("x.h5"))
        })
        .count();
    assert!(cases.len() >= 20 && data_files >= 8, "{} cases, {data_files} of them data files", cases.len());
    run_bad_inputs(&cases);
}

/// A binary started on a CPU without a feature it was built for ends at once with code 2 and
/// one line naming the missing features (here the CPU's feature list is replaced by one
/// without AVX2 and FMA, which every default build uses); with the features it was built for
/// it runs.
#[test]
fn a_cpu_without_the_build_features_is_refused_by_name() {
    let deck = tiny_deck();
    let args = ["plan", deck.to_str().unwrap(), "--ranks", "1"];
    let o = mpi_env(&mut Command::new(bin()))
        .args(args)
        .env(ndtrain::backend::cpu::features::CPU_FEATURES_ENV, "sse4.2,popcnt")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line\n{}", text(&o));
    assert!(lines[0].starts_with("error: this ndtrain was built for CPU features this CPU lacks: "), "{}", lines[0]);
    assert!(lines[0].contains(" avx2 ") && lines[0].contains(" fma "), "{}", lines[0]);
    let all = ndtrain::backend::cpu::features::compiled().join(",");
    let o = mpi_env(&mut Command::new(bin())).args(args).env(ndtrain::backend::cpu::features::CPU_FEATURES_ENV, &all).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

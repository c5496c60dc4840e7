//! The library's deck errors, no binary and no MPI: the wording of each message and hint, and the decks that must resolve.
//!
//! One table of bad decks, each with the substrings its message (`m:`) or hint (`h:`) must
//! contain, plus the decks that must resolve (defaults, aliases, overrides, derived batch and
//! learning rate, the example of `docs/input_deck.md`). No files other than that page and
//! temporary decks. What the binary does with bad input (exit code, one `error:` line, every
//! rank) is `tests/bad_input_cli.rs`; that no deck makes the parser panic, `tests/fuzz/decks.rs`.

use ndtrain::config::{ConfigError, Deck, Resolved};

/// A bad deck: what it is, its text, its `--set` overrides, the world size, and the substrings
/// that the message (`m:`) or the hint (`h:`) must contain.
struct Bad {
    what: &'static str,
    deck: &'static str,
    set: &'static [&'static str],
    world: usize,
    expect: &'static [&'static str],
}

const fn bad(what: &'static str, deck: &'static str, world: usize, expect: &'static [&'static str]) -> Bad {
    Bad { what, deck, set: &[], world, expect }
}

const fn bad_set(what: &'static str, set: &'static [&'static str], world: usize, expect: &'static [&'static str]) -> Bad {
    Bad { what, deck: "", set, world, expect }
}

const BAD: &[Bad] = &[
    // Parsing.
    // The held-out loss.
    bad_set(
        "eval without batches",
        &["eval.every=5", "eval.batches=0"],
        1,
        &["m:[eval] batches must be ≥ 1 when [eval] every(5) > 0, but it is 0"],
    ),
    bad_set(
        "held-out file with synthetic data",
        &["eval.every=5", "eval.path=\"val.bin\""],
        1,
        &["m:[eval] path = \"val.bin\" is given, but [data] source = \"synthetic\" reads no file", "h:tail_samples"],
    ),
    bad_set(
        "held-out file and tail",
        &["eval.every=5", "data.source=\"bin\"", "data.path=\"t.bin\"", "eval.path=\"v.bin\"", "eval.tail_samples=8"],
        1,
        &["m:[eval] path = \"v.bin\" and tail_samples(8) are both given"],
    ),
    bad("syntax error", "[run]\nsteps = 10\n[model\n", 1, &["m:TOML syntax error at line 3"]),
    bad("duplicate key", "[run]\nsteps = 1\nsteps = 2\n", 1, &["m:line 3", "m:duplicate key"]),
    bad("unknown key, close", "[model]\nn_head = 4\n", 1, &["m:unknown key [model] n_head; did you mean n_heads?"]),
    bad("unknown key, far", "[model]\nwibble = 4\n", 1, &["m:unknown key [model] wibble", "m:vocab_size, d_model, n_layers"]),
    bad("key in the wrong table", "[train]\nlr = 1e-3\n", 1, &["m:unknown key [train] lr", "m:[optim] lr"]),
    bad("key outside any table", "steps = 10\n", 1, &["m:steps", "m:did you mean [run] steps?", "h:[run]"]),
    bad("unknown table", "[modle]\nd_model = 4\n", 1, &["m:unknown table [modle]; did you mean [model]?"]),
    bad("unknown table, far", "[zzz]\na = 1\n", 1, &["m:unknown table [zzz]", "m:[run], [model], [parallel]"]),
    bad("table given as a value", "model = 3\n", 1, &["m:[model] must be a table"]),
    bad("string for an integer", "[model]\nd_model = \"big\"\n", 1, &["m:[model] d_model", "m:\"big\"", "m:a whole number"]),
    bad("negative steps", "[run]\nsteps = -3\n", 1, &["m:[run] steps", "m:-3", "m:whole number ≥ 0"]),
    bad("string for a float", "[optim]\nlr = \"fast\"\n", 1, &["m:[optim] lr must be a number", "m:\"fast\""]),
    bad("float for a degree", "[parallel]\ntp = 2.5\n", 1, &["m:[parallel] tp", "m:2.5", "m:a whole number"]),
    bad(
        "enum value not in the list",
        "[optim]\nschedule = \"exp\"\n",
        1,
        &["m:[optim] schedule", "m:\"exp\"", "m:\"cosine\", \"linear\", \"constant\""],
    ),
    bad("integer for an enum", "[data]\nsource = 3\n", 1, &["m:[data] source", "m:\"synthetic\", \"hdf5\", \"bin\""]),
    bad("alias clash", "[parallel]\ntp = 2\ntensor_parallel_size = 2\n", 2, &["m:tensor_parallel_size", "m:tp", "m:alias"]),
    bad("two aliases of one key", "[parallel]\ncp_size = 2\ncontext_parallel_size = 2\n", 2, &["m:cp_size", "m:context_parallel_size"]),
    bad_set("override without =", &["model.d_model"], 1, &["m:malformed override --set model.d_model", "h:table.key=value"]),
    bad_set("override without table", &["d_model=256"], 1, &["m:malformed override --set d_model=256", "h:--set model.d_model=256"]),
    bad_set("override nested", &["model.x.y=1"], 1, &["m:malformed override", "m:one level"]),
    bad_set("override of an unknown key", &["model.n_head=4"], 1, &["m:[model] n_head", "m:--set model.n_head=4", "m:n_heads"]),
    bad_set("override of the wrong type", &["model.n_layers=many"], 1, &["m:[model] n_layers", "m:--set model.n_layers=many"]),
    // [run] and [model].
    bad_set("empty run name", &["run.name="], 1, &["m:[run] name is empty"]),
    bad_set("unsafe run name", &["run.name=a/b"], 1, &["m:[run] name \"a/b\"", "m:'/'", "h:name = \"a_b\""]),
    bad_set("zero steps", &["run.steps=0"], 1, &["m:[run] steps must be ≥ 1, but it is 0"]),
    bad_set("zero size", &["model.n_layers=0"], 1, &["m:[model] n_layers must be ≥ 1, but it is 0"]),
    bad_set("zero vocab", &["model.vocab_size=0"], 1, &["m:[model] vocab_size must be ≥ 1"]),
    bad_set(
        "a micro-step beyond the GPU's 32-bit sizes",
        &["run.device=\"cuda\"", "train.micro_batch=65536", "train.global_batch=65536", "train.seq_len=65536", "model.max_seq_len=65536"],
        1,
        &["m:[train] micro_batch × seq_len", "m:4294967296 exceeds 2147483647", "h:smaller micro_batch"],
    ),
    bad_set("d_model % n_heads", &["model.d_model=100", "model.n_heads=8"], 1, &["m:[model] d_model(100) is not divisible by n_heads(8)"]),
    bad_set("n_heads % n_kv_heads", &["model.n_kv_heads=3"], 1, &["m:[model] n_heads(8) is not divisible by n_kv_heads(3)"]),
    bad_set("odd head_dim", &["model.d_model=24", "model.n_heads=8"], 1, &["m:head_dim", "m:= 3 is odd", "m:RoPE"]),
    bad_set("rope_theta", &["model.rope_theta=0"], 1, &["m:[model] rope_theta must be a finite number > 0, but it is 0"]),
    bad_set("norm_eps NaN", &["model.norm_eps=nan"], 1, &["m:[model] norm_eps", "m:NaN"]),
    bad_set("seq_len > max_seq_len", &["train.seq_len=2048"], 1, &["m:[train] seq_len(2048) exceeds [model] max_seq_len(1024)"]),
    bad_set("zero micro_batch", &["train.micro_batch=0"], 1, &["m:[train] micro_batch must be ≥ 1"]),
    // [parallel] against the world.
    bad_set("zero tp", &["parallel.tp=0"], 1, &["m:[parallel] tp must be ≥ 1, but it is 0"]),
    bad_set("dp_shard -2", &["parallel.dp_shard=-2"], 1, &["m:[parallel] dp_shard must be ≥ 1, or -1", "m:-2"]),
    bad_set(
        "world-size mismatch",
        &["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"],
        4,
        &[
            "m:[parallel] dp_replicate(2) × dp_shard(2) × cp(1) × tp(2) = 8, but the job has 4 ranks",
            "h:run with 8 ranks",
            "h:dp_shard = 1",
        ],
    ),
    bad_set(
        "world-size mismatch, no dp_shard fits",
        &["parallel.dp_shard=1", "parallel.tp=4"],
        6,
        &["m:tp(4) = 4, but the job has 6 ranks", "h:not a multiple of dp_replicate × cp × tp = 4"],
    ),
    bad_set(
        "dp_shard = -1 does not fill",
        &["parallel.tp=4"],
        6,
        &["m:dp_shard = -1", "m:6 ranks", "m:dp_replicate(1) × cp(1) × tp(4) = 4", "h:4 or 8"],
    ),
    bad_set(
        "tp does not divide n_heads",
        &["parallel.tp=3", "model.n_heads=4", "model.n_kv_heads=4"],
        3,
        &["m:tp(3) does not divide [model] n_heads(4)"],
    ),
    bad_set(
        "tp does not divide n_kv_heads",
        &["parallel.tp=8", "model.n_heads=8", "model.n_kv_heads=4"],
        8,
        &["m:tp(8) does not divide [model] n_kv_heads(4)", "h:{1, 2, 4}"],
    ),
    bad_set(
        "tp does not divide ffn_hidden",
        &["parallel.tp=4", "model.ffn_hidden=250"],
        4,
        &["m:tp(4) does not divide [model] ffn_hidden(250)"],
    ),
    bad_set(
        "seq_len vs 2·cp",
        &["parallel.cp=3", "train.seq_len=64"],
        3,
        &["m:[train] seq_len(64) is not divisible by 2 × cp(3) = 6", "h:60 or 66"],
    ),
    bad_set(
        "seq_len vs sequence_parallel",
        &["parallel.tp=4", "parallel.sequence_parallel=true", "train.seq_len=66"],
        4,
        &["m:[train] seq_len(66) is not divisible by cp(1) × tp(4) = 4", "m:sequence_parallel"],
    ),
    // [train] batch geometry.
    bad_set(
        "global_batch not divisible",
        &["train.global_batch=10", "train.micro_batch=2"],
        4,
        &["m:[train] global_batch(10) is not divisible by micro_batch(2) × dp(4) = 8", "h:8 or 16"],
    ),
    bad_set(
        "global_batch and grad_accum disagree",
        &["train.global_batch=64", "train.grad_accum=4", "train.micro_batch=2"],
        4,
        &["m:global_batch(64) ≠ micro_batch(2) × grad_accum(4) × dp(4) = 32"],
    ),
    // [optim].
    bad_set("lr zero", &["optim.lr=0"], 1, &["m:[optim] lr must be a finite number > 0, but it is 0"]),
    bad_set("min_lr > lr", &["optim.lr=1e-4", "optim.min_lr=1e-3"], 1, &["m:[optim] min_lr(0.001) exceeds lr(0.0001)"]),
    bad_set("negative min_lr", &["optim.min_lr=-1e-5"], 1, &["m:[optim] min_lr must be a finite number ≥ 0"]),
    bad_set("beta2 = 1", &["optim.beta2=1.0"], 1, &["m:[optim] beta2 must be in [0, 1), but it is 1"]),
    bad_set("eps zero", &["optim.eps=0"], 1, &["m:[optim] eps must be a finite number > 0"]),
    bad_set("negative weight_decay", &["optim.weight_decay=-0.1"], 1, &["m:[optim] weight_decay must be a finite number ≥ 0"]),
    bad_set("negative grad_clip", &["optim.grad_clip=-1"], 1, &["m:[optim] grad_clip must be a finite number ≥ 0"]),
    bad_set("lr_scaling without base_batch", &["optim.lr_scaling=sqrt"], 1, &["m:lr_scaling = \"sqrt\" needs base_batch > 0"]),
    // [data], [log], [hardware].
    bad_set("hdf5 without path", &["data.source=hdf5"], 1, &["m:[data] source = \"hdf5\" needs a path", "h:--set data.path="]),
    bad_set("bin without path", &["data.source=bin"], 1, &["m:[data] source = \"bin\" needs a path"]),
    bad_set(
        "hdf5 without dataset",
        &["data.source=hdf5", "data.path=x.h5", "data.dataset="],
        1,
        &["m:[data] source = \"hdf5\" needs dataset"],
    ),
    bad_set("synthetic with a path", &["data.path=x.h5"], 1, &["m:[data] path = \"x.h5\" is given, but source = \"synthetic\""]),
    bad_set("synthetic branching", &["data.synthetic_branching=0"], 1, &["m:[data] synthetic_branching(0)"]),
    bad_set("log every zero", &["log.every=0"], 1, &["m:[log] every must be ≥ 1, but it is 0"]),
    bad_set("negative peak", &["hardware.peak_flops_per_rank=-1"], 1, &["m:[hardware] peak_flops_per_rank"]),
    // A mixture of experts.
    bad_set(
        "more experts per token than experts",
        &["model.n_experts=4", "model.experts_per_token=5", "model.moe_ffn_hidden=8"],
        1,
        &["m:[model] experts_per_token(5) must be in 1..=n_experts(4)"],
    ),
    bad_set(
        "experts without their width",
        &["model.n_experts=4", "model.experts_per_token=2"],
        1,
        &["m:[model] moe_ffn_hidden must be ≥ 1"],
    ),
    bad_set(
        "an expert key on a dense model",
        &["model.experts_per_token=2"],
        1,
        &["m:[model] experts_per_token is set, but n_experts = 0", "h:set n_experts"],
    ),
    bad_set(
        "dense blocks beyond the model",
        &["model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_hidden=8", "model.first_dense_layers=3"],
        1,
        &["m:[model] first_dense_layers(3) exceeds n_layers(2)"],
    ),
    bad_set("shared experts on a dense model", &["model.n_shared_experts=1"], 1, &["m:[model] n_shared_experts is set, but n_experts = 0"]),
    bad_set(
        "shared experts and a Hugging Face export",
        &[
            "model.n_experts=4",
            "model.experts_per_token=2",
            "model.moe_ffn_hidden=8",
            "model.n_shared_experts=1",
            "checkpoint.export_hf=hf",
        ],
        1,
        &["m:[checkpoint] export_hf = \"hf\" with [model] n_shared_experts = 1: no Hugging Face family"],
    ),
    bad_set(
        "shared experts not divisible over tp",
        &["model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_hidden=9", "model.n_shared_experts=1", "parallel.tp=2"],
        2,
        &["m:[parallel] tp(2) does not divide the shared experts' width n_shared_experts(1) × moe_ffn_hidden(9) = 9"],
    ),
    // Expert parallelism.
    bad_set("ep on a dense model", &["parallel.ep=2"], 2, &["m:[parallel] ep(2) splits experts, but n_experts = 0", "h:set ep = 1"]),
    bad_set(
        "ep not dividing dp_shard × cp",
        &["model.n_experts=8", "model.experts_per_token=2", "model.moe_ffn_hidden=8", "parallel.ep=4", "parallel.dp_shard=2"],
        2,
        &["m:[parallel] ep(4) does not divide dp_shard(2) × cp(1) = 2", "h:use ep in {1, 2}"],
    ),
    bad_set(
        "experts not divisible by ep",
        &["model.n_experts=6", "model.experts_per_token=2", "model.moe_ffn_hidden=8", "parallel.ep=4", "parallel.dp_shard=4"],
        4,
        &["m:[model] n_experts(6) is not divisible by [parallel] ep(4)"],
    ),
    bad_set("ep zero", &["parallel.ep=0"], 1, &["m:[parallel] ep must be ≥ 1, but it is 0"]),
];

fn overrides(set: &[&str]) -> Vec<String> {
    set.iter().map(|s| s.to_string()).collect()
}

fn resolve(deck: &str, set: &[&str], world: usize) -> Result<Resolved, ConfigError> {
    Deck::from_str_with(deck, &overrides(set))?.resolve(world)
}

#[test]
fn every_bad_deck_is_rejected_with_its_numbers() {
    let mut failures = Vec::new();
    for b in BAD {
        let e = match resolve(b.deck, b.set, b.world) {
            Ok(_) => {
                failures.push(format!("{}: accepted", b.what));
                continue;
            }
            Err(e) => e,
        };
        if e.message.contains('\n') || e.hint.as_deref().is_some_and(|h| h.contains('\n')) {
            failures.push(format!("{}: not one line: {e}", b.what));
        }
        for want in b.expect {
            let (place, text) = match want.split_at(2) {
                ("m:", s) => ("message", Some(e.message.as_str()).filter(|m| m.contains(s)).map(|_| s)),
                ("h:", s) => ("hint", e.hint.as_deref().filter(|h| h.contains(s)).map(|_| s)),
                _ => panic!("{}: expectation {want:?} lacks m: or h:", b.what),
            };
            if text.is_none() {
                failures.push(format!("{}: {place} lacks {:?}\n    got: {e}", b.what, &want[2..]));
            }
        }
    }
    assert!(BAD.len() >= 15);
    assert!(failures.is_empty(), "{} of {} bad decks:\n{}", failures.len(), BAD.len(), failures.join("\n"));
}

#[test]
fn display_is_message_then_hint() {
    let e = resolve("", &["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"], 4).unwrap_err();
    let shown = e.to_string();
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), 2, "{shown}");
    assert_eq!(lines[0], "[parallel] dp_replicate(2) × dp_shard(2) × cp(1) × tp(2) = 8, but the job has 4 ranks");
    assert!(lines[1].starts_with("HINT: "));
    let e = resolve("[model]\nn_head = 4\n", &[], 1).unwrap_err();
    assert_eq!(e.to_string(), "unknown key [model] n_head; did you mean n_heads?");
}

#[test]
fn from_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deck.toml");
    std::fs::write(&path, "[model]\nn_head = 4\n").unwrap();
    let e = Deck::from_file(&path, &[]).unwrap_err();
    assert!(e.message.starts_with(&format!("{}: unknown key [model] n_head", path.display())), "{e}");
    let e = Deck::from_file(&dir.path().join("absent.toml"), &[]).unwrap_err();
    assert!(e.message.contains("cannot read deck"), "{e}");
    // An empty deck (or one of comments only) is refused, not trained on the defaults.
    for text in ["", "\n# nothing yet\n"] {
        std::fs::write(&path, text).unwrap();
        let e = Deck::from_file(&path, &[]).unwrap_err();
        assert_eq!(e.message, format!("{}: the deck is empty ({} bytes, no keys)", path.display(), text.len()));
        assert!(e.hint.as_deref().unwrap_or("").contains("check the path"), "{e:?}");
    }
}

/// A warm-up longer than the run is a warning, not an error: `--set run.steps=5` smoke-tests
/// any deck.
#[test]
fn a_warm_up_beyond_the_run_is_a_warning() {
    let r = resolve("", &["run.steps=10", "optim.warmup_steps=100", "optim.lr=1e-3"], 1).unwrap();
    let warning = r.summary.iter().find(|l| l.starts_with("warning:")).expect("a warning line");
    assert_eq!(
        warning,
        "warning: [optim] warmup_steps(100) exceeds [run] steps(10): the run ends inside the warm-up, at 1.000e-4 = 10/100 of the peak LR"
    );
    assert!(resolve("", &["run.steps=10", "optim.warmup_steps=10"], 1).unwrap().summary.iter().all(|l| !l.starts_with("warning:")));
}

#[test]
fn default_deck_resolves() {
    let r = Deck::default().resolve(1).unwrap();
    assert_eq!((r.layout.world_size(), r.layout.dp(), r.grad_accum, r.global_batch), (1, 1, 1, 1));
    assert_eq!(r.lr, Deck::default().optim.lr);
    assert_eq!(Deck::from_str_with("", &[]).unwrap(), Deck::default());
}

#[test]
fn aliases_set_the_canonical_keys() {
    let deck = "[parallel]\ndp_replicate_size = 2\ndp_shard_size = 2\ncontext_parallel_size = 2\ntensor_parallel_size = 2\n[train]\nseq_len = 64\n";
    let r = resolve(deck, &[], 16).unwrap();
    assert_eq!((r.layout.dp_replicate, r.layout.dp_shard, r.layout.cp, r.layout.tp), (2, 2, 2, 2));
    // Hugging Face's names of the expert keys (Mixtral's and Qwen3-MoE's).
    let r = resolve("[model]\nnum_local_experts = 8\nnum_experts_per_tok = 2\nmoe_intermediate_size = 16\n", &[], 1).unwrap();
    assert_eq!((r.deck.model.n_experts, r.deck.model.experts_per_token, r.deck.model.moe_ffn_hidden), (8, 2, 16));
    let r = resolve("[model]\nnum_experts = 4\nexperts_per_token = 1\nmoe_ffn_hidden = 8\n", &[], 1).unwrap();
    assert_eq!(r.deck.model.n_experts, 4);
    let r = resolve("[parallel]\ntp_size = 2\ncp_size = 2\n", &[], 8).unwrap();
    assert_eq!((r.layout.tp, r.layout.cp, r.layout.dp_shard), (2, 2, 2));
    // The resolved deck is saved with canonical keys only, and reads back the same.
    let d = Deck::from_str_with("[parallel]\ntp_size = 2\n", &[]).unwrap();
    let saved = d.to_toml();
    assert!(saved.contains("tp = 2") && !saved.contains("tp_size"), "{saved}");
    assert_eq!(Deck::from_str_with(&saved, &[]).unwrap(), d);
}

#[test]
fn overrides_replace_deck_values() {
    let deck = "[model]\nd_model = 128\n[optim]\nschedule = \"cosine\"\n[run]\nname = \"x\"\n";
    let d = Deck::from_str_with(deck, &overrides(&["model.d_model=256", "optim.schedule=linear", "run.name=abc"])).unwrap();
    assert_eq!(d.model.d_model, 256);
    assert_eq!(d.optim.schedule, ndtrain::config::Schedule::Linear);
    assert_eq!(d.run.name, "abc");
    // Later overrides win; quoted values are TOML strings; an alias override replaces the key.
    let d = Deck::from_str_with("", &overrides(&["run.steps=5", "run.steps=7", "run.name=\"q r\"", "parallel.tp_size=2"])).unwrap();
    assert_eq!((d.run.steps, d.run.name.as_str(), d.parallel.tp), (7, "q r", 2));
}

#[test]
fn global_batch_derives_grad_accum() {
    let r = resolve("[parallel]\ntp = 2\n[train]\nmicro_batch = 2\nglobal_batch = 64\nseq_len = 128\n", &[], 8).unwrap();
    assert_eq!((r.layout.dp_shard, r.layout.dp(), r.grad_accum, r.global_batch, r.tokens_per_step), (4, 4, 8, 64, 64 * 128));
    assert!(
        r.summary.contains(&"effective batch = micro_batch(2) × grad_accum(8) × dp(4) = 64 sequences = 8192 tokens".to_string()),
        "{:?}",
        r.summary
    );
    // The same deck on another layout keeps the global batch.
    let r = resolve("[parallel]\ntp = 2\n[train]\nmicro_batch = 2\nglobal_batch = 64\nseq_len = 128\n", &[], 2).unwrap();
    assert_eq!((r.grad_accum, r.global_batch), (32, 64));
    let r = resolve("[train]\nmicro_batch = 2\ngrad_accum = 3\n", &[], 4).unwrap();
    assert_eq!(r.global_batch, 24);
}

#[test]
fn lr_scaling_values() {
    let base = ["train.global_batch=64", "optim.base_batch=16", "optim.lr=0.001"];
    let with = |s: &str| {
        let mut set = base.to_vec();
        set.push(s);
        resolve("", &set, 4).unwrap()
    };
    let r = with("optim.lr_scaling=none");
    assert_eq!(r.lr, 0.001);
    assert_eq!(r.summary.len(), 2);
    let r = with("optim.lr_scaling=linear");
    assert!((r.lr - 0.004).abs() < 1e-15, "{}", r.lr);
    let r = with("optim.lr_scaling=sqrt");
    assert!((r.lr - 0.002).abs() < 1e-15, "{}", r.lr);
    assert_eq!(r.summary[2], "lr scaling (sqrt): lr(0.001) × sqrt(global_batch(64) / base_batch(16)) = 0.002");
    // The scaled rate is printed; the deck keeps the rate at base_batch.
    assert_eq!(r.deck.optim.lr, 0.001);
}

#[test]
fn docs_example_resolves_as_documented() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/input_deck.md")).unwrap();
    let example = doc.split("## Example").nth(1).unwrap();
    let toml = example.split("```toml\n").nth(1).unwrap().split("```").next().unwrap();
    let printed = example.split("```text\n").nth(1).unwrap().split("```").next().unwrap();
    let r = resolve(toml, &[], 4).unwrap();
    assert_eq!(r.summary.join("\n") + "\n", printed);
}

//! Stage two of the deck: every constraint checked against the world size, and derived values.
//!
//! Owns the rules between values (`d_model % n_heads`, the product of the degrees against the
//! world size, `global_batch` against `micro_batch × dp`, …) and the values derived from them:
//! the `Layout` (with `dp_shard = -1` filled in), `grad_accum`, the global batch, the learning
//! rate after `lr_scaling`, and the lines rank 0 prints at start. Each error is one line that
//! names the table, the keys and the numbers, with a `HINT:` where a fix is known. Nothing here
//! panics on any deck: products use checked arithmetic. Knows nothing of MPI or of files: a
//! data path is only checked to be given, the data module checks that it exists.
//!
//! One check per table, each naming its keys, then the layout's and the batch's rules that span
//! tables, and their tests.

use super::{ConfigError, Deck, LrScaling, Source};

/// The resolved mesh degrees, outermost to innermost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Layout {
    pub pp: usize,
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
    /// Expert parallelism: the experts split over `ep` ranks cut out of `dp_shard × cp`
    /// (not a factor of the world).
    pub ep: usize,
}

impl Layout {
    pub fn world_size(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
    }
    /// Data-parallel degree: ranks that see different samples (the `batch` group).
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
    /// Parameter-sharding degree: `dp_shard × cp` (the `fsdp` group).
    pub fn fsdp(&self) -> usize {
        self.dp_shard * self.cp
    }
    /// Sharding degree of each expert's weights: `dp_shard × cp / ep` (the `expert_fsdp` group).
    pub fn expert_fsdp(&self) -> usize {
        self.fsdp() / self.ep
    }
}

/// A deck checked against a world size, with every derived value.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub deck: Deck,
    pub layout: Layout,
    pub grad_accum: usize,
    /// Sequences per optimiser step over the whole job: `micro_batch × grad_accum × dp`.
    pub global_batch: usize,
    /// Peak learning rate after `lr_scaling`.
    pub lr: f64,
    /// Blocks of each pipeline stage, in stage order (`pp × pp_virtual` entries; one entry,
    /// every block, without a pipeline): `pp_layers`, or the split that balances the cost.
    pub stage_layers: Vec<usize>,
    /// Tokens per optimiser step over the whole job: `global_batch × seq_len`.
    pub tokens_per_step: usize,
    /// Lines for people, printed by rank 0 at start: the layout, the effective batch and, when
    /// active, the learning-rate scaling.
    pub summary: Vec<String>,
}

/// `Err(make())` unless `ok`.
fn need(ok: bool, make: impl FnOnce() -> ConfigError) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(make())
    }
}

pub(super) fn err(message: String) -> ConfigError {
    ConfigError::new(message)
}

fn at_least_one(table: &str, key: &str, v: u64) -> Result<(), ConfigError> {
    need(v >= 1, || err(format!("[{table}] {key} must be ≥ 1, but it is {v}")))
}

fn positive_finite(table: &str, key: &str, v: f64) -> Result<(), ConfigError> {
    need(v > 0.0 && v.is_finite(), || err(format!("[{table}] {key} must be a finite number > 0, but it is {}", num(v))))
}

fn non_negative_finite(table: &str, key: &str, v: f64) -> Result<(), ConfigError> {
    need(v >= 0.0 && v.is_finite(), || err(format!("[{table}] {key} must be a finite number ≥ 0, but it is {}", num(v))))
}

/// `a × b`, or an error naming the product when it overflows.
fn mul(a: usize, b: usize, what: impl FnOnce() -> String) -> Result<usize, ConfigError> {
    a.checked_mul(b).ok_or_else(|| err(format!("{} is too large (overflows)", what())))
}

fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".into()
    } else {
        format!("{n} ranks")
    }
}

/// A number for people: up to 6 significant digits, exponent form when very small or large.
pub(crate) fn num(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let e = format!("{x:.5e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let trim = |s: &str| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if (-4..6).contains(&exp) {
        trim(&format!("{x:.*}", (5 - exp).max(0) as usize))
    } else {
        format!("{}e{exp}", trim(mantissa))
    }
}

/// The multiples of `m` just below and just above `v` (the one below only when > 0).
fn nearest_multiples(v: usize, m: usize) -> String {
    let below = v / m * m;
    let above = below.checked_add(m);
    match (below, above) {
        (0, Some(a)) => format!("{a}"),
        (b, Some(a)) => format!("{b} or {a}"),
        (b, None) => format!("{b}"),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A name that is safe as one folder name on any file system we run on.
fn safe_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+')
}

impl Deck {
    /// The checks that need no world size (`plan` and `train` run them before MPI work).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_run()?;
        self.check_model()?;
        self.check_parallel()?;
        self.check_train()?;
        self.check_optim()?;
        self.check_data()?;
        self.check_device_sizes()?;
        at_least_one("log", "every", self.log.every)?;
        let h = &self.hardware;
        non_negative_finite("hardware", "peak_flops_per_rank", h.peak_flops_per_rank)?;
        non_negative_finite("hardware", "memory_per_rank", h.memory_per_rank)?;
        need(h.ranks_per_node >= 1, || err(format!("[hardware] ranks_per_node({}) must be >= 1", h.ranks_per_node)))?;
        for (key, v) in [
            ("intra_node_bandwidth", h.intra_node_bandwidth),
            ("intra_node_reduce_bandwidth", h.intra_node_reduce_bandwidth),
            ("inter_node_bandwidth", h.inter_node_bandwidth),
            ("inter_node_all_reduce_bandwidth", h.inter_node_all_reduce_bandwidth),
            ("inter_node_reduce_scatter_bandwidth", h.inter_node_reduce_scatter_bandwidth),
            ("inter_node_blocking_all_reduce_bandwidth", h.inter_node_blocking_all_reduce_bandwidth),
            ("inter_node_packed_bandwidth", h.inter_node_packed_bandwidth),
            ("inter_node_packed_all_reduce_bandwidth", h.inter_node_packed_all_reduce_bandwidth),
            ("inter_node_packed_reduce_scatter_bandwidth", h.inter_node_packed_reduce_scatter_bandwidth),
            ("intra_node_latency", h.intra_node_latency),
            ("inter_node_latency", h.inter_node_latency),
            ("gemm_half_rate_rows", h.gemm_half_rate_rows),
            ("gemm_half_rate_cols", h.gemm_half_rate_cols),
            ("gemm_half_rate_inner", h.gemm_half_rate_inner),
            ("block_other_s_per_token", h.block_other_s_per_token),
            ("attention_s_per_token", h.attention_s_per_token),
            ("replicated_s_per_token", h.replicated_s_per_token),
            ("tp_extra_s_per_token", h.tp_extra_s_per_token),
            ("cp_extra_s_per_token", h.cp_extra_s_per_token),
            ("optimizer_bandwidth", h.optimizer_bandwidth),
            ("memory_bandwidth", h.memory_bandwidth),
        ] {
            non_negative_finite("hardware", key, v)?;
        }
        for &[tokens, s] in &h.block_s_per_token {
            need(tokens >= 1.0 && tokens.is_finite() && s >= 0.0 && s.is_finite(), || {
                err(format!("[hardware] block_s_per_token has [{tokens}, {s}]: each pair must be [tokens >= 1, seconds >= 0]"))
            })?;
        }
        need(h.overlap_efficiency.is_finite() && (0.0..=1.0).contains(&h.overlap_efficiency), || {
            err(format!("[hardware] overlap_efficiency({}) must be between 0 and 1", h.overlap_efficiency))
        })?;
        need(h.fsdp_overlap_efficiency < 0.0 || h.fsdp_overlap_efficiency <= 1.0, || {
            err(format!(
                "[hardware] fsdp_overlap_efficiency({}) must be between 0 and 1 (negative: overlap_efficiency)",
                h.fsdp_overlap_efficiency
            ))
        })?;
        need(h.intra_node_bandwidth > 0.0 && h.inter_node_bandwidth > 0.0, || {
            err(format!(
                "[hardware] intra_node_bandwidth({:e}) and inter_node_bandwidth({:e}) must be > 0 bytes/s",
                h.intra_node_bandwidth, h.inter_node_bandwidth
            ))
        })
    }

    /// Checks every constraint for a job of `world_size` ranks and derives the layout, the
    /// batch geometry and the learning rate.
    pub fn resolve(&self, world_size: usize) -> Result<Resolved, ConfigError> {
        self.validate()?;
        let layout = self.layout(world_size)?;
        self.check_layout(&layout)?;
        let (grad_accum, global_batch) = self.batch(&layout)?;
        let seq_len = self.train.seq_len;
        let tokens_per_step = mul(global_batch, seq_len, || format!("global_batch({global_batch}) × seq_len({seq_len})"))?;
        let (lr, lr_line) = self.scaled_lr(global_batch)?;
        let stage_layers = self.check_pipeline(&layout, grad_accum)?;

        let Layout { pp, dp_replicate, dp_shard, cp, tp, ep } = layout;
        let pp_part = if pp > 1 { format!("pp({pp}) × ") } else { String::new() };
        let mut summary = vec![
            format!(
                "layout: {pp_part}dp_replicate({dp_replicate}) × dp_shard({dp_shard}) × cp({cp}) × tp({tp}) = {} (dp = {}, fsdp = {}{}{})",
                ranks(world_size),
                layout.dp(),
                layout.fsdp(),
                if ep > 1 { format!(", ep = {ep}, expert fsdp = {}", layout.expert_fsdp()) } else { String::new() },
                if self.parallel.sequence_parallel { ", sequence parallel" } else { "" }
            ),
            format!(
                "effective batch = micro_batch({}) × grad_accum({grad_accum}) × dp({}) = {global_batch} sequences = {tokens_per_step} tokens",
                self.train.micro_batch,
                layout.dp()
            ),
        ];
        summary.extend(lr_line);
        if self.optim.warmup_steps > self.run.steps {
            // Well defined (the run ends inside the linear ramp), and what a short smoke test of a
            // long deck does: said, not refused.
            let (w, steps) = (self.optim.warmup_steps, self.run.steps);
            summary.push(format!(
                "warning: [optim] warmup_steps({w}) exceeds [run] steps({steps}): the run ends inside the warm-up, at {:.3e} = {steps}/{w} of the peak LR",
                lr * steps as f64 / w as f64
            ));
        }
        if pp > 1 {
            summary.push(self.pipeline_line(&stage_layers));
        }
        Ok(Resolved { deck: self.clone(), layout, grad_accum, global_batch, lr, tokens_per_step, stage_layers, summary })
    }

    /// The sizes the GPU's kernels and cuBLAS take as 32-bit integers: a deck beyond them is
    /// refused here, not by an assertion inside a launch.
    fn check_device_sizes(&self) -> Result<(), ConfigError> {
        if self.run.device != super::Device::Cuda {
            return Ok(());
        }
        let (m, t) = (&self.model, &self.train);
        let tokens = t.micro_batch as u128 * t.seq_len as u128;
        let sizes = [
            ("[train] micro_batch × seq_len (the rows of a micro-step)", tokens),
            ("[model] vocab_size", m.vocab_size as u128),
            ("[model] d_model", m.d_model as u128),
            ("[model] ffn_hidden", m.ffn_hidden as u128),
        ];
        for (what, v) in sizes {
            need(v <= i32::MAX as u128, || {
                err(format!("{what} = {v} exceeds {} (2^31 − 1), the largest size the GPU's kernels and cuBLAS take", i32::MAX))
                    .with_hint("split the work: a smaller micro_batch with more grad_accum, or tp/cp to divide it")
            })?;
        }
        Ok(())
    }

    fn check_run(&self) -> Result<(), ConfigError> {
        let name = &self.run.name;
        need(!name.is_empty(), || err("[run] name is empty; it names the run and its folder".into()))?;
        let bad = name.chars().find(|&c| !safe_name_char(c));
        let leading = name.starts_with(['.', '-']);
        if bad.is_some() || leading || name.len() > 200 {
            let why = match bad {
                Some(c) => format!("{c:?} is not allowed"),
                None if leading => "it starts with '.' or '-'".into(),
                None => format!("it is {} bytes long (at most 200)", name.len()),
            };
            let mut fixed: String = name.chars().take(200).map(|c| if safe_name_char(c) { c } else { '_' }).collect();
            fixed = fixed.trim_start_matches(['.', '-']).to_string();
            if fixed.is_empty() {
                fixed = "run".into();
            }
            return Err(err(format!("[run] name {name:?} is not safe as a folder name: {why}; use letters, digits, '.', '_', '-' or '+'"))
                .with_hint(format!("name = \"{fixed}\"")));
        }
        non_negative_finite("run", "watchdog_seconds", self.run.watchdog_seconds)?;
        non_negative_finite("run", "liveness_seconds", self.run.liveness_seconds)?;
        non_negative_finite("run", "max_walltime", self.run.max_walltime)?;
        non_negative_finite("run", "signal_lead_time", self.run.signal_lead_time)?;
        at_least_one("run", "steps", self.run.steps)
    }

    fn check_model(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        for (key, v) in [
            ("vocab_size", m.vocab_size),
            ("d_model", m.d_model),
            ("n_layers", m.n_layers),
            ("n_heads", m.n_heads),
            ("n_kv_heads", m.n_kv_heads),
            ("ffn_hidden", m.ffn_hidden),
            ("max_seq_len", m.max_seq_len),
        ] {
            at_least_one("model", key, v as u64)?;
        }
        need(m.head_dim > 0 || m.d_model % m.n_heads == 0, || {
            err(format!("[model] d_model({}) is not divisible by n_heads({})", m.d_model, m.n_heads)).with_hint(format!(
                "head_dim = d_model / n_heads must be a whole number; e.g. d_model = {}, or set head_dim",
                nearest_multiples(m.d_model, m.n_heads)
            ))
        })?;
        need(m.n_heads % m.n_kv_heads == 0, || {
            err(format!("[model] n_heads({}) is not divisible by n_kv_heads({})", m.n_heads, m.n_kv_heads))
                .with_hint("grouped-query attention shares each KV head among n_heads / n_kv_heads query heads; n_kv_heads = n_heads is plain multi-head attention")
        })?;
        let hd = m.head_dim();
        need(hd % 2 == 0, || {
            let from = if m.head_dim > 0 { String::new() } else { format!(" = d_model({}) / n_heads({})", m.d_model, m.n_heads) };
            err(format!("[model] head_dim{from} = {hd} is odd, but RoPE (rotate-half) needs an even head_dim"))
        })?;
        positive_finite("model", "rope_theta", m.rope_theta)?;
        positive_finite("model", "norm_eps", m.norm_eps)?;
        self.check_experts()
    }

    /// A mixture of experts' keys: all unset without `n_experts`, consistent with it.
    fn check_experts(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        if m.n_experts == 0 {
            for (key, set) in [
                ("experts_per_token", m.experts_per_token > 0),
                ("moe_ffn_hidden", m.moe_ffn_hidden > 0),
                ("n_shared_experts", m.n_shared_experts > 0),
                ("first_dense_layers", m.first_dense_layers > 0),
                ("router_aux_loss_coef", m.router_aux_loss_coef != 0.0),
                ("router_bias_update_rate", m.router_bias_update_rate != 0.0),
            ] {
                need(!set, || {
                    err(format!("[model] {key} is set, but n_experts = 0 (a dense model has no experts)"))
                        .with_hint("set n_experts to make the blocks mixtures of experts, or remove the key")
                })?;
            }
            return Ok(());
        }
        let (e, k) = (m.n_experts, m.experts_per_token);
        need(k >= 1 && k <= e, || {
            err(format!("[model] experts_per_token({k}) must be in 1..=n_experts({e})"))
                .with_hint("each token is routed to experts_per_token of the n_experts experts (Mixtral: 2 of 8)")
        })?;
        at_least_one("model", "moe_ffn_hidden", m.moe_ffn_hidden as u64)?;
        need(m.first_dense_layers <= m.n_layers, || {
            err(format!("[model] first_dense_layers({}) exceeds n_layers({})", m.first_dense_layers, m.n_layers))
        })?;
        non_negative_finite("model", "router_aux_loss_coef", m.router_aux_loss_coef)?;
        non_negative_finite("model", "router_bias_update_rate", m.router_bias_update_rate)?;
        let c = &self.checkpoint;
        for (key, v) in [("init_from", &c.init_from), ("export_hf", &c.export_hf)] {
            need(m.n_shared_experts == 0 || v.is_empty(), || {
                err(format!(
                    "[checkpoint] {key} = {v:?} with [model] n_shared_experts = {}: no Hugging Face family ndtrain reads or writes (Mixtral, Qwen3-MoE) has shared experts",
                    m.n_shared_experts
                ))
                .with_hint("remove the key: the model lives in ndtrain's checkpoints")
            })?;
        }
        Ok(())
    }

    /// `ep` cuts groups of experts out of the `dp_shard × cp` ranks: it needs experts, must
    /// divide that product, and must divide the experts evenly.
    fn check_expert_parallel(&self, l: &Layout) -> Result<(), ConfigError> {
        let (m, ep) = (&self.model, l.ep);
        if ep == 1 {
            return Ok(());
        }
        need(m.is_moe(), || {
            err(format!("[parallel] ep({ep}) splits experts, but n_experts = 0 (a dense model has none)"))
                .with_hint("set ep = 1, or give the model experts ([model] n_experts)")
        })?;
        let (s, cp) = (l.dp_shard, l.cp);
        need(l.fsdp() % ep == 0, || {
            let ds: Vec<String> = (1..=l.fsdp()).filter(|d| l.fsdp() % d == 0).map(|d| d.to_string()).collect();
            err(format!("[parallel] ep({ep}) does not divide dp_shard({s}) × cp({cp}) = {}; the ep ranks are cut out of those", l.fsdp()))
                .with_hint(format!("use ep in {{{}}}, or raise dp_shard", ds.join(", ")))
        })?;
        need(m.n_experts % ep == 0, || {
            err(format!(
                "[model] n_experts({}) is not divisible by [parallel] ep({ep}); each ep rank holds n_experts / ep experts",
                m.n_experts
            ))
        })
    }

    fn check_parallel(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        for (key, v) in
            [("pp", p.pp), ("pp_virtual", p.pp_virtual), ("dp_replicate", p.dp_replicate), ("cp", p.cp), ("tp", p.tp), ("ep", p.ep)]
        {
            need(v >= 1, || err(format!("[parallel] {key} must be ≥ 1, but it is {v}")))?;
        }
        need(p.dp_shard >= 1 || p.dp_shard == -1, || {
            err(format!("[parallel] dp_shard must be ≥ 1, or -1 to fill the world, but it is {}", p.dp_shard))
        })
    }

    fn check_train(&self) -> Result<(), ConfigError> {
        let (t, m) = (&self.train, &self.model);
        at_least_one("train", "seq_len", t.seq_len as u64)?;
        at_least_one("train", "micro_batch", t.micro_batch as u64)?;
        need(t.seq_len <= m.max_seq_len, || {
            err(format!("[train] seq_len({}) exceeds [model] max_seq_len({})", t.seq_len, m.max_seq_len))
                .with_hint("lower seq_len, or raise max_seq_len (RoPE positions go up to max_seq_len)")
        })
    }

    fn check_optim(&self) -> Result<(), ConfigError> {
        let o = &self.optim;
        positive_finite("optim", "lr", o.lr)?;
        non_negative_finite("optim", "min_lr", o.min_lr)?;
        need(o.min_lr <= o.lr, || err(format!("[optim] min_lr({}) exceeds lr({})", num(o.min_lr), num(o.lr))))?;
        for (key, b) in [("beta1", o.beta1), ("beta2", o.beta2)] {
            need((0.0..1.0).contains(&b), || err(format!("[optim] {key} must be in [0, 1), but it is {}", num(b))))?;
        }
        positive_finite("optim", "eps", o.eps)?;
        non_negative_finite("optim", "weight_decay", o.weight_decay)?;
        non_negative_finite("optim", "grad_clip", o.grad_clip)?;
        need(o.lr_scaling == LrScaling::None || o.base_batch > 0, || {
            let s = if o.lr_scaling == LrScaling::Linear { "linear" } else { "sqrt" };
            err(format!("[optim] lr_scaling = \"{s}\" needs base_batch > 0, but it is 0"))
                .with_hint("base_batch is the global batch (in sequences) at which lr was tuned")
        })
    }

    fn check_data(&self) -> Result<(), ConfigError> {
        let (d, m) = (&self.data, &self.model);
        match d.source {
            Source::Hdf5 | Source::Bin => {
                let (s, what) =
                    if d.source == Source::Hdf5 { ("hdf5", "an HDF5 file") } else { ("bin", "a .bin file or a glob of shards") };
                need(!d.path.trim().is_empty(), || {
                    err(format!("[data] source = \"{s}\" needs a path ({what}), but path is empty"))
                        .with_hint("--set data.path=FILE, or source = \"synthetic\" for data that needs no file")
                })?;
                // Token ids are checked against vocab_size by the data module (`.bin` shards may
                // hold uint16 or uint32 tokens).
                need(d.source == Source::Bin || !d.dataset.is_empty(), || {
                    err("[data] source = \"hdf5\" needs dataset (the 1-D token array), but it is empty".into())
                })?;
            }
            Source::Synthetic => {
                need(d.path.is_empty(), || {
                    err(format!("[data] path = {:?} is given, but source = \"synthetic\" reads no file", d.path))
                        .with_hint("set source = \"hdf5\" or \"bin\" to read the file, or remove path")
                })?;
                need((1..=m.vocab_size).contains(&d.synthetic_branching), || {
                    err(format!(
                        "[data] synthetic_branching({}) must be in 1..=[model] vocab_size({})",
                        d.synthetic_branching, m.vocab_size
                    ))
                })?;
            }
        }
        self.check_eval()
    }

    /// `[eval]`: a batch count when it is on; a held-out file only where the data is a file.
    fn check_eval(&self) -> Result<(), ConfigError> {
        let (e, d) = (&self.eval, &self.data);
        if !e.enabled() {
            return Ok(());
        }
        need(e.batches >= 1, || err(format!("[eval] batches must be ≥ 1 when [eval] every({}) > 0, but it is 0", e.every)))?;
        need(e.path.is_empty() || d.source != Source::Synthetic, || {
            err(format!("[eval] path = {:?} is given, but [data] source = \"synthetic\" reads no file", e.path))
                .with_hint("remove [eval] path: the held-out samples are then a tail of the synthetic stream ([eval] tail_samples)")
        })?;
        need(e.path.is_empty() || e.tail_samples == 0, || {
            err(format!(
                "[eval] path = {:?} and tail_samples({}) are both given: the held-out samples come from one or the other",
                e.path, e.tail_samples
            ))
        })
    }

    /// The degrees for `world_size` ranks, `dp_shard = -1` filled in.
    fn layout(&self, world_size: usize) -> Result<Layout, ConfigError> {
        need(world_size >= 1, || err("the job has 0 ranks".into()))?;
        let p = &self.parallel;
        let deg = |v: i64, key: &str| usize::try_from(v).map_err(|_| err(format!("[parallel] {key}({v}) is out of range")));
        let (pp, r, cp, tp) = (deg(p.pp, "pp")?, deg(p.dp_replicate, "dp_replicate")?, deg(p.cp, "cp")?, deg(p.tp, "tp")?);
        // The degrees other than dp_shard, as they are named in messages (pp only when used).
        let (pp_name, pp_part) = if pp > 1 { (format!("pp({pp}) × "), "pp × ") } else { (String::new(), "") };
        let fixed = pp.checked_mul(r).and_then(|x| x.checked_mul(cp)).and_then(|x| x.checked_mul(tp));
        let Some(fixed) = fixed else {
            return Err(err(format!("[parallel] {pp_name}dp_replicate({r}) × cp({cp}) × tp({tp}) is too large (overflows)")));
        };
        let dp_shard = if p.dp_shard == -1 {
            need(world_size % fixed == 0, || {
                err(format!(
                    "[parallel] dp_shard = -1 fills the world, but the job has {}, not a multiple of {pp_name}dp_replicate({r}) × cp({cp}) × tp({tp}) = {fixed}",
                    ranks(world_size)
                ))
                .with_hint(format!(
                    "run with a multiple of {fixed} ranks (e.g. {}), or lower {}dp_replicate, cp or tp",
                    nearest_multiples(world_size, fixed),
                    if pp > 1 { "pp, " } else { "" }
                ))
            })?;
            world_size / fixed
        } else {
            let s = deg(p.dp_shard, "dp_shard")?;
            let product = fixed.checked_mul(s);
            need(product == Some(world_size), || {
                let product = product.map_or("too large".to_string(), |n| n.to_string());
                let e = err(format!(
                    "[parallel] {pp_name}dp_replicate({r}) × dp_shard({s}) × cp({cp}) × tp({tp}) = {product}, but the job has {}",
                    ranks(world_size)
                ));
                if world_size % fixed == 0 {
                    e.with_hint(format!(
                        "run with {product} ranks, or set dp_shard = {} (or -1, which fills the world) for {}",
                        world_size / fixed,
                        ranks(world_size)
                    ))
                } else {
                    e.with_hint(format!(
                        "run with {product} ranks; {} is not a multiple of {pp_part}dp_replicate × cp × tp = {fixed}, so no dp_shard fits",
                        ranks(world_size)
                    ))
                }
            })?;
            s
        };
        let ep = deg(p.ep, "ep")?;
        Ok(Layout { pp, dp_replicate: r, dp_shard, cp, tp, ep })
    }

    /// Rules between the degrees and the model or the sequence length.
    fn check_layout(&self, l: &Layout) -> Result<(), ConfigError> {
        let (m, t) = (&self.model, &self.train);
        self.check_expert_parallel(l)?;
        let tp = l.tp;
        let divisors = || {
            let g = gcd(gcd(m.n_heads, m.n_kv_heads), m.ffn_hidden);
            // The first few divisors, searched among the degrees a job could have (a huge prime
            // head count must not make the hint take forever).
            let ds: Vec<String> = (1..=g.min(1 << 16)).filter(|d| g % d == 0).take(12).map(|d| d.to_string()).collect();
            format!(
                "tp must divide n_heads({}), n_kv_heads({}) and ffn_hidden({}): use tp in {{{}}}",
                m.n_heads,
                m.n_kv_heads,
                m.ffn_hidden,
                ds.join(", ")
            )
        };
        for (key, v, what) in [
            ("n_heads", m.n_heads, "query heads"),
            ("n_kv_heads", m.n_kv_heads, "key/value heads"),
            ("ffn_hidden", m.ffn_hidden, "MLP columns"),
        ] {
            need(v % tp == 0, || {
                err(format!("[parallel] tp({tp}) does not divide [model] {key}({v}); each tp rank holds {key} / tp {what}"))
                    .with_hint(divisors())
            })?;
        }
        // The shared experts are one FFN cut over tp like the dense MLP.
        let shared = m.n_shared_experts * m.moe_ffn_hidden;
        need(shared % tp == 0, || {
            err(format!(
                "[parallel] tp({tp}) does not divide the shared experts' width n_shared_experts({}) × moe_ffn_hidden({}) = {shared}; each tp rank holds its columns / tp",
                m.n_shared_experts, m.moe_ffn_hidden
            ))
        })?;
        let cp = l.cp;
        let sl = t.seq_len;
        // Both rules below together: seq_len is a multiple of lcm(2·cp, cp·tp) (each factor only when active).
        let two_cp = mul(2, cp, || format!("2 × cp({cp})"))?;
        let cp_tp = mul(cp, tp, || format!("cp({cp}) × tp({tp})"))?;
        let a = if cp > 1 { two_cp } else { 1 };
        let b = if self.parallel.sequence_parallel { cp_tp } else { 1 };
        let lcm = mul(a / gcd(a, b), b, || format!("lcm(2 × cp, cp × tp) for cp({cp}), tp({tp})"))?;
        let hint = || format!("use seq_len = {}", nearest_multiples(sl, lcm));
        if cp > 1 {
            need(sl % two_cp == 0, || {
                err(format!("[train] seq_len({sl}) is not divisible by 2 × cp({cp}) = {two_cp}; context parallelism cuts each sequence into 2·cp chunks"))
                    .with_hint(hint())
            })?;
        }
        if self.parallel.sequence_parallel {
            need(sl % cp_tp == 0, || {
                err(format!(
                    "[train] seq_len({sl}) is not divisible by cp({cp}) × tp({tp}) = {cp_tp}; sequence_parallel splits each rank's seq_len / cp tokens over the tp group"
                ))
                .with_hint(hint())
            })?;
        }
        Ok(())
    }

    /// `(grad_accum, global_batch)` from whichever of the two the deck gives.
    fn batch(&self, l: &Layout) -> Result<(usize, usize), ConfigError> {
        let t = &self.train;
        let (mb, dp) = (t.micro_batch, l.dp());
        let per_micro = mul(mb, dp, || format!("micro_batch({mb}) × dp({dp})"))?;
        match (t.global_batch, t.grad_accum) {
            (0, 0) => Ok((1, per_micro)),
            (g, 0) => {
                need(g % per_micro == 0, || {
                    err(format!("[train] global_batch({g}) is not divisible by micro_batch({mb}) × dp({dp}) = {per_micro}")).with_hint(format!(
                        "grad_accum = global_batch / (micro_batch × dp) must be a whole number: use global_batch = {}, or change micro_batch",
                        nearest_multiples(g, per_micro)
                    ))
                })?;
                Ok((g / per_micro, g))
            }
            (0, a) => Ok((a, mul(per_micro, a, || format!("micro_batch({mb}) × grad_accum({a}) × dp({dp})"))?)),
            (g, a) => {
                let product = per_micro.checked_mul(a);
                need(product == Some(g), || {
                    let product = product.map_or("too large".to_string(), |n| n.to_string());
                    err(format!("[train] global_batch({g}) ≠ micro_batch({mb}) × grad_accum({a}) × dp({dp}) = {product}"))
                        .with_hint("give only global_batch (grad_accum is then derived), which keeps the same samples on any layout")
                })?;
                Ok((a, g))
            }
        }
    }

    /// The peak learning rate after `lr_scaling`, and the line that says how it was scaled.
    fn scaled_lr(&self, global_batch: usize) -> Result<(f64, Option<String>), ConfigError> {
        let o = &self.optim;
        let ratio = global_batch as f64 / o.base_batch as f64;
        let (lr, line) = match o.lr_scaling {
            LrScaling::None => return Ok((o.lr, None)),
            LrScaling::Linear => {
                let lr = o.lr * ratio;
                (
                    lr,
                    format!(
                        "lr scaling (linear): lr({}) × global_batch({global_batch}) / base_batch({}) = {}",
                        num(o.lr),
                        o.base_batch,
                        num(lr)
                    ),
                )
            }
            LrScaling::Sqrt => {
                let lr = o.lr * ratio.sqrt();
                (
                    lr,
                    format!(
                        "lr scaling (sqrt): lr({}) × sqrt(global_batch({global_batch}) / base_batch({})) = {}",
                        num(o.lr),
                        o.base_batch,
                        num(lr)
                    ),
                )
            }
        };
        need(lr.is_finite() && lr > 0.0, || err(format!("[optim] the scaled lr is {}; {line}", num(lr))))?;
        need(o.min_lr <= lr, || {
            err(format!("[optim] min_lr({}) exceeds the peak lr after scaling: {line}", num(o.min_lr)))
                .with_hint("lower min_lr, or raise lr or base_batch")
        })?;
        Ok((lr, Some(line)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deck(overrides: &[&str]) -> Deck {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Deck::from_str_with("", &o).unwrap()
    }

    fn rejects(overrides: &[&str], world: usize) -> ConfigError {
        deck(overrides).resolve(world).expect_err("the deck should be rejected")
    }

    #[test]
    fn numbers_for_people() {
        assert_eq!(num(3e-4), "0.0003");
        assert_eq!(num(0.000424264068711928), "0.000424264");
        assert_eq!(num(1e-5), "1e-5");
        assert_eq!(num(1e-8), "1e-8");
        assert_eq!(num(10000.0), "10000");
        assert_eq!(num(1.5e7), "1.5e7");
        assert_eq!(num(0.0), "0");
        assert_eq!(num(-2.5), "-2.5");
    }

    #[test]
    fn default_deck_fills_the_world_with_dp_shard() {
        let r = Deck::default().resolve(4).unwrap();
        assert_eq!(r.layout, Layout { pp: 1, dp_replicate: 1, dp_shard: 4, cp: 1, tp: 1, ep: 1 });
        assert_eq!((r.grad_accum, r.global_batch, r.tokens_per_step), (1, 4, 4 * 64));
        assert_eq!(r.summary[0], "layout: dp_replicate(1) × dp_shard(4) × cp(1) × tp(1) = 4 ranks (dp = 4, fsdp = 4)");
        assert_eq!(r.summary[1], "effective batch = micro_batch(1) × grad_accum(1) × dp(4) = 4 sequences = 256 tokens");
        assert_eq!(r.summary.len(), 2);
    }

    #[test]
    fn grad_accum_from_global_batch() {
        let r = deck(&["train.global_batch=32", "train.micro_batch=2", "parallel.tp=2"]).resolve(8).unwrap();
        assert_eq!((r.layout.dp(), r.grad_accum, r.global_batch), (4, 4, 32));
        let r = deck(&["train.grad_accum=3", "train.micro_batch=2"]).resolve(2).unwrap();
        assert_eq!(r.global_batch, 12);
        let r = deck(&["train.grad_accum=3", "train.global_batch=12", "train.micro_batch=2"]).resolve(2).unwrap();
        assert_eq!(r.grad_accum, 3);
    }

    #[test]
    fn lr_scaling() {
        let r = deck(&["train.global_batch=64", "optim.lr_scaling=linear", "optim.base_batch=16", "optim.lr=0.001"]).resolve(4).unwrap();
        assert!((r.lr - 0.004).abs() < 1e-15);
        assert_eq!(r.summary[2], "lr scaling (linear): lr(0.001) × global_batch(64) / base_batch(16) = 0.004");
        let r = deck(&["train.global_batch=64", "optim.lr_scaling=sqrt", "optim.base_batch=16", "optim.lr=0.001"]).resolve(4).unwrap();
        assert!((r.lr - 0.002).abs() < 1e-15);
        let e = rejects(&["train.global_batch=4", "optim.lr_scaling=linear", "optim.base_batch=64", "optim.min_lr=0.0001"], 1);
        assert!(e.message.starts_with("[optim] min_lr(0.0001) exceeds the peak lr after scaling"), "{e}");
    }

    #[test]
    fn world_size_rules() {
        let e = rejects(&["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"], 4);
        assert_eq!(e.message, "[parallel] dp_replicate(2) × dp_shard(2) × cp(1) × tp(2) = 8, but the job has 4 ranks");
        assert_eq!(e.hint.as_deref(), Some("run with 8 ranks, or set dp_shard = 1 (or -1, which fills the world) for 4 ranks"));
        let e = rejects(&["parallel.tp=4"], 6);
        assert!(
            e.message
                .contains("dp_shard = -1 fills the world, but the job has 6 ranks, not a multiple of dp_replicate(1) × cp(1) × tp(4) = 4"),
            "{e}"
        );
        assert!(rejects(&[], 0).message.contains("0 ranks"));
        let e = rejects(&["parallel.dp_replicate=4611686018427387904", "parallel.tp=4"], 4);
        assert!(e.message.contains("overflows"), "{e}");
    }

    #[test]
    fn never_panics_on_extremes() {
        let big = usize::MAX.to_string();
        for o in [
            vec!["train.micro_batch=".to_string() + &big],
            vec!["train.grad_accum=".to_string() + &big, "train.micro_batch=2".into()],
            vec!["model.max_seq_len=".to_string() + &big, "train.seq_len=".to_string() + &big],
            vec!["parallel.cp=4611686018427387904".into()],
            vec!["optim.lr=inf".into()],
            vec!["optim.lr=nan".into()],
            vec!["model.d_model=9223372036854775807".into()],
        ] {
            let o: Vec<String> = o;
            if let Ok(d) = Deck::from_str_with("", &o) {
                let _ = d.resolve(2);
            }
        }
    }

    #[test]
    fn safe_run_names() {
        assert!(deck(&["run.name=llama_25m-dp2.tp2+x"]).resolve(1).is_ok());
        let e = rejects(&["run.name=a/b c"], 1);
        assert!(e.message.contains("'/' is not allowed"), "{e}");
        assert_eq!(e.hint.as_deref(), Some("name = \"a_b_c\""));
        assert!(rejects(&["run.name=.."], 1).message.contains("starts with '.'"));
        assert!(rejects(&["run.name="], 1).message.contains("[run] name is empty"));
    }
}

//! What the run tells people and machines: the rank-0 console, `metrics.csv`, the per-rank
//! timing file, FLOP counting for MFU, and the end-of-run min/avg/max table.
//!
//! Console output goes through [`say!`], which only rank 0 emits. Knows nothing of training
//! beyond the numbers it is handed.

use crate::config::ModelCfg;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

static IS_ROOT: AtomicBool = AtomicBool::new(true);

/// Declares whether this process is rank 0 (the one that prints for people).
pub fn set_root(is_root: bool) {
    IS_ROOT.store(is_root, Ordering::Relaxed);
}

pub fn is_root() -> bool {
    IS_ROOT.load(Ordering::Relaxed)
}

/// `println!` on rank 0 only.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {
        if $crate::metrics::is_root() {
            println!($($arg)*);
        }
    };
}

/// Matmul weights per token for MFU: every linear weight of the blocks plus the output
/// projection (counted even when tied), no embedding lookup.
pub fn matmul_params(cfg: &ModelCfg) -> u64 {
    let (d, f, hd) = (cfg.d_model as u64, cfg.ffn_hidden as u64, cfg.head_dim() as u64);
    let (q, kv) = (cfg.n_heads as u64 * hd, cfg.n_kv_heads as u64 * hd);
    let attention = q * d + 2 * kv * d + d * q;
    // A mixture-of-experts block's active weights: the router, the k experts a token uses and
    // the shared experts every token passes.
    let per_token = (cfg.experts_per_token + cfg.n_shared_experts) as u64;
    let experts = cfg.n_experts as u64 * d + per_token * 3 * cfg.moe_ffn_hidden as u64 * d;
    let mlp = |l: usize| if cfg.moe_layer(l) { experts } else { 3 * f * d };
    (0..cfg.n_layers).map(|l| attention + mlp(l)).sum::<u64>() + cfg.vocab_size as u64 * d
}

/// Training FLOPs per token (`docs/model.md`): `6·N_matmul + 12·L·H·hd·S`, no causal halving
/// (`H·hd = D` for Llama).
pub fn flops_per_token(cfg: &ModelCfg, seq_len: usize) -> f64 {
    6.0 * matmul_params(cfg) as f64 + 12.0 * (cfg.n_layers * cfg.n_heads * cfg.head_dim() * seq_len) as f64
}

/// The median of `v` (the mean of the middle two for an even count; NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// `HhMMmSSs`-style duration for the console.
pub fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{:.1}s", secs.max(0.0))
    }
}

/// Bytes for people, in binary units.
pub fn fmt_bytes(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{} B", bytes.round())
    } else {
        format!("{value:.2} {}", units[unit])
    }
}

/// One optimiser step's numbers, as rank 0 logs them.
#[derive(Clone, Debug)]
pub struct StepRecord {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub step_s: f64,
    pub elapsed_s: f64,
    /// Ranks of the job (for tokens/s per rank).
    pub world: usize,
    /// The held-out loss after this step, where `[eval]` computed one.
    pub val_loss: Option<f64>,
    /// A mixture of experts' auxiliary load-balancing loss (the mean over the batch's
    /// sequences, before its coefficient).
    pub aux_loss: Option<f64>,
}

/// `<out_dir>/metrics.csv`: one row per optimiser step, written by rank 0.
pub struct MetricsCsv {
    out: BufWriter<File>,
}

impl MetricsCsv {
    /// Creates the file, or on a resume at step `resumed_at` keeps the rows of steps up to it
    /// (a run that continues in its own directory keeps one unbroken log).
    pub fn create(path: &Path, resumed_at: u64) -> std::io::Result<Self> {
        let out =
            open_log(path, "step,loss,lr,grad_norm,tokens_per_s,tokens_per_s_per_rank,mfu,step_s,elapsed_s,val_loss,aux_loss", resumed_at)?;
        Ok(MetricsCsv { out })
    }

    pub fn append(&mut self, r: &StepRecord) -> std::io::Result<()> {
        writeln!(
            self.out,
            "{},{:.16e},{:.16e},{:.16e},{:.6e},{:.6e},{:.6e},{:.6e},{:.6e},{},{}",
            r.step,
            r.loss,
            r.lr,
            r.grad_norm,
            r.tokens_per_s,
            r.tokens_per_s / r.world.max(1) as f64,
            r.mfu,
            r.step_s,
            r.elapsed_s,
            r.val_loss.map_or(String::new(), |v| format!("{v:.16e}")),
            r.aux_loss.map_or(String::new(), |v| format!("{v:.16e}"))
        )?;
        self.out.flush()
    }
}

/// `<out_dir>/expert_load.csv`: a mixture of experts' routing balance, one row per optimiser
/// step and expert block, written by rank 0: how many of the global batch's choices (tokens
/// × k) went to the least and the most chosen expert, and the coefficient of variation
/// (standard deviation over mean) of the choices per expert.
pub struct ExpertLoadCsv {
    out: BufWriter<File>,
    first_dense: usize,
    experts: usize,
}

impl ExpertLoadCsv {
    /// Creates the file (on a resume at step `resumed_at`, keeping the rows up to it) for
    /// `experts` experts in every block from `first_dense` on.
    pub fn create(path: &Path, resumed_at: u64, first_dense: usize, experts: usize) -> std::io::Result<Self> {
        let out = open_log(path, "step,layer,choices,min,max,cv", resumed_at)?;
        Ok(ExpertLoadCsv { out, first_dense, experts })
    }

    /// The rows of step `step` from its global counts `[moe blocks × E]`.
    pub fn append(&mut self, step: u64, counts: &[u64]) -> std::io::Result<()> {
        for (i, c) in counts.chunks(self.experts).enumerate() {
            let total: u64 = c.iter().sum();
            let mean = total as f64 / c.len() as f64;
            let var = c.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / c.len() as f64;
            let cv = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
            let (min, max) = (c.iter().min().copied().unwrap_or(0), c.iter().max().copied().unwrap_or(0));
            writeln!(self.out, "{step},{},{total},{min},{max},{cv:.6e}", self.first_dense + i)?;
        }
        self.out.flush()
    }
}

/// The phases a step's wall time is split into.
/// `comm` is the gradient traffic after the last backward (the outer all-reduce, norms, the
/// loss); `wait` the step's synchronisation points (the token count before the first forward,
/// the stop-signal agreement), where a fast rank waits for the slowest; `eval` the held-out
/// loss computed after the step (its collectives count in the step's traffic).
pub const PHASES: [&str; 8] = ["data", "forward", "backward", "comm", "optimizer", "checkpoint", "wait", "eval"];

/// A phase of a step (named in logs as [`PHASES`] says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Data,
    Forward,
    Backward,
    Comm,
    Optimizer,
    Checkpoint,
    Wait,
    Eval,
}

impl Phase {
    pub const ALL: [Phase; PHASES.len()] =
        [Phase::Data, Phase::Forward, Phase::Backward, Phase::Comm, Phase::Optimizer, Phase::Checkpoint, Phase::Wait, Phase::Eval];

    /// The phase's name in the logs.
    pub fn name(self) -> &'static str {
        PHASES[self as usize]
    }
}

/// Per-step phase times of this rank, in seconds, indexed by [`Phase`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes([f64; PHASES.len()]);

impl PhaseTimes {
    pub fn add(&mut self, other: &PhaseTimes) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    /// Every phase's time, in [`PHASES`] order.
    pub fn values(&self) -> &[f64; PHASES.len()] {
        &self.0
    }
}

impl std::ops::Index<Phase> for PhaseTimes {
    type Output = f64;
    fn index(&self, p: Phase) -> &f64 {
        &self.0[p as usize]
    }
}

impl std::ops::IndexMut<Phase> for PhaseTimes {
    fn index_mut(&mut self, p: Phase) -> &mut f64 {
        &mut self.0[p as usize]
    }
}

/// The collectives every timing log has columns for, as `group.kind` (a group of degree 1
/// never communicates, so its columns stay 0).
pub const COLLECTIVES: [&str; 16] = [
    "cp.ring",
    "cp.all_reduce",
    "fsdp.all_gather",
    "fsdp.reduce_scatter",
    "fsdp.all_reduce",
    "dp_rep.all_reduce",
    "batch.all_reduce",
    "tp.all_reduce",
    "tp.all_gather",
    "tp.reduce_scatter",
    "pp.send",
    "pp.recv",
    "pp.all_reduce",
    "ep.all_to_all",
    "expert_fsdp.all_gather",
    "expert_fsdp.reduce_scatter",
];

/// Bytes of model state one rank holds (high-water marks where they vary).
#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryStats {
    /// Parameter, gradient and AdamW-moment shards (padding included).
    pub param_bytes: usize,
    pub grad_bytes: usize,
    pub optim_bytes: usize,
    /// Peak of gathered (unsharded) parameters.
    pub gathered_peak_bytes: usize,
    /// Whole-tensor gradient scratch (global tensors and one block) before reduce-scatter.
    pub grad_scratch_bytes: usize,
    /// Activations held between forward and backward.
    pub activation_bytes: usize,
    /// The checkpoint snapshot's buffers (`[checkpoint] async`; 0 before the first
    /// checkpoint), outside the model state.
    pub snapshot_bytes: usize,
}

impl MemoryStats {
    /// Everything but activations.
    pub fn model_state_bytes(&self) -> usize {
        self.param_bytes + self.grad_bytes + self.optim_bytes + self.gathered_peak_bytes + self.grad_scratch_bytes
    }
}

/// One row of a [`TimingLog`].
pub struct StepTiming<'a> {
    pub step: u64,
    pub step_s: f64,
    pub phases: &'a PhaseTimes,
    /// Writing the previous step's logs.
    pub log_s: f64,
    /// Counters of this step by `group.kind`.
    pub comm: &'a std::collections::BTreeMap<String, crate::parallel::comm::CommCount>,
    pub mem: &'a MemoryStats,
    pub attention_pairs: u64,
    /// The device allocator's bytes in use at the step's end and its high-water mark
    /// (`Backend::device_memory`); `None` on the host.
    pub device_memory: Option<(u64, u64)>,
}

/// `<out_dir>/timing/rank_<5 digits>.csv`: one row per step of this rank's phase times, the
/// time and bytes of each collective (`COLLECTIVES`), model-state memory and peak RSS.
/// Flushed every step (cheap, and a killed job keeps its log).
pub struct TimingLog {
    out: BufWriter<File>,
    /// Resident memory when the log was created, before the model state is allocated: peak
    /// RSS minus this is what the run itself needed.
    rss_start: u64,
}

impl TimingLog {
    pub fn create(dir: &Path, rank: usize, resumed_at: u64, rss_start: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut cols = vec!["step".to_string(), "step_s".to_string()];
        cols.extend(PHASES.iter().map(|p| format!("{p}_s")));
        cols.push("log_s".to_string());
        for c in COLLECTIVES {
            cols.push(format!("{c}_s"));
            cols.push(format!("{c}_bytes"));
        }
        cols.extend(
            [
                "param_bytes",
                "grad_bytes",
                "optim_bytes",
                "gathered_peak_bytes",
                "grad_scratch_bytes",
                "activation_bytes",
                "peak_rss_bytes",
                "rss_start_bytes",
                "attention_pairs",
                "device_bytes",
                "device_peak_bytes",
                "snapshot_bytes",
            ]
            .map(String::from),
        );
        let out = open_log(&dir.join(format!("rank_{rank:05}.csv")), &cols.join(","), resumed_at)?;
        Ok(TimingLog { out, rss_start })
    }

    /// Appends the row of one step.
    pub fn append(&mut self, r: &StepTiming<'_>) -> std::io::Result<()> {
        let (mem, comm) = (r.mem, r.comm);
        let mut row = vec![r.step.to_string(), format!("{:.6e}", r.step_s)];
        row.extend(r.phases.values().iter().map(|x| format!("{x:.6e}")));
        row.push(format!("{:.6e}", r.log_s));
        for c in COLLECTIVES {
            let k = comm.get(c).copied().unwrap_or_default();
            row.push(format!("{:.6e}", k.seconds));
            row.push(k.bytes.to_string());
        }
        for v in [mem.param_bytes, mem.grad_bytes, mem.optim_bytes, mem.gathered_peak_bytes, mem.grad_scratch_bytes, mem.activation_bytes] {
            row.push(v.to_string());
        }
        row.push(peak_rss_bytes().to_string());
        row.push(self.rss_start.to_string());
        row.push(r.attention_pairs.to_string());
        let (device_now, device_peak) = r.device_memory.unwrap_or_default();
        row.push(device_now.to_string());
        row.push(device_peak.to_string());
        row.push(mem.snapshot_bytes.to_string());
        writeln!(self.out, "{}", row.join(","))?;
        self.out.flush()
    }
}

/// A per-step CSV log with `header`. Fresh runs truncate; a run resumed at step
/// `resumed_at > 0` keeps the existing rows whose first column (the step) is at most that,
/// when the existing header is the same, and appends after them.
fn open_log(path: &Path, header: &str, resumed_at: u64) -> std::io::Result<BufWriter<File>> {
    let mut kept = String::new();
    if resumed_at > 0 {
        if let Ok(old) = std::fs::read_to_string(path) {
            let mut lines = old.lines();
            if lines.next() == Some(header) {
                for l in lines.filter(|l| l.split(',').next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s <= resumed_at)) {
                    kept.push_str(l);
                    kept.push('\n');
                }
            }
        }
    }
    let mut out = BufWriter::new(File::create(path)?);
    writeln!(out, "{header}")?;
    out.write_all(kept.as_bytes())?;
    out.flush()?;
    Ok(out)
}

fn proc_status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Peak resident set size of this process (`VmHWM`), 0 where `/proc` is absent.
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// Resident set size of this process now (`VmRSS`), 0 where `/proc` is absent.
pub fn rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

/// `<out_dir>/checkpoint_io.csv`, written by rank 0: one row per checkpoint written or loaded,
/// with what it cost (bytes over all ranks, the slowest rank's seconds, the largest rank's
/// resident memory).
pub struct CheckpointIoLog {
    out: BufWriter<File>,
}

/// One row of [`CheckpointIoLog`].
#[derive(Clone, Debug)]
pub struct CheckpointIo<'a> {
    pub event: &'a str,
    pub step: u64,
    pub file: &'a Path,
    pub bytes: u64,
    pub seconds: f64,
    pub collective: bool,
    /// Largest `VmRSS` of any rank just before the event.
    pub rss_before_bytes: u64,
    /// Largest `VmHWM` of any rank just after it.
    pub peak_rss_bytes: u64,
    /// Model state (parameters + AdamW moments) one rank holds.
    pub state_bytes_per_rank: u64,
    /// Collective HDF5 calls made for it, on the rank with the most.
    pub collective_hdf5_calls: u64,
    /// A write's costs to training (`None` for a load).
    pub writing: Option<WriteTimes>,
}

/// What a checkpoint write cost the training thread, each the largest of any rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteTimes {
    /// Seconds training waited for it: the copy into the snapshot, agreeing at its step, and
    /// any wait for it at a later checkpoint, a stop or the end of the run.
    pub stall_s: f64,
    /// The copy of the shards into the snapshot, seconds.
    pub snapshot_s: f64,
    /// At its step, the wait for the write before it, still in flight, seconds.
    pub waited_s: f64,
    pub snapshot_bytes: u64,
}

impl CheckpointIoLog {
    pub fn create(path: &Path, resumed_at: u64) -> std::io::Result<Self> {
        let header = "step,event,file,bytes,seconds,mb_per_s,collective,rss_before_bytes,peak_rss_bytes,state_bytes_per_rank,\
                      stall_s,snapshot_s,waited_s,snapshot_bytes,collective_hdf5_calls";
        Ok(CheckpointIoLog { out: open_log(path, header, resumed_at)? })
    }

    pub fn append(&mut self, r: &CheckpointIo<'_>) -> std::io::Result<()> {
        writeln!(
            self.out,
            "{},{},{},{},{:.6e},{:.3},{},{},{},{},{},{}",
            r.step,
            r.event,
            r.file.display(),
            r.bytes,
            r.seconds,
            r.bytes as f64 / 1e6 / r.seconds.max(1e-9),
            r.collective,
            r.rss_before_bytes,
            r.peak_rss_bytes,
            r.state_bytes_per_rank,
            r.writing
                .map_or(",,,".to_string(), |w| format!("{:.6e},{:.6e},{:.6e},{}", w.stall_s, w.snapshot_s, w.waited_s, w.snapshot_bytes)),
            r.collective_hdf5_calls
        )?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_formula_counts_lm_head_and_attention() {
        let cfg = ModelCfg {
            vocab_size: 4096,
            d_model: 512,
            n_layers: 8,
            n_heads: 8,
            n_kv_heads: 8,
            head_dim: 0,
            qk_norm: false,
            ffn_hidden: 1536,
            max_seq_len: 512,
            rope_theta: 1e4,
            norm_eps: 1e-5,
            tie_embeddings: false,
            ..ModelCfg::default()
        };
        // 8 · (4·512² + 3·512·1536) + 4096·512
        assert_eq!(matmul_params(&cfg), 8 * (4 * 512 * 512 + 3 * 512 * 1536) + 4096 * 512);
        // bench_small: 412 GFLOP per step of 4 × 512 tokens (its deck's header says so).
        let per_step = flops_per_token(&cfg, 512) * 2048.0;
        assert!((per_step / 1e9 - 412.0).abs() < 1.0, "{per_step}");
    }
}

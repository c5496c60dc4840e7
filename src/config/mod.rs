//! The input deck: TOML tables mirrored by serde types, then validated into derived values.
//!
//! Stage one (`Deck`) mirrors each TOML table with `deny_unknown_fields`-like checking (an
//! unknown key is rejected with the closest valid one). Stage two (`Deck::resolve`) checks every
//! constraint against the world size and derives the values other modules need (`Layout`,
//! `grad_accum`, the scaled learning rate). Each component receives only its own table.
//! Knows nothing of MPI, the model's numerics or files other than the deck itself.
//! Every table, key, default, alias and rule is documented in `docs/input_deck.md`.

mod keys;
mod pipeline;
mod validate;

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use pipeline::balanced_split;
pub use validate::{Layout, Resolved};

/// A deck error: one line for people, naming the table, the key and the numbers.
///
/// `Display` writes the message, then `\nHINT: …` when a hint exists; the caller prefixes
/// `error: `. Neither the message nor the hint contains a line break.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub message: String,
    /// An optional `HINT:` line where a fix is known.
    pub hint: Option<String>,
}

impl ConfigError {
    pub fn new(message: impl Into<String>) -> Self {
        ConfigError { message: message.into(), hint: None }
    }
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)?;
        if let Some(h) = &self.hint {
            write!(f, "\nHINT: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// `[run]`: what the run is called, where it writes, how long it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunCfg {
    pub name: String,
    /// All outputs of the run; empty means `out/<name>`.
    pub out_dir: String,
    pub seed: u64,
    /// Optimiser steps to take.
    pub steps: u64,
    /// Compute threads per rank; 0 means the CPUs of the rank's affinity mask, shared by the
    /// ranks of its node with the same mask.
    pub threads: usize,
    /// End the job when a rank's training loop makes no progress for this long (seconds;
    /// 0 disables the watchdog).
    pub watchdog_seconds: f64,
    /// A rank that has waited this long in a collective without progress probes the ranks it
    /// shares a group with, and ends the job naming those whose node or process is gone
    /// (seconds; 0 disables the probe; it runs with the watchdog).
    pub liveness_seconds: f64,
    /// Where the model computes: the host, or the rank's NVIDIA GPU (feature `cuda`).
    pub device: Device,
    /// Stop with a checkpoint (exit 75) before this many seconds since the start would pass
    /// during the next step and a checkpoint; 0 = no limit.
    pub max_walltime: f64,
    /// Also stop (the same way) before the Slurm or PBS job's own time limit, asked of the
    /// scheduler at start.
    pub stop_before_job_end: bool,
    /// Seconds between the scheduler's stop signal and the job's end (Slurm `--signal=USR1@N`),
    /// when known: a warning when a step and a checkpoint take longer (0 = unknown).
    pub signal_lead_time: f64,
    /// Stop (the same way: checkpoint, exit 75) after this many steps of this job, before
    /// `steps`; the schedule stays that of the whole run (0 = no such stop).
    pub stop_after_steps: u64,
}

/// `[run] device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

/// `[train] precision`: how the GEMMs' operands are rounded. Parameters, optimiser state,
/// activations and gradient reductions are f32 either way ("mixed precision").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 operands.
    #[default]
    Fp32,
    /// bf16 operands (rounded to nearest even), f32 accumulation and output.
    Bf16,
}

impl Default for RunCfg {
    fn default() -> Self {
        RunCfg {
            name: "run".into(),
            out_dir: String::new(),
            seed: 1234,
            steps: 100,
            threads: 0,
            watchdog_seconds: 1800.0,
            liveness_seconds: 10.0,
            device: Device::Cpu,
            max_walltime: 0.0,
            stop_before_job_end: false,
            signal_lead_time: 0.0,
            stop_after_steps: 0,
        }
    }
}

impl RunCfg {
    pub fn out_dir(&self) -> PathBuf {
        if self.out_dir.is_empty() {
            Path::new("out").join(&self.name)
        } else {
            PathBuf::from(&self.out_dir)
        }
    }
}

/// `[model]`: a Llama-style decoder, Hugging Face `LlamaConfig` semantics; with `qk_norm` and
/// an explicit `head_dim`, Qwen3's attention (`Qwen3Config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelCfg {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Width of one attention head; 0 means `d_model / n_heads` (Llama). Qwen3 sets it apart
    /// from the width, so q/k/v are `[n_heads·head_dim, d_model]` and o is its transpose.
    pub head_dim: usize,
    /// An RMSNorm over each head's q and k (weights `q_norm`, `k_norm` of `[head_dim]`) before
    /// RoPE, as Qwen3 does.
    pub qk_norm: bool,
    pub ffn_hidden: usize,
    /// Experts of each mixture-of-experts block; 0: every block has a dense MLP of
    /// `ffn_hidden`. Aliases: `num_local_experts` (Mixtral), `num_experts` (Qwen3-MoE).
    pub n_experts: usize,
    /// Experts each token is routed to (top-k). Alias: `num_experts_per_tok`.
    pub experts_per_token: usize,
    /// Width of each expert's SwiGLU FFN. Alias: `moe_intermediate_size`.
    pub moe_ffn_hidden: usize,
    /// Shared experts of each mixture-of-experts block (DeepSeek's): one SwiGLU FFN of
    /// `n_shared_experts × moe_ffn_hidden` every token passes, its output added to the routed
    /// experts' (0: none).
    pub n_shared_experts: usize,
    /// Divide the chosen experts' probabilities by their sum (Mixtral always does; Qwen3-MoE
    /// when its config says so).
    pub norm_topk_prob: bool,
    /// Blocks, from the first, that keep the dense MLP of `ffn_hidden` in a mixture of experts.
    pub first_dense_layers: usize,
    /// Weight of the auxiliary load-balancing loss in the gradient (`loss + coef · aux_loss`).
    pub router_aux_loss_coef: f64,
    /// Balancing without an auxiliary loss: after each step every expert's selection bias
    /// moves by this much towards an even load (0: no bias).
    pub router_bias_update_rate: f64,
    pub max_seq_len: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub tie_embeddings: bool,
}

impl Default for ModelCfg {
    fn default() -> Self {
        ModelCfg {
            vocab_size: 256,
            d_model: 128,
            n_layers: 2,
            n_heads: 8,
            n_kv_heads: 4,
            head_dim: 0,
            qk_norm: false,
            ffn_hidden: 256,
            n_experts: 0,
            experts_per_token: 0,
            moe_ffn_hidden: 0,
            n_shared_experts: 0,
            norm_topk_prob: true,
            first_dense_layers: 0,
            router_aux_loss_coef: 0.0,
            router_bias_update_rate: 0.0,
            max_seq_len: 1024,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_embeddings: false,
        }
    }
}

impl ModelCfg {
    /// The width of one attention head: `head_dim`, or `d_model / n_heads` when it is 0.
    pub fn head_dim(&self) -> usize {
        if self.head_dim > 0 {
            self.head_dim
        } else {
            self.d_model / self.n_heads
        }
    }

    /// The model routes tokens to experts (`n_experts > 0`).
    pub fn is_moe(&self) -> bool {
        self.n_experts > 0
    }

    /// Block `layer` (0-based) has a mixture of experts rather than the dense MLP.
    pub fn moe_layer(&self, layer: usize) -> bool {
        self.is_moe() && layer >= self.first_dense_layers
    }
}

/// `[parallel]`: the degrees of the 5-D mesh. `dp_shard = -1` fills what is left of the world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelCfg {
    /// Pipeline stages (the slowest mesh axis: stages span nodes).
    pub pp: i64,
    /// Model chunks per pipeline rank (`interleaved` runs more than one).
    pub pp_virtual: i64,
    pub pp_schedule: PpSchedule,
    /// Blocks per stage, in stage order (`pp × pp_virtual` entries); empty: balanced by cost.
    pub pp_layers: Vec<usize>,
    pub dp_replicate: i64,
    pub dp_shard: i64,
    pub cp: i64,
    pub tp: i64,
    /// Expert parallelism: each rank of an `ep` group (cut out of `dp_shard × cp`) holds
    /// `n_experts / ep` of every block's experts.
    pub ep: i64,
    pub sequence_parallel: bool,
    /// FSDP: free gathered block parameters after forward (ZeRO-3) or keep them for backward.
    pub reshard_after_forward: bool,
    /// Overlap communication with compute: prefetch the next block's all-gather and start each
    /// bucket's gradient all-reduce during backward. `false` runs them blocking (for measuring
    /// how much the overlap hides).
    pub overlap: bool,
    /// How the groups' collectives move a device's buffers (`docs/gpu.md`).
    pub comm_backend: CommBackend,
}

/// `[parallel] comm_backend`: how collectives move the backend's buffers. On the host every
/// choice is MPI on host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommBackend {
    /// NCCL where it can run (one GPU per rank), else staged.
    #[default]
    Auto,
    /// NCCL, one communicator per mesh group, bootstrapped over MPI.
    Nccl,
    /// Device buffers handed to a CUDA-aware MPI.
    Mpi,
    /// Device → host → MPI → device: any MPI, several ranks per GPU.
    Staged,
}

impl CommBackend {
    pub fn name(self) -> &'static str {
        match self {
            CommBackend::Auto => "auto",
            CommBackend::Nccl => "nccl",
            CommBackend::Mpi => "mpi",
            CommBackend::Staged => "staged",
        }
    }
}

/// `[parallel] pp_schedule`: the order in which a pipeline rank runs its micro-batches'
/// forwards and backwards (`docs/parallelism.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PpSchedule {
    /// Every forward, then every backward.
    Gpipe,
    /// One forward, one backward in steady state: at most `pp` micro-batches in flight.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `pp_virtual` model chunks per rank: the bubble shrinks by `pp_virtual`.
    Interleaved,
    /// ZB-H1: backward split into input- and weight-gradient halves, the latter filling the bubble.
    ZeroBubble,
}

impl PpSchedule {
    pub fn name(self) -> &'static str {
        match self {
            PpSchedule::Gpipe => "gpipe",
            PpSchedule::OneFOneB => "1f1b",
            PpSchedule::Interleaved => "interleaved",
            PpSchedule::ZeroBubble => "zero_bubble",
        }
    }
}

impl Default for ParallelCfg {
    fn default() -> Self {
        ParallelCfg {
            pp: 1,
            pp_virtual: 1,
            pp_schedule: PpSchedule::OneFOneB,
            pp_layers: vec![],
            dp_replicate: 1,
            dp_shard: -1,
            cp: 1,
            tp: 1,
            ep: 1,
            sequence_parallel: false,
            reshard_after_forward: true,
            overlap: true,
            comm_backend: CommBackend::Auto,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActCkpt {
    /// Keep every activation for backward.
    None,
    /// Keep only each block's input; recompute the block in backward.
    Full,
    /// Keep what is expensive to recompute (the outputs of the projections and of attention);
    /// recompute in backward what elementwise passes rebuild from them (the two norms' outputs,
    /// SwiGLU's product, the token-major attention output).
    Selective,
}

impl ActCkpt {
    /// The deck's spelling.
    pub fn name(self) -> &'static str {
        match self {
            ActCkpt::None => "none",
            ActCkpt::Full => "full",
            ActCkpt::Selective => "selective",
        }
    }
}

/// `[train]`: batch geometry and activation checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainCfg {
    pub seq_len: usize,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Sequences per optimiser step over the whole job (0 = derive from `grad_accum`).
    pub global_batch: usize,
    /// Micro-steps per optimiser step (0 = derive from `global_batch`).
    pub grad_accum: usize,
    pub activation_checkpointing: ActCkpt,
    pub precision: Precision,
}

impl Default for TrainCfg {
    fn default() -> Self {
        TrainCfg {
            seq_len: 64,
            micro_batch: 1,
            global_batch: 0,
            grad_accum: 0,
            activation_checkpointing: ActCkpt::None,
            precision: Precision::Fp32,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Cosine,
    Linear,
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    None,
    Linear,
    Sqrt,
}

/// `[optim]`: AdamW with PyTorch semantics, global-norm clipping and the LR schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimCfg {
    pub lr: f64,
    pub min_lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Max global L2 norm of the gradient; 0 disables clipping.
    pub grad_clip: f64,
    pub lr_scaling: LrScaling,
    /// Reference global batch (sequences) for `lr_scaling`; `lr` is the rate at this batch.
    pub base_batch: usize,
    /// What a step whose loss or gradient norm is NaN or infinite does.
    pub on_nonfinite: OnNonFinite,
}

/// `[optim] on_nonfinite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// Stop the run, naming the step, the rank and the first offending tensor.
    Abort,
    /// Leave the parameters and the optimiser state as they are for this step and go on.
    Skip,
}

impl Default for OptimCfg {
    fn default() -> Self {
        OptimCfg {
            lr: 3e-4,
            min_lr: 0.0,
            schedule: Schedule::Cosine,
            warmup_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            lr_scaling: LrScaling::None,
            base_batch: 0,
            on_nonfinite: OnNonFinite::Abort,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Synthetic,
    Hdf5,
    Bin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    Sequential,
    Shuffled,
}

/// `[data]`: where tokens come from and in which order samples are taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataCfg {
    pub source: Source,
    /// A file (HDF5 or `.bin`), or for `.bin` a glob of shards.
    pub path: String,
    /// HDF5 dataset holding the 1-D token array.
    pub dataset: String,
    pub order: Order,
    /// Synthetic source: successors per token of the seeded Markov chain.
    pub synthetic_branching: usize,
}

impl Default for DataCfg {
    fn default() -> Self {
        DataCfg {
            source: Source::Synthetic,
            path: String::new(),
            dataset: "tokens".into(),
            order: Order::Sequential,
            synthetic_branching: 4,
        }
    }
}

/// `[eval]`: the held-out (validation) loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalCfg {
    /// Evaluate after every this many optimiser steps and after the last (0 = never).
    pub every: u64,
    /// Global batches of held-out samples per evaluation.
    pub batches: usize,
    /// A token file of the kind `[data] source` reads (an HDF5 file uses `[data] dataset`)
    /// holding the held-out tokens; empty = a tail of the training source.
    pub path: String,
    /// Without `path`: samples at the end of the training source that training never reads
    /// (0 = what one evaluation reads, `batches × global_batch`).
    pub tail_samples: u64,
}

impl Default for EvalCfg {
    fn default() -> Self {
        EvalCfg { every: 0, batches: 4, path: String::new(), tail_samples: 0 }
    }
}

impl EvalCfg {
    /// Whether the run evaluates at all.
    pub fn enabled(&self) -> bool {
        self.every > 0
    }
}

/// `[checkpoint]`: where and how often checkpoints are written, and what to start from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointCfg {
    /// Empty means `<out_dir>/ckpt`.
    pub dir: String,
    /// Write a checkpoint every this many optimiser steps (0 = never).
    pub every: u64,
    /// Write beside training from a snapshot of the state (`async` in the deck); false waits
    /// for each write at its step.
    #[serde(rename = "async")]
    pub asynchronous: bool,
    /// Checkpoints to keep (0 = all).
    pub keep: usize,
    /// `""` (start fresh), `"auto"` (newest valid) or a checkpoint path.
    pub resume: String,
    /// A Hugging Face model folder (`config.json` + `model.safetensors`) to initialise from.
    pub init_from: String,
    /// A folder to write the final model to as Hugging Face `config.json` + `model.safetensors`
    /// (empty = none).
    pub export_hf: String,
}

impl Default for CheckpointCfg {
    fn default() -> Self {
        CheckpointCfg {
            dir: String::new(),
            every: 0,
            asynchronous: true,
            keep: 0,
            resume: String::new(),
            init_from: String::new(),
            export_hf: String::new(),
        }
    }
}

/// `[log]`: how often rank 0 prints a line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogCfg {
    pub every: u64,
}

impl Default for LogCfg {
    fn default() -> Self {
        LogCfg { every: 10 }
    }
}

/// `[hardware] rank_placement`: which node each rank of a job lands on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankPlacement {
    /// Consecutive ranks share a node: Slurm's default block distribution, Open MPI's
    /// `--map-by slot` or `core`.
    #[default]
    Block,
    /// Ranks dealt to the nodes in turn: `srun --distribution=cyclic`, `mpirun --map-by node`.
    Cyclic,
}

impl RankPlacement {
    /// The node of `rank` in a job of `nodes` nodes of `per_node` ranks each.
    pub fn node_of(self, rank: usize, per_node: usize, nodes: usize) -> usize {
        match self {
            RankPlacement::Block => rank / per_node.max(1),
            RankPlacement::Cyclic => rank % nodes.max(1),
        }
    }
}

/// `[hardware]`: peak rates used for MFU, and the machine `ndtrain plan` models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HardwareCfg {
    /// Peak FLOP/s of one rank (0 = measure with a short GEMM probe at start).
    pub peak_flops_per_rank: f64,
    /// Memory one rank may use, in bytes (0 = unknown: the planner marks nothing as too big).
    pub memory_per_rank: f64,
    /// Ranks on one node (the planner keeps groups of up to this many consecutive ranks on a node).
    pub ranks_per_node: usize,
    /// How the launcher deals the ranks to the nodes, for the planner's links.
    pub rank_placement: RankPlacement,
    /// Bandwidth of one rank to another rank of its node, bytes/s.
    pub intra_node_bandwidth: f64,
    /// The same for collectives that sum what they move (all-reduce, reduce-scatter), bytes/s
    /// (0 = `intra_node_bandwidth`).
    pub intra_node_reduce_bandwidth: f64,
    /// One rank's share of its node's network bandwidth in a group with one rank on each node,
    /// bytes/s: all-gathers, sends and the all-to-all; the all-reduce's and the
    /// reduce-scatter's own (MPI picks another algorithm for each) where they are set
    /// (0 = `inter_node_bandwidth`).
    pub inter_node_bandwidth: f64,
    pub inter_node_all_reduce_bandwidth: f64,
    pub inter_node_reduce_scatter_bandwidth: f64,
    /// The all-reduce called blocking, as tensor parallelism and the step's small reductions
    /// call it, one rank on each node: MPI runs other algorithms for blocking and non-blocking
    /// collectives between nodes (0 = `inter_node_all_reduce_bandwidth`).
    pub inter_node_blocking_all_reduce_bandwidth: f64,
    /// The same three in a group that spans nodes with several ranks on a node (FSDP over
    /// every rank): its ring crosses between nodes on fewer hops than it has ranks, so a rank
    /// gets more than its share (0 = the one-rank-per-node figure of the same collective).
    pub inter_node_packed_bandwidth: f64,
    pub inter_node_packed_all_reduce_bandwidth: f64,
    pub inter_node_packed_reduce_scatter_bandwidth: f64,
    /// The share of a non-blocking collective's time that moves while the rank computes
    /// (between the progress calls the model makes), measured by the probe; 1 = all of it.
    pub overlap_efficiency: f64,
    /// The same share for FSDP's prefetched all-gathers and reduce-scatters, several in flight
    /// through a micro-batch, which the probe measures on FSDP's own run over every rank
    /// (negative = `overlap_efficiency`).
    pub fsdp_overlap_efficiency: f64,
    /// Latency of one message inside a node, seconds.
    pub intra_node_latency: f64,
    /// Latency of one message between nodes, seconds.
    pub inter_node_latency: f64,
    /// Cores the ranks of a node share (0 = unknown: no oversubscription is modelled).
    pub cores_per_node: usize,
    /// The GEMM rate curve `peak / (1 + half_rows/rows + half_cols/n + half_inner/k)` of a
    /// linear layer of `rows` tokens, `n` outputs and `k` inputs (all 0 = every GEMM at
    /// `peak_flops_per_rank`); `ndtrain probe --deck` fits them on the deck's shapes.
    pub gemm_half_rate_rows: f64,
    pub gemm_half_rate_cols: f64,
    pub gemm_half_rate_inner: f64,
    /// Seconds per token per transformer block of forward + backward outside the GEMMs and
    /// attention (norms, activations, residuals), measured on the real model.
    pub block_other_s_per_token: f64,
    /// Seconds per token per block of the attention's forward + backward (every head) at the
    /// deck's `seq_len`, measured on the host kernels; `plan` cuts it over `tp`.
    pub attention_s_per_token: f64,
    /// Seconds per token per block of the work on whole `[tokens, d_model]` rows (RMSNorms,
    /// residual adds; forward + backward), which every rank of a tensor-parallel group repeats
    /// unless sequence parallelism cuts the tokens; part of `block_other_s_per_token`.
    pub replicated_s_per_token: f64,
    /// Seconds per token per block that the real model's step with `tp = 2` (and with
    /// `cp = 2`) on pairs of ranks took beyond the rest of this model: `plan` adds it, scaled
    /// by the degree, to layouts with that axis (`ndtrain probe --deck` measures both).
    pub tp_extra_s_per_token: f64,
    pub cp_extra_s_per_token: f64,
    /// `[tokens, seconds]` pairs: one block's forward + backward outside attention per token
    /// of a micro-batch of that many tokens on one rank, measured on the real model (empty =
    /// the GEMM curve and `block_other_s_per_token`). The planner interpolates it at a rank's
    /// tokens.
    pub block_s_per_token: Vec<[f64; 2]>,
    /// Bytes/s of the optimiser's memory traffic (28 bytes per parameter: AdamW reads
    /// p, g, m, v and writes p, m, v), measured on the real model. With this or
    /// `block_other_s_per_token` above 0 the planner uses its calibrated time model.
    pub optimizer_bandwidth: f64,
    /// Triad memory bandwidth of one rank with every rank busy, bytes/s (0 = unknown).
    pub memory_bandwidth: f64,
}

impl Default for HardwareCfg {
    /// Rates of a CPU cluster with shared memory inside a node and a 100 Gb/s network between
    /// nodes; set them for the real machine.
    fn default() -> Self {
        HardwareCfg {
            peak_flops_per_rank: 0.0,
            memory_per_rank: 0.0,
            ranks_per_node: 1,
            rank_placement: RankPlacement::Block,
            intra_node_bandwidth: 10e9,
            intra_node_reduce_bandwidth: 0.0,
            inter_node_bandwidth: 12.5e9,
            inter_node_all_reduce_bandwidth: 0.0,
            inter_node_reduce_scatter_bandwidth: 0.0,
            inter_node_blocking_all_reduce_bandwidth: 0.0,
            inter_node_packed_bandwidth: 0.0,
            inter_node_packed_all_reduce_bandwidth: 0.0,
            inter_node_packed_reduce_scatter_bandwidth: 0.0,
            overlap_efficiency: 1.0,
            fsdp_overlap_efficiency: -1.0,
            intra_node_latency: 1e-6,
            inter_node_latency: 5e-6,
            cores_per_node: 0,
            gemm_half_rate_rows: 0.0,
            gemm_half_rate_cols: 0.0,
            gemm_half_rate_inner: 0.0,
            block_other_s_per_token: 0.0,
            attention_s_per_token: 0.0,
            replicated_s_per_token: 0.0,
            tp_extra_s_per_token: 0.0,
            cp_extra_s_per_token: 0.0,
            block_s_per_token: vec![],
            optimizer_bandwidth: 0.0,
            memory_bandwidth: 0.0,
        }
    }
}

/// The whole deck after parsing and overrides, before world-size checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Deck {
    pub run: RunCfg,
    pub model: ModelCfg,
    pub parallel: ParallelCfg,
    pub train: TrainCfg,
    pub optim: OptimCfg,
    pub data: DataCfg,
    pub eval: EvalCfg,
    pub checkpoint: CheckpointCfg,
    pub log: LogCfg,
    pub hardware: HardwareCfg,
}

impl Deck {
    /// Reads a deck file and applies `table.key=value` overrides.
    pub fn from_file(path: &Path, overrides: &[String]) -> Result<Deck, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::new(format!("cannot read deck {}: {e}", path.display())))?;
        // A deck without a single key would train every default: far more likely a wrong path
        // or a file still being written than a wish.
        let empty = text.parse::<toml::Table>().is_ok_and(|t| t.is_empty());
        if empty {
            return Err(ConfigError::new(format!("{}: the deck is empty ({} bytes, no keys)", path.display(), text.len()))
                .with_hint("check the path; to train the defaults on purpose, give at least one key (e.g. [run] name = \"...\")"));
        }
        Deck::from_str_with(&text, overrides)
            .map_err(|e| ConfigError { message: format!("{}: {}", path.display(), e.message), hint: e.hint })
    }

    /// Parses deck text and applies `table.key=value` overrides.
    pub fn from_str_with(text: &str, overrides: &[String]) -> Result<Deck, ConfigError> {
        keys::parse(text, overrides)
    }

    /// The resolved deck as TOML (what the run saves as `deck.toml`).
    /// `[checkpoint] dir`, or `<out_dir>/ckpt` when empty.
    pub fn checkpoint_dir(&self) -> PathBuf {
        if self.checkpoint.dir.is_empty() {
            self.run.out_dir().join("ckpt")
        } else {
            PathBuf::from(&self.checkpoint.dir)
        }
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a Deck always serialises")
    }
}

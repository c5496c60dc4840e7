//! The planner (`ndtrain plan`): what a deck will need on a layout, before a job is queued.
//!
//! Memory per rank by category comes from the same shape functions the code allocates with
//! (`fsdp::memory::predicted_memory`, `Model::memory`, the ring's scratch), bytes per group
//! from the same formulas the tests hold to the measured counters (`fsdp`, `tp`, `cp`), FLOPs
//! from the formula of `docs/model.md`.
//! Nothing of the model is allocated, so a 70B deck on 512 ranks plans in milliseconds.
//! `rank_layouts` enumerates every valid `(pp, dp_replicate, dp_shard, cp, tp)` of a world and
//! orders them by a simple cost model over the `[hardware]` table (`docs/planning.md`).
//! Knows nothing of MPI or training.

pub mod network;
mod text;
pub mod time;

pub use text::{describe, describe_ranking};
pub use time::StageTime;

use crate::config::{ActCkpt, Deck, HardwareCfg, Layout, PpSchedule, RankPlacement, Resolved};
use crate::model::params::Dims;
use crate::model::{ActivationMemory, Model};
use crate::parallel::fsdp::memory::{predicted_comm_bytes as fsdp_bytes, predicted_memory, StateMemory};
use crate::parallel::fsdp::ShardPlan;
use crate::parallel::mesh::GroupKind;
use crate::parallel::pp::schedule::{bubble_fraction, peak_deferred, peak_in_flight};
use crate::parallel::pp::{chunks, rank_dims, Chunk};
use crate::parallel::{cp, ep, tp};
use std::collections::BTreeMap;

/// What one rank of a layout needs per optimiser step (rank 0 of every group: the largest
/// shards and the vocabulary's first rows).
#[derive(Clone, Debug)]
pub struct RankPlan {
    pub layout: Layout,
    pub grad_accum: usize,
    pub global_batch: usize,
    pub tokens_per_step: usize,
    pub lr: f64,
    pub state: StateMemory,
    /// Activation buffers with the deck's activation checkpointing.
    pub activations: ActivationMemory,
    /// The same without (`none`) and with (`selective`, `full`) activation checkpointing.
    pub activations_none: ActivationMemory,
    pub activations_selective: ActivationMemory,
    pub activations_full: ActivationMemory,
    /// Bytes per optimiser step by `group.kind`, as `comm` counts them.
    pub comm: BTreeMap<String, u64>,
    /// Model FLOPs of one optimiser step over all ranks, and the share of one rank.
    pub flops_per_step: f64,
    pub flops_per_rank: f64,
    /// Bytes of the largest gathered unit (one fsdp or expert_fsdp collective call) and of
    /// the largest unit's shard (one dp_rep all-reduce: the whole unit without fsdp).
    pub unit_bytes: usize,
    pub shard_bytes: usize,
    /// The checkpoint snapshot in host memory: a copy of the parameter and AdamW-moment shards
    /// this rank writes (`io::checkpoint::write`), held from the first checkpoint on, outside
    /// the device's peak.
    pub snapshot_bytes: usize,
    /// The pipeline's idle fraction of a step under the deck's schedule (0 without one).
    pub bubble: f64,
    /// Micro-batches whose activations the first stage holds at once (each of its chunks').
    pub in_flight: Vec<usize>,
    /// With a pipeline, rank 0 of every stage (the first is this plan); empty without one.
    pub stages: Vec<StagePlan>,
}

/// What rank 0 of one pipeline stage holds: its blocks and memory.
#[derive(Clone, Debug)]
pub struct StagePlan {
    pub stage: usize,
    /// Global block indices, per chunk.
    pub blocks: Vec<Vec<usize>>,
    pub embed: bool,
    pub head: bool,
    /// Micro-batches whose activations each chunk holds at once.
    pub in_flight: Vec<usize>,
    pub state: StateMemory,
    /// With the deck's activation checkpointing.
    pub activations: ActivationMemory,
}

impl StagePlan {
    /// As [`RankPlan::peak_bytes`].
    pub fn peak_bytes(&self) -> usize {
        self.state.total() + self.activations.total()
    }
}

impl RankPlan {
    /// Predicted peak bytes of one rank: model state, gathered parameters, gradient scratch,
    /// activations and backward buffers all live at once during the last backward.
    pub fn peak_bytes(&self) -> usize {
        self.state.total() + self.activations.total()
    }

    /// The largest [`Self::peak_bytes`] of any pipeline stage (the first stage's without a
    /// pipeline): what must fit in a rank's memory.
    pub fn max_peak_bytes(&self) -> usize {
        self.stages.iter().map(StagePlan::peak_bytes).max().unwrap_or(0).max(self.peak_bytes())
    }
}

/// The plan of one resolved deck: rank 0's, with every pipeline stage's memory.
pub fn plan(res: &Resolved) -> RankPlan {
    let (mut first, first_chunks) = stage_plan(res, 0);
    if res.layout.pp > 1 {
        first.stages = (0..res.layout.pp)
            .map(|stage| {
                let (p, chunks) = if stage == 0 { (first.clone(), first_chunks.clone()) } else { stage_plan(res, stage) };
                StagePlan {
                    stage,
                    blocks: chunks.iter().map(|c| c.layer_ids.clone()).collect(),
                    embed: chunks.iter().any(|c| c.embed),
                    head: chunks.iter().any(|c| c.head),
                    in_flight: p.in_flight.clone(),
                    state: p.state,
                    activations: p.activations,
                }
            })
            .collect();
    }
    first
}

/// The plan of rank 0 of pipeline stage `stage` (tp rank 0, fsdp rank 0; its `stages` empty),
/// and the stage's chunks.
fn stage_plan(res: &Resolved, stage: usize) -> (RankPlan, Vec<Chunk>) {
    let deck = &res.deck;
    let l = res.layout;
    let (dims, chunks) = stage_pieces(res, stage);
    let shards = shard_plan(res, &dims);
    let p = &deck.parallel;
    let in_flight = peak_in_flight(schedule_of(res), l.pp, chunks.len(), stage, res.grad_accum);
    let deferred = peak_deferred(schedule_of(res), l.pp, chunks.len(), stage, res.grad_accum);
    let state = predicted_memory(&shards, l.dp_replicate, p.reshard_after_forward, p.overlap);
    let s_local = deck.train.seq_len / l.cp;
    let mb = deck.train.micro_batch;
    let rows = tp::residual_rows(mb * s_local, l.tp, p.sequence_parallel);
    // One model per micro-batch in flight on each chunk (one without a pipeline).
    let acts = |ckpt| {
        let per_chunk = chunks.iter().zip(in_flight.iter().zip(&deferred)).map(|(c, (&k, &kept))| {
            let cd = dims.stage(c.layer_ids.clone(), c.embed, c.head);
            let mut a = Model::<f32>::memory(&cd, mb, s_local, ckpt, rows);
            // The ring attention's scratch is allocated beside the block's backward buffers.
            a.backward += 4 * cp::ring_scratch_elements(&cd, mb, s_local, l.cp);
            let mut a = a.times(k);
            // Zero bubble: the weight-gradient operands of `kept` micro-batches wait besides.
            a.deferred = kept * Model::<f32>::deferred_memory(&cd, mb, s_local, rows);
            a
        });
        per_chunk.fold(ActivationMemory::default(), ActivationMemory::plus)
    };
    let flops_per_step = crate::metrics::flops_per_token(&deck.model, deck.train.seq_len) * res.tokens_per_step as f64;
    let rank = RankPlan {
        layout: l,
        grad_accum: res.grad_accum,
        global_batch: res.global_batch,
        tokens_per_step: res.tokens_per_step,
        lr: res.lr,
        state,
        activations: acts(deck.train.activation_checkpointing),
        activations_none: acts(ActCkpt::None),
        activations_selective: acts(ActCkpt::Selective),
        activations_full: acts(ActCkpt::Full),
        comm: comm_bytes(res, &dims, &shards),
        flops_per_step,
        flops_per_rank: flops_per_step / l.world_size() as f64,
        unit_bytes: 4 * shards.max_gathered_len(),
        shard_bytes: 4 * shards.units.iter().map(|u| u.shard_len).max().unwrap_or(0),
        snapshot_bytes: state.params + state.optim,
        bubble: if l.pp > 1 { bubble_fraction(schedule_of(res), l.pp, chunks.len(), res.grad_accum) } else { 0.0 },
        in_flight,
        stages: vec![],
    };
    (rank, chunks)
}

/// Bytes per optimiser step of every collective of one rank (rank 0), keyed `group.kind`.
pub fn predicted_comm_bytes(res: &Resolved) -> BTreeMap<String, u64> {
    let (dims, _) = stage_pieces(res, 0);
    comm_bytes(res, &dims, &shard_plan(res, &dims))
}

/// Rank 0's shards of `dims`: over `fsdp`, its experts over `expert_fsdp`.
fn shard_plan(res: &Resolved, dims: &Dims) -> ShardPlan {
    let l = res.layout;
    ShardPlan::with_experts(dims, (l.fsdp(), 0), (l.expert_fsdp(), 0))
}

/// The tensors of rank 0 of pipeline stage `stage` (its tp piece of the stage's chunks: every
/// block without a pipeline) and its chunks.
fn stage_pieces(res: &Resolved, stage: usize) -> (Dims, Vec<Chunk>) {
    let whole = Dims::new(&res.deck.model, res.layout.tp, 0).with_expert_parallel(res.layout.ep, 0);
    let chunks = chunks(&res.stage_layers, res.layout.pp, stage);
    (rank_dims(&whole, &chunks), chunks)
}

/// The schedule the trainer runs (1F1B on one stage without a pipeline).
fn schedule_of(res: &Resolved) -> PpSchedule {
    if res.layout.pp == 1 {
        PpSchedule::OneFOneB
    } else {
        res.deck.parallel.pp_schedule
    }
}

/// [`predicted_comm_bytes`] for rank 0's TP piece `dims` and fsdp `shards`.
fn comm_bytes(res: &Resolved, dims: &Dims, shards: &ShardPlan) -> BTreeMap<String, u64> {
    let deck = &res.deck;
    let l = res.layout;
    let mut out = fsdp_bytes(shards, l.dp_replicate, l.dp(), res.grad_accum, deck.parallel.reshard_after_forward);
    let recompute = deck.train.activation_checkpointing == ActCkpt::Full;
    let sp = deck.parallel.sequence_parallel;
    let partial: usize =
        shards.units.iter().flat_map(|u| &u.tensors).filter(|t| t.tp_replicated && (sp || t.per_head)).map(|t| t.shard_len()).sum();
    let s_local = deck.train.seq_len / l.cp;
    let tokens = deck.train.micro_batch * s_local;
    let chunks = res.stage_layers.len() / l.pp;
    out.extend(tp::predicted_tp_bytes(dims, tokens, res.grad_accum, recompute, sp, partial, chunks));
    if l.ep > 1 {
        let rows = tp::residual_rows(tokens, l.tp, sp).local;
        out.insert("ep.all_to_all".into(), ep::predicted_all_to_all_bytes(dims, rows, res.grad_accum, recompute));
    }
    if l.cp > 1 {
        let ring = cp::predicted_ring_bytes(dims, deck.train.micro_batch, s_local, l.cp, res.grad_accum, recompute, chunks);
        out.insert("cp.ring".into(), ring);
        // The token count and the loss, 8 bytes each.
        out.insert("cp.all_reduce".into(), 16);
    }
    if l.pp > 1 {
        // Rank 0 (first stage): every chunk sends its activations forward and receives their
        // gradients; chunks after the first also receive activations and send gradients.
        let v = chunks;
        let rows = tp::residual_rows(tokens, l.tp, deck.parallel.sequence_parallel);
        // The activation or gradient, and a mixture of experts' loads after it (per sequence
        // E counts, E sums and the rows, each f64 as two f32).
        let loads = dims.moe.as_ref().map_or(0, |e| 8 * deck.train.micro_batch * (2 * e.router.experts + 1));
        let msg = (4 * rows.local * dims.d + loads) as u64;
        let mut each_way = (res.grad_accum * (2 * v - 1)) as u64 * msg;
        if dims.tie {
            // The embedding's gradient shard, to and from the last stage.
            let t = shards.units[0].tensors.iter().find(|t| t.name == "model.embed_tokens.weight").expect("stage 0 holds it");
            each_way += 4 * t.shard_len() as u64;
        }
        out.insert("pp.send".into(), each_way);
        out.insert("pp.recv".into(), each_way);
        // The loss and the squared gradient norm, 8 bytes each.
        out.insert("pp.all_reduce".into(), 16);
    }
    if deck.model.is_moe() {
        // The auxiliary loss's sum travels with the loss: 8 bytes more in each of its reductions.
        for key in ["batch.all_reduce", "cp.all_reduce", "pp.all_reduce"] {
            if let Some(b) = out.get_mut(key) {
                *b += 8;
            }
        }
        // Each micro-batch's expert loads (per sequence: E counts, E probability sums and the
        // rows, in f64) summed over the ranks that share its sequences.
        let loads = (res.grad_accum * deck.train.micro_batch * (2 * deck.model.n_experts + 1) * 8) as u64;
        if l.tp > 1 && sp {
            *out.entry("tp.all_reduce".into()).or_default() += loads;
        }
        if l.cp > 1 {
            *out.entry("cp.all_reduce".into()).or_default() += loads;
        }
        // Once per step, the choices per expert block and expert (f64), summed over every
        // rank that routed other rows (the expert-load log).
        let counts = (8 * (0..deck.model.n_layers).filter(|&b| deck.model.moe_layer(b)).count() * deck.model.n_experts) as u64;
        let batch = l.dp_replicate * l.dp_shard > 1;
        for (key, on) in
            [("batch.all_reduce", batch), ("cp.all_reduce", l.cp > 1), ("pp.all_reduce", l.pp > 1), ("tp.all_reduce", l.tp > 1 && sp)]
        {
            if on {
                *out.entry(key.into()).or_default() += counts;
            }
        }
    }
    out
}

/// Every layout of `world` ranks the deck accepts (`pp × dp_replicate × dp_shard × cp × tp`,
/// and for a mixture of experts every `ep` dividing `dp_shard × cp` and the experts; others
/// keep `[parallel]`'s flags), with the number of factorisations it refused.
pub fn valid_layouts(deck: &Deck, world: usize) -> (Vec<Resolved>, usize) {
    let divisors = |n: usize| (1..=n).filter(move |d| n % d == 0);
    let (mut ok, mut refused) = (vec![], 0);
    for pp in divisors(world) {
        for tp in divisors(world / pp) {
            for cp in divisors(world / pp / tp) {
                for rep in divisors(world / pp / tp / cp) {
                    let shard = world / pp / tp / cp / rep;
                    // ep is not a factor of the world: every degree the experts and the
                    // dp_shard × cp ranks allow.
                    let eps: Vec<usize> = if deck.model.is_moe() {
                        divisors(shard * cp).filter(|ep| deck.model.n_experts % ep == 0).collect()
                    } else {
                        vec![1]
                    };
                    for ep in eps {
                        let mut d = deck.clone();
                        d.parallel.pp = pp as i64;
                        d.parallel.tp = tp as i64;
                        d.parallel.cp = cp as i64;
                        d.parallel.dp_replicate = rep as i64;
                        d.parallel.dp_shard = shard as i64;
                        d.parallel.ep = ep as i64;
                        match d.resolve(world) {
                            Ok(r) => ok.push(r),
                            Err(_) => refused += 1,
                        }
                    }
                }
            }
        }
    }
    (ok, refused)
}

/// The cost model's estimate of one optimiser step on a layout.
#[derive(Clone, Debug)]
pub struct Cost {
    pub compute_s: f64,
    /// Seconds per group (all its collective kinds): exposed (what compute does not hide),
    /// and whole (each collective's own time, none of it hidden).
    pub comm_s: BTreeMap<String, f64>,
    pub comm_whole_s: BTreeMap<String, f64>,
    pub step_s: f64,
    /// The fraction of the step a pipeline rank idles (0 without a pipeline).
    pub bubble: f64,
    pub tokens_per_s: f64,
    /// `None` when `[hardware] memory_per_rank` is not set.
    pub fits: Option<bool>,
    /// Tensor-parallel groups stay inside a node.
    pub tp_in_node: bool,
    /// With a calibrated `[hardware]`: each stage's compute by part (the first alone without
    /// a pipeline), and the seconds the pipeline's bubble adds; empty and 0 otherwise.
    pub stages: Vec<StageTime>,
    pub bubble_s: f64,
}

fn group_size(group: &str, l: &Layout) -> usize {
    match group {
        "tp" => l.tp,
        "cp" => l.cp,
        "fsdp" => l.fsdp(),
        "ep" => l.ep,
        "expert_fsdp" => l.expert_fsdp(),
        "dp_rep" => l.dp_replicate,
        "batch" => l.dp(),
        "pp" => l.pp,
        _ => 1,
    }
}

/// The estimate: compute, plus each collective as a ring over its group's slowest hop
/// ([`network::link`]) — `(n−1)/n` of the counted bytes (twice for an all-reduce; all of them
/// for the all-to-all, whose counted bytes are already those leaving the rank) over the hop's
/// bandwidth (the summing one for all-reduce and reduce-scatter), plus `(n−1)` latencies per
/// call (twice for an all-reduce), with calls estimated from the bytes of one `[tokens, D]`
/// activation (tp, pp), one unit (fsdp, dp_rep, expert_fsdp), one key/value block (cp) or one
/// exchange of routed rows (ep) — of which only what the code does not hide behind compute is
/// charged ([`exposed`]).
pub fn cost(p: &RankPlan, deck: &Deck, hw: &HardwareCfg, peak_flops: f64) -> Cost {
    let l = &p.layout;
    let tokens = (deck.train.micro_batch * deck.train.seq_len / l.cp).max(1) as f64;
    let mut links: BTreeMap<String, network::Link> = BTreeMap::new();
    let mut whole: BTreeMap<(String, String), Collective> = BTreeMap::new();
    for (key, &bytes) in &p.comm {
        let (group, kind) = key.split_once('.').unwrap_or((key, ""));
        let n = group_size(group, l) as f64;
        if n <= 1.0 || bytes == 0 {
            continue;
        }
        let link = *links.entry(group.to_string()).or_insert_with(|| match network::kind_of(group) {
            Some(k) => network::link(k, l, hw),
            None => network::link(GroupKind::Batch, l, hw),
        });
        let bw = match kind {
            // FSDP's and the replicas' reductions are started non-blocking; the rest block.
            "all_reduce" if matches!(group, "dp_rep" | "fsdp" | "expert_fsdp") => link.all_reduce_bandwidth,
            "all_reduce" => link.blocking_all_reduce_bandwidth,
            "reduce_scatter" => link.reduce_scatter_bandwidth,
            _ => link.bandwidth,
        };
        let lat = link.latency;
        let b = bytes as f64;
        let per_call = match group {
            "tp" => 4.0 * tokens * deck.model.d_model as f64,
            "cp" => 8.0 * tokens * (deck.model.n_kv_heads / l.tp * deck.model.head_dim()) as f64,
            "fsdp" | "expert_fsdp" => (p.unit_bytes as f64).max(1.0),
            "dp_rep" => (p.shard_bytes as f64).max(1.0),
            "pp" => 4.0 * tokens * deck.model.d_model as f64,
            // One exchange: the rows of a block's micro-batch that leave the rank.
            "ep" => 4.0 * tokens * (deck.model.experts_per_token * deck.model.d_model) as f64 * (n - 1.0) / n,
            _ => b,
        };
        let calls = (b / per_call).ceil().max(1.0);
        let seconds = match kind {
            "all_reduce" => 2.0 * ((n - 1.0) / n * b / bw + (n - 1.0) * lat * calls),
            // The counted bytes are already those that leave the rank.
            "all_to_all" => b / bw + (n - 1.0) * lat * calls,
            _ => (n - 1.0) / n * b / bw + (n - 1.0) * lat * calls,
        };
        whole.insert((group.to_string(), kind.to_string()), Collective { seconds, calls });
    }
    let bubble = p.bubble;
    let m = p.grad_accum as f64;
    // A micro-batch's forward is one of its passes (three, four under full activation
    // checkpointing, whose recomputed forward runs in the backward).
    let forward_share = if deck.train.activation_checkpointing == ActCkpt::Full { 0.25 } else { 1.0 / 3.0 };
    let hide = |micro_batch_s: f64| Hiding {
        forward_s: micro_batch_s * forward_share,
        backward_s: micro_batch_s * (1.0 - forward_share),
        units: (deck.model.n_layers / l.pp + 1) as f64,
        grad_accum: m,
        pp: l.pp,
        overlap: deck.parallel.overlap,
        efficiency: hw.overlap_efficiency,
        fsdp_efficiency: if hw.fsdp_overlap_efficiency < 0.0 { hw.overlap_efficiency } else { hw.fsdp_overlap_efficiency },
        reshard_after_forward: deck.parallel.reshard_after_forward,
    };
    let comm_s_of = |micro_batch_s: f64| exposed(&whole, &hide(micro_batch_s));
    let per_micro_batch = |comm: &BTreeMap<String, f64>| -> f64 {
        comm.iter().filter(|(g, _)| matches!(g.as_str(), "tp" | "cp" | "ep" | "fsdp" | "expert_fsdp")).map(|(_, t)| t).sum()
    };
    let (compute_s, stages, comm_s, bubble_s, step_s) = if time::calibrated(hw) {
        // The slowest stage sets the pace; the least compute of any stage hides communication.
        let stages = time::stage_times(p, deck, hw, peak_flops);
        let busy = stages.iter().map(StageTime::total).fold(0.0, f64::max);
        let least = stages.iter().map(|s| s.gemm_s + s.other_s).fold(f64::INFINITY, f64::min) / m;
        let comm_s = comm_s_of(least);
        // Exposed communication inside a micro-batch lengthens it, and the bubble with it.
        let idle = time::bubble_s(busy + per_micro_batch(&comm_s), bubble, l.pp, hw);
        let step = busy + idle + comm_s.values().sum::<f64>();
        (busy, stages, comm_s, idle, step)
    } else {
        let compute_s = p.flops_per_rank / peak_flops.max(1.0);
        let comm_s = comm_s_of(compute_s / m);
        // A pipeline rank idles `bubble` of the micro-batches' time (their compute and the
        // communication exposed inside them); the step's own collectives come once, after.
        let inside = compute_s + per_micro_batch(&comm_s);
        let idle = inside / (1.0 - bubble) - inside;
        (compute_s, vec![], comm_s.clone(), idle, compute_s + idle + comm_s.values().sum::<f64>())
    };
    Cost {
        stages,
        bubble_s,
        compute_s,
        comm_whole_s: whole.iter().fold(BTreeMap::new(), |mut acc, ((g, _), c)| {
            *acc.entry(g.clone()).or_default() += c.seconds;
            acc
        }),
        comm_s,
        step_s,
        bubble,
        tokens_per_s: p.tokens_per_step as f64 / step_s.max(1e-12),
        fits: (hw.memory_per_rank > 0.0).then(|| (p.max_peak_bytes() as f64) <= hw.memory_per_rank),
        tp_in_node: !network::link(GroupKind::Tp, l, hw).crosses_nodes,
    }
}

/// One collective kind of a group over a step: its whole time and its calls.
#[derive(Clone, Copy, Debug)]
struct Collective {
    seconds: f64,
    calls: f64,
}

/// What a micro-batch offers to hide communication behind (the stage with the least compute).
struct Hiding {
    forward_s: f64,
    backward_s: f64,
    /// FSDP units of a stage: its blocks and the global tensors.
    units: f64,
    grad_accum: f64,
    pp: usize,
    overlap: bool,
    /// `[hardware] overlap_efficiency`: the share of a collective in flight that moves while
    /// the rank computes (the bucketed all-reduce's).
    efficiency: f64,
    /// `[hardware] fsdp_overlap_efficiency`: the same for FSDP's gathers and reduce-scatters.
    fsdp_efficiency: f64,
    reshard_after_forward: bool,
}

impl Hiding {
    /// What stays exposed of `t` seconds of communication in flight over `behind` seconds of
    /// compute: all but the share `efficiency` that moves while computing, up to the
    /// compute's length, and `1/units` of it at least (the unit that has nothing to hide
    /// behind).
    fn exposed(&self, t: f64, behind: f64, efficiency: f64) -> f64 {
        if t <= 0.0 {
            return 0.0;
        }
        (t - (efficiency * t).min(behind)).max(t / self.units)
    }
}

/// The exposed seconds per group: what the code does not hide behind compute
/// (`docs/planning.md`, *Overlap*).
///
/// - `fsdp`, `expert_fsdp` (with `[parallel] overlap`): each unit's all-gather is prefetched
///   while the unit before it computes, so a micro-batch's forward gathers hide behind its
///   forward; in its backward the gathers again (with `reshard_after_forward`) and the
///   reduce-scatters, each left in flight over the next unit's backward, share the link and
///   hide behind the backward. What exceeds the compute is exposed, and the first unit's
///   gather (the last unit's reduce-scatter) at least. Of the time in flight only
///   `[hardware] fsdp_overlap_efficiency` moves while the rank computes (MPI on the host moves
///   a collective only inside the progress calls between the model's pieces of compute).
/// - `dp_rep` (with `overlap`): its all-reduce starts unit by unit in the step's last backward
///   and hides behind it, at `[hardware] overlap_efficiency`; the last unit's share is exposed
///   at least.
/// - `pp`: every send is posted before the next action computes; what stays on the pipeline's
///   critical path is one transfer per stage boundary as it fills and one as it drains,
///   `2(pp − 1)` messages (the receives are the same transfers).
/// - Everything else blocks: tensor parallelism's collectives inside each layer, the context
///   ring (its overlap is part of the probe's `cp_extra_s_per_token`), the experts' all-to-all,
///   the loss and norm reductions.
fn exposed(whole: &BTreeMap<(String, String), Collective>, h: &Hiding) -> BTreeMap<String, f64> {
    let s = |g: &str, k: &str| whole.get(&(g.to_string(), k.to_string())).map_or(0.0, |c| c.seconds);
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for ((group, kind), c) in whole {
        *out.entry(group.clone()).or_default() += match (group.as_str(), kind.as_str()) {
            ("fsdp" | "expert_fsdp", "all_gather" | "reduce_scatter") if h.overlap => 0.0,
            ("dp_rep", "all_reduce") if h.overlap => h.exposed(c.seconds, h.backward_s, h.efficiency),
            ("pp", "send") => c.seconds.min(2.0 * (h.pp - 1) as f64 * c.seconds / c.calls),
            ("pp", "recv") => 0.0,
            _ => c.seconds,
        };
    }
    if h.overlap {
        for group in ["fsdp", "expert_fsdp"] {
            let (gather, scatter) = (s(group, "all_gather") / h.grad_accum, s(group, "reduce_scatter") / h.grad_accum);
            if gather + scatter == 0.0 {
                continue;
            }
            let forward = if h.reshard_after_forward { gather / 2.0 } else { gather };
            let backward = gather - forward + scatter;
            *out.entry(group.to_string()).or_default() +=
                h.grad_accum * (h.exposed(forward, h.forward_s, h.fsdp_efficiency) + h.exposed(backward, h.backward_s, h.fsdp_efficiency));
        }
    }
    out
}

/// Every valid layout with its plan and cost, best first: layouts that fit in memory and keep
/// tensor parallelism inside a node, by predicted tokens/s; then the others.
pub fn rank_layouts(deck: &Deck, world: usize, hw: &HardwareCfg, peak_flops: f64) -> (Vec<(RankPlan, Cost)>, usize) {
    let (layouts, refused) = valid_layouts(deck, world);
    let mut out: Vec<(RankPlan, Cost)> = layouts
        .iter()
        .map(|r| {
            let p = plan(r);
            let c = cost(&p, &r.deck, hw, peak_flops);
            (p, c)
        })
        .collect();
    let usable = |c: &Cost| c.fits != Some(false) && c.tp_in_node;
    out.sort_by(|a, b| usable(&b.1).cmp(&usable(&a.1)).then(b.1.tokens_per_s.total_cmp(&a.1.tokens_per_s)));
    (out, refused)
}

/// `ndtrain plan`: the deck `deck_path` (with `--set` overrides) for `ranks` ranks — the
/// report of its layout, or with `all_layouts` every valid layout of the world ranked — as the
/// text to print. An error is bad input (the deck, or no valid layout).
pub fn command(
    deck_path: &std::path::Path,
    ranks: usize,
    ranks_per_node: Option<usize>,
    placement: Option<RankPlacement>,
    all_layouts: bool,
    set: &[String],
) -> Result<String, String> {
    let parsed = Deck::from_file(deck_path, set).map_err(|e| e.to_string())?;
    let mut hw = parsed.hardware.clone();
    if let Some(r) = ranks_per_node {
        hw.ranks_per_node = r.max(1);
    }
    if let Some(p) = placement {
        hw.rank_placement = p;
    }
    let peak = if hw.peak_flops_per_rank > 0.0 { hw.peak_flops_per_rank } else { crate::backend::cpu::probe::gemm_flops() };
    if all_layouts {
        parsed.validate().map_err(|e| e.to_string())?;
        let (ranked, refused) = rank_layouts(&parsed, ranks, &hw, peak);
        if ranked.is_empty() {
            return Err(format!("no layout of {ranks} ranks is valid for deck {} ({refused} refused)", deck_path.display()));
        }
        return Ok(describe_ranking(&ranked, refused, &hw, peak));
    }
    let res = parsed.resolve(ranks).map_err(|e| e.to_string())?;
    let n = crate::model::params::param_specs(&res.deck.model).iter().map(|s| s.numel()).sum::<usize>();
    let mut out = format!("deck {} is valid for {ranks} ranks\n", deck_path.display());
    for line in &res.summary {
        out += &format!("{line}\n");
    }
    let bytes = |b: usize| crate::metrics::fmt_bytes(b as f64);
    out += &format!("parameters: {n} ({} in f32; with gradients and AdamW moments {})\n", bytes(n * 4), bytes(n * 16));
    let p = plan(&res);
    out += &describe(&p, &res, &hw);
    // Where the job's nodes are known (the option, or the deck's [hardware]), which groups
    // cross them.
    if ranks_per_node.is_some() || hw.ranks_per_node > 1 {
        for line in crate::run::placement::groups_across_planned_nodes(hw.ranks_per_node, hw.rank_placement, &res.layout) {
            out += &format!("{line}\n");
        }
    }
    let c = cost(&p, &res.deck, &hw, peak);
    out += &text::time_lines(&c);
    out += &format!(
        "\ncost model: {:.3} s compute + {:.3} s bubble + {:.3} s communication = {:.3} s per step, {:.0} tokens/s (peak {:.3e} FLOP/s per rank{})\n",
        c.compute_s,
        c.bubble_s,
        c.step_s - c.compute_s - c.bubble_s,
        c.step_s,
        c.tokens_per_s,
        peak,
        if hw.peak_flops_per_rank > 0.0 { ", [hardware]" } else { ", measured here by the GEMM probe" }
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(entries: &[(&str, &str, f64, f64)]) -> BTreeMap<(String, String), Collective> {
        entries.iter().map(|&(g, k, seconds, calls)| ((g.to_string(), k.to_string()), Collective { seconds, calls })).collect()
    }

    fn hiding(efficiency: f64) -> Hiding {
        Hiding {
            forward_s: 1.0,
            backward_s: 2.0,
            units: 10.0,
            grad_accum: 2.0,
            pp: 4,
            overlap: true,
            efficiency,
            fsdp_efficiency: efficiency,
            reshard_after_forward: true,
        }
    }

    /// FSDP's gathers hide behind the forward and, with the reduce-scatters, behind the
    /// backward, micro-batch by micro-batch; what exceeds the compute, or the share that does
    /// not move while computing, stays exposed, and one unit's share at least.
    #[test]
    fn fsdp_hides_behind_each_pass_up_to_the_compute_and_the_efficiency() {
        // Per micro-batch: gathers 1.5 s in the forward and 1.5 s in the backward, scatters 1 s.
        let w = whole(&[("fsdp", "all_gather", 6.0, 36.0), ("fsdp", "reduce_scatter", 2.0, 18.0), ("tp", "all_reduce", 0.7, 64.0)]);
        let all = exposed(&w, &hiding(1.0));
        // Forward 1.5 − 1; backward 2.5 − 2; two micro-batches.
        assert!((all["fsdp"] - 2.0 * (0.5 + 0.5)).abs() < 1e-12, "{all:?}");
        assert_eq!(all["tp"], 0.7);
        let half = exposed(&w, &hiding(0.5));
        assert!((half["fsdp"] - 2.0 * (0.75 + 1.25)).abs() < 1e-12, "{half:?}");
        let none = exposed(&w, &hiding(0.0));
        assert!((none["fsdp"] - 8.0).abs() < 1e-12, "{none:?}");
        // Little to hide: the unit with nothing before it stays exposed.
        let small = exposed(&whole(&[("fsdp", "all_gather", 0.2, 36.0)]), &hiding(1.0));
        assert!((small["fsdp"] - 2.0 * 2.0 * 0.05 / 10.0).abs() < 1e-12, "{small:?}");
        let blocking = exposed(&w, &Hiding { overlap: false, ..hiding(1.0) });
        assert!((blocking["fsdp"] - 8.0).abs() < 1e-12, "{blocking:?}");
        // FSDP hides at its own share; the bucketed all-reduce at the other.
        let w = whole(&[("fsdp", "all_gather", 6.0, 36.0), ("fsdp", "reduce_scatter", 2.0, 18.0), ("dp_rep", "all_reduce", 1.0, 4.0)]);
        let apart = exposed(&w, &Hiding { fsdp_efficiency: 0.5, ..hiding(1.0) });
        assert!((apart["fsdp"] - half["fsdp"]).abs() < 1e-12 && (apart["dp_rep"] - 0.1).abs() < 1e-12, "{apart:?}");
    }

    /// The pipeline pays one message per stage boundary as it fills and drains, not every
    /// send; its receives are the same transfers.
    #[test]
    fn the_pipeline_exposes_its_fill_and_drain() {
        let w = whole(&[("pp", "send", 3.2, 32.0), ("pp", "recv", 3.2, 32.0)]);
        let e = exposed(&w, &hiding(1.0));
        assert!((e["pp"] - 2.0 * 3.0 * 0.1).abs() < 1e-12, "{e:?}");
        let two = exposed(&whole(&[("pp", "send", 0.3, 2.0)]), &hiding(1.0));
        assert_eq!(two["pp"], 0.3);
    }
}

//! What `ndtrain plan` prints: one layout's report (batch, FLOPs, the pipeline's bubble,
//! memory by category and by pipeline stage, bytes per group), and the ranked table of every
//! layout of a world.

use super::{Cost, RankPlan};
use crate::config::{HardwareCfg, PpSchedule, Resolved};
use crate::metrics::fmt_bytes;
use crate::parallel::pp::schedule::bubble_fraction;
use std::fmt::Write;

fn mib(b: usize) -> String {
    format!("{:.1}", b as f64 / 1048576.0)
}

/// The report `ndtrain plan` prints for one layout.
pub fn describe(p: &RankPlan, res: &Resolved, hw: &HardwareCfg) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "effective batch: {} sequences × seq_len {} = {} tokens per step (grad_accum {}); peak LR {:e}",
        p.global_batch, res.deck.train.seq_len, p.tokens_per_step, p.grad_accum, p.lr
    );
    let _ = writeln!(s, "FLOPs per step: {:.4e} in all, {:.4e} per rank", p.flops_per_step, p.flops_per_rank);
    if p.layout.pp > 1 {
        pipeline_line(&mut s, p, res);
    }
    // On a GPU every buffer below lives in the device's memory (host memory holds only what a
    // staged collective copies through).
    let place = match res.deck.run.device {
        crate::config::Device::Cpu => "memory",
        crate::config::Device::Cuda => "device memory",
    };
    memory_table(&mut s, p, res, place);
    if !p.stages.is_empty() {
        stage_table(&mut s, p, place);
    }
    if hw.memory_per_rank > 0.0 {
        let fits = p.max_peak_bytes() as f64 <= hw.memory_per_rank;
        let _ = writeln!(
            s,
            "  {} [hardware] memory_per_rank = {}",
            if fits { "fits in" } else { "DOES NOT FIT in" },
            fmt_bytes(hw.memory_per_rank)
        );
    }
    let _ = writeln!(s, "\ncommunication per rank per step:");
    if p.comm.values().all(|&b| b == 0) {
        let _ = writeln!(s, "  none (one rank)");
    }
    for (k, &b) in p.comm.iter().filter(|(_, &b)| b > 0) {
        let _ = writeln!(s, "  {k:<22} {b:>16} bytes  ({})", fmt_bytes(b as f64));
    }
    s
}

/// The pipeline's schedule, its micro-batches in flight and every schedule's bubble.
fn pipeline_line(s: &mut String, p: &RankPlan, res: &Resolved) {
    let (pp, m) = (p.layout.pp, p.grad_accum);
    let v = res.stage_layers.len() / pp;
    let _ = writeln!(
        s,
        "pipeline: schedule \"{}\", the first stage holds {:?} micro-batch(es) per chunk at once; bubble (idle fraction of a step) \
         {:.1}% — gpipe and 1f1b {:.1}%, interleaved with 2 chunks {:.1}%, zero_bubble {:.1}%",
        res.deck.parallel.pp_schedule.name(),
        p.in_flight,
        100.0 * p.bubble,
        100.0 * bubble_fraction(PpSchedule::OneFOneB, pp, 1, m),
        100.0 * bubble_fraction(PpSchedule::Interleaved, pp, v.max(2), m),
        100.0 * bubble_fraction(PpSchedule::ZeroBubble, pp, 1, m)
    );
}

/// Rank 0's memory by category, its predicted peak, and the activations under each
/// activation-checkpointing mode.
fn memory_table(s: &mut String, p: &RankPlan, res: &Resolved, place: &str) {
    let l = &p.layout;
    let stage = if l.pp > 1 { format!("pp={} (first stage) ", l.pp) } else { String::new() };
    let _ = writeln!(
        s,
        "\n{place} per rank (rank 0 of {stage}dp_replicate={} dp_shard={} cp={} tp={}{}), MiB:",
        l.dp_replicate,
        l.dp_shard,
        l.cp,
        l.tp,
        if l.ep > 1 { format!(" ep={}", l.ep) } else { String::new() }
    );
    let st = &p.state;
    let a = &p.activations;
    for (name, b) in [
        ("parameters (shard)", st.params),
        ("gradients (shard)", st.grads),
        ("AdamW moments", st.optim),
        ("gathered parameters (peak)", st.gathered_peak),
        ("gradient scratch", st.grad_scratch),
        ("activations held for backward", a.saved + a.recompute + a.head),
        ("logits", a.logits),
        ("backward buffers", a.backward),
        ("weight-gradient operands (zb)", a.deferred),
    ]
    .into_iter()
    .filter(|&(name, b)| b > 0 || !name.ends_with("(zb)"))
    {
        let _ = writeln!(s, "  {name:<32} {:>12}", mib(b));
    }
    let _ = writeln!(s, "  {:<32} {:>12}", "peak (predicted)", mib(p.peak_bytes()));
    let _ = writeln!(s, "  {:<32} {:>12}", "checkpoint snapshot (host)", mib(p.snapshot_bytes));
    let _ = writeln!(
        s,
        "  activations + logits + backward by activation_checkpointing: none {} MiB, selective {} MiB, full {} MiB (deck: {})",
        mib(p.activations_none.total()),
        mib(p.activations_selective.total()),
        mib(p.activations_full.total()),
        res.deck.train.activation_checkpointing.name()
    );
}

/// Rank 0 of each pipeline stage: its blocks, ends, micro-batches in flight and memory.
fn stage_table(s: &mut String, p: &RankPlan, place: &str) {
    let _ = writeln!(s, "\n{place} of rank 0 of each pipeline stage, MiB:");
    let _ = writeln!(
        s,
        "  {:>5} {:>12} {:>10} {:>9} {:>12} {:>12} {:>12}",
        "stage", "blocks", "ends", "in flight", "model state", "activations", "peak"
    );
    for st in &p.stages {
        let blocks: Vec<String> = st.blocks.iter().map(|b| format!("{}-{}", b[0], b[b.len() - 1])).collect();
        let ends = match (st.embed, st.head) {
            (true, true) => "embed+head",
            (true, false) => "embed",
            (false, true) => "head",
            (false, false) => "",
        };
        let in_flight: Vec<String> = st.in_flight.iter().map(|k| k.to_string()).collect();
        let _ = writeln!(
            s,
            "  {:>5} {:>12} {:>10} {:>9} {:>12} {:>12} {:>12}",
            st.stage,
            blocks.join(","),
            ends,
            in_flight.join(","),
            mib(st.state.total()),
            mib(st.activations.total()),
            mib(st.peak_bytes())
        );
    }
    let worst = p.stages.iter().max_by_key(|st| st.peak_bytes()).expect("pp > 1 stages");
    let _ = writeln!(s, "  largest peak: stage {}, {} MiB", worst.stage, mib(worst.peak_bytes()));
}

/// The calibrated time model's parts, per pipeline stage (nothing when uncalibrated).
pub fn time_lines(c: &Cost) -> String {
    let mut s = String::new();
    if c.stages.is_empty() {
        return s;
    }
    let _ = writeln!(s, "\npredicted compute per step, s (docs/planning.md, Predicted step time):");
    let _ = writeln!(s, "  {:>5} {:>10} {:>10} {:>10} {:>10} {:>10}", "stage", "GEMM", "other", "gradients", "optimizer", "total");
    for (i, st) in c.stages.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {i:>5} {:>10.4} {:>10.4} {:>10.4} {:>10.4} {:>10.4}",
            st.gemm_s,
            st.other_s,
            st.grad_s,
            st.optimizer_s,
            st.total()
        );
    }
    for (g, t) in &c.comm_s {
        let whole = c.comm_whole_s.get(g).copied().unwrap_or(0.0);
        let _ = writeln!(s, "  communication {g:<8} {t:>10.4} exposed of {whole:.4}");
    }
    let _ = writeln!(s, "predicted step time: {:.4} s", c.step_s);
    s
}

/// The ranked table `ndtrain plan --all-layouts` prints.
pub fn describe_ranking(ranked: &[(RankPlan, Cost)], refused: usize, hw: &HardwareCfg, peak_flops: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} valid layouts ({refused} factorisations refused by the deck); cost model: peak {:.3e} FLOP/s per rank, {} ranks per node, \
         placed {}, intra-node {:.3e} B/s ({:.3e} B/s summing) + {:.1e} s, inter-node {:.3e} B/s + {:.1e} s per message; \
         communication exposed beyond what the code overlaps",
        ranked.len(),
        peak_flops,
        hw.ranks_per_node,
        match hw.rank_placement {
            crate::config::RankPlacement::Block => "in blocks",
            crate::config::RankPlacement::Cyclic => "cyclically",
        },
        hw.intra_node_bandwidth,
        if hw.intra_node_reduce_bandwidth > 0.0 { hw.intra_node_reduce_bandwidth } else { hw.intra_node_bandwidth },
        hw.intra_node_latency,
        hw.inter_node_bandwidth,
        hw.inter_node_latency
    );
    let _ = writeln!(
        s,
        "\n{:>4} {:>4} {:>6} {:>6} {:>4} {:>4} {:>4} {:>5} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>13}  note",
        "rank",
        "pp",
        "dp_rep",
        "dp_sh",
        "cp",
        "tp",
        "ep",
        "accum",
        "mem/rank",
        "compute s",
        "fsdp s",
        "tp s",
        "cp s",
        "pp s",
        "ep s",
        "dp s",
        "bubble",
        "step s",
        "tokens/s"
    );
    for (i, (p, c)) in ranked.iter().enumerate() {
        let l = &p.layout;
        let g = |k: &str| c.comm_s.get(k).copied().unwrap_or(0.0);
        let mut note = vec![];
        if c.fits == Some(false) {
            note.push("does not fit");
        }
        if !c.tp_in_node {
            note.push("tp spans nodes");
        }
        let _ = writeln!(
            s,
            "{:>4} {:>4} {:>6} {:>6} {:>4} {:>4} {:>4} {:>5} {:>12} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>6.1}% {:>10.4} {:>13.0}  {}",
            i + 1,
            l.pp,
            l.dp_replicate,
            l.dp_shard,
            l.cp,
            l.tp,
            l.ep,
            p.grad_accum,
            fmt_bytes(p.max_peak_bytes() as f64),
            c.compute_s,
            g("fsdp") + g("expert_fsdp"),
            g("tp"),
            g("cp"),
            g("pp"),
            g("ep"),
            g("dp_rep") + g("batch"),
            100.0 * c.bubble,
            c.step_s,
            c.tokens_per_s,
            note.join(", ")
        );
    }
    s
}

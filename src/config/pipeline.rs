//! The pipeline's rules and its stage split: `[parallel] pp`, `pp_virtual`, `pp_schedule` and
//! `pp_layers` checked against the model and the batch, and the blocks of each stage derived
//! (`pp_layers` as given, or the contiguous split that balances the stages' cost, the
//! embedding counted on the first stage and the final norm, output projection and loss on the
//! last). Every error is one line naming the keys and the numbers. Knows nothing of MPI.

use super::validate::{err, Layout};
use super::{ConfigError, Deck, ModelCfg, PpSchedule};

impl Deck {
    /// Checks the pipeline keys for `layout` and `grad_accum` micro-batches per step; returns
    /// the blocks of each of the `pp × pp_virtual` stages.
    pub(super) fn check_pipeline(&self, l: &Layout, grad_accum: usize) -> Result<Vec<usize>, ConfigError> {
        let p = &self.parallel;
        let (pp, v) = (l.pp, p.pp_virtual as usize);
        let n_layers = self.model.n_layers;
        let sched = p.pp_schedule;
        if pp == 1 {
            if v > 1 || !p.pp_layers.is_empty() {
                let key = if v > 1 { format!("pp_virtual({v})") } else { "pp_layers".into() };
                return Err(err(format!("[parallel] {key} is set, but pp = 1: there is no pipeline to split"))
                    .with_hint("set pp to the number of pipeline stages, or remove the key"));
            }
            return Ok(vec![n_layers]);
        }
        if !self.checkpoint.export_hf.is_empty() {
            return Err(err(format!(
                "[checkpoint] export_hf = {:?} with pp = {pp}: the final export gathers the model on one rank, which a pipeline does not",
                self.checkpoint.export_hf
            ))
            .with_hint("write a checkpoint and export it with `ndtrain checkpoint export FILE DIR`"));
        }
        match (sched, v) {
            (PpSchedule::Interleaved, 1) => {
                return Err(err(
                    "[parallel] pp_schedule = \"interleaved\" needs pp_virtual ≥ 2 model chunks per rank, but pp_virtual = 1".into()
                )
                .with_hint("set pp_virtual = 2, or pp_schedule = \"1f1b\""))
            }
            (PpSchedule::Gpipe | PpSchedule::OneFOneB | PpSchedule::ZeroBubble, v) if v > 1 => {
                return Err(err(format!(
                    "[parallel] pp_virtual({v}) > 1 needs pp_schedule = \"interleaved\", but it is \"{}\"",
                    sched.name()
                ))
                .with_hint("set pp_schedule = \"interleaved\", or pp_virtual = 1"))
            }
            _ => {}
        }
        let stages = pp * v;
        if stages > n_layers {
            return Err(err(format!(
                "[parallel] pp({pp}) × pp_virtual({v}) = {stages} stages, but the model has {n_layers} blocks ([model] n_layers)"
            ))
            .with_hint("every stage needs at least one block: lower pp or pp_virtual"));
        }
        if grad_accum < pp {
            return Err(err(format!(
                "[parallel] pp = {pp} stages need at least {pp} micro-batches per step, but grad_accum = {grad_accum}"
            ))
            .with_hint(format!(
                "raise [train] global_batch (or grad_accum) so that grad_accum ≥ {pp}, or lower micro_batch: with fewer micro-batches than stages the pipeline idles"
            )));
        }
        if sched == PpSchedule::Interleaved && grad_accum % pp != 0 {
            return Err(err(format!(
                "[parallel] pp_schedule = \"interleaved\" needs grad_accum to be a multiple of pp({pp}), but grad_accum = {grad_accum}"
            ))
            .with_hint(format!("use grad_accum = {} (through global_batch or grad_accum)", grad_accum.next_multiple_of(pp))));
        }
        if p.pp_layers.is_empty() {
            return Ok(balanced_split(&self.model, stages, self.train.seq_len));
        }
        let given = &p.pp_layers;
        if given.len() != stages {
            return Err(err(format!("[parallel] pp_layers has {} entries, but pp({pp}) × pp_virtual({v}) = {stages} stages", given.len()))
                .with_hint("give the blocks of every stage in stage order, or remove pp_layers for the balanced split"));
        }
        if let Some(i) = given.iter().position(|&n| n == 0) {
            return Err(err(format!("[parallel] pp_layers[{i}] = 0, but every stage needs at least one block")));
        }
        let sum: usize = given.iter().sum();
        if sum != n_layers {
            return Err(err(format!("[parallel] pp_layers = {given:?} sums to {sum}, but [model] n_layers = {n_layers}"))
                .with_hint("the stages' blocks must add up to the model's blocks"));
        }
        Ok(given.clone())
    }

    /// The line rank 0 prints about the pipeline.
    pub(super) fn pipeline_line(&self, stage_layers: &[usize]) -> String {
        let p = &self.parallel;
        let how = if p.pp_layers.is_empty() { "balanced" } else { "pp_layers" };
        format!(
            "pipeline: {} stages ({} per rank), schedule \"{}\", blocks per stage {stage_layers:?} ({how})",
            stage_layers.len(),
            p.pp_virtual,
            p.pp_schedule.name()
        )
    }
}

/// Relative cost per token of one block and of the head (final norm, output projection and
/// loss), forward and backward alike: their multiply-adds.
fn costs(m: &ModelCfg, seq_len: usize) -> (f64, f64, f64) {
    let (d, f, v) = (m.d_model as f64, m.ffn_hidden as f64, m.vocab_size as f64);
    let (q, kv) = ((m.n_heads * m.head_dim()) as f64, (m.n_kv_heads * m.head_dim()) as f64);
    // Projections, the MLP, and causal attention (scores and values over half the sequence).
    let block = 2.0 * d * q + 2.0 * d * kv + 3.0 * d * f + q * seq_len as f64;
    let head = d * v;
    // The embedding is a lookup (and its backward a scatter-add): one pass over the rows.
    let embed = d;
    (block, embed, head)
}

/// The contiguous split of `m.n_layers` blocks into `stages` non-empty stages whose largest
/// cost is smallest, the embedding on the first stage and the head on the last; among equal
/// maxima, the most even counts (earlier stages get the extra blocks).
pub fn balanced_split(m: &ModelCfg, stages: usize, seq_len: usize) -> Vec<usize> {
    let n = m.n_layers;
    let (block, embed, head) = costs(m, seq_len);
    let cost = |stage: usize, blocks: usize| {
        blocks as f64 * block + if stage == 0 { embed } else { 0.0 } + if stage + 1 == stages { head } else { 0.0 }
    };
    // best[s][k]: the smallest largest cost of stages s.. holding the last k blocks.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; stages + 1];
    let mut choice = vec![vec![0usize; n + 1]; stages + 1];
    best[stages][0] = 0.0;
    for s in (0..stages).rev() {
        let left = stages - s;
        for k in left..=n - s {
            // Stage s takes `take` blocks, the later ones the remaining k − take.
            for take in 1..=k - (left - 1) {
                let c = cost(s, take).max(best[s + 1][k - take]);
                // `>=` on ties keeps the largest `take` seen last: earlier stages take more.
                if c < best[s][k] || (c == best[s][k] && take > choice[s][k]) {
                    best[s][k] = c;
                    choice[s][k] = take;
                }
            }
        }
    }
    let mut out = vec![];
    let mut k = n;
    for row in choice.iter().take(stages) {
        out.push(row[k]);
        k -= row[k];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(overrides: &[&str], world: usize) -> String {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let e = Deck::from_str_with("", &o).unwrap().resolve(world).expect_err("the deck should be rejected");
        assert!(!e.message.contains('\n'), "one line: {}", e.message);
        e.message
    }

    /// Every bad pipeline deck fails in the deck checks, naming the numbers.
    #[test]
    fn bad_pipeline_decks_name_their_numbers() {
        let base = ["model.n_layers=4", "train.micro_batch=1", "train.global_batch=8"];
        let with = |extra: &[&'static str]| base.iter().copied().chain(extra.iter().copied()).collect::<Vec<_>>();
        assert_eq!(
            rejects(&with(&["parallel.pp=3", "parallel.dp_shard=1"]), 4),
            "[parallel] pp(3) × dp_replicate(1) × dp_shard(1) × cp(1) × tp(1) = 3, but the job has 4 ranks"
        );
        assert!(rejects(&with(&["parallel.pp=3"]), 4).contains("not a multiple of pp(3) × dp_replicate(1) × cp(1) × tp(1) = 3"));
        assert_eq!(
            rejects(&with(&["parallel.pp=8"]), 8),
            "[parallel] pp(8) × pp_virtual(1) = 8 stages, but the model has 4 blocks ([model] n_layers)"
        );
        assert_eq!(
            rejects(&with(&["parallel.pp=4", "train.global_batch=2"]), 4),
            "[parallel] pp = 4 stages need at least 4 micro-batches per step, but grad_accum = 2"
        );
        assert_eq!(
            rejects(&with(&["parallel.pp=2", "parallel.pp_layers=[1, 2]"]), 2),
            "[parallel] pp_layers = [1, 2] sums to 3, but [model] n_layers = 4"
        );
        assert_eq!(
            rejects(&with(&["parallel.pp=2", "parallel.pp_layers=[4]"]), 2),
            "[parallel] pp_layers has 1 entries, but pp(2) × pp_virtual(1) = 2 stages"
        );
        assert_eq!(
            rejects(&with(&["parallel.pp=2", "parallel.pp_layers=[4, 0]"]), 2),
            "[parallel] pp_layers[1] = 0, but every stage needs at least one block"
        );
        assert!(rejects(&with(&["parallel.pp=2", "parallel.pp_schedule=\"interleaved\""]), 2).contains("needs pp_virtual ≥ 2"));
        assert!(rejects(&with(&["parallel.pp=2", "parallel.pp_virtual=2"]), 2).contains("needs pp_schedule = \"interleaved\""));
        assert_eq!(
            rejects(&with(&["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=\"zero_bubble\""]), 2),
            "[parallel] pp_virtual(2) > 1 needs pp_schedule = \"interleaved\", but it is \"zero_bubble\""
        );
        assert!(rejects(
            &with(&["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=\"interleaved\"", "train.global_batch=5"]),
            2
        )
        .contains("multiple of pp(2), but grad_accum = 5"));
        assert!(rejects(&with(&["parallel.pp_virtual=2"]), 1).contains("but pp = 1"));
        assert!(rejects(&with(&["parallel.pp=0"]), 1).contains("pp must be ≥ 1"));
    }

    #[test]
    fn a_pipeline_deck_resolves_its_stages() {
        let o: Vec<String> = ["model.n_layers=4", "train.micro_batch=1", "train.global_batch=8", "parallel.pp_size=2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let r = Deck::from_str_with("", &o).unwrap().resolve(4).unwrap();
        assert_eq!(r.layout.pp, 2);
        assert_eq!(r.layout.dp_shard, 2);
        assert_eq!(r.stage_layers.iter().sum::<usize>(), 4);
        assert!(r.summary.iter().any(|l| l.starts_with("pipeline: 2 stages")), "{:?}", r.summary);
    }

    fn model(layers: usize, vocab: usize) -> ModelCfg {
        ModelCfg { n_layers: layers, vocab_size: vocab, ..ModelCfg::default() }
    }

    #[test]
    fn balanced_split_covers_every_block_and_is_even_without_a_large_head() {
        let m = model(8, 2);
        assert_eq!(balanced_split(&m, 4, 64), vec![2, 2, 2, 2]);
        assert_eq!(balanced_split(&m, 3, 64), vec![3, 3, 2]);
        assert_eq!(balanced_split(&m, 8, 64), vec![1; 8]);
        for stages in 1..=8 {
            let s = balanced_split(&model(8, 50_000), stages, 64);
            assert_eq!(s.len(), stages);
            assert_eq!(s.iter().sum::<usize>(), 8);
            assert!(s.iter().all(|&k| k >= 1), "{s:?}");
        }
    }

    #[test]
    fn a_large_head_moves_blocks_off_the_last_stage() {
        let m = ModelCfg { vocab_size: 256_000, ..model(8, 1) };
        let s = balanced_split(&m, 2, 64);
        assert!(s[1] < s[0], "{s:?}");
    }
}

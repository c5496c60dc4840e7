//! Stage two of the deck: every constraint checked against the world size, derived values.
use super::{ConfigError, Deck, LrScaling};

/// The resolved mesh degrees, outermost to innermost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
}

impl Layout {
    pub fn world_size(&self) -> usize {
        self.dp_replicate * self.dp_shard * self.cp * self.tp
    }
    /// Data-parallel degree: ranks that see different samples.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
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
}

impl Deck {
    pub fn resolve(&self, world_size: usize) -> Result<Resolved, ConfigError> {
        let p = &self.parallel;
        let fixed = (p.dp_replicate * p.cp * p.tp) as usize;
        let dp_shard = if p.dp_shard == -1 { world_size / fixed } else { p.dp_shard as usize };
        let layout = Layout { dp_replicate: p.dp_replicate as usize, dp_shard, cp: p.cp as usize, tp: p.tp as usize };
        let t = &self.train;
        let dp = layout.dp();
        let (grad_accum, global_batch) = if t.global_batch > 0 {
            (t.global_batch / (t.micro_batch * dp), t.global_batch)
        } else {
            (t.grad_accum.max(1), t.grad_accum.max(1) * t.micro_batch * dp)
        };
        let o = &self.optim;
        let lr = match o.lr_scaling {
            LrScaling::None => o.lr,
            LrScaling::Linear => o.lr * global_batch as f64 / o.base_batch as f64,
            LrScaling::Sqrt => o.lr * (global_batch as f64 / o.base_batch as f64).sqrt(),
        };
        Ok(Resolved { deck: self.clone(), layout, grad_accum, global_batch, lr })
    }
}

//! The user tools that work around training but are no part of it: `ndtrain plan` ([`plan`]:
//! memory, bytes and FLOPs a deck will need on a layout, and the layouts of a world ranked by
//! a cost model), `ndtrain sweep` ([`sweep`]: a scaling study expanded into decks and job
//! scripts), `ndtrain report` ([`report`]: statistics and plots from the logs of finished
//! runs), `ndtrain probe` ([`probe`]: this machine's rates for `[hardware]`) and `ndtrain
//! gpu-check` ([`gpu_check`]: every GPU operation against the host, an MPI program). All but
//! `gpu-check` run as one process without MPI; `cli.rs` calls them. The training path never
//! imports this module: the tools depend on training's formulas and file formats, not the
//! other way round.

pub mod gpu_check;
pub mod plan;
pub mod probe;
pub mod report;
pub mod sweep;

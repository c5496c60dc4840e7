//! ndtrain: an SPMD MPI trainer for Llama-style transformers with N-dimensional parallelism.
//!
//! See `docs/architecture.md` for what each module owns.

pub mod backend;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config;
pub mod cp;
pub mod data;
pub mod debug;
pub mod fsdp;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod hdf5io;
pub mod hf;
pub mod mesh;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod preempt;
pub mod preflight;
pub mod real;
pub mod rng;
pub mod tools;
pub mod tp;
pub mod train;
pub mod train_device;
pub mod watchdog;

//! ndtrain: an SPMD MPI trainer for Llama-style transformers with N-dimensional parallelism.
//!
//! The layers, from the bottom: `scalar`, `rng`, `exit` and `config` (leaves); `backend` (the
//! hardware: host and CUDA kernels); `model` (one-rank maths); `parallel` (the mesh, MPI and
//! every parallel strategy, applied to the model from outside); `optim`, `data`, `io`
//! (HDF5, checkpoints, Hugging Face files), `metrics`; `run` (run control); `train` (the one
//! training loop); `tools` (`plan`, `sweep`, `report`) and `cli` on top.
//! `docs/architecture.md` draws the module graph and says what each module owns.

pub mod backend;
pub mod cli;
pub mod config;
pub mod data;
pub mod exit;
pub mod io;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod rng;
pub mod run;
pub mod scalar;
pub mod tools;
pub mod train;

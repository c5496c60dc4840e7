//! The layer between the model and the network: the process mesh and every parallel strategy,
//! applied to the model from outside through its hooks (`model::hooks`).
//!
//! * `comm` — MPI: start-up, groups, collectives and their counters (the only module that names
//!   the `mpi` crate);
//! * `mesh` — the 5-D mesh `pp × dp_replicate × dp_shard × cp × tp` and its groups (`tp`,
//!   `cp`, `fsdp`, `dp_rep`, `batch`, `pp`, and `ep` × `expert_fsdp` cut out of `fsdp`);
//! * `collective` — a group's collectives on a backend's buffers, as the strategies call them:
//!   MPI on host memory, staged through host copies, and (feature `cuda`) NCCL or a CUDA-aware
//!   MPI on the GPU's buffers, over the device side the backend offers (`backend::cuda::comm`);
//! * `fsdp` — data parallelism in its three forms (DP, FSDP, HSDP): the shard plan, the sharded
//!   parameters and gradients, their memory and byte formulas;
//! * `tp` — Megatron tensor parallelism with sequence parallelism, and its byte formula;
//! * `cp` — context parallelism: the zigzag split and ring attention, and its byte formula;
//! * `ep` — expert parallelism: the experts split over ranks cut out of `fsdp`, the byte
//!   formula of the all-to-all that moves their rows;
//! * `pp` — pipeline parallelism: each rank's chunks of blocks, the schedules, and the executor
//!   that runs a schedule's actions with the activations and gradients sent between stages.
//!
//! `docs/parallelism.md` gives the maths. Every strategy is written over the backend's buffer
//! type, and a group of degree 1 is a no-op inside the collectives, never a special case here.

pub mod collective;
pub mod comm;
pub mod cp;
pub mod ep;
pub mod fsdp;
pub mod mesh;
pub mod pp;
pub mod tp;

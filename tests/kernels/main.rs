//! Every compute kernel against a plain reference written here in f64.
//!
//! The references are the textbook maths in naive loops: RMSNorm and the Jacobian of each row,
//! Hugging Face rotate-half RoPE, SwiGLU, cross entropy over whole `[N, V]` rows, attention
//! through the full `[Sq, Sk]` softmax of each head (causal by global position, grouped-query),
//! plain matrix products, and AdamW, clipping and the learning-rate schedule as
//! `docs/model.md` states them. Each kernel runs in f32 (training) and in f64
//! (gradient checks) on the same inputs, which are rounded to f32 so that both element types
//! see identical values. Covered on purpose: attention lengths that are not a multiple of the
//! 64-row query block, GQA, context-parallel zigzag chunks with keys from another rank's chunk
//! or in ring-arrival (unsorted) order, vocabulary-sharded cross entropy with padding columns,
//! several parallel tasks per kernel, and the overwrite (`=`) / accumulate (`+=`) contract of
//! each backward. The backward references are themselves checked by central differences.
//!
//! Errors are measured in the max norm relative to the reference: `max |got − want|` over
//! `max |want|` of one tensor, so near-zero elements cannot blow the figure up.
//!
//! Legend: `N` rows (tokens), `D` width, `V` vocab, `B` batch, `H` query heads, `KV` key/value
//! heads, `Sq`/`Sk` query/key lengths, `hd` head dim.
//!
//! One file per family: `elementwise.rs` (RMSNorm, RoPE and the head transposes, SwiGLU, the
//! residual adds), `cross_entropy.rs`, `linear.rs` (the GEMM-backed linear maps), `attention.rs`
//! (self-attention, context-parallel chunks, the merge of partials, zigzag positions) and
//! `optim.rs` (AdamW, the learning-rate schedule, clipping); the f64 references and their
//! finite-difference check are in `reference.rs`, the tolerances, inputs and comparison in
//! `support.rs`.

// The references index like the maths they transcribe.
#![allow(clippy::needless_range_loop)]

mod attention;
mod cross_entropy;
mod elementwise;
mod linear;
mod optim;
mod reference;
mod support;

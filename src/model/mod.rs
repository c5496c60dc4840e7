//! The Llama-style decoder written as one-rank maths: parameters, kernels, forward and backward.
pub mod params;

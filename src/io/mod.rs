//! Files: HDF5 access (`hdf5`, the only module that names the `hdf5` crate), the sharded
//! parallel-HDF5 checkpoints (`checkpoint`) and Hugging Face model folders (`hf`). Knows nothing
//! of the training loop: it is handed host slices and metadata.

pub mod checkpoint;
pub mod hdf5;
pub mod hf;

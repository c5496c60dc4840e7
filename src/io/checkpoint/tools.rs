//! `ndtrain ckpt inspect | verify | export`: one process reads a checkpoint (no MPI job), a
//! tensor or a bounded run of rows at a time, so a checkpoint larger than memory can be checked
//! and converted.

use super::blocks::{block_checksum, ShardBlock};
use super::{LoadError, Reader, KINDS};
use crate::model::params::param_specs;
use ndarray::{ArrayD, ArrayViewD, ArrayViewMut, IxDyn};
use std::path::Path;

/// Elements read per chunk while verifying (64 MiB of f32).
const VERIFY_CHUNK_ELEMS: usize = 16 << 20;

/// One tensor of a checkpoint as the tools report it.
#[derive(Clone, Debug)]
pub struct TensorReport {
    /// Dataset path, e.g. `model/model.norm.weight`.
    pub path: String,
    pub shape: Vec<usize>,
    pub stored: u64,
    pub computed: u64,
    pub stats: TensorStats,
}

impl TensorReport {
    pub fn ok(&self) -> bool {
        self.stored == self.computed
    }
}

/// A tensor's values summarised: `min`/`max` skip NaNs, while a NaN or an infinity anywhere
/// shows in `mean` and `rms` (so a damaged tensor stands out). An empty tensor has NaNs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorStats {
    pub min: f32,
    pub max: f32,
    pub mean: f64,
    pub rms: f64,
}

/// The sums behind [`TensorStats`], gathered one chunk of rows at a time.
struct StatsAccum {
    min: f32,
    max: f32,
    sum: f64,
    sum_sq: f64,
    n: usize,
}

impl StatsAccum {
    fn new() -> StatsAccum {
        StatsAccum { min: f32::INFINITY, max: f32::NEG_INFINITY, sum: 0.0, sum_sq: 0.0, n: 0 }
    }

    fn add(&mut self, chunk: ArrayViewD<'_, f32>) {
        let (min, max, sum, sum_sq) = chunk.fold((self.min, self.max, self.sum, self.sum_sq), |(lo, hi, s, q), &x| {
            let v = x as f64;
            (lo.min(x), hi.max(x), s + v, q + v * v)
        });
        *self = StatsAccum { min, max, sum, sum_sq, n: self.n + chunk.len() };
    }

    fn finish(&self) -> TensorStats {
        if self.n == 0 {
            return TensorStats { min: f32::NAN, max: f32::NAN, mean: f64::NAN, rms: f64::NAN };
        }
        let n = self.n as f64;
        TensorStats { min: self.min, max: self.max, mean: self.sum / n, rms: (self.sum_sq / n).sqrt() }
    }
}

/// Reads every tensor the checkpoint's model has (parameters and both moments), in row chunks,
/// and recomputes its checksum. A missing or mis-shaped tensor is an error naming it.
pub fn verify_tensors(r: &Reader) -> Result<Vec<TensorReport>, LoadError> {
    let specs = param_specs(&r.meta.model);
    let mut out = vec![];
    let mut buf = vec![];
    for kind in KINDS {
        for spec in &specs {
            let path = format!("{kind}/{}", spec.name);
            let corrupt = |m: String| LoadError::Corrupt(format!("checkpoint {}: tensor {path}: {m}", r.path().display()));
            let ds = r.file().dataset(&path).map_err(|_| corrupt("missing".into()))?;
            let shape = ds.shape();
            if shape != spec.shape {
                return Err(corrupt(format!("shape {shape:?}, the checkpoint's model has {:?}", spec.shape)));
            }
            let stored = ds.attr_u64("checksum").map_err(|e| corrupt(e.to_string()))?;
            // A chunk is a run of whole rows: the dataset's shape with fewer rows.
            let cols: usize = shape[1..].iter().product();
            let rows_per_chunk = (VERIFY_CHUNK_ELEMS / cols.max(1)).max(1);
            let mut computed = 0u64;
            let mut stats = StatsAccum::new();
            let mut r0 = 0;
            while r0 < shape[0] {
                let rows = rows_per_chunk.min(shape[0] - r0);
                let mut start = vec![0; shape.len()];
                start[0] = r0;
                let mut count = shape.clone();
                count[0] = rows;
                buf.resize(rows * cols, 0.0);
                let mut chunk = ArrayViewMut::from_shape(IxDyn(&count), &mut buf[..]).expect("the buffer holds the chunk");
                ds.read_slab(&start, chunk.view_mut()).map_err(|e| corrupt(e.to_string()))?;
                stats.add(chunk.view());
                let block = ShardBlock { name: spec.name.clone(), global_shape: shape.clone(), start, count, primary: true };
                computed = computed.wrapping_add(block_checksum(&path, &block, &buf));
                r0 += rows;
            }
            out.push(TensorReport { path, shape, stored, computed, stats: stats.finish() });
        }
    }
    Ok(out)
}

/// `ckpt verify`: Ok with the tensor count when every checksum matches; otherwise an error
/// naming every corrupt tensor.
pub fn verify(path: &Path) -> Result<usize, LoadError> {
    let r = Reader::open_serial(path)?;
    let tensors = verify_tensors(&r)?;
    let bad: Vec<String> =
        tensors.iter().filter(|t| !t.ok()).map(|t| format!("{} (stored {:#018x}, read {:#018x})", t.path, t.stored, t.computed)).collect();
    if bad.is_empty() {
        Ok(tensors.len())
    } else {
        Err(LoadError::Corrupt(format!("checkpoint {}: checksum mismatch in {} tensor(s): {}", path.display(), bad.len(), bad.join(", "))))
    }
}

/// `ckpt inspect`: the metadata, every tensor with its shape, checksum, value statistics and
/// whether it verifies.
pub fn inspect(path: &Path) -> Result<String, LoadError> {
    use std::fmt::Write;
    let r = Reader::open_serial(path)?;
    let m = &r.meta;
    let mut s = String::new();
    let _ = writeln!(s, "checkpoint     {}", path.display());
    let _ = writeln!(s, "format         version {} (ndtrain {})", r.file().attr_u64("format_version").unwrap_or(0), m.ndtrain_version);
    let _ = writeln!(s, "step           {} of {} (optimiser step {}), {} tokens seen", m.step, m.run_steps, m.optim_step, m.tokens_seen);
    let _ = writeln!(s, "written by     {}", m.layout);
    let _ = writeln!(
        s,
        "data           next step {}, {} samples seen, global_batch {} × seq_len {}, order {}, seed {}",
        m.data.next_step, m.data.samples_seen, m.data.global_batch, m.data.seq_len, m.data.order, m.seed
    );
    let c = &m.model;
    let _ = writeln!(
        s,
        "model          vocab {} d_model {} layers {} heads {}/{} kv ffn {} tied {}",
        c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.tie_embeddings
    );
    let tensors = verify_tensors(&r)?;
    let _ = writeln!(
        s,
        "\n{:<60} {:>16} {:>20} {:>10} {:>10} {:>10} {:>10}  status",
        "tensor", "shape", "checksum", "min", "max", "mean", "rms"
    );
    for t in &tensors {
        let shape = t.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("×");
        let status = if t.ok() { "ok".to_string() } else { format!("CORRUPT (read {:#018x})", t.computed) };
        let st = &t.stats;
        let _ = writeln!(
            s,
            "{:<60} {:>16} {:>#20x} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e}  {status}",
            t.path, shape, t.stored, st.min, st.max, st.mean, st.rms
        );
    }
    let bad = tensors.iter().filter(|t| !t.ok()).count();
    let total: usize = tensors.iter().map(|t| t.shape.iter().product::<usize>()).sum();
    let _ = writeln!(
        s,
        "\n{} tensors, {:.1} MiB; {}",
        tensors.len(),
        total as f64 * 4.0 / 1048576.0,
        if bad == 0 { "valid: every checksum matches".to_string() } else { format!("INVALID: {bad} tensor(s) fail their checksum") }
    );
    Ok(s)
}

/// `ckpt export --hf DIR`: the parameters as a Hugging Face folder, one tensor in memory at a
/// time, each verified against its checksum as it is read.
pub fn export_hf(path: &Path, dir: &Path) -> Result<(), String> {
    let r = Reader::open_serial(path).map_err(|e| e.to_string())?;
    let specs = param_specs(&r.meta.model);
    crate::io::hf::write_model(dir, &r.meta.model, |i, buf| {
        let spec = &specs[i];
        let ds_path = format!("model/{}", spec.name);
        let fail = |m: String| crate::io::hf::HfError(format!("checkpoint {}: tensor {ds_path}: {m}", path.display()));
        let ds = r.file().dataset(&ds_path).map_err(|e| fail(e.to_string()))?;
        let start = vec![0; spec.shape.len()];
        buf.resize(spec.numel(), 0.0);
        let tensor = ArrayViewMut::from_shape(IxDyn(&spec.shape), &mut buf[..]).expect("the buffer holds the tensor");
        ds.read_slab(&start, tensor).map_err(|e| fail(e.to_string()))?;
        let block =
            ShardBlock { name: spec.name.clone(), global_shape: spec.shape.clone(), start, count: spec.shape.clone(), primary: true };
        let stored = ds.attr_u64("checksum").map_err(|e| fail(e.to_string()))?;
        if block_checksum(&ds_path, &block, buf) != stored {
            return Err(fail("checksum mismatch: the checkpoint is corrupt".into()));
        }
        Ok(())
    })
    .map_err(|e| e.to_string())
}

/// A whole dataset of a checkpoint, e.g. `model/model.norm.weight`, as an array of the
/// dataset's shape (tests, small tensors).
pub fn read_array(path: &Path, dataset: &str) -> Result<ArrayD<f32>, String> {
    let file = crate::io::hdf5::H5File::open_serial(path).map_err(|e| e.to_string())?;
    let ds = file.dataset(dataset).map_err(|e| e.to_string())?;
    let mut out = ArrayD::zeros(IxDyn(&ds.shape()));
    ds.read_slab(&vec![0; out.ndim()], out.view_mut()).map_err(|e| e.to_string())?;
    Ok(out)
}

/// [`read_array`] as the shape and the values, row-major.
pub fn read_tensor(path: &Path, dataset: &str) -> Result<(Vec<usize>, Vec<f32>), String> {
    let a = read_array(path, dataset)?;
    let shape = a.shape().to_vec();
    // A fresh array is in standard layout from the start of its buffer: the buffer is the
    // values in row-major order.
    let (values, _) = a.into_raw_vec_and_offset();
    Ok((shape, values))
}

/// Every dataset path of a checkpoint (`model/...`, `optim/exp_avg/...`, `optim/exp_avg_sq/...`).
pub fn dataset_paths(path: &Path) -> Result<Vec<String>, String> {
    let file = crate::io::hdf5::H5File::open_serial(path).map_err(|e| e.to_string())?;
    let mut out = vec![];
    for kind in KINDS {
        out.extend(file.members(kind).map_err(|e| e.to_string())?.into_iter().map(|n| format!("{kind}/{n}")));
    }
    Ok(out)
}

/// Where a dataset's contiguous data starts in the file (the tests corrupt bytes there).
pub fn dataset_offset(path: &Path, dataset: &str) -> Result<u64, String> {
    let file = crate::io::hdf5::H5File::open_serial(path).map_err(|e| e.to_string())?;
    file.dataset(dataset).map_err(|e| e.to_string())?.file_offset().ok_or_else(|| format!("{dataset} has no contiguous data"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{array, s};

    #[test]
    fn statistics_gather_over_chunks_of_rows() {
        let a = array![[1.0f32, -2.0], [3.0, 4.0], [0.5, f32::NAN]];
        let mut acc = StatsAccum::new();
        acc.add(a.slice(s![0..2, ..]).into_dyn());
        assert_eq!(acc.finish(), TensorStats { min: -2.0, max: 4.0, mean: 1.5, rms: 7.5f64.sqrt() });
        acc.add(a.slice(s![2..3, ..]).into_dyn());
        let st = acc.finish();
        assert_eq!((st.min, st.max), (-2.0, 4.0), "min and max skip the NaN");
        assert!(st.mean.is_nan() && st.rms.is_nan(), "the NaN shows in the mean and RMS");
        assert!(StatsAccum::new().finish().mean.is_nan());
    }
}

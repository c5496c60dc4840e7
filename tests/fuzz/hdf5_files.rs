//! HDF5 token files: the writer's own datasets, datasets it never makes, junk bytes, odd dataset names.

use std::path::Path;

use ndtrain::config::Source;
use ndtrain::io::hdf5::{write_tokens, TokenSlice};
use proptest::prelude::*;

use crate::cases;
use crate::sources::{data_cfg, exercise_source, geometry};

/// What the HDF5 file holds.
#[derive(Debug, Clone)]
enum H5Content {
    /// `ndtrain`'s own writer (`data prepare`): a 1-D uint16 or uint32 dataset.
    U16(Vec<u16>),
    U32(Vec<u32>),
    /// Datasets the writer never makes, through the `hdf5` crate.
    I64(Vec<i64>),
    U64(Vec<u64>),
    I8(Vec<i8>),
    F32(Vec<f32>),
    TwoD(usize, Vec<u32>),
    Scalar(u32),
    /// A group where the dataset should be.
    Group,
    /// Not an HDF5 file at all.
    Junk(Vec<u8>),
}

fn h5_content() -> impl Strategy<Value = H5Content> {
    let tok = || prop_oneof![9 => 0u32..128, 1 => any::<u32>()];
    prop_oneof![
        4 => prop::collection::vec(prop_oneof![9 => 0u16..128, 1 => any::<u16>()], 0..200).prop_map(H5Content::U16),
        2 => prop::collection::vec(tok(), 0..200).prop_map(H5Content::U32),
        1 => prop::collection::vec(prop_oneof![9 => 0i64..128, 1 => any::<i64>()], 0..100).prop_map(H5Content::I64),
        1 => prop::collection::vec(prop_oneof![9 => 0u64..128, 1 => any::<u64>()], 0..100).prop_map(H5Content::U64),
        1 => prop::collection::vec(any::<i8>(), 0..100).prop_map(H5Content::I8),
        1 => prop::collection::vec(any::<f32>(), 0..50).prop_map(H5Content::F32),
        1 => (1usize..4, prop::collection::vec(tok(), 0..60)).prop_map(|(r, v)| H5Content::TwoD(r, v)),
        1 => tok().prop_map(H5Content::Scalar),
        1 => Just(H5Content::Group),
        1 => prop::collection::vec(any::<u8>(), 0..600).prop_map(H5Content::Junk),
    ]
}

fn write_h5(path: &Path, name: &str, content: &H5Content) -> Result<(), String> {
    let e = |e: hdf5::Error| e.to_string();
    let create = || hdf5::File::create(path).map_err(e);
    match content {
        H5Content::U16(t) => return write_tokens(path, name, TokenSlice::U16(t), 65536).map_err(|e| e.0),
        H5Content::U32(t) => return write_tokens(path, name, TokenSlice::U32(t), 1 << 32).map_err(|e| e.0),
        H5Content::Junk(b) => return std::fs::write(path, b).map_err(|x| x.to_string()),
        _ => {}
    }
    let f = create()?;
    match content {
        H5Content::I64(v) => f.new_dataset::<i64>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::U64(v) => f.new_dataset::<u64>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::I8(v) => f.new_dataset::<i8>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::F32(v) => f.new_dataset::<f32>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::TwoD(rows, v) => {
            let cols = v.len() / rows;
            let d = f.new_dataset::<u32>().shape([*rows, cols]).create(name).map_err(e)?;
            if cols > 0 {
                // write_raw takes a 1-D view; the crate writes it over the whole 2-D extent.
                d.write_raw(&v[..rows * cols]).map_err(e)?;
            }
        }
        H5Content::Scalar(t) => f.new_dataset::<u32>().create(name).and_then(|d| d.write_scalar(t)).map_err(e)?,
        H5Content::Group => {
            f.create_group(name).map_err(e)?;
        }
        _ => unreachable!(),
    }
    f.close().map_err(e)
}

fn dataset_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("tokens".to_string()),
        1 => prop::sample::select(vec!["", "/", "//", ".", "/tokens", "tokens/", "a/b", "grp/tokens", "tok ens", "\u{e9}t\u{e9}", "a\0b"])
            .prop_map(String::from),
        1 => ".{0,10}",
    ]
}

proptest! {
    #![proptest_config(cases(64))]

    /// A file written with one dataset name and read with another (often the same).
    #[test]
    fn hdf5_token_files_never_panic(
        content in h5_content(),
        written in dataset_name(),
        read in prop_oneof![2 => Just(None), 1 => dataset_name().prop_map(Some)],
        g in geometry(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.h5");
        // Names HDF5 itself refuses to create (empty, ".", a NUL byte, a missing group) leave
        // no file or an empty one: reading that is fuzzed too.
        let _ = write_h5(&path, &written, &content);
        let dataset = read.unwrap_or(written);
        exercise_source(&data_cfg(Source::Hdf5, &path, &dataset, g.order), &g)?;
    }
}

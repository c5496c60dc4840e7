#!/usr/bin/env python3
"""Writes the binary seeds of the fuzz corpus (tests/fuzz/corpus.rs, `corpus_*` tests).

The deck seeds under deck/ are hand-written TOML. The token-file seeds are made here, so the
bytes are reproducible and reviewable: `python3 tests/fuzz_corpus/make_corpus.py` (run with
Debian's /usr/bin/python3, which has python3-h5py for the HDF5 seeds). The fuzzer mutates every seed byte by byte; a file
that ever made it fail is added here (or as a file under deck/) with a line saying what it found.
"""
import os
import struct

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2 = (20240520, 1, 2)     # magic, version, bytes per token (llm.c GPT-2 .bin: uint16)
LLAMA3 = (20240801, 7, 4)   # llm.c Llama-3 .bin: uint32


def bin_file(name, kind, tokens, count=None, cut=0, extra=b""):
    magic, version, width = kind
    header = [0] * 256
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    body = b"".join(t.to_bytes(width, "little") for t in tokens)
    data = struct.pack("<256i", *header) + body
    data = data[: len(data) - cut] + extra
    with open(os.path.join(HERE, "bin", name), "wb") as f:
        f.write(data)


def h5_file(name, datasets):
    with h5py.File(os.path.join(HERE, "hdf5", name), "w") as f:
        for key, value in datasets.items():
            f.create_dataset(key, data=value)


os.makedirs(os.path.join(HERE, "bin"), exist_ok=True)
os.makedirs(os.path.join(HERE, "hdf5"), exist_ok=True)
ramp = [(7 * i + 3) % 128 for i in range(300)]
bin_file("gpt2_valid.bin", GPT2, ramp)
bin_file("llama3_valid.bin", LLAMA3, ramp)
bin_file("gpt2_one_sample.bin", GPT2, ramp[:9])
bin_file("gpt2_empty.bin", GPT2, [])
bin_file("gpt2_count_too_large.bin", GPT2, ramp[:40], count=1 << 20)
bin_file("gpt2_count_negative.bin", GPT2, ramp[:40], count=-1)
bin_file("gpt2_truncated.bin", GPT2, ramp[:40], cut=1)
bin_file("gpt2_extra_bytes.bin", GPT2, ramp[:40], extra=b"\x01\x02\x03")
bin_file("gpt2_token_over_vocab.bin", GPT2, ramp[:40] + [65535] + ramp[:20])
bin_file("llama3_token_over_u16.bin", LLAMA3, ramp[:40] + [1 << 20])
bin_file("magic_swapped_width.bin", (20240520, 1, 4), ramp[:40])
bin_file("bad_version.bin", (20240520, 3, 2), ramp[:40])
with open(os.path.join(HERE, "bin", "header_short.bin"), "wb") as f:
    f.write(struct.pack("<3i", 20240520, 1, 40))

ramp_np = np.array(ramp, dtype=np.int64)
h5_file("tokens_u16.h5", {"tokens": ramp_np.astype(np.uint16)})
h5_file("tokens_i64.h5", {"tokens": ramp_np})
h5_file("tokens_u8_and_other.h5", {"tokens": ramp_np.astype(np.uint8), "other": np.zeros(3, dtype=np.float32)})
h5_file("tokens_negative.h5", {"tokens": np.array([1, 2, -3, 4] * 20, dtype=np.int32)})
h5_file("tokens_float.h5", {"tokens": ramp_np.astype(np.float32)})
h5_file("tokens_2d.h5", {"tokens": ramp_np.reshape(30, 10).astype(np.int32)})
h5_file("tokens_empty.h5", {"tokens": np.zeros(0, dtype=np.int32)})
h5_file("tokens_scalar.h5", {"tokens": np.int32(5)})
h5_file("no_tokens_dataset.h5", {"ids": ramp_np.astype(np.int32)})

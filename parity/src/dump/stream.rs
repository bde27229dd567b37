//! A dump written as the run goes: a safetensors file laid out before the run (every tensor's dtype, shape and
//! place, from [`super::layout`]), each tensor's rows written at their place as they are produced (token-major, so
//! rows `[t0, t1)` of a tap are one contiguous range), the states when known, and last the generated tokens and
//! the header.
//!
//! The file, in order: the header's length (u64), the header (JSON padded with spaces), `generated` (i64, its real
//! length), then every planned tensor (8-byte dtypes first, then by name). The planned tensors start at a place
//! fixed before the run, after room for the header and for every token asked for; a run that generates fewer
//! (generation stops at a NaN) gives the unused room to the header's padding, so the tensors stay contiguous and
//! aligned. The header is written last, so a file cut short is no valid safetensors; and the file is written under
//! a temporary name beside `out` (`.{name}.…partial`), renamed to `out` once complete and checked, removed on error.

use super::layout::Planned;
use crate::non_finite::NonFinite;
use anyhow::{Context, Result, anyhow, bail, ensure};
use candle_core::{DType, Tensor};
use reference::io::AtomicFile;
use reference::taps::TapSink;
use safetensors::tensor::{Dtype as StDtype, Metadata, TensorInfo};
use std::collections::{BTreeMap, HashMap};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The one tensor whose length is known at the end: the greedy continuation (i64).
pub const GENERATED: &str = "generated";

/// Room in the header for metadata beyond what is known when the file is laid out (the run's times, `nan_at`).
const METADATA_ROOM: usize = 1024;

/// At most this many bytes of a tensor are converted and written at once.
const CHUNK_BYTES: usize = 8 << 20;

/// A planned tensor: where it lies and how many of its rows are written.
#[derive(Debug)]
struct Slot {
    dtype: DType,
    shape: Vec<usize>,
    /// Offset from the start of the planned tensors.
    offset: u64,
    /// Rows `[0, written)` are on disk.
    written: usize,
}

impl Slot {
    fn row_bytes(&self) -> u64 {
        (self.shape.iter().skip(1).product::<usize>() * self.dtype.size_in_bytes()) as u64
    }

    fn bytes(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1) as u64 * self.row_bytes()
    }

    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// A dump being written (see the module's description). It is also a [`TapSink`]: the taps a backend streams go to
/// their rows; rows past the planned ones (the single-token calls after the prompt) are not part of the dump and
/// are let go.
pub struct StreamWriter {
    out: PathBuf,
    file: AtomicFile,
    slots: BTreeMap<String, Slot>,
    /// Where the planned tensors start in the file.
    data: u64,
    /// The most tokens `generated` may hold.
    generate: usize,
    /// Every tensor written that holds NaN or infinity, its counts summed over its pieces, its first index the
    /// earliest (rows come in order).
    non_finite: BTreeMap<String, NonFinite>,
}

impl StreamWriter {
    /// Lays out `planned` and at most `generate` generated tokens in a temporary file beside `out`, with room in
    /// the header for `metadata` (what is known before the run) and a little more.
    pub fn create(
        out: &Path,
        planned: Vec<Planned>,
        generate: usize,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let file = AtomicFile::create(out).with_context(|| {
            format!(
                "--out {}: creating the dump's temporary file beside it",
                out.display()
            )
        })?;
        let mut planned = planned;
        planned.sort_by(|a, b| {
            (b.dtype.size_in_bytes(), &a.name).cmp(&(a.dtype.size_in_bytes(), &b.name))
        });
        let mut slots = BTreeMap::new();
        let mut offset = 0;
        for p in planned {
            ensure!(
                p.name != GENERATED && !slots.contains_key(&p.name),
                "the dump's layout names `{}` twice",
                p.name
            );
            st_dtype(p.dtype)?;
            let slot = Slot {
                dtype: p.dtype,
                shape: p.shape,
                offset,
                written: 0,
            };
            offset += slot.bytes();
            slots.insert(p.name, slot);
        }
        let mut w = StreamWriter {
            out: out.to_path_buf(),
            file,
            slots,
            data: 0,
            generate,
            non_finite: BTreeMap::new(),
        };
        // The header is longest with every token generated (its numbers have the most digits).
        let room = (w.header(generate, metadata)?.len() + METADATA_ROOM).next_multiple_of(8);
        w.data = (8 + room + 8 * generate) as u64;
        w.file
            .as_file()
            .set_len(w.data + offset)
            .with_context(|| w.at("sizing"))?;
        Ok(w)
    }

    /// Every tensor written so far holding NaN or infinity, in computation order.
    pub fn non_finite(&self) -> Vec<NonFinite> {
        let mut found: Vec<NonFinite> = self.non_finite.values().cloned().collect();
        crate::non_finite::sort(&mut found);
        found
    }

    /// Writes rows `[first, first + R)` of the planned tensor `name` (`R = t.dim(0)`); rows come in order, each
    /// once, in the planned dtype.
    pub fn write_rows(&mut self, name: &str, first: usize, t: &Tensor) -> Result<()> {
        let out = self.out.display().to_string();
        let slot = self.slots.get_mut(name).with_context(|| {
            format!("writing the dump {out}: the run gave `{name}`, which the dump's layout does not hold")
        })?;
        let dims = t.dims();
        let rows = dims.first().copied().unwrap_or(1);
        ensure!(
            t.dtype() == slot.dtype
                && dims.len() == slot.shape.len()
                && dims.get(1..) == slot.shape.get(1..),
            "writing the dump {out}: `{name}` came as {:?} {dims:?}, the layout holds {:?} {:?}",
            t.dtype(),
            slot.dtype,
            slot.shape
        );
        ensure!(
            first == slot.written && first + rows <= slot.rows(),
            "writing the dump {out}: rows {first}..{} of `{name}` came after rows 0..{} of {}",
            first + rows,
            slot.written,
            slot.rows()
        );
        if let Some(mut found) = NonFinite::scan(name, t)? {
            found.shape = slot.shape.clone();
            found.count = slot.shape.iter().product();
            if let Some(row) = found.first.first_mut() {
                *row += first;
            }
            self.non_finite
                .entry(name.to_string())
                .and_modify(|seen| {
                    seen.nan += found.nan;
                    seen.inf += found.inf;
                })
                .or_insert(found);
        }
        let at = self.data + slot.offset + first as u64 * slot.row_bytes();
        let chunk = (CHUNK_BYTES as u64 / slot.row_bytes().max(1)).max(1) as usize;
        slot.written += rows;
        let f = self.file.as_file_mut();
        f.seek(SeekFrom::Start(at))
            .with_context(|| format!("writing the dump {out}: `{name}`"))?;
        for start in (0..rows).step_by(chunk) {
            let piece = t.narrow(0, start, chunk.min(rows - start))?;
            let (_, bytes) = reference::io::tensor_bytes(&piece)?
                .with_context(|| format!("`{name}`: no safetensors dtype"))?;
            f.write_all(&bytes)
                .with_context(|| format!("writing the dump {out}: `{name}`"))?;
        }
        Ok(())
    }

    /// Writes the whole planned tensor `name`.
    pub fn write(&mut self, name: &str, t: &Tensor) -> Result<()> {
        if let Some(slot) = self.slots.get(name) {
            ensure!(
                t.dims() == slot.shape,
                "writing the dump {}: `{name}` came as {:?}, the layout holds {:?}",
                self.out.display(),
                t.dims(),
                slot.shape
            );
        }
        self.write_rows(name, 0, t)
    }

    /// Completes the dump with the tokens generated and its metadata: checks that every planned tensor was written
    /// whole, writes `generated` and the header, checks the file as safetensors reads it, and renames it to the
    /// final path. Returns how many tensors the dump holds.
    pub fn finish(
        mut self,
        generated: &[u32],
        metadata: &BTreeMap<String, String>,
    ) -> Result<usize> {
        let out = self.out.display().to_string();
        let n = generated.len();
        ensure!(
            n <= self.generate,
            "writing the dump {out}: {n} generated tokens, room for {}",
            self.generate
        );
        let missing: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.written < s.rows())
            .map(|(name, s)| format!("`{name}` (rows 0..{} of {})", s.written, s.rows()))
            .collect();
        if !missing.is_empty() {
            bail!(
                "writing the dump {out}: the run did not give {} of its tensors: {}{}",
                missing.len(),
                missing[..missing.len().min(5)].join(", "),
                if missing.len() > 5 { ", …" } else { "" }
            );
        }
        let header = self.header(n, metadata)?;
        let room = self.data as usize - 8 - 8 * n;
        ensure!(
            header.len() <= room,
            "writing the dump {out}: its header ({} bytes) outgrew the {room} bytes laid out for it (metadata \
             added after the run is limited to {METADATA_ROOM} bytes)",
            header.len()
        );
        let mut bytes = Vec::with_capacity(8 + room + 8 * n);
        bytes.extend((room as u64).to_le_bytes());
        bytes.extend(header.as_bytes());
        bytes.resize(8 + room, b' ');
        bytes.extend(generated.iter().flat_map(|&id| (id as i64).to_le_bytes()));
        let f = self.file.as_file_mut();
        f.seek(SeekFrom::Start(0))
            .and_then(|_| f.write_all(&bytes))
            .and_then(|_| f.flush())
            .with_context(|| self.at("writing the header of"))?;
        let tensors = self.check()?;
        self.file.commit().with_context(|| {
            format!(
                "{}: renaming the dump into place",
                crate::outputs::named(&self.out)
            )
        })?;
        Ok(tensors)
    }

    /// Reads the written file's header as safetensors does (which checks that the tensors cover the file exactly)
    /// and checks that it holds every planned tensor and `generated`; the number of tensors.
    fn check(&self) -> Result<usize> {
        // SAFETY: the file is this writer's own temporary file, which nothing else writes while it is mapped.
        let map = unsafe { memmap2::Mmap::map(self.file.as_file()) }
            .with_context(|| self.at("reading back"))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
            anyhow!(
                "writing the dump {}: not valid safetensors: {e}",
                self.out.display()
            )
        })?;
        let names = meta.tensors();
        ensure!(
            names.len() == self.slots.len() + 1
                && names.contains_key(GENERATED)
                && self.slots.keys().all(|k| names.contains_key(k)),
            "writing the dump {}: its header does not name exactly the tensors written",
            self.out.display()
        );
        Ok(names.len())
    }

    /// The header's JSON with `generated` holding `n` tokens.
    fn header(&self, n: usize, metadata: &BTreeMap<String, String>) -> Result<String> {
        let lead = 8 * n;
        let mut infos = vec![(
            GENERATED.to_string(),
            TensorInfo {
                dtype: StDtype::I64,
                shape: vec![n],
                data_offsets: (0, lead),
            },
        )];
        for (name, s) in &self.slots {
            let start = lead + s.offset as usize;
            infos.push((
                name.clone(),
                TensorInfo {
                    dtype: st_dtype(s.dtype)?,
                    shape: s.shape.clone(),
                    data_offsets: (start, start + s.bytes() as usize),
                },
            ));
        }
        // Safetensors wants them in the order they lie in the file.
        infos.sort_by_key(|(_, info)| info.data_offsets);
        let meta: HashMap<String, String> = metadata.clone().into_iter().collect();
        let meta = Metadata::new((!meta.is_empty()).then_some(meta), infos)
            .map_err(|e| anyhow!("writing the dump {}: its header: {e}", self.out.display()))?;
        serde_json::to_string(&meta).context("the dump's header")
    }

    fn at(&self, what: &str) -> String {
        format!("{what} the dump {}", self.out.display())
    }
}

impl TapSink for StreamWriter {
    fn put(&mut self, name: &str, position: usize, tensor: &Tensor) -> reference::Result<()> {
        if let Some(s) = self.slots.get(name)
            && s.written == s.rows()
            && position >= s.rows()
        {
            return Ok(());
        }
        self.write_rows(name, position, tensor)
            .map_err(|e| reference::Error::Sink(format!("{e:#}")))
    }
}

/// The safetensors dtype of a dump tensor.
fn st_dtype(d: DType) -> Result<StDtype> {
    Ok(match d {
        DType::F64 => StDtype::F64,
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::I64 => StDtype::I64,
        DType::U32 => StDtype::U32,
        other => bail!("a dump cannot hold dtype {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn plan() -> Vec<Planned> {
        let p = |name: &str, dtype, shape: &[usize]| Planned {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        };
        vec![
            p("token_ids", DType::I64, &[3]),
            // An odd number of f32 values: what follows would be misaligned if `generated` came last.
            p("b", DType::F32, &[3, 1]),
            p("a", DType::F32, &[3, 2, 2]),
        ]
    }

    fn rows(first: usize, n: usize, width: usize) -> Tensor {
        let v: Vec<f32> = (first * width..(first + n) * width)
            .map(|x| x as f32)
            .collect();
        Tensor::from_vec(v, (n, width), &Device::Cpu).unwrap()
    }

    #[test]
    fn rows_written_in_pieces_read_back_as_safetensors_with_fewer_tokens_than_room() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("d.safetensors");
        let meta = BTreeMap::from([("backend".to_string(), "test".to_string())]);
        let mut w = StreamWriter::create(&out, plan(), 6, &meta).unwrap();
        w.write(
            "token_ids",
            &Tensor::new(&[1i64, 2, 3], &Device::Cpu).unwrap(),
        )
        .unwrap();
        w.put("b", 0, &rows(0, 2, 1)).unwrap();
        w.put("a", 0, &rows(0, 1, 4).reshape((1, 2, 2)).unwrap())
            .unwrap();
        w.put("b", 2, &rows(2, 1, 1)).unwrap();
        w.put("a", 1, &rows(1, 2, 4).reshape((2, 2, 2)).unwrap())
            .unwrap();
        // Rows past the planned ones (the continuation's calls) are let go.
        w.put("b", 3, &rows(3, 1, 1)).unwrap();
        let mut meta = meta;
        meta.insert("nan_at".into(), "2".into());
        assert_eq!(w.finish(&[7, 8], &meta).unwrap(), 4);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        let bytes = std::fs::read(&out).unwrap();
        let (n, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(n % 8, 0);
        for (name, info) in header.tensors() {
            let size = info.dtype.bitsize() / 8;
            assert_eq!(
                (8 + n + info.data_offsets.0) % size,
                0,
                "{name} is misaligned"
            );
        }
        let d = crate::dump::Dump::read(&out).unwrap();
        assert_eq!(d.metadata["nan_at"], "2");
        assert_eq!(
            d.get("generated").unwrap().to_vec1::<i64>().unwrap(),
            [7, 8]
        );
        assert_eq!(
            d.get("token_ids").unwrap().to_vec1::<i64>().unwrap(),
            [1, 2, 3]
        );
        assert_eq!(
            d.get("b")
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            [0.0, 1.0, 2.0]
        );
        assert_eq!(
            d.get("a")
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            (0..12).map(|x| x as f32).collect::<Vec<_>>()
        );
    }

    #[test]
    fn what_the_layout_does_not_hold_is_an_error_and_leaves_no_file() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("d.safetensors");
        let meta = BTreeMap::new();
        let mut w = StreamWriter::create(&out, plan(), 2, &meta).unwrap();
        let e = w.put("c", 0, &rows(0, 3, 1)).unwrap_err().to_string();
        assert!(e.contains("`c`") && e.contains("does not hold"), "{e}");
        let e = w.put("b", 1, &rows(1, 2, 1)).unwrap_err().to_string();
        assert!(e.contains("rows 1..3 of `b` came after rows 0..0"), "{e}");
        let e = w.put("b", 0, &rows(0, 3, 2)).unwrap_err().to_string();
        assert!(e.contains("[3, 2]"), "{e}");
        w.put("b", 0, &rows(0, 3, 1)).unwrap();
        let e = format!("{:#}", w.finish(&[1, 2], &meta).unwrap_err());
        assert!(
            e.contains("did not give 2 of its tensors: `a` (rows 0..0 of 3), `token_ids`"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        let w = StreamWriter::create(&out, plan(), 2, &meta).unwrap();
        let e = format!("{:#}", w.finish(&[1, 2, 3], &meta).unwrap_err());
        assert!(e.contains("3 generated tokens, room for 2"), "{e}");
        let e = format!(
            "{:#}",
            StreamWriter::create(&tmp.path().join("no/d.safetensors"), plan(), 2, &meta)
                .err()
                .unwrap()
        );
        assert!(e.contains("--out") && e.contains("no/d.safetensors"), "{e}");
    }
}

//! Where a graph's constants live: in memory, or appended to a `.bin` file that several graphs share.

use super::ElemType;
use crate::error::{Error, Result};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// A graph's `.bin`.
#[derive(Debug, Clone)]
pub(crate) enum Bin {
    /// Held by the graph.
    Memory(Vec<u8>),
    /// Appended to a file, possibly shared with other graphs.
    File(SharedBin),
}

impl Bin {
    /// Bytes so far.
    pub(crate) fn len(&self) -> Result<usize> {
        match self {
            Bin::Memory(v) => Ok(v.len()),
            Bin::File(f) => Ok(f.lock()?.len),
        }
    }

    /// Appends `bytes`; returns their offset.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> Result<usize> {
        match self {
            Bin::Memory(v) => {
                let offset = v.len();
                v.extend_from_slice(bytes);
                Ok(offset)
            }
            Bin::File(f) => f.lock()?.append(bytes),
        }
    }

    /// The `size` bytes at `offset`.
    pub(crate) fn read(&self, offset: usize, size: usize) -> Result<Cow<'_, [u8]>> {
        match self {
            Bin::Memory(v) => v
                .get(offset..offset + size)
                .map(Cow::Borrowed)
                .ok_or_else(|| {
                    Error::Interface(format!(
                        "{size} bytes at offset {offset} lie outside the .bin ({} bytes)",
                        v.len()
                    ))
                }),
            Bin::File(f) => f.read(offset, size).map(Cow::Owned),
        }
    }
}

/// A `.bin` file that graphs append their constants to as they are built ([`super::Graph::with_shared_bin`]), so
/// that no graph holds its weights in memory, and that several graphs' XMLs can point into (one copy of the weights
/// on disk, and one mapping of them for OpenVINO per graph read). A constant written under a key (see
/// [`super::Graph::constant_streamed`]) is written once: a later graph asking for the same key gets a `Const` at the
/// same offset. Cloning shares the file.
#[derive(Debug, Clone)]
pub struct SharedBin(Arc<Mutex<BinFile>>);

#[derive(Debug)]
struct BinFile {
    path: PathBuf,
    writer: BufWriter<File>,
    len: usize,
    /// Key → (type, shape, offset, size).
    keys: HashMap<String, (ElemType, Vec<usize>, usize, usize)>,
}

impl BinFile {
    fn append(&mut self, bytes: &[u8]) -> Result<usize> {
        let offset = self.len;
        self.writer
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.len += bytes.len();
        Ok(offset)
    }
}

impl SharedBin {
    /// Creates (or truncates) the file at `path`.
    pub fn create(path: &Path) -> Result<SharedBin> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        Ok(SharedBin(Arc::new(Mutex::new(BinFile {
            path: path.to_path_buf(),
            writer: BufWriter::with_capacity(1 << 20, file),
            len: 0,
            keys: HashMap::new(),
        }))))
    }

    /// A file in the system's temporary directory that no name reaches (unlinked once opened): a graph's constants
    /// for as long as a graph or a mapping holds it, gone with the last, whatever ends the process.
    pub fn scratch() -> Result<SharedBin> {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("qwen35-bin-{}-{n}.bin", std::process::id()));
        let bin = SharedBin::create(&path)?;
        std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        Ok(bin)
    }

    /// The file as written so far, mapped read-only (its pages are the page cache's: a reader hands them back with
    /// `madvise`, and they are read again from the cache or the disk).
    pub(crate) fn map(&self) -> Result<memmap2::Mmap> {
        let mut f = self.lock()?;
        let path = f.path.clone();
        f.writer.flush().map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is only ever appended to (by this process, through this writer): the bytes mapped do
        // not change while the map lives.
        unsafe { memmap2::Mmap::map(f.writer.get_ref()) }.map_err(|e| Error::io(&path, e))
    }

    fn lock(&self) -> Result<MutexGuard<'_, BinFile>> {
        self.0.lock().map_err(|_| {
            Error::Interface("a shared .bin was poisoned by a panic while writing".into())
        })
    }

    /// The file's path.
    pub fn path(&self) -> Result<PathBuf> {
        Ok(self.lock()?.path.clone())
    }

    /// Bytes written so far.
    pub fn len(&self) -> Result<usize> {
        Ok(self.lock()?.len)
    }

    /// Whether nothing has been written yet.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Writes out what is buffered, so that the file holds every constant appended so far (needed before anyone
    /// reads it).
    pub fn flush(&self) -> Result<()> {
        let mut f = self.lock()?;
        let path = f.path.clone();
        f.writer.flush().map_err(|e| Error::io(&path, e))
    }

    /// The offset of the constant written under `key`, if any; an error if it was written with another type or
    /// shape (two tensors under one key: a bug of the caller).
    pub(crate) fn lookup(
        &self,
        key: &str,
        ty: ElemType,
        shape: &[usize],
        size: usize,
    ) -> Result<Option<usize>> {
        let f = self.lock()?;
        match f.keys.get(key) {
            None => Ok(None),
            Some((t, s, offset, n)) if *t == ty && s == shape && *n == size => Ok(Some(*offset)),
            Some((t, s, _, _)) => Err(Error::Interface(format!(
                "{}: constant `{key}` was written as {} {s:?}, now asked for as {} {shape:?}",
                f.path.display(),
                t.ir_name(),
                ty.ir_name()
            ))),
        }
    }

    /// Records that the constant `key` lies at `offset`.
    pub(crate) fn remember(
        &self,
        key: &str,
        ty: ElemType,
        shape: &[usize],
        offset: usize,
        size: usize,
    ) -> Result<()> {
        self.lock()?
            .keys
            .insert(key.to_string(), (ty, shape.to_vec(), offset, size));
        Ok(())
    }

    /// The `size` bytes at `offset`, read back from the file.
    fn read(&self, offset: usize, size: usize) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut f = self.lock()?;
        let path = f.path.clone();
        if offset + size > f.len {
            return Err(Error::Interface(format!(
                "{}: {size} bytes at offset {offset} lie outside the file ({} bytes)",
                path.display(),
                f.len
            )));
        }
        f.writer.flush().map_err(|e| Error::io(&path, e))?;
        let mut out = vec![0; size];
        f.writer
            .get_ref()
            .read_exact_at(&mut out, offset as u64)
            .map_err(|e| Error::io(&path, e))?;
        Ok(out)
    }
}

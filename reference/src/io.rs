//! Safetensors files this project writes (dumps, synthetic checkpoints): tensors in their own dtypes plus string
//! metadata; and [`AtomicFile`], how a file is written whole or not at all. Reading checkpoints is
//! [`crate::weights`]' job.

use crate::error::{Error, Result};
use candle_core::DType;
use candle_core::Tensor;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions, Permissions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A file that appears at its path only once complete: written into a hidden sibling (`.NAME.XXXXXX.partial`, in
/// the same directory, so that the rename is atomic) created with mode `0666` less the umask, as
/// [`File::create`] would make it, and renamed onto the path by [`AtomicFile::commit`]. Dropped uncommitted (an
/// error on the way), the sibling is removed and the path left as it was. A symlink is followed: the file it names
/// is replaced and the link kept. The sibling is registered ([`crate::temps`]) while it exists, so that a signal
/// ending the run removes it too; an output that is an input of the run ([`crate::inputs`]) is refused when the file
/// is created and again when it is renamed into place. A path that exists and is neither a regular file nor a
/// directory (`/dev/null`, a terminal, a pipe) is written in place: there is nothing to rename onto it.
pub struct AtomicFile(Target);

enum Target {
    Staged {
        temp: tempfile::NamedTempFile,
        dest: PathBuf,
        mode: Permissions,
    },
    InPlace(File),
}

impl AtomicFile {
    /// Starts writing `path` (nothing appears there before [`AtomicFile::commit`]).
    pub fn create(path: &Path) -> std::io::Result<Self> {
        crate::inputs::refuse_output(path)?;
        if let Ok(m) = std::fs::metadata(path) {
            if m.is_dir() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::IsADirectory,
                    "is a directory",
                ));
            }
            if !m.is_file() {
                let file = OpenOptions::new().write(true).truncate(true).open(path)?;
                return Ok(AtomicFile(Target::InPlace(file)));
            }
        }
        let dest = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = dest
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let prefix = format!(".{name}.");
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".partial");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // As open(2) creates it: the umask applies (tempfile's own default is 0600).
            builder.permissions(Permissions::from_mode(0o666));
        }
        // Registered as it is made: removed by a signal's handler if the run is ended before it is dropped or
        // committed.
        let temp = crate::temps::create(|| builder.tempfile_in(dir), |t| t.path())?;
        let mode = temp.as_file().metadata()?.permissions();
        Ok(AtomicFile(Target::Staged { temp, dest, mode }))
    }

    /// The sibling being written, for a writer that takes a path rather than a [`Write`] (it may replace the
    /// sibling by a file of its own: [`AtomicFile::commit`] sets the mode again and renames whatever is there);
    /// `None` when the path is written in place.
    pub fn staged_path(&self) -> Option<&Path> {
        match &self.0 {
            Target::Staged { temp, .. } => Some(temp.path()),
            Target::InPlace(_) => None,
        }
    }

    /// Renames the finished file onto its path (with the mode it was created with).
    pub fn commit(self) -> std::io::Result<()> {
        match self.0 {
            Target::Staged { temp, dest, mode } => {
                // An input read since the file was started (the run's inputs are recorded as they are opened).
                crate::inputs::refuse_output(&dest)?;
                std::fs::set_permissions(temp.path(), mode)?;
                let staged = temp.path().to_path_buf();
                temp.persist(&dest).map_err(|e| e.error)?;
                crate::temps::forget(&staged);
                Ok(())
            }
            Target::InPlace(mut file) => file.flush(),
        }
    }

    /// Removes the unfinished file (nothing appears at its path); an error drops it the same way.
    pub fn discard(self) {
        if let Target::Staged { temp, .. } = self.0 {
            let staged = temp.path().to_path_buf();
            drop(temp);
            crate::temps::forget(&staged);
        }
    }

    /// The file being written (to seek, size or map it, for a writer that does more than append).
    pub fn as_file(&self) -> &File {
        match &self.0 {
            Target::Staged { temp, .. } => temp.as_file(),
            Target::InPlace(file) => file,
        }
    }

    /// [`AtomicFile::as_file`], mutably.
    pub fn as_file_mut(&mut self) -> &mut File {
        match &mut self.0 {
            Target::Staged { temp, .. } => temp.as_file_mut(),
            Target::InPlace(file) => file,
        }
    }

    fn file(&mut self) -> &mut File {
        self.as_file_mut()
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file().flush()
    }
}

/// Writes `bytes` to `path` whole or not at all (see [`AtomicFile`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = AtomicFile::create(path)?;
    file.write_all(bytes)?;
    file.commit()
}

/// Writes tensors (each in its own dtype: f32, f64, f16, bf16, i64 or u32) and string metadata to a safetensors
/// file, whole or not at all (see [`AtomicFile`]).
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let err = |message: String| Error::File {
        file: path.display().to_string(),
        message: format!("writing: {message}"),
    };
    let mut encoded: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> =
        Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dtype, bytes) = tensor_bytes(t)?.ok_or_else(|| {
            err(format!(
                "tensor `{name}`: cannot write dtype {:?}",
                t.dtype()
            ))
        })?;
        encoded.push((name.clone(), dtype, t.dims().to_vec(), bytes));
    }
    let views = encoded
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| err(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let meta = if meta.is_empty() { None } else { Some(meta) };
    let mut out = AtomicFile::create(path).map_err(|e| Error::io(path, e))?;
    match out.staged_path() {
        Some(staged) => safetensors::serialize_to_file(views, meta, staged),
        None => safetensors::serialize(views, meta).and_then(|b| Ok(out.write_all(&b)?)),
    }
    .map_err(|e| err(e.to_string()))?;
    out.commit().map_err(|e| Error::io(path, e))
}

/// A tensor's values as safetensors stores them (little-endian, row-major) with its safetensors dtype, for f32, f64,
/// f16, bf16, i64 and u32 tensors (`None` for another dtype).
pub fn tensor_bytes(t: &Tensor) -> Result<Option<(StDtype, Vec<u8>)>> {
    let flat = t.flatten_all()?;
    Ok(Some(match t.dtype() {
        DType::F32 => (
            StDtype::F32,
            le_bytes(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        ),
        DType::F64 => (
            StDtype::F64,
            le_bytes(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        ),
        DType::F16 => (
            StDtype::F16,
            le_bytes(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        ),
        DType::BF16 => (
            StDtype::BF16,
            le_bytes(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        ),
        DType::I64 => (
            StDtype::I64,
            le_bytes(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        ),
        DType::U32 => (
            StDtype::U32,
            le_bytes(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        ),
        _ => return Ok(None),
    }))
}

fn le_bytes<T, const N: usize>(values: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.into_iter().flat_map(f).collect()
}

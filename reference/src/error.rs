//! The error type of the reference: every failure names the file, key or input it concerns.

use std::path::PathBuf;

/// Errors of the reference decoder.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration field is missing, mistyped or inconsistent.
    #[error("{file}: {key}: {message}")]
    Config {
        /// The file the configuration came from.
        file: String,
        /// The key (dotted path) at fault.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A weight tensor is missing, mis-shaped or of an unsupported dtype.
    #[error("{file}: tensor `{key}`: {message}")]
    Weights {
        /// The file (or directory) that should hold the tensor.
        file: String,
        /// The tensor name.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A file as a whole is unusable (not JSON, not safetensors, absent), or a key of a JSON file that is not a
    /// tensor's name is wrong.
    #[error("{file}: {message}")]
    File {
        /// The file (or directory).
        file: String,
        /// What is wrong with it.
        message: String,
    },
    /// An input of a run is invalid (token id out of range, bad shape of a state, ...).
    #[error("{0}")]
    Input(String),
    /// The tokenizer or the chat template failed.
    #[error("{file}: {message}")]
    Tokenizer {
        /// The file involved.
        file: String,
        /// What went wrong.
        message: String,
    },
    /// A file could not be read or written. (The I/O error is part of the message, not a `source`: a chain printed
    /// with `{:#}` would repeat it.)
    #[error("{path}: {error}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// A backend other than the reference failed (an OpenVINO device, …): its own error, as text.
    #[error("{0}")]
    Backend(String),
    /// Where taps were streamed failed (a dump being written, …): its own error, as text.
    #[error("{0}")]
    Sink(String),
    /// An error from a tensor operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The result type of the reference.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }
}

//! Errors of the OpenVINO side; each names the graph, device, file or option at fault.

use std::path::PathBuf;

/// Errors of the OpenVINO side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No OpenVINO runtime could be found or loaded.
    #[error("OpenVINO runtime: {0}")]
    Runtime(String),
    /// A device is absent or refused a request.
    #[error("device `{device}`: {message}")]
    Device {
        /// The device name.
        device: String,
        /// What went wrong.
        message: String,
    },
    /// A graph could not be built (shape or type mismatch: a bug or an unsupported config).
    #[error("graph {graph}: {message}")]
    Graph {
        /// The graph name.
        graph: String,
        /// What went wrong.
        message: String,
    },
    /// OpenVINO refused to read, compile or run a graph.
    #[error("{stage} of {graph} on {device}: {message}")]
    OpenVino {
        /// `reading`, `compiling` or `inference`.
        stage: &'static str,
        /// The graph name.
        graph: String,
        /// The device name.
        device: String,
        /// OpenVINO's message.
        message: String,
    },
    /// An invalid option or configuration (device config JSON, graph options).
    #[error("{0}")]
    Config(String),
    /// An invalid input of a run: an empty prompt, a sequence longer than the static context, a layer that does not
    /// exist.
    #[error("{0}")]
    Input(String),
    /// A graph's interface is not what its caller expects (an output missing, a state of the other layer kind): a
    /// mismatch between the builder and its user, reported instead of a panic.
    #[error("graph interface: {0}")]
    Interface(String),
    /// A file could not be read or written. (The I/O error is part of the message, not a `source`: a chain printed
    /// with `{:#}` would repeat it.)
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
    /// From the reference decoder (config, weights, tokenizer).
    #[error(transparent)]
    Reference(#[from] reference::Error),
    /// A tensor operation on the host.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The result type of the OpenVINO side.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }

    pub(crate) fn graph(graph: &str, message: impl Into<String>) -> Self {
        Error::Graph {
            graph: graph.to_string(),
            message: message.into(),
        }
    }
}

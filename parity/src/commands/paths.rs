//! The files and directories the shared options name, as inputs and outputs of a command's
//! [`Paths`](crate::outputs::Paths) check.

use super::args::{DeviceArgs, GraphArgs, ModelArgs, ReportArgs};
use crate::outputs::{DeclarePaths, Kind, Paths};

impl DeclarePaths for ModelArgs {
    /// The checkpoint directory is an input: `--model`, or the bundled model.
    fn declare(&self, paths: Paths) -> Paths {
        match &self.model {
            Some(d) => paths.input("--model", Some(d)),
            None => paths.input("the bundled model", crate::bundled::model_dir().ok()),
        }
    }
}

impl DeclarePaths for GraphArgs {
    /// `--device-config` is an input, `--cache-dir` an output directory.
    fn declare(&self, paths: Paths) -> Paths {
        paths
            .input("--device-config", self.device_config.as_ref())
            .output("--cache-dir", self.cache_dir.as_ref(), Kind::Dir)
    }
}

impl DeclarePaths for DeviceArgs {
    /// The graph options' paths.
    fn declare(&self, paths: Paths) -> Paths {
        self.graph.declare(paths)
    }
}

impl DeclarePaths for ReportArgs {
    /// `--json`, `--report` and `--plot` are output files.
    fn declare(&self, paths: Paths) -> Paths {
        paths
            .file("--json", self.json.as_ref())
            .file("--report", self.report.as_ref())
            .file("--plot", self.plot.as_ref())
    }
}

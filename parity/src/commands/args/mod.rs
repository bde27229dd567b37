//! Command-line options shared by the subcommands, and their conversion into the plain settings the library below
//! `commands/` takes (no clap type leaves this module's commands): validated before any work starts. One file per
//! group of options: the model (`model.rs`), how it computes (`form.rs`), the device and its graphs (`device.rs`),
//! the prompt (`prompt.rs`), thresholds and reports (`checks.rs`).

mod checks;
mod device;
mod form;
mod model;
mod prompt;

pub use checks::{ModeArg, ReportArgs, ThresholdArgs};
pub use device::{Backend, DeviceArgs, GraphArgs, refuse_graph_flags};
pub use form::{DecodeForm, FormArgs, InverseArg, MoeFormArg, PrefillForm};
pub use model::{Dtype, ModelArgs};
pub use prompt::{ImageArgs, PromptArgs};

use anyhow::{Result, bail};

/// Two positive sizes written `AxB` (`x` or `X` between), as `flag` takes them; `example` shows the form in the
/// error (`HxW in patches, e.g. 32x32`).
pub fn parse_pair(flag: &str, text: &str, example: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| x.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match text
        .split_once(['x', 'X'])
        .map(|(a, b)| (parse(a), parse(b)))
    {
        Some((Some(a), Some(b))) => Ok((a, b)),
        _ => bail!("{flag} {text}: expected {example}"),
    }
}

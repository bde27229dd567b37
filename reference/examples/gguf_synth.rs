//! Writes GGUF files of synthetic weights for `gguf_speed` (`docs/speed.md`, "GGUF weights kept packed"): one file a
//! ggml type, each holding one matrix of the 9B model's MLP shape whose blocks are random with finite values
//! ([`reference::gguf::decode::random_blocks`]: valid scales, random codes), so the decode and product speeds of a
//! type can be measured without converting and quantizing a 9B checkpoint.
//!
//! ```text
//! cargo run --release -p reference --example gguf_synth -- DIR [TYPE ...]
//! ```
//!
//! `DIR/<type>.gguf` for each TYPE (ggml's names: `q4_K`, `q6_K`, `q8_0`, ...; default: f16, bf16, q4_0, q8_0,
//! q4_K, q5_K, q6_K). The matrix is `blk.31.ffn_up.weight` `[12288, 4096]` (rows, columns), or for Q6_K, the type
//! llama.cpp's Q4_K_M gives the down projections, `blk.31.ffn_down.weight` `[4096, 12288]`. No model metadata: the
//! files serve `gguf_speed FILE --matrix`, not a run.

use reference::gguf::GgmlType;
use reference::gguf::decode::random_blocks;
use reference::gguf::types::ALL;
use std::path::PathBuf;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The 9B model's hidden size and MLP width.
const HIDDEN: u64 = 4096;
const INTERMEDIATE: u64 = 12288;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().map(PathBuf::from) else {
        return Err("usage: gguf_synth DIR [TYPE ...]".into());
    };
    let names: Vec<&str> = if args.len() > 1 {
        args[1..].iter().map(String::as_str).collect()
    } else {
        vec!["f16", "bf16", "q4_0", "q8_0", "q4_K", "q5_K", "q6_K"]
    };
    std::fs::create_dir_all(&dir)?;
    for name in names {
        let ty = ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| format!("{name}: not a ggml type name (q4_K, q6_K, q8_0, f16, ...)"))?;
        let (tensor, rows, cols) = if ty == GgmlType::Q6_K {
            ("blk.31.ffn_down.weight", HIDDEN, INTERMEDIATE)
        } else {
            ("blk.31.ffn_up.weight", INTERMEDIATE, HIDDEN)
        };
        let blocks = (rows * cols) as usize / ty.block_elems();
        let data = random_blocks(ty, blocks, 31 + ty.id() as u64)?;
        let name_value = {
            let s = "synthetic";
            let mut v = (s.len() as u64).to_le_bytes().to_vec();
            v.extend_from_slice(s.as_bytes());
            v
        };
        let bytes = reference::gguf::file::write(
            &[("general.name", 8, name_value)],
            &[(tensor, vec![cols, rows], ty, data)],
            32,
        );
        let path = dir.join(format!("{name}.gguf"));
        std::fs::write(&path, bytes)?;
        println!("{}: {tensor} {ty} [{rows}, {cols}]", path.display());
    }
    Ok(())
}

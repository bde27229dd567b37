//! Prompt-lookup decoding: draft tokens from an earlier n-gram of the context, verified as one block; after a
//! partial match the state from before the verify call is restored and the accepted tokens fed again (a recurrent
//! state cannot be rolled back).

use super::{Backend, has_nan};
use crate::error::{Error, Result};
use crate::model::argmax;
use candle_core::Tensor;
use std::time::Instant;

/// How prompt-lookup decoding drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupOptions {
    /// The longest n-gram looked up: the last `max_ngram` tokens of the context first, down to the last one.
    pub max_ngram: usize,
    /// The most draft tokens proposed per verify call.
    pub max_draft: usize,
}

impl Default for LookupOptions {
    fn default() -> Self {
        LookupOptions {
            max_ngram: 3,
            max_draft: 4,
        }
    }
}

/// What prompt-lookup decoding produced, and how often its drafts hit.
#[derive(Debug, Clone)]
pub struct Lookup {
    /// The chosen tokens (plain greedy's, when the backend computes a block as it computes single tokens).
    pub tokens: Vec<u32>,
    /// The logits `[V]` each token was chosen from.
    pub logits: Vec<Tensor>,
    /// Draft tokens proposed.
    pub proposed: usize,
    /// Draft tokens accepted (equal to the argmax chain of their verify call).
    pub accepted: usize,
    /// Forward calls, the prompt's included.
    pub forward_calls: usize,
    /// Forward calls that verified a draft.
    pub verify_calls: usize,
    /// Partial matches: the state restored from before the verify call and the accepted tokens fed again.
    pub refeeds: usize,
    /// Seconds spent on the prompt.
    pub prompt_seconds: f64,
    /// Seconds spent after the prompt.
    pub decode_seconds: f64,
    /// The index of the token the backend could not choose because its logits held a NaN (generation stopped).
    pub nan_at: Option<usize>,
}

impl Lookup {
    /// Accepted over proposed draft tokens (0 when nothing was proposed).
    pub fn acceptance(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// The draft for the next tokens: the most recent earlier occurrence of the context's last `n` tokens (`n` from
/// `max_ngram` down to 1) that is followed by `max_draft` tokens, else the one followed by the most, and the tokens
/// that followed it there (at most `max_draft`). Empty when no n-gram recurs.
pub fn find_draft(context: &[u32], max_ngram: usize, max_draft: usize) -> Vec<u32> {
    let len = context.len();
    if max_draft == 0 {
        return Vec::new();
    }
    for n in (1..=max_ngram.min(len.saturating_sub(1))).rev() {
        let pattern = &context[len - n..];
        let mut best: Option<(usize, usize)> = None;
        // Occurrences starting before the pattern itself, the most recent first.
        for i in (0..len - n).rev() {
            if &context[i..i + n] != pattern {
                continue;
            }
            let follow = (len - (i + n)).min(max_draft);
            if best.is_none_or(|(_, f)| follow > f) {
                best = Some((i + n, follow));
            }
            if follow == max_draft {
                break;
            }
        }
        if let Some((from, follow)) = best {
            return context[from..from + follow].to_vec();
        }
    }
    Vec::new()
}

/// Prompt-lookup decoding from a fresh state: greedy generation whose next tokens are drafted from an earlier
/// n-gram of the context ([`find_draft`]) and verified in one forward call of [last token, drafts] with the logits
/// of every row; the longest prefix of the draft that matches the argmax chain is accepted, and the row after it
/// gives one more token. A recurrent state cannot be rolled back past rejected drafts, so on a partial match the
/// state taken before the verify call is restored and the accepted tokens are fed again. Stops as [`super::greedy`] does
/// (after `max_new` tokens, a token in `stop`, or logits holding a NaN) and needs no more cache slots than it.
pub fn prompt_lookup(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    opts: LookupOptions,
) -> Result<Lookup> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty".into()));
    }
    backend.config().check_token_ids(prompt)?;
    backend.reset()?;
    let start = Instant::now();
    let first = backend.forward(prompt, false)?;
    let prompt_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut out = Lookup {
        tokens: Vec::with_capacity(max_new.min(4096)),
        logits: Vec::with_capacity(max_new.min(4096)),
        proposed: 0,
        accepted: 0,
        forward_calls: 1,
        verify_calls: 0,
        refeeds: 0,
        prompt_seconds,
        decode_seconds: 0.0,
        nan_at: None,
    };
    let mut context = prompt.to_vec();
    let mut logits = first.logits.get(first.logits.dim(0)? - 1)?;
    'generate: while out.tokens.len() < max_new {
        if has_nan(&logits)? {
            out.nan_at = Some(out.tokens.len());
            break;
        }
        // `next` is chosen but not yet fed.
        let next = argmax(&logits)?;
        out.tokens.push(next);
        out.logits.push(logits.clone());
        context.push(next);
        if stop.contains(&next) || out.tokens.len() == max_new {
            break;
        }
        // Every accepted draft token and the one chosen after them must fit in `max_new`.
        let room = max_new - out.tokens.len() - 1;
        let draft = find_draft(&context, opts.max_ngram, opts.max_draft.min(room));
        if draft.is_empty() {
            logits = backend.forward(&[next], false)?.logits.get(0)?;
            out.forward_calls += 1;
            continue;
        }
        let before = backend.snapshot()?;
        let mut ids = Vec::with_capacity(draft.len() + 1);
        ids.push(next);
        ids.extend_from_slice(&draft);
        let rows = backend.forward(&ids, true)?.logits;
        out.forward_calls += 1;
        out.verify_calls += 1;
        out.proposed += draft.len();
        // Row j predicts the token after ids[j]: draft[j] is accepted when it is that row's argmax.
        let mut matched = 0;
        for (j, &d) in draft.iter().enumerate() {
            let row = rows.get(j)?;
            if has_nan(&row)? || argmax(&row)? != d {
                break;
            }
            out.tokens.push(d);
            out.logits.push(row);
            context.push(d);
            matched += 1;
            if stop.contains(&d) {
                out.accepted += matched;
                break 'generate;
            }
        }
        out.accepted += matched;
        logits = rows.get(matched)?;
        if matched < draft.len() {
            backend.restore(&before)?;
            backend.forward(&ids[..matched + 1], false)?;
            out.forward_calls += 1;
            out.refeeds += 1;
        }
    }
    out.decode_seconds = start.elapsed().as_secs_f64();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use crate::backend::{Forward, ReferenceBackend, RunRecord, Snapshot, greedy};
    use crate::model::{Model, RunOptions};
    use crate::synthetic::small_config_json;
    use candle_core::{DType, Device};
    use std::collections::BTreeMap;

    #[test]
    fn drafts_come_from_the_most_recent_earlier_ngram() {
        // The last 3 tokens (7, 8, 9) occur at 1..4, followed by 4, 5.
        assert_eq!(
            find_draft(&[1, 7, 8, 9, 4, 5, 7, 8, 9], 3, 4),
            vec![4, 5, 7, 8]
        );
        assert_eq!(find_draft(&[1, 7, 8, 9, 4, 5, 7, 8, 9], 3, 2), vec![4, 5]);
        // No 3- or 2-gram recurs; the last token (9) does.
        assert_eq!(find_draft(&[9, 1, 2, 3, 9], 3, 4), vec![1, 2, 3, 9]);
        // Of two occurrences the most recent one with a full draft wins.
        assert_eq!(find_draft(&[5, 1, 5, 2, 3, 4, 6, 5], 1, 3), vec![2, 3, 4]);
        // The most recent one is followed by fewer tokens than asked: the earlier full one is taken.
        assert_eq!(find_draft(&[5, 1, 2, 3, 5, 6, 5], 1, 3), vec![1, 2, 3]);
        // A loop of period 1: the draft overlaps the pattern.
        assert_eq!(find_draft(&[4, 4, 4], 2, 4), vec![4]);
        assert!(find_draft(&[1, 2, 3], 3, 4).is_empty());
        assert!(find_draft(&[1], 3, 4).is_empty());
        assert!(find_draft(&[1, 1, 1], 3, 0).is_empty());
    }

    /// A backend whose next token is a function of everything it has been fed (3·Σ ids + ⌊len/5⌋ mod 7, one-hot
    /// logits), so a rejected draft left in its state would change every later token. `restores` counts restores;
    /// `forgetful` ignores them (the fault prompt lookup must not have).
    struct Counting {
        config: Config,
        record: RunRecord,
        fed: Vec<u32>,
        restores: usize,
        forgetful: bool,
    }

    impl Counting {
        fn new(forgetful: bool) -> Self {
            let json = small_config_json().to_string();
            Counting {
                config: Config::from_json_str(&json, "test").unwrap(),
                record: RunRecord::default(),
                fed: Vec::new(),
                restores: 0,
                forgetful,
            }
        }

        fn next(fed: &[u32]) -> usize {
            let sum: u32 = fed.iter().sum();
            ((3 * sum as usize) + fed.len() / 5) % 7
        }
    }

    impl Backend for Counting {
        fn config(&self) -> &Config {
            &self.config
        }
        fn record(&self) -> &RunRecord {
            &self.record
        }
        fn reset(&mut self) -> Result<()> {
            self.fed.clear();
            Ok(())
        }
        fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Forward> {
            let v = self.config.vocab_size;
            let mut rows = Vec::new();
            for &id in ids {
                self.fed.push(id);
                let mut row = vec![0f32; v];
                row[Self::next(&self.fed)] = 1.0;
                rows.push(row);
            }
            if !all_logits {
                rows.drain(..rows.len() - 1);
            }
            let n = rows.len();
            let flat: Vec<f32> = rows.concat();
            Ok(Forward {
                logits: Tensor::from_vec(flat, (n, v), &Device::Cpu)?,
                taps: BTreeMap::new(),
            })
        }
        fn snapshot(&self) -> Result<Snapshot> {
            let fed = Tensor::from_vec(self.fed.clone(), self.fed.len(), &Device::Cpu)?;
            Ok(Snapshot {
                position: self.fed.len(),
                rope_delta: 0,
                tensors: [("fed".to_string(), fed)].into(),
            })
        }
        fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
            self.restores += 1;
            if !self.forgetful {
                self.fed = snapshot.get("fed")?.to_vec1()?;
            }
            Ok(())
        }
    }

    #[test]
    fn prompt_lookup_gives_greedys_tokens_restoring_after_partial_matches() {
        let prompt = [1, 2, 3, 1, 2, 3];
        let mut b = Counting::new(false);
        let plain = greedy(&mut b, &prompt, 30, &[], false, |_| Ok(())).unwrap();
        let l = prompt_lookup(&mut b, &prompt, 30, &[], LookupOptions::default()).unwrap();
        assert_eq!(l.tokens, plain.tokens);
        assert_eq!(l.tokens.len(), 30);
        assert_eq!(l.logits.len(), 30);
        // Drafts were proposed, some accepted and some rejected (each rejection a restore and a re-feed).
        assert!(l.accepted > 0 && l.accepted < l.proposed, "{l:?}");
        assert!(l.refeeds > 0);
        assert_eq!(b.restores, l.refeeds);
        // Every call accounted for: the prompt, single-token steps, verify calls and re-feeds.
        let singles = l.forward_calls - 1 - l.verify_calls - l.refeeds;
        assert_eq!(singles + l.verify_calls + l.accepted, l.tokens.len() - 1);
        // The state holds exactly the tokens fed, never a rejected draft: prompt and every token but the last.
        assert_eq!(b.fed.len(), prompt.len() + 29);

        // Without the restore the rejected drafts stay in the state and the tokens change.
        let mut forgetful = Counting::new(true);
        let l = prompt_lookup(&mut forgetful, &prompt, 30, &[], LookupOptions::default()).unwrap();
        assert_ne!(l.tokens, plain.tokens);
    }

    #[test]
    fn prompt_lookup_stops_like_greedy() {
        let prompt = [1, 2, 3, 1, 2, 3];
        let mut b = Counting::new(false);
        let plain = greedy(&mut b, &prompt, 30, &[], false, |_| Ok(())).unwrap();
        // Stop at the first 5 greedy chooses, wherever it lands (a draft or a chosen token).
        let stop = [5];
        let until = plain.tokens.iter().position(|&t| t == 5).unwrap() + 1;
        for k in 1..=5 {
            let opts = LookupOptions {
                max_ngram: 3,
                max_draft: k,
            };
            let l = prompt_lookup(&mut b, &prompt, 30, &stop, opts).unwrap();
            assert_eq!(l.tokens, plain.tokens[..until], "max_draft {k}");
            // And never past max_new.
            for n in [1, 2, 7] {
                let l = prompt_lookup(&mut b, &prompt, n, &[], opts).unwrap();
                assert_eq!(l.tokens, plain.tokens[..n], "max_draft {k}, {n} tokens");
            }
        }
    }

    /// On the reference (the bundled tiny model), a chat prompt that repeats itself: drafts are proposed, some hit,
    /// and the tokens are greedy's.
    #[test]
    fn prompt_lookup_on_the_reference_gives_greedys_tokens() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/models/tiny");
        let model = Model::load(&dir, DType::F32).unwrap();
        let tok = crate::tokenizer::ChatTokenizer::load(&dir).unwrap();
        let text = "the cat sat on the mat. ".repeat(4);
        let message = crate::tokenizer::Message::new("user", text.trim());
        let prompt = tok.encode_chat(&[message], false).unwrap();
        let mut b = ReferenceBackend::new(model, RunOptions::default(), false, "f32").unwrap();
        let plain = greedy(&mut b, &prompt, 64, &[], false, |_| Ok(())).unwrap();
        let l = prompt_lookup(&mut b, &prompt, 64, &[], LookupOptions::default()).unwrap();
        assert_eq!(l.tokens, plain.tokens);
        // A verify row and a single-token call compute the same logits up to f32 rounding (chunked vs matrix form).
        for (a, g) in l.logits.iter().zip(&plain.logits) {
            let d = (a - g).unwrap().abs().unwrap().max_all().unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-4);
        }
        println!(
            "tiny: {} tokens, {} of {} drafts accepted, {} forward calls ({} verify, {} re-feeds)",
            l.tokens.len(),
            l.accepted,
            l.proposed,
            l.forward_calls,
            l.verify_calls,
            l.refeeds
        );
        assert!(l.accepted > 0 && l.refeeds > 0, "{l:?}");
    }
}

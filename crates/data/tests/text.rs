//! The character-level corpus: the committed Shakespeare files, tokenisation, windows, and
//! malformed input.

mod common;

use std::path::{Path, PathBuf};

use common::{gzip, write, TempDir};
use lockstep_data::{
    char_corpus_files, load_char_corpus, load_shakespeare_embedded, parse_char_corpus, CharCorpus,
    DataError, Split, SHAKESPEARE_TRAIN_SHA256, SHAKESPEARE_VAL_SHA256,
};
use sha2::{Digest, Sha256};

fn shakespeare_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/shakespeare")
        .join(name)
}

fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

#[test]
fn embedded_shakespeare_is_the_documented_corpus() {
    let c = load_shakespeare_embedded().unwrap();
    assert_eq!(c.name, "shakespeare");
    // Byte counts and hashes as in data/shakespeare/README.md (one token per byte).
    assert_eq!((c.train.len(), c.val.len()), (932_958, 103_531));
    let train = c.decode(&c.train);
    let val = c.decode(&c.val);
    assert_eq!(sha256(&train), SHAKESPEARE_TRAIN_SHA256);
    assert_eq!(sha256(&val), SHAKESPEARE_VAL_SHA256);
    // Play order: train opens with Hamlet and ends inside A Midsummer Night's Dream; validation
    // opens with Hamlet's last ~10% (act V, scene 2) and ends with Puck's epilogue.
    assert!(train.starts_with("HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n"));
    assert!(train.ends_with("For parting my fair Pyramus and me:\n"));
    assert!(val.starts_with("No, not to stay the grinding of the axe,\n"));
    assert!(val.ends_with("And Robin shall restore amends.\n\n[Exit.]\n"));

    // 76 distinct characters, counted with Python over the 8 source files; ascending, ASCII.
    assert_eq!(c.vocab_size(), 76);
    assert!(c.vocab.windows(2).all(|p| p[0] < p[1]));
    assert!(c.vocab.iter().all(|&b| b < 128));
    for ch in [b'\n', b' ', b'a', b'Z', b'\''] {
        assert!(c.vocab.contains(&ch), "{:?} missing", char::from(ch));
    }
    assert!(!c.vocab.contains(&b'\r'));
    assert!(c.train.iter().chain(&c.val).all(|&t| (t as usize) < 76));
}

#[test]
fn embedded_copy_equals_the_committed_files() {
    let train_gz = std::fs::read(shakespeare_file("train.txt.gz")).unwrap();
    let val_gz = std::fs::read(shakespeare_file("val.txt.gz")).unwrap();
    let from_files = parse_char_corpus("shakespeare", &train_gz, &val_gz).unwrap();
    assert_eq!(from_files, load_shakespeare_embedded().unwrap());
}

#[test]
fn pinned_hashes_agree_with_readme_and_make_script() {
    for doc in ["README.md", "make.sh"] {
        let text = std::fs::read_to_string(shakespeare_file(doc)).unwrap();
        for hash in [SHAKESPEARE_TRAIN_SHA256, SHAKESPEARE_VAL_SHA256] {
            assert!(text.contains(hash), "{doc} does not mention {hash}");
        }
    }
}

#[test]
fn encode_decode_round_trip() {
    let c = load_shakespeare_embedded().unwrap();
    let text = "To be, or not to be: that is the question:\n  Whether 'tis nobler";
    let ids = c.encode(text).unwrap();
    assert_eq!(ids.len(), text.len());
    assert_eq!(c.decode(&ids), text);
    // Ids are vocabulary positions: the plays hold no '\t', so '\n' (0x0a) is the smallest byte
    // present (id 0) and ' ' (0x20) the next (id 1).
    assert_eq!(&c.vocab[..2], b"\n ");
    assert_eq!(c.encode("\n").unwrap(), [0]);
    assert_eq!(c.encode(" ").unwrap(), [1]);
    // A stretch of the corpus encodes to its own tokens.
    let piece = &c.val[1000..1500];
    assert_eq!(c.encode(&c.decode(piece)).unwrap(), piece);
}

/// "hello world\n" / "low\n": vocab "\n dehlorw", ids \n=0 ' '=1 d=2 e=3 h=4 l=5 o=6 r=7 w=8.
fn tiny() -> CharCorpus {
    parse_char_corpus("tiny", b"hello world\n", b"low\n").unwrap()
}

#[test]
fn tiny_corpus_vocab_and_ids() {
    let c = tiny();
    assert_eq!(c.vocab, b"\n dehlorw");
    assert_eq!(c.train, [4, 3, 5, 5, 6, 1, 8, 6, 7, 5, 2, 0]);
    assert_eq!(c.val, [5, 6, 8, 0]);
    assert_eq!(c.tokens(Split::Train), &c.train[..]);
    assert_eq!(c.tokens(Split::Val), &c.val[..]);
    // A character only in validation is in the vocabulary too.
    let c2 = parse_char_corpus("t", b"aa", b"ab").unwrap();
    assert_eq!(
        (c2.vocab.as_slice(), c2.val.as_slice()),
        (&b"ab"[..], &[0, 1][..])
    );
}

#[test]
fn window_count_is_len_minus_one_over_context() {
    let c = tiny(); // 12 train tokens, 4 val tokens
    for (context, n) in [
        (1, 11),
        (2, 5),
        (3, 3),
        (4, 2),
        (5, 2),
        (6, 1),
        (11, 1),
        (12, 0),
    ] {
        assert_eq!(c.num_windows(Split::Train, context), n, "context {context}");
    }
    assert_eq!(c.num_windows(Split::Val, 3), 1);
    assert_eq!(c.num_windows(Split::Val, 4), 0);
}

#[test]
fn gather_windows_closed_form() {
    let c = tiny();
    // Stale contents are cleared.
    let (mut x, mut y) = (vec![99; 7], vec![99; 3]);
    // context 3: w0 = "hell" (x "hel", y "ell"), w1 = "lo w", w2 = "worl" (the last window,
    // ending at token 9; tokens 10, 11 are the dropped tail).
    c.gather_windows(Split::Train, 3, &[2, 0, 1, 2], &mut x, &mut y);
    assert_eq!(x, [8, 6, 7, 4, 3, 5, 5, 6, 1, 8, 6, 7]);
    assert_eq!(y, [6, 7, 5, 3, 5, 5, 6, 1, 8, 6, 7, 5]);
    assert_eq!(
        c.decode(&x.iter().map(|&t| t as u16).collect::<Vec<_>>()),
        "worhello wor"
    );
    assert_eq!(
        c.decode(&y.iter().map(|&t| t as u16).collect::<Vec<_>>()),
        "orlello worl"
    );

    c.gather_windows(Split::Val, 3, &[0], &mut x, &mut y);
    assert_eq!(
        (x.as_slice(), y.as_slice()),
        (&[5, 6, 8][..], &[6, 8, 0][..])
    );
    c.gather_windows(Split::Train, 3, &[], &mut x, &mut y);
    assert!(x.is_empty() && y.is_empty());
}

#[test]
fn targets_are_inputs_shifted_by_one_on_every_shakespeare_window() {
    let c = load_shakespeare_embedded().unwrap();
    let context = 256;
    let n = c.num_windows(Split::Val, context);
    assert_eq!(n, (103_531 - 1) / 256);
    let all: Vec<u32> = (0..n as u32).collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    c.gather_windows(Split::Val, context, &all, &mut x, &mut y);
    assert_eq!((x.len(), y.len()), (n * context, n * context));
    // Over all windows in order, x is tokens[..n*context] and y is tokens[1..=n*context].
    let as_i64 = |s: &[u16]| s.iter().map(|&t| i64::from(t)).collect::<Vec<_>>();
    assert_eq!(x, as_i64(&c.val[..n * context]));
    assert_eq!(y, as_i64(&c.val[1..=n * context]));
}

#[test]
#[should_panic(
    expected = "window 3 is out of range: the tiny Train text has 3 windows of context 3"
)]
fn gather_window_past_the_end_panics() {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    tiny().gather_windows(Split::Train, 3, &[0, 3], &mut x, &mut y);
}

#[test]
#[should_panic(expected = "context length must be at least 1")]
fn zero_context_panics() {
    tiny().num_windows(Split::Train, 0);
}

#[test]
#[should_panic(expected = "token id 9 is out of range: the tiny vocabulary has 9 characters")]
fn decode_of_unknown_id_panics() {
    tiny().decode(&[0, 9]);
}

fn err(train: &[u8], val: &[u8]) -> String {
    parse_char_corpus("tiny", train, val)
        .unwrap_err()
        .to_string()
}

#[test]
fn empty_texts_are_rejected() {
    assert_eq!(err(b"", b"x"), "tiny train text: contains no samples");
    assert_eq!(err(b"x", b""), "tiny validation text: contains no samples");
    // Empty after decompression too.
    assert_eq!(
        err(b"x", &gzip(b"")),
        "tiny validation text: contains no samples"
    );
}

#[test]
fn non_ascii_and_control_bytes_are_rejected_with_offset_and_line() {
    assert_eq!(
        err("ab\ncaf\u{e9}\n".as_bytes(), b"x"),
        "tiny train text line 2: byte 0xc3 at offset 6 is not ASCII: the text must be 7-bit \
         ASCII (no UTF-8, no binary data)"
    );
    assert_eq!(
        err(b"ok", b"line one\r\nline two\r\n"),
        "tiny validation text line 1: byte 0x0d at offset 8 is a carriage return: line endings \
         must be LF (convert CRLF to LF)"
    );
    assert_eq!(
        err(b"a\n\nb\x00c", b"x"),
        "tiny train text line 3: byte 0x00 at offset 4 is a control character: only printable \
         ASCII, \\n and \\t are allowed"
    );
    assert_eq!(
        err(b"x", b"\x7f"),
        "tiny validation text line 1: byte 0x7f at offset 0 is a control character: only \
         printable ASCII, \\n and \\t are allowed"
    );
    // Tabs are text; offsets refer to the decompressed bytes of a gzipped text.
    assert!(parse_char_corpus("t", b"a\tb\n", b"c").is_ok());
    assert_eq!(
        err(&gzip(b"fine\nthen \xff"), b"x"),
        "tiny train text line 2: byte 0xff at offset 10 is not ASCII: the text must be 7-bit \
         ASCII (no UTF-8, no binary data)"
    );
}

/// A corpus folder loads like its bytes given to `parse_char_corpus` under the folder's name;
/// `.txt.gz` is preferred to `.txt`, file by file.
#[test]
fn a_corpus_folder_loads_like_its_texts() {
    let dir = TempDir::new("corpus-dir");
    let root = dir.path("");
    let (train, val) = (
        b"to be or not to be\n".repeat(50),
        b"that is the question\n",
    );
    write(&dir.path("train.txt.gz"), &gzip(&train));
    write(&dir.path("train.txt"), b"ignored: the .gz file wins\n");
    write(&dir.path("val.txt"), val);
    assert_eq!(
        char_corpus_files(&root),
        (dir.path("train.txt.gz"), dir.path("val.txt"))
    );
    let name = root.display().to_string();
    let want = parse_char_corpus(&name, &train, val).unwrap();
    assert_eq!(load_char_corpus(&root).unwrap(), want);

    // Content errors name the text as parse_char_corpus does; file errors name the file.
    write(&dir.path("val.txt"), b"caf\xc3\xa9");
    let msg = load_char_corpus(&root).unwrap_err().to_string();
    assert!(
        msg.starts_with(&format!("{name} validation text line 1: byte 0xc3")),
        "{msg}"
    );
    std::fs::remove_file(dir.path("val.txt")).unwrap();
    let msg = load_char_corpus(&root).unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "{}: file not found (data.dir of a text dataset must hold train.txt and val.txt (or \
             .txt.gz))",
            dir.path("val.txt").display()
        )
    );
}

#[test]
fn corrupt_gzip_is_rejected_naming_the_text() {
    let good = gzip(&b"to be or not to be\n".repeat(200));
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0xff;
    let truncated = &good[..good.len() - 10];
    for (train, val, which) in [
        (&flipped[..], &b"x"[..], "tiny train text"),
        (&b"x"[..], truncated, "tiny validation text"),
    ] {
        let e = parse_char_corpus("tiny", train, val).unwrap_err();
        assert!(matches!(e, DataError::Gzip { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("{which}: gzip data is corrupt or truncated: ")),
            "{msg}"
        );
    }
}

#[test]
fn encode_names_the_unknown_character() {
    let c = tiny();
    assert_eq!(c.encode("hello").unwrap(), [4, 3, 5, 5, 6]);
    assert_eq!(c.encode("").unwrap(), Vec::<u16>::new());
    assert_eq!(
        c.encode("hello\nwhy").unwrap_err().to_string(),
        "text to encode line 2: character 'y' (U+0079) at byte offset 8 is not in the tiny \
         vocabulary (9 characters)"
    );
    assert_eq!(
        c.encode("h\u{e9}").unwrap_err().to_string(),
        "text to encode line 1: character '\u{e9}' (U+00E9) at byte offset 1 is not in the tiny \
         vocabulary (9 characters)"
    );
}

// ---- Fuzzing the corpus reader and the windows: valid texts round-trip, a bad byte is named by
// text, line and offset, arbitrary bytes never panic, windows tile the text. ----

mod fuzz {
    use proptest::prelude::*;

    use super::common::fuzz_cases;

    use super::common::gzip;
    use lockstep_data::{parse_char_corpus, DataError, Split};

    /// Non-empty text of the accepted bytes: printable ASCII, \n and \t.
    fn text() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(
            prop_oneof![8 => 0x20u8..=0x7e, 1 => Just(b'\n'), 1 => Just(b'\t')],
            1..200,
        )
    }

    /// A byte the reader refuses.
    fn bad_byte() -> impl Strategy<Value = u8> {
        prop_oneof![0u8..=0x08, 0x0bu8..=0x1f, Just(0x7f), 0x80u8..=0xff]
    }

    fn maybe_gzip(bytes: &[u8], gz: bool) -> Vec<u8> {
        if gz {
            gzip(bytes)
        } else {
            bytes.to_vec()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(512)))]

        /// Ids decode to the texts, the vocabulary is exactly the sorted set of their bytes.
        #[test]
        fn valid_texts_round_trip(train in text(), val in text(), gz in any::<(bool, bool)>()) {
            let c = parse_char_corpus("f", &maybe_gzip(&train, gz.0), &maybe_gzip(&val, gz.1)).unwrap();
            prop_assert_eq!(c.decode(&c.train).into_bytes(), train.clone());
            prop_assert_eq!(c.decode(&c.val).into_bytes(), val.clone());
            let mut vocab: Vec<u8> = train.iter().chain(&val).copied().collect();
            vocab.sort_unstable();
            vocab.dedup();
            prop_assert_eq!(&c.vocab, &vocab);
            let s = String::from_utf8(train.clone()).unwrap();
            prop_assert_eq!(c.encode(&s).unwrap(), c.train.clone());
        }

        /// One refused byte at `at`: the error names the text, its line, the byte and the offset.
        #[test]
        fn a_bad_byte_is_named_by_text_line_and_offset(
            mut train in text(),
            val in text(),
            at in any::<usize>(),
            bad in bad_byte(),
            in_val in any::<bool>(),
            gz in any::<bool>(),
        ) {
            let (mut target, which) = if in_val { (val.clone(), "validation") } else { (train.clone(), "train") };
            let offset = at % (target.len() + 1);
            target.insert(offset, bad);
            let line = 1 + target[..offset].iter().filter(|&&b| b == b'\n').count();
            let target = maybe_gzip(&target, gz);
            let e = if in_val {
                parse_char_corpus("f", &train, &target)
            } else {
                train = target;
                parse_char_corpus("f", &train, &val)
            }
            .unwrap_err();
            prop_assert!(matches!(e, DataError::BadLine { .. }), "{:?}", e);
            let want = format!("f {which} text line {line}: byte 0x{bad:02x} at offset {offset} ");
            prop_assert!(e.to_string().starts_with(&want), "{} (expected {})", e, want);
        }

        /// Arbitrary bytes (sometimes behind the gzip magic): a corpus or an error naming the
        /// text, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(
            mut train in proptest::collection::vec(any::<u8>(), 0..200),
            val in proptest::collection::vec(any::<u8>(), 0..50),
            gz_magic in any::<bool>(),
        ) {
            if gz_magic {
                train.splice(0..0, [0x1f, 0x8b]);
            }
            if let Err(e) = parse_char_corpus("f", &train, &val) {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("f train text") || msg.starts_with("f validation text"), "{}", msg);
            }
        }

        /// Edits of a gzipped text: corrupt streams are gzip errors naming the text.
        #[test]
        fn mutated_gzip_never_panics(
            t in text(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        ) {
            let mut bytes = gzip(&t);
            for (i, v) in edits {
                let n = bytes.len();
                bytes[i % n] = v;
            }
            if let Err(e) = parse_char_corpus("f", &bytes, b"x") {
                prop_assert!(e.to_string().starts_with("f train text"), "{}", e);
            }
        }

        /// Windows of every context: (len - 1) / context of them, inputs are the tokens in
        /// order, targets the same shifted by one, so over a pass every token but the first and
        /// the dropped tail is a target exactly once.
        #[test]
        fn windows_tile_the_text(t in text(), context in 1usize..40) {
            let c = parse_char_corpus("f", &t, b"x").unwrap();
            let n = c.num_windows(Split::Train, context);
            prop_assert_eq!(n, (t.len() - 1) / context);
            let all: Vec<u32> = (0..n as u32).collect();
            let (mut x, mut y) = (Vec::new(), Vec::new());
            c.gather_windows(Split::Train, context, &all, &mut x, &mut y);
            let tokens: Vec<i64> = c.train.iter().map(|&v| i64::from(v)).collect();
            prop_assert_eq!(&x[..], &tokens[..n * context]);
            prop_assert_eq!(&y[..], &tokens[1..n * context + 1]);
        }
    }
}

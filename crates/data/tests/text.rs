//! The character-level corpus: the committed Shakespeare files, tokenisation, windows, and
//! malformed input.

mod common;

use std::path::{Path, PathBuf};

use common::gzip;
use lockstep_data::{
    load_shakespeare_embedded, parse_char_corpus, CharCorpus, DataError, Split,
    SHAKESPEARE_TRAIN_SHA256, SHAKESPEARE_VAL_SHA256,
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

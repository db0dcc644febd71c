//! Bounds on what a loader reads (findings of a hostile test): gzip bombs are refused at the
//! format's cap with memory bounded by the cap, IDX data is bounded by its header, and devices,
//! FIFOs and directories are refused before they are read. The caps are the real ones; the
//! modules' unit tests repeat the bomb tests with lowered caps.

mod common;

use std::path::Path;

use common::{gzip, idx_bytes, write, TempDir};
use lockstep_data::{
    load_char_corpus, load_digits, load_idx, parse_char_corpus, parse_digits, parse_idx, read_idx,
    DataError, DIGITS_MAX_BYTES, IDX_IMAGES_U8, IDX_LABELS_U8, IDX_MAX_PAYLOAD_BYTES,
    TEXT_MAX_BYTES,
};

#[path = "common/alloc_count.rs"]
mod alloc_count;
use alloc_count::peak_of;

/// Scratch a loader may hold besides its output: the gzip decoder's state and buffers, a read
/// chunk, error text.
const SLACK: u64 = 1 << 20;

/// A gzip bomb: `mib` concatenated gzip members, each 1 MiB of `byte` (about 1 KB of gzip), so
/// 2,048 of them, a 2 MB file, inflate to 2 GiB. Concatenated members are one valid gzip stream.
fn bomb(byte: u8, mib: usize) -> Vec<u8> {
    gzip(&vec![byte; 1 << 20]).repeat(mib)
}

fn assert_too_large(err: &DataError, path: &Path, limit: u64, found: Option<u64>) {
    match err {
        DataError::TooLarge {
            path: p,
            limit: l,
            found: f,
            ..
        } => {
            assert_eq!((p.as_path(), *l, *f), (path, limit, found), "{err}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("{}: ", path.display())), "{msg}");
    assert!(
        msg.contains(&format!("more than the limit of {limit} bytes")),
        "{msg}"
    );
}

/// The hostile test's finding: a 2 MB gzip of a digits "CSV" used to be inflated whole (2 GiB
/// resident). Now reading stops at DIGITS_MAX_BYTES.
#[test]
fn digits_gzip_bomb_is_refused_at_the_cap_with_bounded_memory() {
    let dir = TempDir::new("bomb-digits");
    let p = dir.path("digits.csv.gz");
    let gz = bomb(b'1', 2048);
    assert!(gz.len() < 3 << 20, "{} bytes", gz.len());
    write(&p, &gz);
    let (result, peak) = peak_of(|| load_digits(&p));
    let err = result.unwrap_err();
    assert_too_large(&err, &p, DIGITS_MAX_BYTES, None);
    assert!(
        err.to_string().ends_with("(reading stopped there)"),
        "{err}"
    );
    assert!(peak <= DIGITS_MAX_BYTES + SLACK, "peak {peak} bytes");

    // The same bytes in memory.
    let (result, peak) = peak_of(|| parse_digits(&gz, "bomb.csv.gz"));
    assert_too_large(
        &result.unwrap_err(),
        Path::new("bomb.csv.gz"),
        DIGITS_MAX_BYTES,
        None,
    );
    assert!(peak <= DIGITS_MAX_BYTES + SLACK, "peak {peak} bytes");
}

/// The same for a text corpus: a gzip of more than TEXT_MAX_BYTES of spaces (valid text) is
/// refused at the cap, holding at most the cap.
#[test]
fn text_gzip_bomb_is_refused_at_the_cap_with_bounded_memory() {
    let gz = bomb(b' ', (TEXT_MAX_BYTES >> 20) as usize + 1);
    let (result, peak) = peak_of(|| parse_char_corpus("bomb", &gz, b"val"));
    assert_too_large(
        &result.unwrap_err(),
        Path::new("bomb train text"),
        TEXT_MAX_BYTES,
        None,
    );
    assert!(peak <= TEXT_MAX_BYTES + SLACK, "peak {peak} bytes");
}

/// A file whose length alone is over the cap is refused before it is read (sparse files: no
/// disk is used).
#[test]
fn plain_files_over_the_cap_are_refused_from_their_length() {
    let dir = TempDir::new("long-files");
    let sparse = |name: &str, head: &[u8], len: u64| {
        let p = dir.path(name);
        write(&p, head);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len)
            .unwrap();
        p
    };

    let p = sparse("digits.csv", b"0,0", DIGITS_MAX_BYTES + 1);
    let (result, peak) = peak_of(|| load_digits(&p));
    assert_too_large(
        &result.unwrap_err(),
        &p,
        DIGITS_MAX_BYTES,
        Some(DIGITS_MAX_BYTES + 1),
    );
    assert!(peak <= SLACK, "peak {peak} bytes");

    let header = idx_bytes(IDX_IMAGES_U8, &[1, 1, 1], &[0]);
    let long = IDX_MAX_PAYLOAD_BYTES + 2048;
    let p = sparse("train-images-idx3-ubyte", &header, long);
    let (result, peak) = peak_of(|| read_idx(&p, IDX_IMAGES_U8, "u8 images"));
    let err = result.unwrap_err();
    assert!(
        matches!(err, DataError::TooLarge { found: Some(n), .. } if n == long),
        "{err:?}"
    );
    assert!(peak <= SLACK, "peak {peak} bytes");

    let corpus = TempDir::new("long-text");
    write(&corpus.path("val.txt"), b"hello\n");
    let p = corpus.path("train.txt");
    write(&p, b"x");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(TEXT_MAX_BYTES + 1)
        .unwrap();
    let (result, peak) = peak_of(|| load_char_corpus(corpus.path("").as_path()));
    assert_too_large(
        &result.unwrap_err(),
        &p,
        TEXT_MAX_BYTES,
        Some(TEXT_MAX_BYTES + 1),
    );
    assert!(peak <= SLACK, "peak {peak} bytes");
}

fn assert_not_regular(err: DataError, path: &Path, kind: &str) {
    let msg = err.to_string();
    assert!(
        matches!(err, DataError::NotRegularFile { .. }),
        "expected NotRegularFile, got {msg}"
    );
    assert_eq!(
        msg,
        format!(
            "{}: not a regular file ({kind}); a dataset must be a regular file",
            path.display()
        )
    );
}

/// /dev/zero yields zeros for ever: it used to be read until memory ran out. Every loader
/// refuses it (and anything not a regular file) before reading.
#[test]
fn dev_zero_is_refused() {
    let zero = Path::new("/dev/zero");
    if !zero.exists() {
        eprintln!("note: no /dev/zero here");
        return;
    }
    let dev = "a character device";
    assert_not_regular(load_digits(zero).unwrap_err(), zero, dev);
    assert_not_regular(
        read_idx(zero, IDX_IMAGES_U8, "u8 images").unwrap_err(),
        zero,
        dev,
    );
    assert_not_regular(load_idx(zero, zero, "x").unwrap_err(), zero, dev);

    // A corpus folder whose train.txt is a link to /dev/zero: the link is followed, and what it
    // names is refused, under the name that was given.
    let dir = TempDir::new("dev-zero-text");
    let train = dir.path("train.txt");
    std::os::unix::fs::symlink(zero, &train).unwrap();
    write(&dir.path("val.txt"), b"hello\n");
    assert_not_regular(
        load_char_corpus(dir.path("").as_path()).unwrap_err(),
        &train,
        dev,
    );
}

#[test]
fn directories_are_refused() {
    let dir = TempDir::new("dir-as-file");
    let d = dir.path("digits.csv.gz");
    std::fs::create_dir(&d).unwrap();
    assert_not_regular(load_digits(&d).unwrap_err(), &d, "a directory");
}

/// Opening a FIFO for reading blocks until a writer comes: refused before it is opened.
#[test]
fn fifos_are_refused_without_blocking() {
    let dir = TempDir::new("fifo");
    let p = dir.path("train-images-idx3-ubyte");
    match std::process::Command::new("mkfifo").arg(&p).status() {
        Ok(s) if s.success() => {}
        _ => {
            eprintln!("note: mkfifo is not available; FIFO test skipped");
            return;
        }
    }
    // On failure this would block for ever: run it on a thread and give up after a while.
    let (tx, rx) = std::sync::mpsc::channel();
    let q = p.clone();
    std::thread::spawn(move || {
        let _ = tx.send(read_idx(&q, IDX_IMAGES_U8, "u8 images").map(drop));
    });
    let result = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("reading a FIFO blocked");
    assert_not_regular(result.unwrap_err(), &p, "a FIFO");
}

/// An IDX gzip whose payload is larger than its header declares is refused, naming both sizes.
#[test]
fn idx_gzip_with_more_payload_than_declared_is_refused() {
    let dir = TempDir::new("idx-long");
    let (ip, lp) = (
        dir.path("train-images-idx3-ubyte.gz"),
        dir.path("train-labels-idx1-ubyte.gz"),
    );
    write(&ip, &gzip(&idx_bytes(IDX_IMAGES_U8, &[2, 2, 2], &[9; 108])));
    write(&lp, &gzip(&idx_bytes(IDX_LABELS_U8, &[2], &[0, 1])));
    let msg = load_idx(&ip, &lp, "x").unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "{}: trailing bytes: header says 2×2×2 = 8 bytes of u8 images, file has 108",
            ip.display()
        )
    );
}

/// A small header followed by a 2 GiB gzip bomb: the declared byte is kept, the rest is only
/// counted, and counting stops at the cap (memory stays small).
#[test]
fn idx_gzip_bomb_after_the_payload_is_counted_only_to_the_cap() {
    let mut gz = gzip(&idx_bytes(IDX_IMAGES_U8, &[1, 1, 1], &[7]));
    gz.extend_from_slice(&bomb(0, 2048));
    let (result, peak) = peak_of(|| parse_idx(&gz, "bomb-idx", IDX_IMAGES_U8, "u8 images"));
    let msg = result.unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "bomb-idx: trailing bytes: header says 1×1×1 = 1 bytes of u8 images, file has more \
             than {IDX_MAX_PAYLOAD_BYTES} (reading stopped there)"
        )
    );
    assert!(peak <= SLACK, "peak {peak} bytes");
}

/// A header declaring more than IDX_MAX_PAYLOAD_BYTES is refused from the header, before
/// anything is allocated or inflated for it: 300 images of 2048×2048 (1.2 GiB).
#[test]
fn idx_header_declaring_more_than_the_cap_is_refused_from_the_header() {
    let dir = TempDir::new("idx-huge");
    let ip = dir.path("train-images-idx3-ubyte.gz");
    let mut gz = gzip(&idx_bytes(IDX_IMAGES_U8, &[300, 2048, 2048], &[0; 4096]));
    gz.extend_from_slice(&bomb(0, 1300));
    write(&ip, &gz);
    let (result, peak) = peak_of(|| read_idx(&ip, IDX_IMAGES_U8, "u8 images"));
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            DataError::IdxTooLarge {
                declared: 1_258_291_200,
                limit: IDX_MAX_PAYLOAD_BYTES,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{}: header declares 300×2048×2048 = 1258291200 bytes of u8 images, more than the \
             limit of {IDX_MAX_PAYLOAD_BYTES} bytes",
            ip.display()
        )
    );
    assert!(peak <= SLACK, "peak {peak} bytes");
}

/// The shape of an images file whose payload is a 2 GiB gzip bomb: only the header is inflated.
#[test]
fn idx_images_shape_of_a_bomb_reads_only_the_header() {
    let dir = TempDir::new("shape-bomb");
    let p = dir.path("train-images-idx3-ubyte.gz");
    let mut gz = gzip(&idx_bytes(IDX_IMAGES_U8, &[1000, 1024, 1024], &[]));
    gz.extend_from_slice(&bomb(0, 2048));
    write(&p, &gz);
    let (result, peak) = peak_of(|| lockstep_data::idx_images_shape(&p));
    let s = result.unwrap();
    assert_eq!((s.count, s.rows, s.cols), (1000, 1024, 1024));
    assert!(peak <= SLACK, "peak {peak} bytes");
}

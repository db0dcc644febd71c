//! Reading dataset bytes, from a file or memory, plain or gzip, through one bounded reader.
//!
//! The format is decided by the content (gzip's magic bytes 1f 8b), not the file name, so a
//! decompressed `train-images-idx3-ubyte` and the original `.gz` both load.
//!
//! Every loader of the crate reads through [`Bounded`], which yields at most `limit` bytes of
//! content (after decompression): the IDX loader sets the limit from what the header declares
//! (capped by [`crate::idx::IDX_MAX_PAYLOAD_BYTES`]), the formats without a header by a cap of
//! their own ([`crate::text::TEXT_MAX_BYTES`], [`crate::digits::DIGITS_MAX_BYTES`]). Reading
//! stops as soon as the stream passes the limit, so a gzip bomb is never inflated beyond it,
//! and nothing is allocated for a size the input only claims: buffers grow with the data
//! actually read, from a first reservation no larger than the input (the gzip trailer's size
//! field is never used).
//!
//! Files: only regular files are opened (a device such as /dev/zero yields bytes forever, a FIFO
//! blocks on open), and their length is checked against the limit before reading. A file is
//! streamed through the decoder, never held compressed in memory.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;

use crate::error::DataError;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Bytes read from the stream at a time.
const CHUNK: usize = 32 << 10;

/// The longest gzip file whose content can fit in `limit` bytes: deflate's stored blocks (what
/// an encoder falls back to for incompressible data) add 5 bytes per 65,535, and a gzip member
/// adds a header and an 8-byte trailer (generously: 64 KiB, for a file name or comment). A longer
/// file is refused before it is read, so a file of empty members cannot be read for ever.
pub(crate) fn max_gzip_len(limit: u64) -> u64 {
    limit.saturating_add(limit / 8192).saturating_add(64 << 10)
}

/// A stream of a dataset's content (gunzipped when it is gzip) that yields at most `limit`
/// bytes: reading past the limit is [`DataError::TooLarge`] instead of more data.
pub(crate) struct Bounded<'a> {
    inner: Box<dyn Read + 'a>,
    origin: PathBuf,
    /// Names the content in [`DataError::TooLarge`], e.g. "the text after decompression".
    what: &'static str,
    limit: u64,
    /// Content bytes read so far.
    consumed: u64,
    /// Length of the input (file or slice, compressed or not): bounds the first reservation.
    input_len: u64,
}

impl<'a> Bounded<'a> {
    /// Opens the regular file `path` (refusing devices, FIFOs, sockets and directories before
    /// opening them) whose content may be at most `limit` bytes; a plain file longer than that,
    /// or a gzip file too long to hold at most that much ([`max_gzip_len`]), is refused from its
    /// length. `hint` tells the user where the file should come from when it does not exist.
    pub(crate) fn file(
        path: &Path,
        hint: &'static str,
        limit: u64,
        what: &'static str,
    ) -> Result<Bounded<'static>, DataError> {
        let io_err = |cause: std::io::Error| match cause.kind() {
            std::io::ErrorKind::NotFound => DataError::NotFound {
                path: path.to_path_buf(),
                hint,
            },
            _ => DataError::Io {
                path: path.to_path_buf(),
                cause,
            },
        };
        let meta = std::fs::metadata(path).map_err(io_err)?;
        check_regular(path, &meta.file_type())?;
        let mut file = File::open(path).map_err(io_err)?;
        // The path may have been replaced between the two calls: check what was opened.
        let meta = file.metadata().map_err(io_err)?;
        check_regular(path, &meta.file_type())?;
        let len = meta.len();

        let mut magic = [0u8; 2];
        let got = read_full(&mut file, &mut magic).map_err(io_err)?;
        file.seek(SeekFrom::Start(0)).map_err(io_err)?;
        let gzip = got == 2 && magic == GZIP_MAGIC;
        let (max_len, measured) = if gzip {
            (max_gzip_len(limit), "the gzip file")
        } else {
            (limit, what)
        };
        if len > max_len {
            return Err(DataError::TooLarge {
                path: path.to_path_buf(),
                what: measured,
                limit: max_len,
                found: Some(len),
            });
        }
        // The file may grow after the check (or be a /proc file whose length reads 0): the
        // stream is bounded all the same, and `take` stops the raw read too.
        let file = FileRead(file).take(max_len.saturating_add(1));
        let inner: Box<dyn Read> = if gzip {
            Box::new(MultiGzDecoder::new(file))
        } else {
            Box::new(file)
        };
        Ok(Bounded {
            inner,
            origin: path.to_path_buf(),
            what,
            limit,
            consumed: 0,
            input_len: len,
        })
    }

    /// `raw` (plain, or gzip recognised by its magic bytes) as a stream of at most `limit`
    /// content bytes; `origin` names it in errors. Plain bytes longer than the limit are
    /// refused at once.
    pub(crate) fn memory(
        raw: &'a [u8],
        origin: &Path,
        limit: u64,
        what: &'static str,
    ) -> Result<Bounded<'a>, DataError> {
        let inner: Box<dyn Read + 'a> = if raw.starts_with(&GZIP_MAGIC) {
            // Multi-member aware: concatenated gzip files are valid gzip and some tools write
            // them.
            Box::new(MultiGzDecoder::new(raw))
        } else {
            if raw.len() as u64 > limit {
                return Err(DataError::TooLarge {
                    path: origin.to_path_buf(),
                    what,
                    limit,
                    found: Some(raw.len() as u64),
                });
            }
            Box::new(raw)
        };
        Ok(Bounded {
            inner,
            origin: origin.to_path_buf(),
            what,
            limit,
            consumed: 0,
            input_len: raw.len() as u64,
        })
    }

    /// Lowers the limit (never raises it), e.g. once a header has said how much follows.
    pub(crate) fn lower_limit(&mut self, limit: u64) {
        self.limit = self.limit.min(limit);
    }

    /// Content bytes read so far.
    pub(crate) fn consumed(&self) -> u64 {
        self.consumed
    }

    /// The whole content; more than the limit is [`DataError::TooLarge`].
    pub(crate) fn read_all(mut self) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::new();
        self.read_up_to(u64::MAX, &mut out)?;
        Ok(out)
    }

    /// Appends up to `n` more bytes to `out`: fewer only at the end of the stream. Passing the
    /// limit is [`DataError::TooLarge`]. `out` first reserves at most the input's length (and
    /// `n`), then grows with the data, never beyond the limit.
    pub(crate) fn read_up_to(&mut self, n: u64, out: &mut Vec<u8>) -> Result<(), DataError> {
        let mut chunk = [0u8; CHUNK];
        let first = n
            .min(self.input_len)
            .min(self.limit - self.consumed.min(self.limit));
        out.reserve_exact(usize::try_from(first).unwrap_or(usize::MAX));
        let mut wanted = n;
        while wanted > 0 {
            // One byte more than the limit allows is asked for, to tell "ends at the limit"
            // from "goes on".
            let room = self.limit.saturating_sub(self.consumed).saturating_add(1);
            let ask = wanted.min(room).min(CHUNK as u64) as usize;
            let got = self.read_chunk(&mut chunk[..ask])?;
            if got == 0 {
                break;
            }
            if self.consumed + got as u64 > self.limit {
                return Err(self.too_large());
            }
            if out.capacity() - out.len() < got {
                // Doubling, but never past what this call may still add.
                let most =
                    usize::try_from(wanted.min(self.limit - self.consumed)).unwrap_or(usize::MAX);
                let grow = out.capacity().max(got).min(most).max(got);
                out.reserve_exact(grow);
            }
            out.extend_from_slice(&chunk[..got]);
            self.consumed += got as u64;
            wanted -= got as u64;
        }
        Ok(())
    }

    /// Reads and discards the rest of the stream up to the limit, keeping nothing: the number of
    /// bytes, and whether the stream goes on past the limit (then reading stopped there).
    pub(crate) fn skip_rest(&mut self) -> Result<(u64, bool), DataError> {
        let mut chunk = [0u8; CHUNK];
        let mut skipped = 0;
        loop {
            let room = self.limit.saturating_sub(self.consumed).saturating_add(1);
            let ask = room.min(CHUNK as u64) as usize;
            let got = self.read_chunk(&mut chunk[..ask])? as u64;
            if got == 0 {
                return Ok((skipped, false));
            }
            if self.consumed + got > self.limit {
                let within = self.limit - self.consumed;
                self.consumed = self.limit;
                return Ok((skipped + within, true));
            }
            self.consumed += got;
            skipped += got;
        }
    }

    /// The error for a stream that went past its limit.
    pub(crate) fn too_large(&self) -> DataError {
        DataError::TooLarge {
            path: self.origin.clone(),
            what: self.what,
            limit: self.limit,
            found: None,
        }
    }

    fn read_chunk(&mut self, buf: &mut [u8]) -> Result<usize, DataError> {
        read_full(&mut self.inner, buf).map_err(|cause| match FileRead::unwrap(cause) {
            Ok(file_error) => DataError::Io {
                path: self.origin.clone(),
                cause: file_error,
            },
            // Reading from memory fails only in the gzip decoder.
            Err(cause) => DataError::Gzip {
                path: self.origin.clone(),
                cause,
            },
        })
    }
}

/// Reads until `buf` is full or the stream ends; the bytes read.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Refuses anything but a regular file, naming what it is.
fn check_regular(path: &Path, ft: &std::fs::FileType) -> Result<(), DataError> {
    if ft.is_file() {
        return Ok(());
    }
    let kind = if ft.is_dir() {
        "a directory"
    } else {
        special_kind(ft)
    };
    Err(DataError::NotRegularFile {
        path: path.to_path_buf(),
        kind,
    })
}

#[cfg(unix)]
fn special_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(not(unix))]
fn special_kind(_: &std::fs::FileType) -> &'static str {
    "a special file"
}

/// A file whose read errors are marked as the file's, so that an error surfacing through the
/// gzip decoder is reported as a read error ([`DataError::Io`]) and not as corrupt gzip.
struct FileRead(File);

#[derive(Debug)]
struct FileFailed(std::io::Error);

impl std::fmt::Display for FileFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for FileFailed {}

impl Read for FileRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0
            .read(buf)
            .map_err(|e| std::io::Error::new(e.kind(), FileFailed(e)))
    }
}

impl FileRead {
    /// The file's own error if `e` is one, else `e` back.
    fn unwrap(e: std::io::Error) -> Result<std::io::Error, std::io::Error> {
        if e.get_ref().is_some_and(|inner| inner.is::<FileFailed>()) {
            let inner = e.into_inner().expect("checked above");
            Ok(inner.downcast::<FileFailed>().expect("checked above").0)
        } else {
            Err(e)
        }
    }
}

/// The content of the file at `path`, gunzipped if it starts with the gzip magic, at most
/// `limit` bytes; `hint` as for [`Bounded::file`].
pub(crate) fn read_maybe_gz(
    path: &Path,
    hint: &'static str,
    limit: u64,
    what: &'static str,
) -> Result<Vec<u8>, DataError> {
    Bounded::file(path, hint, limit, what)?.read_all()
}

/// `raw` gunzipped if it is gzip, else unchanged, at most `limit` bytes; `origin` only names it
/// in errors.
pub(crate) fn decode(
    raw: &[u8],
    origin: &Path,
    limit: u64,
    what: &'static str,
) -> Result<Vec<u8>, DataError> {
    Bounded::memory(raw, origin, limit, what)?.read_all()
}

#[cfg(test)]
pub(crate) mod tests {
    //! The bounded reader with small limits; the loaders' tests with their real caps are in
    //! tests/bounds.rs.

    use std::io::Write;
    use std::path::{Path, PathBuf};

    use super::*;

    pub(crate) fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    /// A fresh directory for one test, removed on drop.
    pub(crate) struct Scratch(pub PathBuf);

    impl Scratch {
        pub(crate) fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir()
                .join(format!("lockstep-data-unit-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn too_large(e: DataError) -> (PathBuf, &'static str, u64, Option<u64>) {
        match e {
            DataError::TooLarge {
                path,
                what,
                limit,
                found,
            } => (path, what, limit, found),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    /// Deterministic bytes that deflate cannot shrink.
    fn noise(n: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_gzip_bomb_stops_at_the_limit() {
        // 64 MiB of 'a' in 64 KB of gzip, read with a limit of 1 MiB.
        let bomb = gzip(&vec![b'a'; 64 << 20]);
        let err = decode(&bomb, Path::new("bomb.gz"), 1 << 20, "the text").unwrap_err();
        assert_eq!(
            err.to_string(),
            "bomb.gz: the text is more than the limit of 1048576 bytes (reading stopped there)"
        );
        assert_eq!(
            too_large(err),
            ("bomb.gz".into(), "the text", 1 << 20, None)
        );
    }

    #[test]
    fn content_of_exactly_the_limit_is_read_without_reserving_more() {
        let data = noise(100_000);
        for input in [data.clone(), gzip(&data)] {
            let out = decode(&input, Path::new("m"), 100_000, "x").unwrap();
            assert_eq!(out, data);
            assert!(out.capacity() <= 100_000, "capacity {}", out.capacity());
        }
        // One byte less: plain bytes are refused from their length, gzip where reading passes
        // the limit.
        let err = decode(&data, Path::new("m"), 99_999, "x").unwrap_err();
        assert_eq!(too_large(err).3, Some(100_000));
        let err = decode(&gzip(&data), Path::new("m"), 99_999, "x").unwrap_err();
        assert_eq!(too_large(err).3, None);
    }

    #[test]
    fn read_up_to_and_skip_rest_stop_at_the_limit() {
        let data = noise(1000);
        let gz = gzip(&data);
        let mut r = Bounded::memory(&gz, Path::new("m"), 600, "x").unwrap();
        let mut out = Vec::new();
        r.read_up_to(100, &mut out).unwrap();
        assert_eq!(out, data[..100]);
        assert_eq!(r.skip_rest().unwrap(), (500, true));

        let mut r = Bounded::memory(&gz, Path::new("m"), 2000, "x").unwrap();
        r.read_up_to(100, &mut out).unwrap();
        assert_eq!(r.skip_rest().unwrap(), (900, false));
        // Asking for more than the stream holds stops at its end.
        let mut r = Bounded::memory(&data, Path::new("m"), 2000, "x").unwrap();
        let mut all = Vec::new();
        r.read_up_to(5000, &mut all).unwrap();
        assert_eq!(all, data);
        assert_eq!(r.consumed(), 1000);
    }

    #[test]
    fn files_are_streamed_and_bounded() {
        let dir = Scratch::new("read-files");
        let data = noise(100_000);
        let (plain, gz) = (dir.0.join("plain"), dir.0.join("data.gz"));
        std::fs::write(&plain, &data).unwrap();
        std::fs::write(&gz, gzip(&data)).unwrap();
        for p in [&plain, &gz] {
            assert_eq!(read_maybe_gz(p, "h", 100_000, "x").unwrap(), data);
        }
        // A plain file over the limit is refused from its length.
        let err = read_maybe_gz(&plain, "h", 1000, "the text").unwrap_err();
        assert_eq!(
            too_large(err),
            (plain.clone(), "the text", 1000, Some(100_000))
        );
        // A gzip file longer than any gzip of at most `limit` bytes can be: from its length too.
        let big = noise(200_000);
        std::fs::write(&gz, gzip(&big)).unwrap();
        let len = std::fs::metadata(&gz).unwrap().len();
        let err = read_maybe_gz(&gz, "h", 1000, "the text").unwrap_err();
        assert_eq!(
            too_large(err),
            (gz.clone(), "the gzip file", max_gzip_len(1000), Some(len))
        );
        // Within that length, the content is bounded as it is read.
        let err = read_maybe_gz(&gz, "h", 150_000, "the text").unwrap_err();
        assert_eq!(too_large(err), (gz.clone(), "the text", 150_000, None));
        // A missing file is NotFound with the hint.
        let err = read_maybe_gz(&dir.0.join("none"), "get it", 10, "x").unwrap_err();
        assert!(
            matches!(err, DataError::NotFound { hint: "get it", .. }),
            "{err:?}"
        );
    }

    #[test]
    fn a_gzip_file_fits_its_length_bound() {
        // Incompressible data: the gzip is a little longer than the data, within max_gzip_len.
        for n in [0, 1, 65_535, 65_536, 1 << 20] {
            let len = gzip(&noise(n)).len() as u64;
            assert!(len <= max_gzip_len(n as u64), "{n} bytes gzip to {len}");
        }
    }
}

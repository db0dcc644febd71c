//! Reading a run's text files (configs, summaries, metrics) with a bound: only a regular file is
//! read, never more than a limit — so a config path that is `/dev/zero`, a FIFO or a huge file is
//! an error naming it, not an endless read or an allocation of everything.

use std::io::Read;
use std::path::Path;

/// Largest config file (`--config`, a run's `config.toml`, a cluster description).
pub const CONFIG_MAX_BYTES: u64 = 16 << 20;
/// Largest `summary.json`.
pub const SUMMARY_MAX_BYTES: u64 = 256 << 20;
/// Largest `metrics.jsonl` (ten million steps of records on a few ranks).
pub const METRICS_MAX_BYTES: u64 = 16 << 30;

/// The text of the regular file at `path`, of at most `limit` bytes. A special file (device,
/// FIFO, socket, directory) or a longer one is an `InvalidInput` error saying so.
pub fn read_text(path: &Path, limit: u64) -> std::io::Result<String> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    if meta.len() > limit {
        return Err(invalid(format!(
            "{} bytes, more than the {limit} bytes such a file may have",
            meta.len()
        )));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(invalid(format!(
            "longer than the {limit} bytes such a file may have"
        )));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_and_oversized_files_are_refused() {
        for p in ["/dev/zero", "/dev/null", "/"] {
            let e = read_text(Path::new(p), 1 << 20).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{p}: {e}");
        }
        let dir = std::env::temp_dir().join(format!("lockstep-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "x".repeat(100)).unwrap();
        assert!(read_text(&f, 99).is_err());
        assert_eq!(read_text(&f, 100).unwrap().len(), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

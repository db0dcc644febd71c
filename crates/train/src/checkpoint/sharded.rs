//! Sharded checkpoints (`checkpoint.sharded = true`): every rank writes its own shard, and no
//! rank ever holds the whole model state for a checkpoint.
//!
//! A set is a directory `step-<N>.shards/` beside the whole-model files:
//! ```text
//! manifest.json        identity, step, optimizer steps, parameter count, vectors per shard, and
//!                      per shard: file, bytes, SHA-256, its ranges of the canonical flat vector
//! shard-<rank>.bin     magic "LKSTSHRD" | version u32 | header length u32 | header (JSON:
//!                      identity, step, rank, ranges, vectors) | payload | SHA-256 of all before
//! ```
//! The payload is each vector (the parameters, then each optimizer state vector) at the shard's
//! ranges, in order, as little-endian `f32`. The ranges are coordinates of the **canonical flat
//! vector** (the whole model's, the one a whole-model checkpoint holds), so a set says nothing
//! about the layout that wrote it: a rank of any layout (dp × tp × pp, any ZeRO level, any world
//! size, one worker) reads the values of its own local vector from whichever shards hold them
//! ([`read_local`]), with the same bits as from a whole-model file. A rank writes the ZeRO chunks
//! of its local vector (its chunk of each segment over the data-parallel group, at every level),
//! so every value is written once per tensor-parallel rank holding it: the tensors a tp stage
//! replicates appear in several shards, with identical values, and any of them may be read.
//!
//! Publication is atomic for the whole set: shards and manifest are written and synced in a hidden
//! staging directory (`.step-<N>.shards.<config>.tmp`), which rank 0 renames to its name after
//! the step's record reaches metrics.jsonl. A set with a missing, short or damaged shard is
//! skipped as a whole by [`verify`], with a message naming the shard.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::{
    io_err, remove, write_container, CheckpointError, Identity, SharedVectors,
};

const MAGIC: &[u8; 8] = b"LKSTSHRD";
pub(crate) const VERSION: u32 = 1;
pub(crate) const FORMAT: &str = "lockstep sharded checkpoint";
const MANIFEST: &str = "manifest.json";
/// Manifests list a few ranges per shard; anything larger is not ours.
const MAX_MANIFEST: u64 = 64 << 20;
/// Shard headers likewise.
const MAX_HEADER: usize = 64 << 20;

/// A set's directory name.
pub fn set_name(step: u64) -> String {
    format!("step-{step:09}.shards")
}

/// The step of a set's directory name.
pub fn set_step(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?
        .strip_suffix(".shards")?
        .parse()
        .ok()
}

/// The hidden directory in `dir` a set is staged in before publication.
pub(crate) fn staging_dir(dir: &Path, step: u64, identity: &Identity) -> PathBuf {
    dir.join(staging_name(step, identity))
}

/// [`staging_dir`]'s name (it says whose it is).
fn staging_name(step: u64, identity: &Identity) -> String {
    let id: String = identity.config.chars().take(16).collect();
    format!(".step-{step:09}.shards.{id}.tmp")
}

/// The name of `rank`'s shard in a set.
pub(crate) fn shard_name(rank: usize) -> String {
    format!("shard-{rank:05}.bin")
}

/// One shard as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub rank: usize,
    pub bytes: u64,
    pub sha256: String,
    /// Ranges of the canonical flat vector, in payload order, as `[start, end)`.
    pub ranges: Vec<[u64; 2]>,
}

/// What a set holds, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub identity: Identity,
    /// Optimizer steps completed (the step the set was taken after).
    pub step: u64,
    pub optimizer_steps: u64,
    /// Values of the canonical flat vector (the model's parameters).
    pub num_params: u64,
    /// Vectors per shard: the parameters, then each optimizer state vector.
    pub vectors: u32,
    pub shards: Vec<ShardInfo>,
}

#[derive(Serialize, Deserialize)]
struct ShardHeader {
    identity: Identity,
    step: u64,
    rank: usize,
    ranges: Vec<[u64; 2]>,
    vectors: u32,
}

/// One rank's part of a set: canonical `ranges`, and per vector its values at them as pieces
/// (borrowed from wherever the rank keeps them: nothing is copied to write a shard).
pub struct ShardView<'a> {
    pub ranges: Vec<Range<usize>>,
    /// `vectors[v]`: pieces whose lengths add up to the ranges' total.
    pub vectors: Vec<Vec<&'a [f32]>>,
}

/// Where a rank's shard comes from: which values of the vectors it keeps, at which canonical
/// ranges (built by the training loop, which knows its ZeRO chunks).
#[derive(Debug, Clone)]
pub(crate) struct ShardLayout {
    /// Canonical ranges, in the shard's order.
    pub(crate) ranges: Vec<Range<usize>>,
    /// The same values' ranges in the whole local vector,
    pub(crate) whole: Vec<Range<usize>>,
    /// and in the rank's chunks only (what ZeRO keeps of a sharded vector).
    pub(crate) chunks: Vec<Range<usize>>,
    /// Whether the parameters are the whole local vector (below ZeRO 3) or the rank's chunks,
    pub(crate) params_whole: bool,
    /// and the optimizer's state (ZeRO 0).
    pub(crate) state_whole: bool,
}

impl ShardLayout {
    /// The shard of `params` (the whole local vector below ZeRO 3, the rank's chunks at 3) and
    /// `state` (the optimizer's vectors, whole at level 0 and chunks from 1).
    pub(crate) fn view<'a>(&self, params: &'a [f32], state: &[&'a [f32]]) -> ShardView<'a> {
        let pick = |v: &'a [f32], whole: bool| -> Vec<&'a [f32]> {
            let ranges = if whole { &self.whole } else { &self.chunks };
            ranges.iter().map(|r| &v[r.clone()]).collect()
        };
        let mut vectors = vec![pick(params, self.params_whole)];
        vectors.extend(state.iter().map(|s| pick(s, self.state_whole)));
        ShardView {
            ranges: self.ranges.clone(),
            vectors,
        }
    }
}

/// A rank's shard held without a copy: its layout and the very vectors the training loop keeps.
pub(crate) struct SharedShard {
    pub(crate) layout: ShardLayout,
    pub(crate) vectors: SharedVectors,
}

impl SharedShard {
    pub(crate) fn view(&self) -> ShardView<'_> {
        self.layout
            .view(&self.vectors.params, &self.vectors.state())
    }
}

/// The canonical ranges of a local vector's values `local` (a range of the local vector), where
/// `map` lists the local vector's ranges of its stage's canonical vector (in local order) and
/// the stage starts at `offset` of the whole one: pairs (canonical, local), in local order.
pub fn canonical_pieces(
    map: &[Range<usize>],
    offset: usize,
    local: Range<usize>,
) -> Vec<(Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let mut at = 0;
    for m in map {
        let here = at..at + m.len();
        at = here.end;
        let (s, e) = (local.start.max(here.start), local.end.min(here.end));
        if s < e {
            let c = offset + m.start + (s - here.start);
            out.push((c..c + (e - s), s..e));
        }
    }
    out
}

/// Rank 0, before any rank writes: an empty staging directory for the set of `step` (a
/// leftover of a killed attempt is removed first).
pub fn prepare(dir: &Path, step: u64, identity: &Identity) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let staging = staging_dir(dir, step, identity);
    remove(&staging).map_err(|e| io_err(&staging, e))?;
    std::fs::create_dir(&staging).map_err(|e| io_err(&staging, e))
}

/// Rank 0, after a rank failed to write its shard (every rank has stopped writing): the set's
/// staging directory and whatever it holds, removed (best effort; a resume removes it too).
pub fn abandon(dir: &Path, step: u64, identity: &Identity) {
    let _ = remove(&staging_dir(dir, step, identity));
}

/// Write `rank`'s shard into the staging directory [`prepare`] made, synced; `between` is called
/// after each vector (the `kill-while-checkpointing` fault fires there). Returns its entry.
pub fn write_shard(
    dir: &Path,
    step: u64,
    identity: &Identity,
    rank: usize,
    view: &ShardView,
    between: &mut dyn FnMut(),
) -> Result<ShardInfo, CheckpointError> {
    let path = staging_dir(dir, step, identity).join(shard_name(rank));
    let ranges: Vec<[u64; 2]> = view
        .ranges
        .iter()
        .map(|r| [r.start as u64, r.end as u64])
        .collect();
    let header = ShardHeader {
        identity: identity.clone(),
        step,
        rank,
        ranges: ranges.clone(),
        vectors: view.vectors.len() as u32,
    };
    let total: usize = view.ranges.iter().map(|r| r.len()).sum();
    for v in &view.vectors {
        assert_eq!(
            v.iter().map(|p| p.len()).sum::<usize>(),
            total,
            "shard vector length"
        );
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| io_err(&path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let io = |e| io_err(&path, e);
    let header = serde_json::to_vec(&header).expect("header serialises");
    let (bytes, digest) =
        write_container(&mut w, MAGIC, VERSION, &header, &view.vectors, &mut |_| {
            between()
        })
        .map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(ShardInfo {
        file: shard_name(rank),
        rank,
        bytes,
        sha256: hex(&digest),
        ranges,
    })
}

/// Rank 0, once every shard is written: the manifest into the staging directory, synced; the set
/// is then published by [`StagedSet::publish`].
pub fn stage_manifest(dir: &Path, manifest: &Manifest) -> Result<StagedSet, CheckpointError> {
    let staging = staging_dir(dir, manifest.step, &manifest.identity);
    let path = staging.join(MANIFEST);
    let bytes = serde_json::to_vec(manifest).expect("manifest serialises");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| io_err(&path, e))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .and_then(|()| File::open(&staging)?.sync_all())
        .map_err(|e| io_err(&path, e))?;
    Ok(StagedSet {
        dir: dir.to_path_buf(),
        staging,
        step: manifest.step,
        identity: manifest.identity.clone(),
    })
}

/// A complete set under its staging name, waiting for metrics.jsonl.
pub struct StagedSet {
    dir: PathBuf,
    staging: PathBuf,
    step: u64,
    identity: Identity,
}

impl StagedSet {
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Give the set its name (one rename of its directory), then prune all but the newest `keep`
    /// of the run's checkpoints (files and sets). A set of this run already under the name (one
    /// skipped as damaged, now taken again) is replaced. Returns its path.
    pub fn publish(mut self, keep: usize) -> Result<PathBuf, CheckpointError> {
        let path = self.dir.join(set_name(self.step));
        if std::fs::symlink_metadata(&path).is_ok() {
            if crate::checkpoint::read_identity(&path).as_ref() != Some(&self.identity) {
                return Err(CheckpointError::NotRegular {
                    path: path.display().to_string(),
                    what: format!(
                        "{} exists and is not this run's checkpoint: not replaced",
                        path.display()
                    ),
                });
            }
            remove(&path).map_err(|e| io_err(&path, e))?;
        }
        std::fs::rename(&self.staging, &path)
            .and_then(|()| File::open(&self.dir)?.sync_all())
            .map_err(|e| io_err(&path, e))?;
        self.staging = PathBuf::new();
        crate::checkpoint::prune(&self.dir, &self.identity, keep)?;
        Ok(path)
    }
}

/// Dropped unpublished (an error on the way), the staging directory goes.
impl Drop for StagedSet {
    fn drop(&mut self) {
        if !self.staging.as_os_str().is_empty() {
            let _ = remove(&self.staging);
        }
    }
}

/// Is `name` the staging directory of a set of the run of `identity` (a killed write's, when
/// found at a resume)?
pub(crate) fn is_staging_of(name: &str, identity: &Identity) -> bool {
    name.strip_prefix(".step-")
        .and_then(|rest| rest.split_once(".shards."))
        .and_then(|(step, _)| step.parse::<u64>().ok())
        .is_some_and(|step| name == staging_name(step, identity))
}

/// The manifest of the set at `path` (bounded, regular file, parsed; not verified).
pub fn read_manifest(path: &Path) -> Result<Manifest, CheckpointError> {
    let file = path.join(MANIFEST);
    let corrupt = |what: String| CheckpointError::Corrupt {
        path: file.display().to_string(),
        what,
    };
    let meta = std::fs::symlink_metadata(&file).map_err(|e| io_err(&file, e))?;
    if !meta.is_file() {
        return Err(corrupt("not a regular file".into()));
    }
    if meta.len() > MAX_MANIFEST {
        return Err(corrupt(format!(
            "{} bytes is larger than any manifest",
            meta.len()
        )));
    }
    let bytes = std::fs::read(&file).map_err(|e| io_err(&file, e))?;
    let m: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("unreadable: {e}")))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(corrupt(format!(
            "format {:?} version {}, this build reads {FORMAT:?} version {VERSION}",
            m.format, m.version
        )));
    }
    Ok(m)
}

/// Read and verify the set at `path` against the loading run's identity: the manifest, then
/// every shard (present, a regular file of the listed size, its SHA-256, its header agreeing
/// with the manifest), and that the shards' ranges cover the whole vector. Returns the manifest.
pub fn verify(path: &Path, expect: &Identity) -> Result<Manifest, CheckpointError> {
    let m = read_manifest(path)?;
    crate::checkpoint::check_identity(path, &m.identity, expect)?;
    let corrupt = |what: String| CheckpointError::Corrupt {
        path: path.display().to_string(),
        what,
    };
    for s in &m.shards {
        let file = shard_path(path, s)?;
        verify_shard(&file, s, &m)?;
    }
    check_coverage(&m).map_err(corrupt)?;
    Ok(m)
}

/// A shard's path, its name checked (a plain `shard-N.bin`, never a path elsewhere).
fn shard_path(set: &Path, s: &ShardInfo) -> Result<PathBuf, CheckpointError> {
    if s.file != shard_name(s.rank) {
        return Err(CheckpointError::Corrupt {
            path: set.join(MANIFEST).display().to_string(),
            what: format!(
                "shard {:?} of rank {} is not a shard's name",
                s.file, s.rank
            ),
        });
    }
    Ok(set.join(&s.file))
}

fn verify_shard(file: &Path, s: &ShardInfo, m: &Manifest) -> Result<(), CheckpointError> {
    let corrupt = |what: String| CheckpointError::Corrupt {
        path: file.display().to_string(),
        what,
    };
    let meta = std::fs::symlink_metadata(file).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => corrupt("shard missing".into()),
        _ => io_err(file, e),
    })?;
    if !meta.is_file() {
        return Err(corrupt("not a regular file".into()));
    }
    if meta.len() != s.bytes {
        return Err(corrupt(format!(
            "{} bytes, the manifest lists {}",
            meta.len(),
            s.bytes
        )));
    }
    let mut f = File::open(file).map_err(|e| io_err(file, e))?;
    let body = s
        .bytes
        .checked_sub(32)
        .ok_or_else(|| corrupt("shorter than any shard".into()))?;
    let mut hasher = Sha256::new();
    let mut left = body;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        f.read_exact(&mut buf[..n]).map_err(|e| io_err(file, e))?;
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    let mut digest = [0u8; 32];
    f.read_exact(&mut digest).map_err(|e| io_err(file, e))?;
    if hasher.finalize().as_slice() != digest || hex(&digest) != s.sha256 {
        return Err(corrupt(
            "SHA-256 checksum does not match the contents and the manifest".into(),
        ));
    }
    let (header, payload_at) = read_header(file, &mut f)?;
    let floats: u64 = s.ranges.iter().map(|r| r[1].saturating_sub(r[0])).sum();
    let want = payload_at + 4 * floats * u64::from(m.vectors) + 32;
    if header.identity != m.identity
        || header.step != m.step
        || header.rank != s.rank
        || header.ranges != s.ranges
        || header.vectors != m.vectors
        || want != s.bytes
    {
        return Err(corrupt("header disagrees with the manifest".into()));
    }
    Ok(())
}

/// A shard's header and where its payload starts.
fn read_header(path: &Path, f: &mut File) -> Result<(ShardHeader, u64), CheckpointError> {
    let corrupt = |what: String| CheckpointError::Corrupt {
        path: path.display().to_string(),
        what,
    };
    f.seek(SeekFrom::Start(0)).map_err(|e| io_err(path, e))?;
    let mut start = [0u8; 16];
    f.read_exact(&mut start).map_err(|e| io_err(path, e))?;
    if &start[..8] != MAGIC {
        return Err(CheckpointError::BadMagic {
            path: path.display().to_string(),
        });
    }
    let version = u32::from_le_bytes(start[8..12].try_into().unwrap());
    if version != VERSION {
        return Err(CheckpointError::Version {
            path: path.display().to_string(),
            found: version,
        });
    }
    let hlen = u32::from_le_bytes(start[12..16].try_into().unwrap()) as usize;
    if hlen > MAX_HEADER {
        return Err(corrupt(format!("header of {hlen} bytes")));
    }
    let mut header = vec![0u8; hlen];
    f.read_exact(&mut header).map_err(|e| io_err(path, e))?;
    let h =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("unreadable header: {e}")))?;
    Ok((h, 16 + hlen as u64))
}

/// Every value of `0..num_params` in some shard, and no range outside it.
fn check_coverage(m: &Manifest) -> Result<(), String> {
    let mut all: Vec<[u64; 2]> = m.shards.iter().flat_map(|s| s.ranges.clone()).collect();
    all.sort_unstable();
    let mut covered = 0u64;
    for [s, e] in all {
        if s > e || e > m.num_params {
            return Err(format!(
                "a shard lists values {s}..{e} of {} parameters",
                m.num_params
            ));
        }
        if s > covered {
            return Err(format!("no shard holds values {covered}..{s}"));
        }
        covered = covered.max(e);
    }
    if covered < m.num_params {
        return Err(format!("no shard holds values {covered}..{}", m.num_params));
    }
    Ok(())
}

/// Fill `out` (one slice per vector, each as long as `wanted` in all) with the set's values at
/// the canonical ranges `wanted`, in order: a rank's local vector in any layout. Reads only the
/// pieces it needs from the shards (verified by [`verify`] on rank 0 first).
pub fn read_local(
    path: &Path,
    m: &Manifest,
    wanted: &[Range<usize>],
    out: &mut [&mut [f32]],
) -> Result<(), CheckpointError> {
    let total: usize = wanted.iter().map(|r| r.len()).sum();
    if out.len() != m.vectors as usize || out.iter().any(|v| v.len() != total) {
        return Err(CheckpointError::Mismatch {
            path: path.display().to_string(),
            what: format!(
                "{} vectors per shard; this run reads {} of {total} values",
                m.vectors,
                out.len()
            ),
        });
    }
    // Every shard range: (start, end, shard, its first value's index in the shard's vectors).
    let mut index: Vec<(u64, u64, usize, u64)> = Vec::new();
    for (i, s) in m.shards.iter().enumerate() {
        let mut at = 0;
        for &[a, b] in &s.ranges {
            index.push((a, b, i, at));
            at += b - a;
        }
    }
    index.sort_unstable();
    let mut files: HashMap<usize, (File, u64, u64)> = HashMap::new();
    let mut dst = 0usize;
    for w in wanted {
        let mut c = w.start as u64;
        while c < w.end as u64 {
            // A range holding value c: among those starting at or before it, one reaching past.
            let upto = index.partition_point(|e| e.0 <= c);
            let Some(&(a, b, shard, first)) = index[..upto].iter().rev().find(|e| e.1 > c) else {
                return Err(CheckpointError::Corrupt {
                    path: path.display().to_string(),
                    what: format!("no shard holds value {c}"),
                });
            };
            let n = (b.min(w.end as u64) - c) as usize;
            let s = &m.shards[shard];
            let (f, payload_at, per_vector) = match files.entry(shard) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let file = shard_path(path, s)?;
                    let mut f = File::open(&file).map_err(|e| io_err(&file, e))?;
                    let (_, at) = read_header(&file, &mut f)?;
                    let len: u64 = s.ranges.iter().map(|r| r[1] - r[0]).sum();
                    v.insert((f, at, len))
                }
            };
            let at = dst + (c - w.start as u64) as usize;
            for (v, vector) in out.iter_mut().enumerate() {
                let pos = *payload_at + 4 * (v as u64 * *per_vector + first + (c - a));
                let slot = &mut vector[at..at + n];
                f.seek(SeekFrom::Start(pos))
                    .and_then(|_| f.read_exact(bytemuck::cast_slice_mut(slot)))
                    .map_err(|e| io_err(&path.join(&s.file), e))?;
            }
            c += n as u64;
        }
        dst += w.len();
    }
    Ok(())
}

/// The whole model from the set at `path` (for `lockstep export`): verified, then read.
pub fn load_whole(
    path: &Path,
    expect: &Identity,
) -> Result<crate::checkpoint::Checkpoint, CheckpointError> {
    let m = verify(path, expect)?;
    let n = usize::try_from(m.num_params).map_err(|_| CheckpointError::Corrupt {
        path: path.display().to_string(),
        what: format!("{} parameters", m.num_params),
    })?;
    let mut vectors = vec![vec![0f32; n]; m.vectors as usize];
    let mut out: Vec<&mut [f32]> = vectors.iter_mut().map(|v| &mut v[..]).collect();
    let everything = std::iter::once(0..n).collect::<Vec<_>>();
    read_local(path, &m, &everything, &mut out)?;
    let params = vectors.remove(0);
    Ok(crate::checkpoint::Checkpoint {
        step: m.step,
        params,
        optimizer_state: vectors,
        optimizer_steps: m.optimizer_steps,
        identity: m.identity,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            config: "c0ffee".repeat(8),
            model: "m".into(),
        }
    }

    /// 10 values, 3 vectors (parameters and two state vectors: value, 100 + value, 200 + value),
    /// written as 3 shards in the layout of a tp stage: ranks 0 and 1 both hold the "replicated"
    /// values 0..2, rank 0 also 2..4 and 8..10, rank 1 4..6, rank 2 6..8 (ranges out of order).
    fn written_set(dir: &Path, step: u64) -> PathBuf {
        let id = identity();
        let whole: Vec<Vec<f32>> = (0..3)
            .map(|v| (0..10).map(|i| (100 * v + i) as f32).collect())
            .collect();
        prepare(dir, step, &id).unwrap();
        let mut shards = Vec::new();
        for (rank, ranges) in [
            vec![8..10, 0..2, 2..4],
            vec![0..2, 4..6],
            std::iter::once(6..8).collect(),
        ]
        .into_iter()
        .enumerate()
        {
            let vectors = whole
                .iter()
                .map(|w| ranges.iter().map(|r| &w[r.clone()]).collect())
                .collect();
            let view = ShardView { ranges, vectors };
            shards.push(write_shard(dir, step, &id, rank, &view, &mut || {}).unwrap());
        }
        let m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            identity: id,
            step,
            optimizer_steps: step,
            num_params: 10,
            vectors: 3,
            shards,
        };
        stage_manifest(dir, &m).unwrap().publish(5).unwrap()
    }

    #[test]
    fn any_layout_reads_its_values_from_the_shards_that_hold_them() {
        let tmp = tempfile::tempdir().unwrap();
        let set = written_set(tmp.path(), 4);
        assert_eq!(set, tmp.path().join("step-000000004.shards"));
        // Published under its name only: no staging directory is left.
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["step-000000004.shards".to_string()]);
        let m = verify(&set, &identity()).unwrap();
        // A local vector of another layout: pieces across shard boundaries, out of order.
        let wanted = vec![7..9, 1..5, 9..10];
        let mut vectors = vec![vec![0f32; 7]; 3];
        let mut out: Vec<&mut [f32]> = vectors.iter_mut().map(|v| &mut v[..]).collect();
        read_local(&set, &m, &wanted, &mut out).unwrap();
        for (v, got) in vectors.iter().enumerate() {
            let want: Vec<f32> = [7, 8, 1, 2, 3, 4, 9]
                .iter()
                .map(|i| (100 * v + i) as f32)
                .collect();
            assert_eq!(got, &want);
        }
        // The whole model, as export and a whole-model load see it.
        let c = crate::checkpoint::load(&set, &identity()).unwrap();
        assert_eq!(c.params, (0..10).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(c.optimizer_state[1][3], 203.0);
        assert_eq!((c.step, c.optimizer_steps), (4, 4));
        // Listed with the files, prunable, removable.
        let listed = crate::checkpoint::list(tmp.path()).unwrap();
        assert_eq!(listed, vec![(4, set.clone())]);
        assert_eq!(crate::checkpoint::read_identity(&set), Some(identity()));
    }

    #[test]
    fn a_set_with_a_missing_short_or_damaged_shard_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let set = written_set(tmp.path(), 2);
        let shard = set.join("shard-00001.bin");
        let bytes = std::fs::read(&shard).unwrap();
        let refused = |what: &str| {
            let e = verify(&set, &identity()).unwrap_err().to_string();
            assert!(e.contains("shard-00001.bin") && e.contains(what), "{e}");
        };
        let mut damaged = bytes.clone();
        damaged[40] ^= 1;
        std::fs::write(&shard, &damaged).unwrap();
        refused("SHA-256");
        std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
        refused("bytes, the manifest lists");
        std::fs::remove_file(&shard).unwrap();
        refused("shard missing");
        std::fs::write(&shard, &bytes).unwrap();
        verify(&set, &identity()).unwrap();
        // Another run's set is a mismatch (an error, never skipped).
        let other = Identity {
            config: "other".into(),
            model: "m".into(),
        };
        assert!(matches!(
            verify(&set, &other),
            Err(CheckpointError::Mismatch { .. })
        ));
    }

    #[test]
    fn forged_manifests_are_refused_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let set = written_set(tmp.path(), 2);
        let path = set.join(MANIFEST);
        let good = read_manifest(&set).unwrap();
        let forge = |edit: &dyn Fn(&mut Manifest)| {
            let mut m = good.clone();
            edit(&mut m);
            std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
            verify(&set, &identity()).unwrap_err().to_string()
        };
        // A shard's name is a shard's name, never a path elsewhere.
        let e = forge(&|m| m.shards[0].file = "../../etc/passwd".into());
        assert!(e.contains("is not a shard's name"), "{e}");
        // A gap in the coverage, or values past the end.
        let e = forge(&|m| {
            m.shards.remove(2);
        });
        assert!(e.contains("no shard holds values 6..8"), "{e}");
        let e = forge(&|m| m.num_params = 9);
        assert!(
            e.contains("header disagrees") || e.contains("of 9 parameters"),
            "{e}"
        );
        let e = forge(&|m| m.version = 7);
        assert!(e.contains("version 7"), "{e}");
        std::fs::write(&path, b"{ not json").unwrap();
        let e = verify(&set, &identity()).unwrap_err().to_string();
        assert!(
            e.contains("manifest.json") && e.contains("unreadable"),
            "{e}"
        );
    }

    #[test]
    fn an_abandoned_staging_directory_of_this_run_is_removed_and_others_kept() {
        let tmp = tempfile::tempdir().unwrap();
        prepare(tmp.path(), 6, &identity()).unwrap();
        let other = Identity {
            config: "0123456789abcdef-other".into(),
            model: "m".into(),
        };
        prepare(tmp.path(), 6, &other).unwrap();
        let removed = crate::checkpoint::remove_abandoned(tmp.path(), &identity());
        assert_eq!(removed.len(), 1);
        assert!(!removed[0].exists());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn canonical_pieces_follow_the_index_map() {
        // Local vector = canonical 10..14 then 2..4 of a stage starting at 100.
        let map = vec![10..14, 2..4];
        assert_eq!(
            canonical_pieces(&map, 100, 3..6),
            vec![(113..114, 3..4), (102..104, 4..6)]
        );
        assert_eq!(canonical_pieces(&map, 0, 0..0), vec![]);
    }
}

//! Crash-safe, world-size-independent checkpoints.
//!
//! File layout (`step-<N>.ckpt`, little-endian):
//! ```text
//! magic "LKSTCKPT" | version u32 | header length u32 | header (JSON) | payload | SHA-256 of all before
//! ```
//! The header names the config identity hash, the model structure hash, the step, the parameter
//! count and the optimizer state vectors; the payload is the parameters then each state vector, as
//! f32. Nothing in it depends on the world size: parameters and optimizer state are identical on
//! every rank, the sampler position *is* the step (batches are a pure function of seed and step),
//! and so are the learning-rate schedule position and every random choice. A run saved by 4
//! workers resumes on 2 or 3 with the same bits.
//!
//! Writes are atomic: temporary file in the same directory, fsync, rename, fsync of the directory,
//! so a crash leaves the previous checkpoints intact and never a torn file under a real name. The
//! newest `keep` files are kept. Loading verifies length, magic, version, checksum and identity; a
//! damaged newest file is reported and the previous good one used.

pub mod sharded;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"LKSTCKPT";
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {what}")]
    Io { path: String, what: String },
    #[error("{path}: not a lockstep checkpoint (bad magic)")]
    BadMagic { path: String },
    #[error("{path}: checkpoint format version {found}, this build reads version {VERSION}")]
    Version { path: String, found: u32 },
    #[error("{path}: truncated or corrupt: {what}")]
    Corrupt { path: String, what: String },
    #[error("{path}: checkpoint belongs to another run: {what}")]
    Mismatch { path: String, what: String },
    /// The disk (or the user's quota) is full: retrying cannot help, freeing space can.
    #[error("{path}: no space left for the checkpoint ({what}); free space or set checkpoint.dir")]
    NoSpace { path: String, what: String },
    /// Something other than a regular file sits at the checkpoint's name (a link, a FIFO, …):
    /// never replaced or written through.
    #[error("{what}")]
    NotRegular { path: String, what: String },
}

/// Everything a resumed run needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps completed.
    pub step: u64,
    pub params: Vec<f32>,
    /// Optimizer state vectors in `Optimizer::state()` order.
    pub optimizer_state: Vec<Vec<f32>>,
    pub optimizer_steps: u64,
    pub identity: Identity,
}

impl Checkpoint {
    /// Checks that the vectors have the sizes of the loading run's parameters and optimizer
    /// state; `path` names the checkpoint (or its directory) in the error. A file of this run
    /// always agrees (the identity covers the model's shapes and the optimizer), so a
    /// disagreement means a forged or foreign file whose identity happens to match.
    pub fn check_sizes(
        &self,
        path: &Path,
        params: usize,
        state: &[usize],
    ) -> Result<(), CheckpointError> {
        let found: Vec<usize> = self.optimizer_state.iter().map(Vec::len).collect();
        if self.params.len() != params || found != state {
            return Err(CheckpointError::Mismatch {
                path: path.display().to_string(),
                what: format!(
                    "{} parameters and optimizer state of sizes {found:?}; this run has {params} \
                     parameters and state of sizes {state:?}",
                    self.params.len()
                ),
            });
        }
        Ok(())
    }
}

/// A checkpoint's contents as they come: what [`stage`] writes. Each vector is lent (a run's
/// live buffer when nothing has to be gathered for it; training waits meanwhile) or owned (one
/// gathered for it), so writing it takes no copy, and keeping it for a background write copies
/// only what is lent.
#[derive(Debug, Clone)]
pub struct CheckpointView<'a> {
    pub step: u64,
    pub params: Cow<'a, [f32]>,
    pub optimizer_state: Vec<Cow<'a, [f32]>>,
    pub optimizer_steps: u64,
    pub identity: &'a Identity,
}

impl Checkpoint {
    /// This checkpoint as a [`CheckpointView`].
    pub fn view(&self) -> CheckpointView<'_> {
        CheckpointView {
            step: self.step,
            params: Cow::Borrowed(&self.params),
            optimizer_state: self
                .optimizer_state
                .iter()
                .map(|v| Cow::Borrowed(&v[..]))
                .collect(),
            optimizer_steps: self.optimizer_steps,
            identity: &self.identity,
        }
    }
}

impl CheckpointView<'_> {
    /// The checkpoint, owned (for a write that outlives the buffers): lent vectors are copied,
    /// owned ones moved.
    pub fn into_owned(self) -> Checkpoint {
        Checkpoint {
            step: self.step,
            params: self.params.into_owned(),
            optimizer_state: self
                .optimizer_state
                .into_iter()
                .map(Cow::into_owned)
                .collect(),
            optimizer_steps: self.optimizer_steps,
            identity: self.identity.clone(),
        }
    }
}

/// The vectors a training loop keeps, held by a checkpoint write without a copy: its parameters
/// and its optimizer's state ([`lockstep_model::Optimizer::shared_state`]), shared. The loop's
/// next update writes in place once the write has dropped them, and copies a vector first while
/// the write still holds it, so the values written are always those of the checkpoint's step.
pub(crate) struct SharedVectors {
    pub(crate) params: Arc<Vec<f32>>,
    pub(crate) state: Vec<Arc<Vec<f32>>>,
}

impl SharedVectors {
    /// The optimizer's state vectors, borrowed.
    pub(crate) fn state(&self) -> Vec<&[f32]> {
        self.state.iter().map(|v| v.as_slice()).collect()
    }
}

/// What a checkpoint must agree on with the run that loads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Hash of the settings that determine the trajectory (see `TrainConfig::identity_hash`).
    pub config: String,
    /// Hex SHA-256 of the model's parameter names and shapes.
    pub model: String,
}

#[derive(Serialize, Deserialize)]
struct Header {
    identity: Identity,
    step: u64,
    num_params: u64,
    optimizer_steps: u64,
    state_lens: Vec<u64>,
}

pub fn file_name(step: u64) -> String {
    format!("step-{step:09}.ckpt")
}

/// The bytes of a checkpoint file holding `c` (the inverse of [`decode`]).
pub fn encode(c: &Checkpoint) -> Vec<u8> {
    let floats = c.params.len() + c.optimizer_state.iter().map(Vec::len).sum::<usize>();
    let mut out = Vec::with_capacity(16 + 1024 + 4 * floats + 32);
    write_encoded(&mut out, &c.view(), &mut |_| {}).expect("writing to memory cannot fail");
    out
}

/// Stream [`encode`]'s bytes into `w`, hashing as they go, so a checkpoint never exists twice in
/// memory; `between` is called with the fraction of the payload written after each vector (the
/// `kill-while-checkpointing` fault fires there).
fn write_encoded<W: std::io::Write>(
    w: &mut W,
    c: &CheckpointView,
    between: &mut dyn FnMut(f64),
) -> std::io::Result<()> {
    let header = Header {
        identity: c.identity.clone(),
        step: c.step,
        num_params: c.params.len() as u64,
        optimizer_steps: c.optimizer_steps,
        state_lens: c.optimizer_state.iter().map(|s| s.len() as u64).collect(),
    };
    let header = serde_json::to_vec(&header).expect("header serialises");
    let vectors: Vec<[&[f32]; 1]> = std::iter::once(&c.params[..])
        .chain(c.optimizer_state.iter().map(|v| &v[..]))
        .map(|v| [v])
        .collect();
    let n = vectors.len();
    let mut after = |i: usize| between((i + 1) as f64 / n as f64);
    write_container(w, MAGIC, VERSION, &header, &vectors, &mut after)?;
    Ok(())
}

/// The container both checkpoint formats share, streamed into `w` and hashed on the way:
/// `magic | version u32 | header length u32 | header | payload | SHA-256 of all before`, the
/// payload being each of `vectors` (given as pieces) as little-endian `f32`. `between(i)` is
/// called after vector `i`, once what is written so far has reached `w`'s sink (a process killed
/// there leaves a partial file whose header says whose it is). Returns the bytes written and
/// the digest.
pub(crate) fn write_container<'v, W: std::io::Write, V: AsRef<[&'v [f32]]>>(
    w: &mut W,
    magic: &[u8; 8],
    version: u32,
    header: &[u8],
    vectors: &[V],
    between: &mut dyn FnMut(usize),
) -> std::io::Result<(u64, [u8; 32])> {
    let mut hasher = Sha256::new();
    let mut bytes = 0u64;
    let mut put = |w: &mut W, b: &[u8]| {
        hasher.update(b);
        bytes += b.len() as u64;
        w.write_all(b)
    };
    put(w, magic)?;
    put(w, &version.to_le_bytes())?;
    put(w, &(header.len() as u32).to_le_bytes())?;
    put(w, header)?;
    for (i, pieces) in vectors.iter().enumerate() {
        for piece in pieces.as_ref() {
            // Little-endian on disk: the payload is the vectors' bytes as they are on this target.
            for chunk in piece.chunks(1 << 18) {
                put(w, bytemuck::cast_slice(chunk))?;
            }
        }
        w.flush()?;
        between(i);
    }
    let digest: [u8; 32] = hasher.finalize().into();
    w.write_all(&digest)?;
    Ok((bytes + 32, digest))
}

/// Decodes and verifies a checkpoint's bytes (everything but the identity check of [`load`]);
/// `path` names the file in errors. Pure, so it can be fuzzed: any bytes give a checkpoint or a
/// [`CheckpointError`] naming `path`, never a panic, and nothing is allocated beyond the input.
pub fn decode(bytes: &[u8], path: &str) -> Result<Checkpoint, CheckpointError> {
    let corrupt = |what: String| CheckpointError::Corrupt {
        path: path.to_string(),
        what,
    };
    if bytes.len() < 8 + 4 + 4 + 32 {
        if bytes.len() >= 8 && &bytes[..8] != MAGIC {
            return Err(CheckpointError::BadMagic { path: path.into() });
        }
        return Err(corrupt(format!(
            "{} bytes is shorter than any checkpoint",
            bytes.len()
        )));
    }
    if &bytes[..8] != MAGIC {
        return Err(CheckpointError::BadMagic { path: path.into() });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    if version != VERSION {
        return Err(CheckpointError::Version {
            path: path.into(),
            found: version,
        });
    }
    let (body, digest) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body).as_slice() != digest {
        return Err(corrupt(
            "SHA-256 checksum does not match the contents".into(),
        ));
    }
    let hlen = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let header_end = 16usize
        .checked_add(hlen)
        .filter(|&e| e <= body.len())
        .ok_or_else(|| corrupt("header length past the end".into()))?;
    let header: Header = serde_json::from_slice(&body[16..header_end])
        .map_err(|e| corrupt(format!("unreadable header: {e}")))?;
    let payload = &body[header_end..];
    // The lengths come from the file: a forged or damaged header (with a matching checksum) may
    // claim anything, so the sizes are computed with checked arithmetic and compared with the
    // payload before anything is allocated for them.
    let lens: Vec<u64> = std::iter::once(header.num_params)
        .chain(header.state_lens.iter().copied())
        .collect();
    let want = lens
        .iter()
        .try_fold(0u64, |acc, &l| acc.checked_add(l))
        .and_then(|floats| floats.checked_mul(4))
        .ok_or_else(|| {
            corrupt(format!(
                "header describes vectors of {lens:?} floats, more bytes than any file holds"
            ))
        })?;
    if payload.len() as u64 != want {
        return Err(corrupt(format!(
            "payload has {} bytes, header describes {want}",
            payload.len()
        )));
    }
    // Every length now fits in the payload, so in usize.
    let mut vecs = Vec::with_capacity(lens.len());
    let mut rest = payload;
    for l in lens {
        let (this, after) = rest.split_at(4 * l as usize);
        vecs.push(
            this.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect::<Vec<f32>>(),
        );
        rest = after;
    }
    let params = vecs.remove(0);
    Ok(Checkpoint {
        step: header.step,
        params,
        optimizer_state: vecs,
        optimizer_steps: header.optimizer_steps,
        identity: header.identity,
    })
}

pub(crate) fn io_err(path: &Path, e: std::io::Error) -> CheckpointError {
    let (path, what) = (path.display().to_string(), e.to_string());
    if crate::files::is_no_space(&e) {
        CheckpointError::NoSpace { path, what }
    } else if crate::files::is_not_regular(&e) {
        CheckpointError::NotRegular { path, what }
    } else {
        CheckpointError::Io { path, what }
    }
}

/// Write `c` atomically into `dir` and prune all but the newest `keep` checkpoints of the same
/// run: files of another run or of nobody (a user's file that happens to be called
/// `step-<n>.ckpt`, a checkpoint of a run sharing `checkpoint.dir`) are never removed.
pub fn save(dir: &Path, c: &Checkpoint, keep: usize) -> Result<PathBuf, CheckpointError> {
    stage(dir, &c.view(), &mut |_| {})?.publish(keep)
}

/// A checkpoint written and synced under a temporary name in its directory, not yet under its
/// own: [`save`] in two steps, so that its publication can wait (for metrics.jsonl) while its
/// writing counts as the step's. Dropped unpublished, the temporary file is removed.
pub struct StagedCheckpoint {
    file: crate::files::Staged,
    dir: PathBuf,
    path: PathBuf,
    identity: Identity,
    step: u64,
}

/// Stage `c` in `dir` (see [`StagedCheckpoint`]); `between` is called with the fraction of the
/// payload written after each vector, the file holding all of it so far.
pub fn stage(
    dir: &Path,
    c: &CheckpointView,
    between: &mut dyn FnMut(f64),
) -> Result<StagedCheckpoint, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let path = dir.join(file_name(c.step));
    let mut file = crate::files::Staged::create(&path).map_err(|e| io_err(&path, e))?;
    let mut buffered = std::io::BufWriter::with_capacity(1 << 20, file.file());
    write_encoded(&mut buffered, c, between)
        .and_then(|()| std::io::Write::flush(&mut buffered))
        .map_err(|e| io_err(&path, e))?;
    drop(buffered);
    file.sync().map_err(|e| io_err(&path, e))?;
    Ok(StagedCheckpoint {
        file,
        dir: dir.to_path_buf(),
        path,
        identity: c.identity.clone(),
        step: c.step,
    })
}

impl StagedCheckpoint {
    /// The step the checkpoint was taken after.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Give the checkpoint its name (atomically), then prune all but the newest `keep` of the
    /// run's checkpoints (see [`save`]). Returns its path.
    pub fn publish(self, keep: usize) -> Result<PathBuf, CheckpointError> {
        let StagedCheckpoint {
            file,
            dir,
            path,
            identity,
            ..
        } = self;
        file.publish().map_err(|e| io_err(&path, e))?;
        prune(&dir, &identity, keep)?;
        Ok(path)
    }
}

/// Remove a checkpoint: a file, or a sharded set's directory (never following a link; absent is fine).
pub fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Remove all but the newest `keep` (at least one) of the run's checkpoints in `dir`, files and
/// sharded sets alike (see [`save`]: never another run's).
pub(crate) fn prune(dir: &Path, identity: &Identity, keep: usize) -> Result<(), CheckpointError> {
    let ours = of_run(dir, |id| id == identity)?;
    if ours.len() > keep.max(1) {
        for old in &ours[..ours.len() - keep.max(1)] {
            let _ = remove(old);
        }
    }
    Ok(())
}

/// The checkpoint files in `dir` (oldest first) that are regular files whose header names an
/// identity `is_ours` accepts — what lockstep may delete. Links are never followed.
pub fn of_run(
    dir: &Path,
    is_ours: impl Fn(&Identity) -> bool,
) -> Result<Vec<PathBuf>, CheckpointError> {
    Ok(list(dir)?
        .into_iter()
        .filter(|(_, p)| read_identity(p).is_some_and(|id| is_ours(&id)))
        .map(|(_, p)| p)
        .collect())
}

/// The identity in a checkpoint file's header, reading only the header (no checksum: a damaged
/// payload still says whose file it is), or in a sharded set's manifest. `None` for anything
/// that is not a regular file starting like a lockstep checkpoint or a set's directory.
pub fn read_identity(path: &Path) -> Option<Identity> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    if std::fs::symlink_metadata(path).ok()?.is_dir() {
        return sharded::read_manifest(path).ok().map(|m| m.identity);
    }
    /// Headers are a few hundred bytes; anything claiming more is not ours.
    const MAX_HEADER: usize = 1 << 20;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.file_type().is_file() {
        return None;
    }
    let mut start = [0u8; 16];
    f.read_exact(&mut start).ok()?;
    let hlen = u32::from_le_bytes(start[12..16].try_into().unwrap()) as usize;
    if &start[..8] != MAGIC || hlen > MAX_HEADER {
        return None;
    }
    let mut header = vec![0u8; hlen];
    f.read_exact(&mut header).ok()?;
    serde_json::from_slice::<Header>(&header)
        .ok()
        .map(|h| h.identity)
}

/// Checkpoints in `dir`, oldest first: whole-model files and sharded sets (directories; by step,
/// a file before a set of the same step).
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut v = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(v),
        Err(e) => return Err(io_err(dir, e)),
    };
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.strip_suffix(".ckpt"))
            .and_then(|s| s.parse().ok())
        {
            v.push((step, entry.path()));
        } else if let Some(step) = sharded::set_step(&name) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                v.push((step, entry.path()));
            }
        }
    }
    v.sort();
    Ok(v)
}

/// Remove the unfinished checkpoints a killed write of this run left in `dir`: hidden
/// temporaries named after a checkpoint (`.step-N.ckpt.XXXXXX.tmp`) that are regular files whose
/// header names `identity` (written first, so even a partial file says whose it is), and this
/// run's staging directories of sharded sets (named after its identity). Another run's files and
/// anything else are left alone. Returns the paths removed.
pub fn remove_abandoned(dir: &Path, identity: &Identity) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let unfinished = name
            .strip_prefix(".step-")
            .and_then(|rest| rest.split_once(".ckpt."))
            .is_some_and(|(step, tail)| step.parse::<u64>().is_ok() && tail.ends_with(".tmp"));
        let path = entry.path();
        let abandoned = if sharded::is_staging_of(&name, identity) {
            remove(&path).is_ok()
        } else {
            unfinished
                && read_identity(&path).as_ref() == Some(identity)
                && std::fs::remove_file(&path).is_ok()
        };
        if abandoned {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

/// Read and verify one file, or the whole model from a sharded set; `expect` is the loading
/// run's identity.
pub fn load(path: &Path, expect: &Identity) -> Result<Checkpoint, CheckpointError> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(path, e))?;
    if meta.is_dir() {
        return sharded::load_whole(path, expect);
    }
    // A device or FIFO under a checkpoint's name would be read forever: only regular files.
    if !meta.is_file() {
        return Err(CheckpointError::Corrupt {
            path: path.display().to_string(),
            what: "not a regular file".into(),
        });
    }
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let c = decode(&bytes, &path.display().to_string())?;
    check_identity(path, &c.identity, expect)?;
    Ok(c)
}

/// A checkpoint (file or set) at `path` whose identity is `found` belongs to the run of `expect`.
pub(crate) fn check_identity(
    path: &Path,
    found: &Identity,
    expect: &Identity,
) -> Result<(), CheckpointError> {
    if found.model != expect.model {
        return Err(CheckpointError::Mismatch {
            path: path.display().to_string(),
            what: format!(
                "model structure {} ≠ this run's {}",
                found.model, expect.model
            ),
        });
    }
    if found.config != expect.config {
        return Err(CheckpointError::Mismatch {
            path: path.display().to_string(),
            what: format!("config identity {} ≠ this run's {} (model, data, training or optimizer settings differ)", found.config, expect.config),
        });
    }
    Ok(())
}

/// Checkpoint files passed over while looking for a good one: (path, why).
pub type Skipped = Vec<(PathBuf, String)>;

/// The newest good checkpoint of either kind, as [`load_latest`] finds it.
#[derive(Debug, PartialEq)]
pub enum Latest {
    /// A whole-model file, read and verified.
    File(Checkpoint),
    /// A sharded set, verified (every shard, the coverage); its values are read by each rank.
    Set {
        path: PathBuf,
        manifest: sharded::Manifest,
    },
}

impl Latest {
    /// Optimizer steps completed (the step the checkpoint was taken after).
    pub fn step(&self) -> u64 {
        match self {
            Latest::File(c) => c.step,
            Latest::Set { manifest, .. } => manifest.step,
        }
    }

    pub fn optimizer_steps(&self) -> u64 {
        match self {
            Latest::File(c) => c.optimizer_steps,
            Latest::Set { manifest, .. } => manifest.optimizer_steps,
        }
    }
}

/// The newest checkpoint in `dir` (file or sharded set) that verifies. Damaged ones are skipped
/// and reported in the returned list (path, reason); a checkpoint of *another run* is an error,
/// never skipped.
pub fn load_latest(
    dir: &Path,
    expect: &Identity,
) -> Result<(Option<Latest>, Skipped), CheckpointError> {
    let mut skipped = Vec::new();
    for (_, path) in list(dir)?.into_iter().rev() {
        let found = if path.is_dir() {
            sharded::verify(&path, expect).map(|manifest| Latest::Set {
                path: path.clone(),
                manifest,
            })
        } else {
            load(&path, expect).map(Latest::File)
        };
        match found {
            Ok(latest) => return Ok((Some(latest), skipped)),
            Err(e @ CheckpointError::Mismatch { .. }) => return Err(e),
            Err(e) => skipped.push((path, e.to_string())),
        }
    }
    Ok((None, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            params: (0..1000).map(|i| i as f32 * 0.25 - step as f32).collect(),
            optimizer_state: vec![(0..1000).map(|i| -(i as f32)).collect()],
            optimizer_steps: step,
            identity: Identity {
                config: "cfg".into(),
                model: "model".into(),
            },
        }
    }

    #[test]
    fn round_trip_keep_and_latest() {
        let dir = tempfile::tempdir().unwrap();
        for s in [10, 20, 30, 40] {
            save(dir.path(), &sample(s), 3).unwrap();
        }
        let steps: Vec<u64> = list(dir.path())
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, vec![20, 30, 40]);
        let (c, skipped) = load_latest(dir.path(), &sample(0).identity).unwrap();
        assert_eq!(c.unwrap(), Latest::File(sample(40)));
        assert!(skipped.is_empty());
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }

    #[test]
    fn a_staged_checkpoint_is_invisible_until_published_and_has_encodes_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let older = save(dir.path(), &sample(10), 3).unwrap();
        let mut fractions = Vec::new();
        let staged = stage(dir.path(), &sample(20).view(), &mut |f| fractions.push(f)).unwrap();
        assert_eq!(fractions, vec![0.5, 1.0]);
        // Not under its name yet: a resume now finds step 10.
        let (c, _) = load_latest(dir.path(), &sample(0).identity).unwrap();
        assert_eq!(c.unwrap().step(), 10);
        let path = staged.publish(3).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), encode(&sample(20)));
        assert!(older.exists());
        // Dropped unpublished: no file, no temporary left.
        drop(stage(dir.path(), &sample(30).view(), &mut |_| {}).unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn only_this_runs_unfinished_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let ours = sample(10);
        let mut theirs = sample(10);
        theirs.identity.config = "another run".into();
        // Partial files as a killed write leaves them (the header and part of the payload).
        let partial = |c: &Checkpoint, name: &str| {
            let bytes = encode(c);
            std::fs::write(dir.path().join(name), &bytes[..bytes.len() / 2]).unwrap();
        };
        partial(&ours, ".step-000000010.ckpt.AbC123.tmp");
        partial(&theirs, ".step-000000010.ckpt.XyZ789.tmp");
        partial(&ours, ".summary.json.AbC123.tmp");
        save(dir.path(), &ours, 3).unwrap();
        let removed = remove_abandoned(dir.path(), &ours.identity);
        assert_eq!(
            removed,
            vec![dir.path().join(".step-000000010.ckpt.AbC123.tmp")]
        );
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".step-000000010.ckpt.XyZ789.tmp",
                ".summary.json.AbC123.tmp",
                "step-000000010.ckpt"
            ]
        );
    }

    #[test]
    fn corrupt_or_truncated_newest_falls_back_to_the_previous() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &sample(10), 3).unwrap();
        let newest = save(dir.path(), &sample(20), 3).unwrap();
        let mut bytes = std::fs::read(&newest).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&newest, &bytes).unwrap();
        let (c, skipped) = load_latest(dir.path(), &sample(0).identity).unwrap();
        assert_eq!(c.unwrap().step(), 10);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].1.contains("checksum"), "{}", skipped[0].1);
        bytes.truncate(50);
        std::fs::write(&newest, &bytes).unwrap();
        let (c, skipped) = load_latest(dir.path(), &sample(0).identity).unwrap();
        assert_eq!(c.unwrap().step(), 10);
        assert!(
            skipped[0].1.contains("truncated or corrupt"),
            "{}",
            skipped[0].1
        );
    }

    #[test]
    fn a_device_under_a_checkpoints_name_is_skipped_not_read_forever() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &sample(10), 3).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join(file_name(20))).unwrap();
        let (c, skipped) = load_latest(dir.path(), &sample(0).identity).unwrap();
        assert_eq!(c.unwrap().step(), 10);
        assert!(skipped[0].1.contains("not a regular file"), "{skipped:?}");
    }

    #[test]
    fn other_runs_and_foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = save(dir.path(), &sample(10), 3).unwrap();
        let other = Identity {
            config: "different".into(),
            model: "model".into(),
        };
        let e = load_latest(dir.path(), &other).unwrap_err().to_string();
        assert!(
            e.contains("another run") && e.contains("config identity"),
            "{e}"
        );
        let other = Identity {
            config: "cfg".into(),
            model: "bigger".into(),
        };
        assert!(load(&p, &other)
            .unwrap_err()
            .to_string()
            .contains("model structure"));
        std::fs::write(
            &p,
            b"GIF89a this is not a checkpoint at all, but long enough to read",
        )
        .unwrap();
        assert!(matches!(
            load(&p, &sample(0).identity),
            Err(CheckpointError::BadMagic { .. })
        ));
        let mut bytes = encode(&sample(1));
        bytes[8] = 9;
        std::fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            load(&p, &sample(0).identity),
            Err(CheckpointError::Version { found: 9, .. })
        ));
    }

    // ---- Fuzzing the decoder: valid checkpoints round-trip bit for bit; random bytes, edits of
    // a real checkpoint and forged headers (checksum recomputed) give an error naming the path,
    // never a panic. ----

    use proptest::prelude::*;

    const PATH: &str = "fuzz/step-000000001.ckpt";

    /// Cases per property: `default`, or `PROPTEST_CASES` for a long fuzzing run.
    fn fuzz_cases(default: u32) -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// Decodes, checking that an error names the path.
    fn decode_checked(bytes: &[u8]) -> Result<Checkpoint, String> {
        decode(bytes, PATH).map_err(|e| {
            let msg = e.to_string();
            assert!(msg.starts_with(PATH), "error does not name the file: {msg}");
            msg
        })
    }

    /// Any f32 bits (NaNs, infinities, subnormals): the format must not touch them.
    fn floats(max: usize) -> impl Strategy<Value = Vec<f32>> {
        proptest::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..max)
    }

    fn checkpoint() -> impl Strategy<Value = Checkpoint> {
        (
            any::<u64>(),
            floats(40),
            proptest::collection::vec(floats(40), 0..3),
            any::<u64>(),
            ".{0,12}",
            "[0-9a-f]{0,64}",
        )
            .prop_map(
                |(step, params, optimizer_state, optimizer_steps, config, model)| Checkpoint {
                    step,
                    params,
                    optimizer_state,
                    optimizer_steps,
                    identity: Identity { config, model },
                },
            )
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// `body` (magic, version, header length, header, payload) with its SHA-256 appended: what a
    /// forger, or a bug that writes a bad header, produces.
    fn sealed(mut body: Vec<u8>) -> Vec<u8> {
        let digest = Sha256::digest(&body);
        body.extend_from_slice(&digest);
        body
    }

    /// A checkpoint whose header JSON is `header` (over `payload_floats` zero floats), sealed.
    fn forged(header: &str, payload_floats: usize) -> Vec<u8> {
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&VERSION.to_le_bytes());
        body.extend_from_slice(&(header.len() as u32).to_le_bytes());
        body.extend_from_slice(header.as_bytes());
        body.resize(body.len() + 4 * payload_floats, 0);
        sealed(body)
    }

    fn header_json(num_params: u64, state_lens: &[u64]) -> String {
        format!(
            r#"{{"identity":{{"config":"cfg","model":"model"}},"step":1,"num_params":{num_params},"optimizer_steps":1,"state_lens":{state_lens:?}}}"#
        )
    }

    /// Lengths a header might claim: small, near the payload, or near the overflow points.
    fn claimed_len() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..8,
            Just(u64::MAX),
            Just(u64::MAX / 4),
            Just(u64::MAX / 4 + 1),
            Just(1 << 62),
            Just(1 << 63),
            any::<u64>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(512)))]

        #[test]
        fn valid_checkpoints_round_trip(c in checkpoint()) {
            let d = decode_checked(&encode(&c)).unwrap();
            prop_assert_eq!((d.step, d.optimizer_steps, &d.identity), (c.step, c.optimizer_steps, &c.identity));
            prop_assert_eq!(bits(&d.params), bits(&c.params));
            prop_assert_eq!(d.optimizer_state.len(), c.optimizer_state.len());
            for (a, b) in d.optimizer_state.iter().zip(&c.optimizer_state) {
                prop_assert_eq!(bits(a), bits(b));
            }
        }

        /// Random bytes, half of them behind the real magic and version.
        #[test]
        fn arbitrary_bytes_are_refused_naming_the_file(
            prefix in any::<bool>(),
            tail in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut bytes = if prefix { [&MAGIC[..], &VERSION.to_le_bytes()].concat() } else { Vec::new() };
            bytes.extend_from_slice(&tail);
            prop_assert!(decode_checked(&bytes).is_err());
        }

        /// Any edit of a real checkpoint (bit flips, byte writes, truncation, appended bytes) is
        /// refused: the SHA-256 covers every byte, and the length fields are read only after it.
        #[test]
        fn edited_checkpoints_are_refused(
            c in checkpoint(),
            flips in proptest::collection::vec((any::<usize>(), 0u8..8), 0..4),
            cut in proptest::option::of(any::<usize>()),
            extra in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let good = encode(&c);
            let mut bytes = good.clone();
            for (i, b) in flips {
                let n = bytes.len();
                bytes[i % n] ^= 1 << b;
            }
            if let Some(cut) = cut {
                let n = bytes.len();
                bytes.truncate(cut % (n + 1));
            }
            bytes.extend_from_slice(&extra);
            // Edits that cancel out (no flips, a cut at the end, no extra) leave a good file;
            // skipped here rather than rejected, which long runs would hit too often.
            if bytes != good {
                prop_assert!(decode_checked(&bytes).is_err());
            }
        }

        /// Forged headers with a valid checksum: any claimed lengths, any payload size. Decoded
        /// only when the claim matches the payload exactly.
        #[test]
        fn forged_headers_never_panic(
            num_params in claimed_len(),
            state_lens in proptest::collection::vec(claimed_len(), 0..4),
            payload_floats in 0usize..16,
        ) {
            let bytes = forged(&header_json(num_params, &state_lens), payload_floats);
            let claimed: Option<u64> = std::iter::once(num_params)
                .chain(state_lens.iter().copied())
                .try_fold(0u64, |a, l| a.checked_add(l));
            match decode_checked(&bytes) {
                Ok(c) => {
                    prop_assert_eq!(claimed, Some(payload_floats as u64));
                    prop_assert_eq!(c.params.len() as u64, num_params);
                }
                Err(msg) => {
                    prop_assert!(claimed != Some(payload_floats as u64), "{}", msg);
                    prop_assert!(msg.contains("truncated or corrupt"), "{}", msg);
                }
            }
        }

        /// Forged header-length fields and header text: refused, never a panic.
        #[test]
        fn forged_header_fields_never_panic(
            hlen in prop_oneof![Just(u32::MAX), 0u32..300, any::<u32>()],
            header in ".{0,80}",
            payload in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut body = MAGIC.to_vec();
            body.extend_from_slice(&VERSION.to_le_bytes());
            body.extend_from_slice(&hlen.to_le_bytes());
            body.extend_from_slice(header.as_bytes());
            body.extend_from_slice(&payload);
            let _ = decode_checked(&sealed(body));
        }
    }

    /// Regression (found by `forged_headers_never_panic`): lengths whose sum times 4 overflows
    /// u64 panicked with "attempt to multiply with overflow" in debug builds and wrapped in
    /// release, where a payload of the wrapped size was then accepted as a checkpoint whose
    /// vectors disagree with its header.
    #[test]
    fn forged_lengths_that_overflow_are_corrupt_not_a_panic() {
        for (num_params, state_lens, floats) in [
            (1u64 << 62, vec![], 0usize),
            ((1 << 62) + 1, vec![], 1),
            (u64::MAX, vec![1], 0),
            (1, vec![u64::MAX / 4, u64::MAX / 4], 2),
        ] {
            let msg =
                decode_checked(&forged(&header_json(num_params, &state_lens), floats)).unwrap_err();
            assert!(
                msg.contains("truncated or corrupt: header describes vectors of"),
                "{msg}"
            );
        }
    }

    /// Regression (found reading the resume path while writing the harness): a checkpoint whose
    /// identity matches but whose optimizer-state vectors have other sizes made resume panic in
    /// `copy_from_slice`; now it is a mismatch naming the sizes.
    #[test]
    fn state_vectors_of_other_sizes_are_a_mismatch() {
        let c = sample(1);
        assert!(c.check_sizes(Path::new(PATH), 1000, &[1000]).is_ok());
        let e = c
            .check_sizes(Path::new(PATH), 1000, &[999])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "{PATH}: checkpoint belongs to another run: 1000 parameters and optimizer state \
                 of sizes [1000]; this run has 1000 parameters and state of sizes [999]"
            )
        );
        assert!(c.check_sizes(Path::new(PATH), 1000, &[1000, 1000]).is_err());
        assert!(c.check_sizes(Path::new(PATH), 999, &[1000]).is_err());
    }
}

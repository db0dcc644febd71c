//! Resource limits of a configuration, checked before anything starts.
//!
//! A value that parses is not yet a value that can run: `dist.timeout_secs = 1e300` overflows a
//! `Duration`, `train.steps = 10000000000` asks for terabytes of step records, a layer of 2^62
//! units overflows the allocator's size computation. Each such value is refused here, naming the
//! field, what it would need and what the machine or the types can hold — so it ends as bad input
//! (exit status 3, never restarted) instead of a panic or an abort in every worker.
//!
//! Memory is estimated per worker, from the parameter count (parameters, the summed gradient, one
//! gradient per local micro-batch, optimizer state — `crate::memory::predict`, the formula
//! `lockstep plan` uses too — and burn's own copies) and the activations of one micro-batch, against the host's physical memory (`/proc/meminfo`). The estimate is an
//! upper bound of the right order, not an exact figure: it refuses what cannot fit, not what is
//! merely large.

use lockstep_model::LayerKind;

use crate::config::{ConfigError, DatasetKind, ModelKind, TrainConfig};
use crate::memory::{self, StateShape};
use crate::model_spec::transformer_spec;

/// Longest wait a collective may be given: a week. `Duration`/`Instant` arithmetic and the
/// store's longest wait stay finite.
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 24.0 * 3600.0;
/// Most optimizer steps of one run. Every rank keeps a record (≈ 300 bytes) per step, and rank 0
/// gathers all of them for the summary.
pub const MAX_STEPS: u64 = 10_000_000;
/// Largest batch / micro-batch (samples).
pub const MAX_BATCH: usize = 1 << 24;
/// Largest width of any layer (units, channels, d_model, d_ff, context).
pub const MAX_WIDTH: usize = 1 << 24;
/// Most layers (hidden layers, conv blocks, transformer blocks).
pub const MAX_LAYERS: usize = 4096;
/// Largest gradient bucket (values).
pub const MAX_BUCKET: usize = 1 << 28;
/// Most checkpoints kept, and timed repetitions per layer when profiling.
pub const MAX_KEEP: usize = 100_000;
pub const MAX_PROFILE_REPS: usize = 10_000;
/// Most pipeline stages or data-parallel replicas a config may name.
pub const MAX_PARALLEL: usize = 1 << 16;
/// Assumed when `/proc/meminfo` cannot be read.
const FALLBACK_MEMORY: u128 = 8 << 30;

fn invalid(field: &'static str, message: String) -> ConfigError {
    ConfigError::Invalid { field, message }
}

/// This host's physical memory in bytes.
pub fn host_memory_bytes() -> u128 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(FALLBACK_MEMORY)
}

/// Check every numeric field against what the types and `memory` bytes per worker can hold.
pub fn check(cfg: &TrainConfig, memory: u128) -> Result<(), ConfigError> {
    check_common(cfg)?;
    check_model(cfg, memory)
}

/// The limits that do not depend on the model (every job).
pub fn check_common(cfg: &TrainConfig) -> Result<(), ConfigError> {
    let t = &cfg.train;
    if t.steps > MAX_STEPS {
        return Err(invalid(
            "train.steps",
            format!(
                "{} steps exceed the limit of {MAX_STEPS} (every rank keeps a record per step)",
                t.steps
            ),
        ));
    }
    if t.steps == 0 && t.epochs > MAX_STEPS {
        return Err(invalid(
            "train.epochs",
            format!(
                "{} epochs exceed the limit of {MAX_STEPS} steps whatever the dataset",
                t.epochs
            ),
        ));
    }
    for (field, v) in [
        ("train.global_batch", t.global_batch),
        ("train.microbatch", t.microbatch),
    ] {
        if v > MAX_BATCH {
            return Err(invalid(
                field,
                format!("{v} samples exceed the limit of {MAX_BATCH}"),
            ));
        }
    }
    let d = &cfg.dist;
    // NaN and infinity are refused by config validation; here the finite but absurd.
    if d.timeout_secs > MAX_TIMEOUT_SECS {
        return Err(invalid(
            "dist.timeout_secs",
            format!(
                "{} s is longer than the longest wait allowed, {MAX_TIMEOUT_SECS} s (a week)",
                d.timeout_secs
            ),
        ));
    }
    if d.bucket_elems > MAX_BUCKET {
        return Err(invalid(
            "dist.bucket_elems",
            format!("{} values exceed the limit of {MAX_BUCKET}", d.bucket_elems),
        ));
    }
    if cfg.checkpoint.keep > MAX_KEEP {
        return Err(invalid(
            "checkpoint.keep",
            format!(
                "{} checkpoints exceed the limit of {MAX_KEEP}",
                cfg.checkpoint.keep
            ),
        ));
    }
    let p = &cfg.parallel;
    if p.profile_reps > MAX_PROFILE_REPS {
        return Err(invalid(
            "parallel.profile_reps",
            format!(
                "{} repetitions exceed the limit of {MAX_PROFILE_REPS}",
                p.profile_reps
            ),
        ));
    }
    for (field, v) in [("parallel.pp", p.pp), ("parallel.dp", p.dp)] {
        if v > MAX_PARALLEL {
            return Err(invalid(
                field,
                format!("{v} exceeds the limit of {MAX_PARALLEL}"),
            ));
        }
    }
    Ok(())
}

/// Widths and counts of the model's layers, then its memory against `memory`.
fn check_model(cfg: &TrainConfig, memory: u128) -> Result<(), ConfigError> {
    let m = &cfg.model;
    let widths: &[(&'static str, &[usize])] = &[
        ("model.hidden", &m.hidden),
        ("model.conv", &m.conv),
        ("model.cnn_hidden", std::slice::from_ref(&m.cnn_hidden)),
        ("model.d_model", std::slice::from_ref(&m.d_model)),
        ("model.d_ff", std::slice::from_ref(&m.d_ff)),
        ("model.context", std::slice::from_ref(&m.context)),
        ("model.heads", std::slice::from_ref(&m.heads)),
    ];
    for (field, values) in widths {
        if values.len() > MAX_LAYERS {
            return Err(invalid(
                field,
                format!("{} layers exceed the limit of {MAX_LAYERS}", values.len()),
            ));
        }
        if let Some(w) = values.iter().find(|&&w| w > MAX_WIDTH) {
            return Err(invalid(
                field,
                format!("a width of {w} exceeds the limit of {MAX_WIDTH}"),
            ));
        }
    }
    if m.blocks > MAX_LAYERS {
        return Err(invalid(
            "model.blocks",
            format!("{} blocks exceed the limit of {MAX_LAYERS}", m.blocks),
        ));
    }
    if matches!(
        cfg.data.dataset,
        DatasetKind::FashionMnist | DatasetKind::Mnist
    ) {
        read_idx_shapes(cfg).map_err(|e| invalid("data.dir", e.to_string()))?;
    }
    let data = dataset_bytes(cfg);
    let need = memory_estimate(cfg) + data;
    if need > memory {
        if data > need / 2 {
            return Err(invalid(
                "data.dir",
                format!(
                    "the {} dataset's images take about {} per worker (as its files' headers \
                     declare them) and the model about {} more, but this host has {} of memory",
                    cfg.data.dataset,
                    gib(data),
                    gib(need - data),
                    gib(memory)
                ),
            ));
        }
        let field = match m.kind {
            ModelKind::Transformer => "model.d_model",
            ModelKind::Cnn => "model.conv",
            ModelKind::Mlp => "model.hidden",
        };
        return Err(invalid(
            field,
            format!(
                "the model needs about {} per worker ({} parameters, {} of activations per \
                 micro-batch) but this host has {} of memory",
                gib(need),
                param_count(cfg),
                gib(activation_bytes(cfg)),
                gib(memory)
            ),
        ));
    }
    Ok(())
}

fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u128 << 30) as f64)
}

/// Features per sample and classes of a built-in dataset: an IDX dataset's image size from its
/// training images' header (only the header is read; a file that cannot be read is reported by
/// the loader, and is taken as 28×28 here).
fn input_shape(cfg: &TrainConfig) -> ([u128; 3], u128) {
    match cfg.data.dataset {
        DatasetKind::Digits => ([1, 8, 8], 10),
        DatasetKind::FashionMnist | DatasetKind::Mnist => {
            let shape = idx_shapes(cfg).map_or((28, 28), |[train, _]| (train.rows, train.cols));
            ([1, shape.0 as u128, shape.1 as u128], 10)
        }
        DatasetKind::Shakespeare => ([1, 28, 28], 10),
    }
}

/// The declared shapes of an IDX dataset's training and test images, from their headers.
fn idx_shapes(cfg: &TrainConfig) -> Option<[lockstep_data::IdxShape; 2]> {
    read_idx_shapes(cfg).ok().flatten()
}

/// [`idx_shapes`], with what is wrong with a header that exists (a declared size over the
/// loader's cap, a malformed header) as an error; `None` when a file is missing (the loader
/// names it, with where to get it).
fn read_idx_shapes(
    cfg: &TrainConfig,
) -> Result<Option<[lockstep_data::IdxShape; 2]>, lockstep_data::DataError> {
    let dir = crate::datasets::idx_dir(&cfg.data);
    let shape = |split| match lockstep_data::idx_images_shape(
        &lockstep_data::idx_files(&dir, split).images,
    ) {
        Ok(s) => Ok(Some(s)),
        Err(lockstep_data::DataError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    };
    let train = shape(lockstep_data::IdxSplit::Train)?;
    let test = shape(lockstep_data::IdxSplit::Test)?;
    Ok(train.zip(test).map(|(a, b)| [a, b]))
}

/// Bytes every worker holds for a built-in image dataset: its pixels (all images') as bytes while
/// loading and as `f32` features after (5 bytes per pixel), from the files' headers.
pub fn dataset_bytes(cfg: &TrainConfig) -> u128 {
    match cfg.data.dataset {
        DatasetKind::FashionMnist | DatasetKind::Mnist => idx_shapes(cfg).map_or(0, |shapes| {
            shapes.iter().map(|s| s.pixels() as u128 * 5).sum()
        }),
        DatasetKind::Digits | DatasetKind::Shakespeare => 0,
    }
}

/// Parameters of the configured model (u128: no width the limits admit can overflow it).
pub fn param_count(cfg: &TrainConfig) -> u128 {
    let m = &cfg.model;
    let ([c, h, w], classes) = input_shape(cfg);
    let dense = |widths: &[u128]| -> u128 { widths.windows(2).map(|p| p[0] * p[1] + p[1]).sum() };
    match m.kind {
        ModelKind::Transformer => {
            let (d, vocab, ctx) = (m.d_model as u128, 256u128, m.context as u128);
            let ff = if m.d_ff == 0 { 4 * d } else { m.d_ff as u128 };
            let block = 4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d;
            vocab * d + ctx * d + m.blocks as u128 * block + 2 * d + d * vocab + vocab
        }
        ModelKind::Cnn => {
            let mut params = 0u128;
            let (mut ch, mut hh, mut ww) = (c, h, w);
            for &out in &m.conv {
                params += ch * out as u128 * 9 + out as u128;
                ch = out as u128;
                hh /= 2;
                ww /= 2;
            }
            params + dense(&[ch * hh * ww, m.cnn_hidden as u128, classes])
        }
        ModelKind::Mlp => {
            let widths: Vec<u128> = std::iter::once(c * h * w)
                .chain(m.hidden.iter().map(|&x| x as u128))
                .chain(std::iter::once(classes))
                .collect();
            dense(&widths)
        }
    }
}

/// Margin on the activation estimate when refusing a config (burn's temporaries during backward).
const ACTIVATION_MARGIN: u128 = 2;
/// Parameter-sized copies burn keeps besides the loop's own buffers: `memory::BURN_COPIES` and
/// the autodiff graph's references to the parameters.
const BURN_COPIES: u128 = memory::BURN_COPIES as u128 + 1;

/// The largest vocabulary a character corpus can have (the limits hold before any is read).
const MAX_VOCAB: usize = 256;

/// Activation values one sample's forward keeps for its backward (`crate::memory`'s estimate).
pub fn activation_values_per_sample(cfg: &TrainConfig) -> u128 {
    match cfg.model.kind {
        ModelKind::Transformer => {
            let spec = transformer_spec(cfg, MAX_VOCAB);
            let kinds = std::iter::once(LayerKind::Embedding)
                .chain((0..cfg.model.blocks).map(LayerKind::Block))
                .chain(std::iter::once(LayerKind::Head));
            memory::transformer_held_values(&spec, kinds)
        }
        _ => {
            let (input, classes) = input_shape(cfg);
            memory::classifier_held_floats(cfg, input, classes)
        }
    }
}

/// Activation bytes of one micro-batch's forward and backward, with a margin.
pub fn activation_bytes(cfg: &TrainConfig) -> u128 {
    activation_values_per_sample(cfg) * cfg.train.microbatch as u128 * 4 * ACTIVATION_MARGIN
}

/// Bytes one worker needs at most: the model state of one worker holding every micro-batch of a
/// step ([`memory::predict`]: parameters, one gradient per micro-batch, the summed gradient and
/// its fixed-point accumulator, optimizer state) plus burn's parameter-sized copies and the
/// activations of one micro-batch with a margin.
pub fn memory_estimate(cfg: &TrainConfig) -> u128 {
    let params = param_count(cfg);
    let microbatches = (cfg.train.global_batch / cfg.train.microbatch.max(1)) as u128;
    // The shape's sizes are usize; the estimate is u128 so that no admitted width overflows it:
    // the parameter-sized terms are scaled here rather than inside `predict`.
    let per_param = memory::predict(&StateShape {
        stage_params: 1,
        local_microbatches: 0,
        optimizer_vectors: memory::optimizer_vectors(cfg),
        reproducible: cfg.dist.reproducible,
        largest_layer: 0,
        dp: 1,
        zero: 0,
        activation_bytes_per_microbatch: 0,
        peak_held: 1,
        streamed_last: false,
        steps_in_backward: false,
    })
    .model_state_bytes() as u128;
    params * (per_param + 4 * (microbatches + BURN_COPIES)) + activation_bytes(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConfigLoad;

    fn with(sets: &[&str]) -> Result<TrainConfig, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_toml_str("", "test", &sets)
    }

    /// An IDX dataset folder whose image files declare `count` images of `side`² pixels (headers
    /// only: the check reads nothing else).
    fn idx_headers(dir: &std::path::Path, count: u32, side: u32) {
        for (stem, n) in [("train", count), ("t10k", count / 6)] {
            let mut h = vec![0, 0, 8, 3];
            for v in [n, side, side] {
                h.extend_from_slice(&v.to_be_bytes());
            }
            std::fs::write(dir.join(format!("{stem}-images-idx3-ubyte")), h).unwrap();
        }
    }

    #[test]
    fn an_image_datasets_memory_comes_from_its_headers_not_from_28_by_28() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().display().to_string();
        let cfg = |side| {
            idx_headers(tmp.path(), 60_000, side);
            let mut c = with(&[]).unwrap();
            c.data.dataset = DatasetKind::Mnist;
            c.data.dir = dir.clone();
            c
        };
        let small = cfg(28);
        assert_eq!(input_shape(&small).0, [1, 28, 28]);
        // 70,000 images × 784 pixels × 5 bytes.
        assert_eq!(dataset_bytes(&small), 70_000 * 784 * 5);
        check(&small, 8 << 30).unwrap();
        // 2048 × 2048 images: the MLP's first layer and the images themselves are counted.
        idx_headers(tmp.path(), 120, 2048);
        let mut big = small.clone();
        big.model.hidden = vec![8];
        assert_eq!(input_shape(&big).0, [1, 2048, 2048]);
        assert_eq!(dataset_bytes(&big), (120 + 20) * 2048 * 2048 * 5);
        let e = check(&big, 2 << 30).unwrap_err();
        assert_eq!(field_of(e), "data.dir");
        // More than the loader would ever read: refused by the check, from the header alone.
        idx_headers(tmp.path(), 60_000, 2048);
        let e = check(&big, 8 << 30).unwrap_err().to_string();
        assert!(e.contains("data.dir"), "{e}");
    }

    fn field_of(e: ConfigError) -> &'static str {
        match e {
            ConfigError::Invalid { field, .. } => field,
            other => panic!("not a field error: {other}"),
        }
    }

    #[test]
    fn absurd_values_are_refused_naming_the_field() {
        for (set, field) in [
            ("dist.timeout_secs=1e19", "dist.timeout_secs"),
            ("dist.timeout_secs=1e300", "dist.timeout_secs"),
            ("train.steps=10000000000", "train.steps"),
            ("train.epochs=1000000000000", "train.epochs"),
            ("model.hidden=[1000000000]", "model.hidden"),
            ("model.hidden=[4611686018427387904]", "model.hidden"),
            ("model.hidden=[100000, 100000]", "model.hidden"),
            ("dist.bucket_elems=1000000000000", "dist.bucket_elems"),
            ("checkpoint.keep=1000000000", "checkpoint.keep"),
        ] {
            let steps0 = if set.starts_with("train.epochs") {
                vec![set, "train.steps=0"]
            } else {
                vec![set]
            };
            let e = with(&steps0).expect_err(set);
            assert_eq!(field_of(e), field, "{set}");
        }
    }

    #[test]
    fn a_transformers_shape_errors_name_their_own_field() {
        for (set, field) in [
            // A zero width is its own field's error, not the heads'.
            ("model.d_model=0", "model.d_model"),
            ("model.heads=3", "model.heads"),
            ("model.context=1", "model.context"),
        ] {
            let sets = [
                "model.kind=\"transformer\"",
                "data.dataset=\"shakespeare\"",
                set,
            ];
            let e = with(&sets).expect_err(set);
            assert_eq!(field_of(e), field, "{set}");
        }
    }

    #[test]
    fn shipped_sizes_fit_and_the_estimate_grows_with_the_model() {
        let small = with(&[]).unwrap();
        let big = with(&["model.hidden=[4096, 4096]"]).unwrap();
        assert!(memory_estimate(&big) > 100 * memory_estimate(&small));
        assert!(memory_estimate(&small) < 64 << 20);
        // A model that fits 24 GiB is refused on a 256 MiB host.
        let e = check(&big, 256 << 20).unwrap_err().to_string();
        assert!(
            e.contains("model.hidden") && e.contains("GiB of memory"),
            "{e}"
        );
    }
}

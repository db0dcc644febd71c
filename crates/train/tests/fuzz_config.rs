//! Fuzzing the config decoder (TOML text and `--set` overrides from outside): it never panics,
//! and whatever it accepts is usable — every duration converts, every size the limits admit fits
//! the host, so a worker cannot crash on a value that validation let through.
//!
//! Budget: `PROPTEST_CASES` (default 256 per property in `cargo test`). Findings are kept below as
//! named regression cases.

use lockstep_train::ConfigLoad;
use std::time::Duration;

use lockstep_train::limits::{self, MAX_TIMEOUT_SECS};
use lockstep_train::{ConfigError, TrainConfig};
use proptest::prelude::*;

/// Keys a user can set, with the kinds of values worth throwing at them.
const KEYS: &[&str] = &[
    "model.kind",
    "model.hidden",
    "model.conv",
    "model.cnn_hidden",
    "model.d_model",
    "model.heads",
    "model.blocks",
    "model.context",
    "model.d_ff",
    "data.dataset",
    "data.test_fraction",
    "train.steps",
    "train.epochs",
    "train.global_batch",
    "train.microbatch",
    "train.lr",
    "train.min_lr",
    "train.warmup_steps",
    "train.eval_every",
    "train.log_every",
    "optimizer.kind",
    "optimizer.momentum",
    "optimizer.beta1",
    "optimizer.eps",
    "dist.timeout_secs",
    "dist.bucket_elems",
    "dist.transport",
    "parallel.pp",
    "parallel.dp",
    "parallel.microbatches",
    "parallel.stage_cuts",
    "parallel.profile_reps",
    "parallel.prefetch_layers",
    "checkpoint.every",
    "checkpoint.keep",
];

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|v| v.to_string()),
        (0u32..40).prop_map(|e| (1u128 << e).to_string()),
        any::<f64>().prop_map(|v| format!("{v:e}")),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e300".to_string()),
        Just("-1".to_string()),
        prop::collection::vec(any::<u64>(), 0..4).prop_map(|v| format!("{v:?}")),
        prop::collection::vec(0u64..5000, 0..4).prop_map(|v| format!("{v:?}")),
        "[a-z\\-]{0,12}",
        Just("\"transformer\"".to_string()),
        Just("\"shakespeare\"".to_string()),
        Just("\"cnn\"".to_string()),
        Just("\"fashion-mnist\"".to_string()),
        Just("{ x = 1 }".to_string()),
        Just("true".to_string()),
    ]
}

/// What an accepted config promises the workers.
fn usable(c: &TrainConfig) {
    // The collective timeout converts to a Duration and can be added to an Instant.
    let d = Duration::from_secs_f64(c.dist.timeout_secs);
    assert!(c.dist.timeout_secs <= MAX_TIMEOUT_SECS);
    let _ = std::time::Instant::now() + d;
    assert!(c.train.steps <= limits::MAX_STEPS);
    assert!(c.train.global_batch.is_multiple_of(c.train.microbatch));
    assert!(limits::memory_estimate(c) <= limits::host_memory_bytes());
    // Identity and serialisation work on anything accepted.
    let again = TrainConfig::from_toml_str(&c.to_toml(), "resolved", &[]).expect("round trip");
    assert_eq!(&again, c);
    let _ = c.identity_hash();
}

proptest! {
    #[test]
    fn overrides_never_panic_and_accepted_configs_are_usable(
        sets in prop::collection::vec((0..KEYS.len(), value()), 1..6)
    ) {
        let sets: Vec<String> = sets.iter().map(|(k, v)| format!("{}={v}", KEYS[*k])).collect();
        match TrainConfig::from_toml_str("", "fuzz", &sets) {
            Ok(c) => usable(&c),
            Err(ConfigError::Invalid { field, .. }) => prop_assert!(field.contains('.')),
            Err(_) => {}
        }
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
        let _ = TrainConfig::from_toml_str(&text, "fuzz.toml", &[]);
    }

    #[test]
    fn mutated_shipped_configs_never_panic(
        which in 0usize..4,
        cut in any::<prop::sample::Index>(),
        insert in "[\\[\\]=\"a-z0-9.\\n ]{0,8}",
    ) {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/");
        let names = ["digits-mlp.toml", "fashion-mlp.toml", "bench-mlp784.toml", "shakespeare.toml"];
        let text = std::fs::read_to_string(format!("{root}{}", names[which])).unwrap();
        let mut at = cut.index(text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let mutated = format!("{}{insert}{}", &text[..at], &text[at..]);
        if let Ok(c) = TrainConfig::from_toml_str(&mutated, "fuzz.toml", &[]) {
            usable(&c);
        }
    }
}

/// The audit's findings, kept: each was a panic or an abort in every worker before.
#[test]
fn regression_values_that_crashed_workers_are_refused() {
    for set in [
        "dist.timeout_secs=1e19",
        "dist.timeout_secs=1e300",
        "train.steps=10000000000",
        "model.hidden=[1000000000]",
        "model.hidden=[4611686018427387904]",
    ] {
        let e = TrainConfig::from_toml_str("", "regression", &[set.to_string()]).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { .. }), "{set}: {e}");
    }
}

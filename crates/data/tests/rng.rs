//! The PRNG against published reference vectors, golden values, and distribution checks.

use lockstep_data::rng::{ln_unit, mix64};
use lockstep_data::Rng;

#[test]
fn xoshiro256starstar_reference_vector() {
    // Output of the authors' reference C code (xoshiro256starstar.c) from state {1, 2, 3, 4}.
    let mut r = Rng::from_state([1, 2, 3, 4]);
    let out: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
    assert_eq!(out, [11520, 0, 1509978240, 1215971899390074240]);
}

#[test]
fn splitmix64_reference_vector() {
    // splitmix64 seeded with 0: the first outputs of the reference implementation.
    let g = 0x9E37_79B9_7F4A_7C15u64;
    assert_eq!(mix64(g), 0xe220a8397b1dcdaf);
    assert_eq!(mix64(g.wrapping_mul(2)), 0x6e789e6aa1b965f4);
    assert_eq!(mix64(g.wrapping_mul(3)), 0x06c45d188009454f);
}

#[test]
fn golden_seeded_streams() {
    // Pinned (and cross-checked with an independent Python transcription): any change to
    // seeding changes every run's data order and initialisation.
    let mut r = Rng::new(42);
    assert_eq!(
        [r.next_u64(), r.next_u64(), r.next_u64()],
        [0x15780b2e0c2ec716, 0x6104d9866d113a7e, 0xae17533239e499a1]
    );
    let mut s = Rng::stream(42, 0);
    assert_eq!(
        [s.next_u64(), s.next_u64()],
        [0xd469c81cc8cc0c29, 0xf32feba53743e4ff]
    );
}

#[test]
fn golden_floats() {
    let mut r = Rng::new(42);
    let u: Vec<u32> = (0..3).map(|_| r.next_f32().to_bits()).collect();
    let mut r = Rng::new(42);
    let n: Vec<u32> = (0..4).map(|_| r.normal_f32().to_bits()).collect();
    assert_eq!(u, GOLDEN_UNIFORM);
    assert_eq!(n, GOLDEN_NORMAL);
}

/// f32 bits of the first uniforms and normals of `Rng::new(42)`, cross-checked with the Python
/// transcription (normals ≈ -0.72622, 0.22162, 0.46418, 1.47625).
const GOLDEN_UNIFORM: [u32; 3] = [1034666072, 1052903858, 1059985235];
const GOLDEN_NORMAL: [u32; 4] = [3208243583, 1046671632, 1055762598, 1069348286];

#[test]
fn ln_unit_matches_std_closely() {
    let mut r = Rng::new(1);
    for _ in 0..100_000 {
        let x = r.next_f64().max(f64::MIN_POSITIVE);
        let (ours, std) = (ln_unit(x), x.ln());
        assert!(
            (ours - std).abs() <= 4.0 * f64::EPSILON * std.abs().max(1.0),
            "ln({x}): {ours} vs {std}"
        );
    }
    for x in [
        1.0,
        0.5,
        0.25,
        1e-300,
        0.999_999_999,
        std::f64::consts::FRAC_1_SQRT_2,
    ] {
        assert!(
            (ln_unit(x) - x.ln()).abs() <= 4.0 * f64::EPSILON * x.ln().abs().max(1.0),
            "{x}"
        );
    }
    assert_eq!(ln_unit(1.0), 0.0);
}

#[test]
fn normal_moments() {
    let mut r = Rng::new(3);
    let n = 200_000;
    let xs: Vec<f64> = (0..n).map(|_| f64::from(r.normal_f32())).collect();
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
    let within_1 = xs.iter().filter(|x| x.abs() < 1.0).count() as f64 / n as f64;
    // Standard errors: mean 0.0022, variance 0.0032, P(|x|<1) 0.001.
    assert!(mean.abs() < 0.012, "mean {mean}");
    assert!((var - 1.0).abs() < 0.016, "variance {var}");
    assert!((within_1 - 0.682_689).abs() < 0.005, "P(|x|<1) {within_1}");
}

#[test]
fn uniform_ranges_and_bounded_integers() {
    let mut r = Rng::new(9);
    let mut counts = [0usize; 3];
    for _ in 0..30_000 {
        let f = r.next_f32();
        assert!((0.0..1.0).contains(&f));
        counts[r.below(3) as usize] += 1;
        assert_eq!(r.below(1), 0);
    }
    // Each count ~ Binomial(30000, 1/3): sd 82.
    assert!(
        counts.iter().all(|&c| (9_600..=10_400).contains(&c)),
        "{counts:?}"
    );
    // A bound just above 2^63 rejects about half of the draws; results stay below it and both
    // halves of the range appear.
    let bound = (1u64 << 63) + 1;
    let draws: Vec<u64> = (0..1000).map(|_| r.below(bound)).collect();
    assert!(draws.iter().all(|&d| d < bound));
    assert!(draws.iter().any(|&d| d < 1 << 62) && draws.iter().any(|&d| d > 3 << 61));
}

#[test]
fn shuffle_is_uniform_over_small_permutations() {
    // 3! = 6 orders, 60000 shuffles: each ~10000 (sd 91).
    let mut r = Rng::new(5);
    let mut counts = std::collections::HashMap::new();
    for _ in 0..60_000 {
        let mut v = [0u8, 1, 2];
        r.shuffle(&mut v);
        *counts.entry(v).or_insert(0usize) += 1;
    }
    assert_eq!(counts.len(), 6);
    assert!(
        counts.values().all(|&c| (9_500..=10_500).contains(&c)),
        "{counts:?}"
    );
}

#[test]
#[should_panic(expected = "state must not be all zero")]
fn zero_state_is_rejected() {
    Rng::from_state([0; 4]);
}

//! `lockstep bench` end to end with tiny settings (nothing here is timed): all four cases run
//! every repetition as real training runs, the JSON has its documented shape, the exact
//! two-worker runs end with the one-worker parameters, and bad input is refused before any run.

mod common;
use common::{assert_ok, lockstep};

/// The digits MLP, 4 micro-batches of 8 per step, 6 steps, no checkpoints.
const TINY: &[&str] = &[
    "train.global_batch=32",
    "train.microbatch=8",
    "train.steps=6",
    "train.eval_every=0",
    "train.log_every=1",
    "checkpoint.every=0",
];

fn config() -> String {
    format!(
        "{}/../../configs/digits-mlp.toml",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn bench(out: &std::path::Path, runs: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let config = config();
    let mut args = vec![
        "bench",
        "--config",
        &config,
        "--out",
        out.to_str().unwrap(),
        "--runs",
        runs.to_str().unwrap(),
    ];
    for s in TINY {
        args.extend_from_slice(&["--set", s]);
    }
    args.extend_from_slice(extra);
    lockstep(&args).output().expect("spawn lockstep")
}

#[test]
fn all_four_cases_run_and_exact_equals_one_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bench.json");
    let runs = tmp.path().join("runs");
    let o = bench(&out, &runs, &["--reps", "2"]);
    assert_ok(&o);
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();

    assert_eq!(j["reps"], 2);
    assert_eq!(j["nproc"], 2);
    assert_eq!(j["global_batch"], 32);
    assert_eq!(j["steps"], 6);
    assert!(j["machine"]["cores"].as_u64().unwrap() >= 1);
    assert!(!j["machine"]["cpu_model"].as_str().unwrap().is_empty());
    // The limit each case is read against: a measured peak, and the MLP's FLOPs per sample by
    // the 6-per-parameter count (digits: 64-128-64-10 plus biases).
    let peak = j["machine"]["gemm_peak_gflops_per_core"].as_f64().unwrap();
    assert!(peak.is_finite() && peak > 0.0, "{peak}");
    // The vector units: present exactly where the CPU has them, and never slower than the GEMM
    // built on them (f32).
    let m = &j["machine"];
    assert!(m["amx_bf16"].is_boolean());
    #[cfg(target_arch = "x86_64")]
    {
        let fma = &m["f32_fma_peak_gflops_per_core"];
        assert_eq!(
            fma.is_f64(),
            std::arch::is_x86_feature_detected!("avx512f"),
            "{m}"
        );
        if let Some(fma) = fma.as_f64() {
            assert!(fma > 0.5 * peak, "FMA peak {fma} against the GEMM's {peak}");
        }
        let bf16 = &m["bf16_dot_peak_gflops_per_core"];
        assert_eq!(
            bf16.is_f64(),
            std::arch::is_x86_feature_detected!("avx512bf16"),
            "{m}"
        );
    }
    let params = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10;
    assert_eq!(
        j["machine"]["model_flops_per_sample"].as_f64().unwrap(),
        6.0 * params as f64
    );

    let cases = j["cases"].as_array().unwrap();
    let names: Vec<&str> = cases.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["1x1", "2x1-exact", "2x1-plain", "2x1-nocomm"]);
    let workers: Vec<u64> = cases
        .iter()
        .map(|c| c["workers"].as_u64().unwrap())
        .collect();
    assert_eq!(workers, [1, 2, 2, 2]);
    for c in cases {
        let sps = &c["samples_per_sec"];
        let per_rep: Vec<f64> = sps["per_rep"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(per_rep.len(), 2, "{}: one value per repetition", c["name"]);
        assert!(per_rep.iter().all(|v| v.is_finite() && *v > 0.0), "{c}");
        let (min, max) = (sps["min"].as_f64().unwrap(), sps["max"].as_f64().unwrap());
        let median = sps["median"].as_f64().unwrap();
        assert!(min <= median && median <= max, "{c}");
        let gflops = c["gflops"]["median"].as_f64().unwrap();
        let flops = j["machine"]["model_flops_per_sample"].as_f64().unwrap();
        assert!(
            (gflops - median * flops / 1e9).abs() <= 1e-9 * gflops.max(1.0),
            "{c}"
        );
        let cores = c["workers"].as_f64().unwrap() * j["threads_per_worker"].as_f64().unwrap();
        let fraction = c["fraction_of_peak"].as_f64().unwrap();
        assert!((fraction - gflops / (cores * peak)).abs() < 1e-12, "{c}");
        assert_eq!(c["param_hashes"].as_array().unwrap().len(), 2);
        assert_eq!(c["median_step_ms"]["per_rep"].as_array().unwrap().len(), 2);
        // Every case sums gradients (the exact ones and the bound their own micro-batches too).
        let comm = c["communication_ms"]["per_rep"].as_array().unwrap();
        assert_eq!(comm.len(), 2, "{c}");
        assert!(comm.iter().all(|v| v.as_f64().unwrap() > 0.0), "{c}");
    }

    // Exact on two workers ends with the one-worker bits, every repetition; plain mode does not
    // promise it, and the no-communication jobs train on half batches (another model).
    let hashes = |i: usize| -> Vec<String> {
        cases[i]["param_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_string())
            .collect()
    };
    let one = hashes(0);
    assert_eq!(one[0].len(), 64);
    assert_eq!(one[0], one[1], "one worker is reproducible run to run");
    assert_eq!(hashes(1), one, "2x1 exact has the 1x1 parameters");
    assert_ne!(hashes(3)[0], one[0], "the bound's jobs see half batches");
    assert_eq!(j["exact_matches_one_worker"], true);

    // Every repetition of every case was a real training run with its own directory; the bound
    // ran two one-worker jobs with half the global batch each.
    for (case, jobs) in [
        ("1x1", 1),
        ("2x1-exact", 1),
        ("2x1-plain", 1),
        ("2x1-nocomm", 2),
    ] {
        for rep in 1..=2 {
            for job in 0..jobs {
                let dir = runs.join(format!("{case}-r{rep}-j{job}"));
                let s = common::summary(&dir);
                let expect_world = if case == "1x1" || case == "2x1-nocomm" {
                    1
                } else {
                    2
                };
                assert_eq!(s["world_size"], expect_world, "{}", dir.display());
                let batch = if case == "2x1-nocomm" { 16 } else { 32 };
                assert_eq!(s["global_batch"], batch, "{}", dir.display());
                assert_eq!(
                    s["reproducible"],
                    case != "2x1-plain" && case != "2x1-nocomm"
                );
            }
        }
    }

    let ratios = j["ratios"].as_array().unwrap();
    let names: Vec<&str> = ratios.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "exact/plain",
            "exact/1x1",
            "plain/1x1",
            "exact/nocomm",
            "plain/nocomm",
            "nocomm/1x1"
        ]
    );
    let c = |i: usize| cases[i]["samples_per_sec"]["median"].as_f64().unwrap();
    let exact_plain = ratios[0]["of_medians"].as_f64().unwrap();
    assert!((exact_plain - c(1) / c(2)).abs() < 1e-9 * exact_plain);

    // The table names every case and the hash check.
    let table = String::from_utf8_lossy(&o.stdout);
    for n in ["1x1", "2x1-exact", "2x1-plain", "2x1-nocomm", "exact/plain"] {
        assert!(table.contains(n), "{table}");
    }
    assert!(
        table.contains("2x1-exact ends with the 1x1 parameters: yes"),
        "{table}"
    );
}

#[test]
fn bad_input_is_refused_before_any_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bench.json");
    let runs = tmp.path().join("runs");
    // 32 samples cannot be split into whole micro-batches of 8 over 3 independent jobs.
    let o = bench(&out, &runs, &["--nproc", "3"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("train.global_batch"), "{err}");
    assert!(!runs.exists() && !out.exists(), "nothing written");
    // A bad --set names the key.
    let o = bench(&out, &runs, &["--set", "train.steps=x"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(!runs.exists() && !out.exists(), "nothing written");
}

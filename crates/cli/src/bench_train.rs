//! `lockstep bench`: the training benchmark behind docs/src/performance.md's figures, in one
//! invocation so that its cases see the same machine.
//!
//! Four cases on one config: one worker (`1x1`), `N` workers exact (`Nx1-exact`, the default
//! `dist.reproducible = true`), `N` workers plain (`Nx1-plain`, `dist.reproducible = false`), and
//! the no-communication bound (`Nx1-nocomm`): `N` independent one-worker jobs started together,
//! each with `1/N` of the global batch, so every process computes and steps the optimizer exactly
//! as a worker of the `N`-worker job does, on the same shared cores, but never talks to another —
//! the speed `N` workers would reach if gradient exchange were free. No setting is needed for it
//! (a one-worker job never communicates), so nothing in `lockstep train` can be left in a
//! "do not communicate" mode by mistake.
//!
//! Every case is a real `lockstep train` run (a child process of this binary, logs in the runs
//! directory). The cases are interleaved: repetition `k` runs all of them, starting one case
//! further along each time, so a machine that slows down or speeds up during the benchmark (other
//! jobs on shared cores) moves every case alike instead of one. A run's speed is the global batch
//! over the median step time of its slowest rank, warm-up steps skipped, as `lockstep scale`
//! computes it (`lockstep_report::scaling`); the no-communication case takes the slowest of its
//! independent jobs.

use lockstep_train::ConfigLoad;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;
use lockstep_report::scaling::{self, Layout, Run};
use lockstep_train::metrics::median;
use lockstep_train::TrainConfig;
use serde::Serialize;

/// `lockstep bench`'s arguments.
#[derive(Args, Clone)]
pub struct BenchTrainArgs {
    /// TOML config to benchmark.
    #[arg(long, default_value = "configs/bench-mlp784.toml")]
    config: PathBuf,
    /// Workers of the parallel cases (the baseline is always one worker).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Repetitions of every case (interleaved).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Compute threads per worker, the same in every case.
    #[arg(long, default_value_t = 1)]
    threads_per_worker: usize,
    /// Override a config value in every case, e.g. --set train.steps=100 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Where the JSON results go.
    #[arg(long, default_value = "bench.json")]
    out: PathBuf,
    /// Scratch directory for the runs and their logs (replaced run by run).
    #[arg(long, default_value = "runs/bench")]
    runs: PathBuf,
}

/// The benchmark's results (`--out`).
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub config: String,
    pub sets: Vec<String>,
    pub nproc: usize,
    pub reps: usize,
    pub threads_per_worker: usize,
    pub global_batch: usize,
    pub steps: u64,
    /// Steps skipped as warm-up in every run.
    pub warmup_steps: u64,
    pub machine: Machine,
    pub cases: Vec<CaseResult>,
    pub ratios: Vec<Ratio>,
    /// Whether the exact `N`-worker runs ended with the one-worker parameters (same `param_hash`).
    pub exact_matches_one_worker: bool,
}

/// Facts about the host the figures belong to.
#[derive(Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs this process may use.
    pub cores: usize,
    /// `model name` from /proc/cpuinfo ("unknown" elsewhere).
    pub cpu_model: String,
    /// 1-minute load average when the benchmark started (other work on the machine).
    pub load_average: Option<f64>,
    /// One core's measured f32 matrix-multiply peak, GFLOP/s: the kernel set the dense layers
    /// use, single-threaded, on square products of `gemm_peak_n` (`lockstep_model::measure_gemm_peak`).
    pub gemm_peak_gflops_per_core: f64,
    pub gemm_peak_n: usize,
    /// One core's vector units with no memory in the way, GFLOP/s
    /// (`lockstep_model::measure_instruction_peaks`): AVX-512 f32 FMAs and AVX512-BF16 dot
    /// products (`None` where the CPU lacks them), and whether CPUID reports AMX-BF16 tiles.
    pub f32_fma_peak_gflops_per_core: Option<f64>,
    pub bf16_dot_peak_gflops_per_core: Option<f64>,
    pub amx_bf16: bool,
    /// Training FLOPs of one sample (forward and backward) of the config's model, by the usual
    /// count: 6 per dense parameter, plus the transformer's attention (`12·L·d·T²`); `None` where
    /// lockstep has no count (the CNN's convolutions, a user's job).
    pub model_flops_per_sample: Option<f64>,
}

/// One case over all repetitions.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    pub name: String,
    pub workers: usize,
    pub reproducible: bool,
    /// False for the no-communication bound.
    pub communicates: bool,
    pub samples_per_sec: Spread,
    pub median_step_ms: Spread,
    /// The slowest rank's median communication per step (exposed: summing its gradients with
    /// the other ranks'; for one worker and the bound, summing its own micro-batches). A
    /// repetition far above the others of its case ran while communication was slow on the
    /// machine (docs/src/performance.md, "Training benchmark").
    pub communication_ms: Spread,
    /// `param_hash` of every repetition (of the first job, for the no-communication bound).
    pub param_hashes: Vec<String>,
    /// Achieved training GFLOP/s (`model_flops_per_sample` × samples/s) and that over the peak
    /// of the cores the case computes on (workers × threads per worker × one core's peak).
    pub gflops: Option<Spread>,
    pub fraction_of_peak: Option<f64>,
}

/// Per-repetition values and their median, min and max.
#[derive(Debug, Serialize)]
pub struct Spread {
    pub per_rep: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(per_rep: Vec<f64>) -> Spread {
        Spread {
            median: median(per_rep.clone()),
            min: per_rep.iter().copied().fold(f64::INFINITY, f64::min),
            max: per_rep.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            per_rep,
        }
    }
}

/// `of` over `to` in samples/s: the ratio of the medians, and the ratios within each repetition
/// (the cases of one repetition ran back to back).
#[derive(Debug, Serialize)]
pub struct Ratio {
    pub name: String,
    pub of: String,
    pub to: String,
    pub of_medians: f64,
    pub per_rep: Spread,
}

/// What one case runs.
struct Case {
    name: String,
    /// Workers of one job.
    workers: usize,
    /// Independent jobs started together (the no-communication bound) or 1.
    jobs: usize,
    reproducible: bool,
}

impl Case {
    fn communicates(&self) -> bool {
        self.jobs == 1 && self.workers > 1
    }

    /// The case's overrides after the user's.
    fn sets(&self, user: &[String], global_batch: usize) -> Vec<String> {
        let mut sets = user.to_vec();
        sets.push(format!("dist.reproducible={}", self.reproducible));
        if self.jobs > 1 {
            sets.push(format!("train.global_batch={}", global_batch / self.jobs));
        }
        sets
    }
}

fn cases(n: usize) -> Vec<Case> {
    let case = |name: String, workers, jobs, reproducible| Case {
        name,
        workers,
        jobs,
        reproducible,
    };
    vec![
        case("1x1".into(), 1, 1, true),
        case(format!("{n}x1-exact"), n, 1, true),
        case(format!("{n}x1-plain"), n, 1, false),
        case(format!("{n}x1-nocomm"), 1, n, false),
    ]
}

/// Run the benchmark: print the table, write the JSON.
pub fn run(a: BenchTrainArgs) -> Result<()> {
    crate::flags::count("--nproc", a.nproc, 2, crate::flags::MAX_LOCAL_WORKERS)?;
    crate::flags::count("--reps", a.reps, 1, 10_000)?;
    crate::flags::threads("--threads-per-worker", a.threads_per_worker)?;
    crate::flags::output_file("--out", &a.out)?;
    let cases = cases(a.nproc);
    // Every case's config is checked before the first run (bad input: exit status 3).
    let base = TrainConfig::load_for(crate::job(), Some(&a.config), &a.sets)?;
    let (global_batch, microbatch) = (base.train.global_batch, base.train.microbatch);
    if global_batch % (a.nproc * microbatch) != 0 {
        return Err(lockstep_train::ConfigError::Invalid {
            field: "train.global_batch",
            message: format!(
                "{global_batch} must be a multiple of --nproc ({}) × train.microbatch \
                 ({microbatch}), so that each no-communication job gets whole micro-batches",
                a.nproc
            ),
        }
        .into());
    }
    for c in &cases {
        TrainConfig::load_for(
            crate::job(),
            Some(&a.config),
            &c.sets(&a.sets, global_batch),
        )
        .with_context(|| format!("case {}", c.name))?;
    }
    std::fs::create_dir_all(&a.runs).with_context(|| format!("creating {}", a.runs.display()))?;
    let machine = machine(&base);
    eprintln!(
        "lockstep bench: {} cases × {} repetitions on {} ({} cores, {}), runs in {}",
        cases.len(),
        a.reps,
        a.config.display(),
        machine.cores,
        machine.cpu_model,
        a.runs.display()
    );

    // [case][rep]
    let mut results: Vec<Vec<Measured>> = vec![Vec::new(); cases.len()];
    let mut steps = 0;
    for rep in 0..a.reps {
        for i in 0..cases.len() {
            let c = (i + rep) % cases.len();
            let case = &cases[c];
            eprintln!(
                "lockstep bench: repetition {}/{}: {}",
                rep + 1,
                a.reps,
                case.name
            );
            let runs = run_case(&a, case, rep, global_batch)?;
            steps = runs[0].summary.steps;
            results[c].push(measure(case, &runs));
        }
    }

    let report = assemble(&a, cases, results, global_batch, steps, machine);
    print!("{}", format_table(&report));
    let json = serde_json::to_string_pretty(&report)? + "\n";
    lockstep_train::write_atomic(&a.out, json.as_bytes())
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("lockstep bench: wrote {}", a.out.display());
    Ok(())
}

/// A run's log file, replaced each repetition; never opened through a link or as a device.
fn create_log(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    lockstep_train::files::check_output_path(path)
        .map_err(|e| crate::request::BadRequest(e.to_string()))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))
}

/// Run one repetition of `case`: its job(s) as `lockstep train` child processes, all started
/// before any is waited for; returns each job's run.
fn run_case(a: &BenchTrainArgs, case: &Case, rep: usize, global_batch: usize) -> Result<Vec<Run>> {
    let exe = std::env::current_exe().context("finding this program to run `train`")?;
    let mut children = Vec::new();
    for j in 0..case.jobs {
        let dir = a.runs.join(format!("{}-r{}-j{}", case.name, rep + 1, j));
        let log_path = dir.with_extension("log");
        let log = create_log(&log_path)?;
        let mut cmd = Command::new(&exe);
        cmd.arg("train")
            .arg("--config")
            .arg(&a.config)
            .args(["--nproc", &case.workers.to_string()])
            .args(["--threads-per-worker", &a.threads_per_worker.to_string()])
            .args(["--max-restarts", "0", "--overwrite"])
            .arg("--out")
            .arg(&dir);
        for s in case.sets(&a.sets, global_batch) {
            cmd.args(["--set", &s]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        children.push((child, dir, log_path));
    }
    let mut runs = Vec::new();
    let mut failed = None;
    for (mut child, dir, log_path) in children {
        let status = child.wait().context("waiting for a benchmark run")?;
        if !status.success() && failed.is_none() {
            failed = Some((status, log_path));
        } else if status.success() {
            let (summary, records) = crate::scale::load_run(&dir)?;
            runs.push(Run {
                layout: Layout {
                    name: case.name.clone(),
                    dp: case.workers,
                    tp: 1,
                    pp: 1,
                },
                summary,
                records,
            });
        }
    }
    if let Some((status, log)) = failed {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(10).collect();
        bail!(
            "case {} (repetition {}) failed ({status}); the end of {}:\n{}",
            case.name,
            rep + 1,
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(runs)
}

/// A repetition's samples/s, median step seconds and parameter hash: of its one job, or of the
/// slowest of its independent jobs (whose global batches add up to the case's).
/// One repetition of one case.
#[derive(Debug, Clone)]
struct Measured {
    samples_per_sec: f64,
    /// Median step of the slowest rank (of the slower job for the bound).
    step_seconds: f64,
    /// That rank's median communication per step (the bound's: summing its own micro-batches).
    communication_seconds: f64,
    param_hash: String,
}

fn measure(case: &Case, runs: &[Run]) -> Measured {
    let points = scaling::compare(runs);
    let slowest = points
        .points
        .iter()
        .max_by(|a, b| a.median_step_seconds.total_cmp(&b.median_step_seconds))
        .expect("a case runs at least one job");
    let batch: usize = runs.iter().map(|r| r.summary.global_batch).sum();
    debug_assert_eq!(runs.len(), case.jobs);
    Measured {
        samples_per_sec: batch as f64 / slowest.median_step_seconds,
        step_seconds: slowest.median_step_seconds,
        communication_seconds: slowest.communication,
        param_hash: runs[0].summary.param_hash.clone(),
    }
}

fn assemble(
    a: &BenchTrainArgs,
    cases: Vec<Case>,
    results: Vec<Vec<Measured>>,
    global_batch: usize,
    steps: u64,
    machine: Machine,
) -> BenchReport {
    let case_results: Vec<CaseResult> = cases
        .iter()
        .zip(&results)
        .map(|(c, r)| CaseResult {
            name: c.name.clone(),
            workers: c.workers * c.jobs,
            reproducible: c.reproducible,
            communicates: c.communicates(),
            samples_per_sec: Spread::of(r.iter().map(|x| x.samples_per_sec).collect()),
            median_step_ms: Spread::of(r.iter().map(|x| x.step_seconds * 1e3).collect()),
            communication_ms: Spread::of(r.iter().map(|x| x.communication_seconds * 1e3).collect()),
            param_hashes: r.iter().map(|x| x.param_hash.clone()).collect(),
            gflops: None,
            fraction_of_peak: None,
        })
        .map(|mut c| {
            if let Some(flops) = machine.model_flops_per_sample {
                let gflops = Spread::of(
                    c.samples_per_sec
                        .per_rep
                        .iter()
                        .map(|sps| sps * flops / 1e9)
                        .collect(),
                );
                let cores = (c.workers * a.threads_per_worker) as f64;
                c.fraction_of_peak =
                    Some(gflops.median / (cores * machine.gemm_peak_gflops_per_core));
                c.gflops = Some(gflops);
            }
            c
        })
        .collect();
    let ratio = |name: &str, of: usize, to: usize| Ratio {
        name: name.into(),
        of: cases[of].name.clone(),
        to: cases[to].name.clone(),
        of_medians: case_results[of].samples_per_sec.median
            / case_results[to].samples_per_sec.median,
        per_rep: Spread::of(
            results[of]
                .iter()
                .zip(&results[to])
                .map(|(x, y)| x.samples_per_sec / y.samples_per_sec)
                .collect(),
        ),
    };
    let ratios = vec![
        ratio("exact/plain", 1, 2),
        ratio("exact/1x1", 1, 0),
        ratio("plain/1x1", 2, 0),
        ratio("exact/nocomm", 1, 3),
        ratio("plain/nocomm", 2, 3),
        // The ceiling of the speedups above: what N workers give on this machine when they never
        // talk.
        ratio("nocomm/1x1", 3, 0),
    ];
    let one = &case_results[0].param_hashes;
    let exact_matches_one_worker = case_results[1]
        .param_hashes
        .iter()
        .chain(one)
        .all(|h| *h == one[0]);
    BenchReport {
        config: a.config.display().to_string(),
        sets: a.sets.clone(),
        nproc: a.nproc,
        reps: a.reps,
        threads_per_worker: a.threads_per_worker,
        global_batch,
        steps,
        warmup_steps: scaling::warmup_steps(steps),
        machine,
        cases: case_results,
        ratios,
        exact_matches_one_worker,
    }
}

fn machine(cfg: &TrainConfig) -> Machine {
    let cpu_model = lockstep_train::device::cpu_model().unwrap_or_else(|| "unknown".into());
    let load_average = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok());
    // Before any case runs, on this (otherwise idle) thread.
    let peak = lockstep_model::measure_gemm_peak(512, std::time::Duration::from_millis(300), 5);
    let units = lockstep_model::measure_instruction_peaks(std::time::Duration::from_millis(100), 3);
    Machine {
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
        load_average,
        gemm_peak_gflops_per_core: peak.gflops,
        gemm_peak_n: peak.n,
        f32_fma_peak_gflops_per_core: units.f32_fma_gflops,
        bf16_dot_peak_gflops_per_core: units.bf16_dot_gflops,
        amx_bf16: units.amx_bf16,
        model_flops_per_sample: model_flops_per_sample(cfg),
    }
}

/// Training FLOPs of one sample of a built-in model (see `Machine::model_flops_per_sample`).
/// The transformer's parameters are counted with a 256-symbol vocabulary (the limits' upper
/// bound), a few percent above the embedded corpora's.
fn model_flops_per_sample(cfg: &TrainConfig) -> Option<f64> {
    use lockstep_run::config::ModelKind;
    if crate::job().name() != "lockstep" {
        return None;
    }
    let dense = 6.0 * lockstep_train::limits::param_count(cfg) as f64;
    let m = &cfg.model;
    match m.kind {
        ModelKind::Mlp => Some(dense),
        ModelKind::Transformer => {
            let t = m.context as f64;
            Some(dense * t + 12.0 * m.blocks as f64 * m.d_model as f64 * t * t)
        }
        ModelKind::Cnn => None,
    }
}

/// One core's vector units, as `lockstep bench` prints them.
fn units_line(m: &Machine) -> String {
    let rate = |r: Option<f64>| r.map_or("none".to_string(), |g| format!("{g:.1} GFLOP/s"));
    format!(
        "its vector units: f32 FMA {}, bf16 dot products (AVX512-BF16) {}, AMX-BF16 tiles {}\n",
        rate(m.f32_fma_peak_gflops_per_core),
        rate(m.bf16_dot_peak_gflops_per_core),
        if m.amx_bf16 {
            "reported"
        } else {
            "not reported"
        }
    )
}

/// The table `lockstep bench` prints.
pub fn format_table(r: &BenchReport) -> String {
    let mut s = format!(
        "{} × {} repetitions, interleaved; {} steps (first {} skipped), global batch {}, \
         {} thread(s) per worker; {} cores ({})\n",
        r.config,
        r.reps,
        r.steps,
        r.warmup_steps,
        r.global_batch,
        r.threads_per_worker,
        r.machine.cores,
        r.machine.cpu_model
    );
    s += &format!(
        "one core's f32 matrix-multiply peak: {:.1} GFLOP/s ({}³ products, single-threaded)\n",
        r.machine.gemm_peak_gflops_per_core, r.machine.gemm_peak_n
    );
    s += &units_line(&r.machine);
    s += &format!(
        "{:<12} {:>7} {:>12} {:>17} {:>9} {:>17} {:>8} {:>9} {:>7}\n",
        "case",
        "workers",
        "samples/s",
        "min–max",
        "step_ms",
        "comm_ms (min–max)",
        "hash",
        "GFLOP/s",
        "% peak"
    );
    for c in &r.cases {
        let (sps, comm) = (&c.samples_per_sec, &c.communication_ms);
        let (gflops, peak) = match (&c.gflops, c.fraction_of_peak) {
            (Some(g), Some(f)) => (format!("{:.1}", g.median), format!("{:.0}%", 100.0 * f)),
            _ => ("–".into(), "–".into()),
        };
        s += &format!(
            "{:<12} {:>7} {:>12.0} {:>17} {:>9.2} {:>17} {:>8} {:>9} {:>7}\n",
            c.name,
            c.workers,
            sps.median,
            format!("{:.0}–{:.0}", sps.min, sps.max),
            c.median_step_ms.median,
            format!("{:.2} ({:.2}–{:.2})", comm.median, comm.min, comm.max),
            c.param_hashes.first().map_or("", |h| &h[..8.min(h.len())]),
            gflops,
            peak
        );
    }
    for q in &r.ratios {
        s += &format!(
            "{:<13} {:.3} (per repetition {:.3}–{:.3})\n",
            q.name, q.of_medians, q.per_rep.min, q.per_rep.max
        );
    }
    s += &format!(
        "{} ends with the 1x1 parameters: {}\n",
        r.cases[1].name,
        if r.exact_matches_one_worker {
            "yes"
        } else {
            "NO"
        }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_split_the_batch_only_for_the_bound() {
        let c = cases(2);
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["1x1", "2x1-exact", "2x1-plain", "2x1-nocomm"]);
        assert_eq!(
            c[3].sets(&["train.steps=3".into()], 256),
            [
                "train.steps=3",
                "dist.reproducible=false",
                "train.global_batch=128"
            ]
        );
        assert_eq!(c[1].sets(&[], 256), ["dist.reproducible=true"]);
        assert!(c[1].communicates() && !c[3].communicates() && !c[0].communicates());
    }

    #[test]
    fn a_spread_has_the_median_and_the_range() {
        let s = Spread::of(vec![3.0, 1.0, 2.0, 10.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert_eq!(s.per_rep, [3.0, 1.0, 2.0, 10.0]);
    }
}

//! `lockstep plan`: predicted step time, speedup and efficiency of layouts on a described cluster,
//! calibrated from a finished run. The model is `lockstep_report::plan` (equations and validation:
//! docs/src/plan.md); this file reads the run directory and the cluster description and prints.

use std::path::Path;

use anyhow::{bail, Context, Result};
use lockstep_report::plan::{self, ClusterSpec, Layer, Plan, PlanError, Workload};
use lockstep_train::job::{JobSpec, Trainable};
use lockstep_train::{ConfigLoad, TrainConfig};

use crate::request::BadRequest;
use crate::{flags, PlanArgs};

pub fn run(a: &PlanArgs) -> Result<()> {
    if let Some(path) = &a.json {
        flags::output_file("--json", path)?;
    }
    let cfg = TrainConfig::load_for(crate::job(), Some(&a.from.join("config.toml")), &[])
        .with_context(|| format!("reading the config of run {}", a.from.display()))?;
    let (summary, records) = crate::scale::load_run(&a.from)?;
    let (layers, tp_pieces) = model_layers(crate::job(), &cfg)
        .with_context(|| format!("building the model of run {}", a.from.display()))?;
    let mut workload = Workload::from_config(&cfg, layers);
    workload.tp_pieces = tp_pieces;
    let cluster = cluster_spec(a)?.resolve()?;
    let link =
        plan::calibration_link(&summary.transport, a.calib_gbytes_per_s, a.calib_latency_us)?;
    let cal = plan::calibrate(&summary, &records, &workload, &link)
        .with_context(|| format!("calibrating from run {}", a.from.display()))?;
    // Calibrated on what the run did; predicted for the level asked for.
    match a.zero {
        Some(z) if z > 3 => {
            return Err(BadRequest(format!("--zero {z}: ZeRO levels are 0, 1, 2 and 3")).into())
        }
        Some(z) => workload.zero = z,
        None => {}
    }
    let layouts = a
        .layouts
        .as_deref()
        .map(plan::parse_layouts)
        .transpose()
        .context("--layouts")?;
    let limit = match a.memory_gib {
        Some(g) if !(g.is_finite() && g > 0.0 && g <= 1e9) => {
            return Err(BadRequest(format!(
                "--memory-gib {g}: must be a positive number of GiB (at most 1e9)"
            ))
            .into())
        }
        g => g.map(plan::gib_bytes),
    };
    let p = plan::plan(&cluster, &workload, &cal, layouts.as_deref(), limit);
    print!("{}", format_plan(&p, &a.from));
    if let Some(run_plan) = &summary.plan {
        println!(
            "the calibration run's parallel plan: {}",
            run_plan.describe()
        );
    }
    if let Some(path) = &a.json {
        lockstep_train::write_atomic(path, (serde_json::to_string_pretty(&p)? + "\n").as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("lockstep plan: wrote {}", path.display());
    }
    if let Some(note) = &p.memory_note {
        bail!("{note} (--memory-gib)");
    }
    if p.recommendation.is_none() {
        bail!("no layout fits this cluster and config (see the skipped lines above)");
    }
    Ok(())
}

/// The layers of `job`'s model for `cfg`, as the trainer builds it, and the fixed
/// tensor-parallel pieces of its layers (1: none). Not pure: it opens the job's data (for the
/// input shape and classes, or the vocabulary). A layered model (the built-in transformer, a
/// user's `LayeredJob`, whose `lockstep::tp` layers give its pieces and split parameters) has its
/// layers; any other job is one layer of its replica's parameter count.
fn model_layers(job: &dyn JobSpec, cfg: &TrainConfig) -> Result<(Vec<Layer>, usize), PlanError> {
    let model_err = |e: &dyn std::fmt::Display| PlanError::Model(e.to_string());
    // Shapes only: the CPU serves whatever device the run will use.
    let cpu = lockstep_train::device::Placement::cpu();
    Ok(match job.build(cfg, &cpu).map_err(|e| model_err(&e))? {
        Trainable::Layered(model) => {
            let offsets = model.layer_offsets();
            let floats = model.activation_floats();
            let layers = (0..model.num_layers())
                .map(|l| Layer {
                    name: model.layer_name(l),
                    params: offsets[l + 1] - offsets[l],
                    activation_bytes_per_sample: floats[l] * 4,
                    held_activation_bytes_per_sample: model.held_activation_floats(l..l + 1) * 4,
                    tp_split_params: model.tp_split_params(l),
                })
                .collect();
            (layers, model.tp_pieces())
        }
        Trainable::Replica(replica) => (
            vec![Layer {
                name: job.label(cfg),
                params: replica.layout().iter().map(|p| p.len).sum(),
                activation_bytes_per_sample: 0,
                held_activation_bytes_per_sample: replica.activation_bytes(1) as usize,
                tp_split_params: 0,
            }],
            1,
        ),
    })
}

/// The cluster file, if any, with the flags over it.
fn cluster_spec(a: &PlanArgs) -> Result<ClusterSpec> {
    let file = match &a.cluster {
        Some(path) => {
            let text = flags::small_file("--cluster", path, 1 << 20)?;
            ClusterSpec::from_toml_str(&text, &path.display().to_string())?
        }
        None => ClusterSpec::default(),
    };
    let given = ClusterSpec {
        nodes: a.nodes,
        workers_per_node: a.workers_per_node,
        link_gbps: a.link_gbps,
        link_latency_us: a.link_latency_us,
        link_burst_kib: a.link_burst_kib,
        link_efficiency: a.link_efficiency,
        intra_gbytes_per_s: a.intra_gbytes_per_s,
        intra_latency_us: a.intra_latency_us,
        shm_gbytes_per_s: a.shm_gbytes_per_s,
        shm_latency_us: a.shm_latency_us,
        compute_scale: a.compute_scale,
    };
    let spec = given.or(file);
    if let Some(n) = spec.nodes {
        flags::count("--nodes", n, 1, flags::MAX_NODES)?;
    }
    if let Some(n) = spec.workers_per_node {
        flags::count("--workers-per-node", n, 1, flags::MAX_LOCAL_WORKERS)?;
    }
    Ok(spec)
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

/// The calibration, the cluster, one row per layout, the skipped layouts and the recommendation.
pub fn format_plan(p: &Plan, from: &Path) -> String {
    let c = &p.calibration;
    let mut s = format!(
        "calibration: {} ({} worker(s), dp {} × pp {}, {}), {} steady steps, measured step {} ms\n",
        from.display(),
        c.world,
        c.dp,
        c.pp,
        c.transport,
        c.steps_used,
        ms(c.measured_step_s)
    );
    s += &format!(
        "  compute {:.4} ms/sample; optimizer {} ms; other {} ms; gradient sync {} ms = CPU {} ms + its links {} ms (modelled: {:.2} GB/s, {:.0} µs)\n",
        c.work_per_sample_s * 1e3,
        ms(c.optimizer_per_param_s * p.workload.params as f64),
        ms(c.overhead_s),
        ms(c.measured_sync_s),
        ms((c.measured_sync_s - c.modelled_network_s).max(0.0)),
        ms(c.modelled_network_s),
        c.link.bytes_per_s / 1e9,
        c.link.latency_s * 1e6
    );
    let (mb, rb) = (
        c.modelled_bytes_per_rank_step,
        c.measured_bytes_per_rank_step,
    );
    let agree = if rb > 0.0 && ((mb - rb) / rb).abs() <= 0.01 {
        "agree".to_string()
    } else if rb > 0.0 {
        format!("differ by {:+.1}%", 100.0 * (mb / rb - 1.0))
    } else {
        "the run sent nothing".to_string()
    };
    s += &format!(
        "  bytes sent per rank per step: model {:.0}, run {:.0} ({agree}); {} parameters; layer costs: {}\n",
        mb, rb, p.workload.params, c.layer_shares_from
    );
    for n in &c.notes {
        s += &format!("  note: {n}\n");
    }
    let k = &p.cluster;
    let link = |l: &plan::Link| {
        format!(
            "{:.3} GB/s, {:.0} µs",
            l.bytes_per_s / 1e9,
            l.latency_s * 1e6
        )
    };
    s += &format!(
        "cluster: {} node(s) × {} worker(s); between nodes {}{}; inside a node: tcp {}, shm {}; compute ×{}\n",
        k.nodes,
        k.workers_per_node,
        link(&k.inter),
        if k.inter.burst_bytes > 0.0 {
            format!(", bucket {:.0} KiB", k.inter.burst_bytes / 1024.0)
        } else {
            String::new()
        },
        link(&k.intra),
        link(&k.shm),
        k.compute_scale
    );
    s += &format!(
        "{:<14} {:>7} {:>5} {:>5} {:>9} {:>10} {:>9} {:>7} {:>8} {:>7} {:>9} {:>9}\n",
        "layout",
        "workers",
        "nodes",
        "via",
        "step_ms",
        "compute_ms",
        "comm_ms",
        "bubble",
        "speedup",
        "effic.",
        "state_GiB",
        "peak_GiB"
    );
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for x in &p.predictions {
        s += &format!(
            "{:<14} {:>7} {:>5} {:>5} {:>9} {:>10} {:>9} {:>6.0}% {:>7.2}× {:>6.0}% {:>9.3} {:>9.3}{}\n",
            x.layout.to_string(),
            x.workers,
            x.nodes_used,
            if x.workers == 1 { "-" } else { &x.transport },
            ms(x.step_s),
            ms(x.compute_s),
            ms(x.communication_s()),
            x.bubble_fraction * 100.0,
            x.speedup,
            x.efficiency * 100.0,
            gib(x.memory.model_state_bytes()),
            gib(x.memory.peak_rss_bytes),
            if x.fits_memory {
                ""
            } else {
                "  does not fit"
            }
        );
    }
    s +=
        "  (memory of the fullest rank: state = parameters + gradients + optimizer + activations; \
          peak = predicted resident)\n";
    if let Some(limit) = p.memory_limit_bytes {
        let out: Vec<String> = p
            .predictions
            .iter()
            .filter(|x| !x.fits_memory)
            .map(|x| x.layout.to_string())
            .collect();
        s += &format!(
            "memory: {:.2} GiB per worker; {}\n",
            gib(limit),
            if out.is_empty() {
                "every layout fits".to_string()
            } else {
                format!("not fitting (never recommended): {}", out.join(", "))
            }
        );
    }
    if let Some(note) = &p.memory_note {
        s += &format!("{note}\n");
    }
    for x in &p.skipped {
        s += &format!("skipped {}: {}\n", x.layout, x.reason);
    }
    if let Some(r) = &p.recommendation {
        s += &format!("recommendation: {}\n", r.why);
    }
    s
}

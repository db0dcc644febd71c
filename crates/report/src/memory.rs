//! Memory per rank, written once for both reports: the table columns and rows, the stacked bar
//! per rank, resident memory over the steps (the run report's "Memory" section and the scale
//! report's chart of every layout's ranks).
//!
//! The figures are `summary.json`'s `ranks[i].memory` (see `lockstep_run::memory`): what the
//! training loop held, counted from its buffers, against the process's peak resident memory and
//! the goal 1.5 × model state + 0.5 GiB.

use lockstep_run::memory::{RankMemory, BOUND_ALLOWANCE_BYTES, BOUND_FACTOR};
use lockstep_run::metrics::{StepRecord, Summary};

use crate::svg::{LineChart, Series, StackedBars, PALETTE};

/// Segments of a rank's bar, with their colours: the model state, then what the process held
/// beyond it.
const SEGMENTS: [(&str, &str); 5] = [
    ("parameters", "#0072b2"),
    ("gradients", "#56b4e9"),
    ("optimizer state", "#009e73"),
    ("activations (estimate)", "#e69f00"),
    ("other resident", "#bbbbbb"),
];

const MIB: f64 = (1u64 << 20) as f64;

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB)
}

/// Columns of the memory table.
pub(crate) const TABLE_HEAD: [&str; 9] = [
    "rank",
    "parameters MiB",
    "gradients MiB",
    "optimizer MiB",
    "activations MiB",
    "model state MiB",
    "peak resident MiB",
    "goal MiB",
    "within goal",
];

/// The table row of `label`'s memory: the held figures, the peak resident memory and the goal.
pub(crate) fn table_row(label: &str, m: &RankMemory) -> Vec<String> {
    vec![
        label.to_string(),
        mib(m.params_bytes),
        mib(m.grads_bytes),
        mib(m.optimizer_bytes),
        mib(m.activation_peak_bytes),
        mib(m.model_state_bytes()),
        if m.peak_rss_bytes > 0 {
            mib(m.peak_rss_bytes)
        } else {
            "—".into()
        },
        mib(m.bound_bytes()),
        match m.peak_rss_bytes {
            0 => "—".into(),
            p if p <= m.bound_bytes() => "yes".into(),
            _ => "no".into(),
        },
    ]
}

/// A stacked bar per `(label, memory)`: the model state's parts and the rest of the peak
/// resident memory.
pub(crate) fn bars(title: &str, rows: &[(String, RankMemory)]) -> StackedBars {
    StackedBars {
        title: title.into(),
        x_label: "MiB".into(),
        segments: SEGMENTS
            .iter()
            .map(|(n, c)| (n.to_string(), c.to_string()))
            .collect(),
        rows: rows
            .iter()
            .map(|(label, m)| {
                let other = m.peak_rss_bytes.saturating_sub(m.model_state_bytes());
                let v = [
                    m.params_bytes,
                    m.grads_bytes,
                    m.optimizer_bytes,
                    m.activation_peak_bytes,
                    other,
                ];
                (label.clone(), v.iter().map(|&b| b as f64 / MIB).collect())
            })
            .collect(),
        unit_scale: 1.0,
        unit: " MiB".into(),
        reference: None,
    }
}

/// What the figures mean, in one paragraph.
pub(crate) fn explanation() -> String {
    format!(
        "Parameters, gradients (every per-micro-batch buffer, the reduced gradient and the exact \
         sum's fixed-point accumulator) and optimizer state are counted from the buffers the \
         training loop holds; activations are the model's estimate of what one micro-batch's \
         autodiff graph keeps, times the most micro-batches held at once (0: the job gives no \
         estimate); peak resident is the worker process's high-water mark (VmHWM). Goal: peak \
         resident ≤ {BOUND_FACTOR} × model state + {} MiB.",
        BOUND_ALLOWANCE_BYTES >> 20
    )
}

/// Resident memory after every step, one line per rank (`None` when no record has it).
pub(crate) fn rss_chart(s: &Summary, records: &[StepRecord]) -> Option<LineChart> {
    let mut chart = LineChart::new("resident memory per step", "step", "MiB").y_from_zero();
    let mut any = false;
    for (i, r) in s.ranks.iter().enumerate() {
        let points: Vec<(f64, f64)> = records
            .iter()
            .filter(|x| x.rank == r.rank)
            .filter_map(|x| x.rss_bytes.map(|b| (x.step as f64 + 1.0, b as f64 / MIB)))
            .collect();
        if !points.is_empty() {
            any = true;
            let colour = PALETTE[i % PALETTE.len()];
            chart = chart.series(Series::new(format!("rank {}", r.rank), colour, points));
        }
    }
    any.then_some(chart)
}

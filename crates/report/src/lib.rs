//! lockstep-report: everything a run says afterwards, kept out of the training path.
//!
//! `report.rs` (a run's report.md / report.html from its summary.json and metrics.jsonl),
//! `memory.rs` (the memory table and charts both reports share), `scaling.rs` (layouts and speedup/efficiency/verdict across runs), `scale_report.rs`
//! (scale_report.md / .html), `svg.rs` (inline SVG charts both reports share), and `plan/` (the
//! alpha-beta performance model behind `lockstep plan`, calibrated from a finished run).
//!
//! Invariant: reports are self-contained (no scripts, no external references; inline SVG only)
//! and every table is written once to both the Markdown and the HTML, from the numbers in
//! summary.json / scale.json.

mod memory;
pub mod plan;
pub mod report;
pub mod scale_report;
pub mod scaling;
pub mod svg;

//! Inline SVG charts shared by the run report (`report.rs`) and the scaling report
//! (`scale_report.rs`): line charts, stacked horizontal bars and a timeline of attempts.
//!
//! Every chart has a title, labelled axes with "nice" ticks (1, 2, 5 × 10ᵏ) and a legend that sits
//! *beside* or *below* the plot area, never on top of the data. The output is plain SVG text — no
//! scripts, no fonts, no references other than the SVG namespace — so a page that embeds it is
//! self-contained and renders the same offline. [`well_formed`] checks that property for tests.

use std::fmt::Write as _;

/// Colours that stay distinguishable with the common colour-vision deficiencies (Okabe–Ito).
pub const PALETTE: [&str; 8] = [
    "#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#999999",
];

/// Dash patterns cycled with the palette, so that curves drawn exactly on top of each other (the
/// same loss curve at every world size) still show each one.
pub const DASHES: [&str; 4] = ["", "9 5", "3 4", "12 4 3 4"];

/// Width of every chart, in CSS pixels.
pub const WIDTH: f64 = 760.0;

/// Escape text for SVG/HTML content and attribute values.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Tick values covering `lo..=hi`: about `n` intervals of 1, 2 or 5 × 10ᵏ, the first tick ≤ `lo`
/// and the last ≥ `hi`. A degenerate range is widened so that it still has two ticks.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else if lo == 0.0 {
        (0.0, 1.0)
    } else {
        (lo - lo.abs() * 0.5, hi + hi.abs() * 0.5)
    };
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag);
    let start = (lo / step + 1e-9).floor() * step;
    let end = (hi / step - 1e-9).ceil() * step;
    let k = ((end - start) / step).round().max(1.0) as usize;
    (0..=k).map(|i| start + i as f64 * step).collect()
}

/// A tick label with just enough decimals for the tick spacing; thousands as "k".
fn tick_label(v: f64, step: f64) -> String {
    if v.abs() < step.abs() * 1e-6 {
        return "0".into(); // not "0k", "0.00" or "-0"
    }
    let (v, step, suffix) = if step >= 1000.0 {
        (v / 1000.0, step / 1000.0, "k")
    } else {
        (v, step, "")
    };
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10() - 1e-9).ceil() as usize
    };
    let s = format!("{v:.decimals$}");
    let s = if s
        .trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        s.trim_start_matches('-').to_string() // no "-0"
    } else {
        s
    };
    format!("{s}{suffix}")
}

/// Rough width of `text` at `size` px in a sans-serif font (for laying out legends).
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.58
}

fn open(w: f64, h: f64, title: &str) -> String {
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{}" font-family="sans-serif">"#,
        esc(title)
    )
}

fn title(svg: &mut String, x: f64, text: &str) {
    let _ = write!(
        svg,
        r#"<text x="{x:.1}" y="18" font-size="14" font-weight="bold" text-anchor="middle">{}</text>"#,
        esc(text)
    );
}

/// One curve of a [`LineChart`].
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub colour: String,
    pub points: Vec<(f64, f64)>,
    /// SVG `stroke-dasharray` ("" = solid).
    pub dash: String,
    /// Draw a dot at every point.
    pub markers: bool,
    /// A text next to each point (empty, or one per point).
    pub point_labels: Vec<String>,
}

impl Series {
    pub fn new(label: impl Into<String>, colour: &str, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            colour: colour.to_string(),
            points,
            dash: String::new(),
            markers: false,
            point_labels: Vec::new(),
        }
    }

    pub fn dashed(mut self, dash: &str) -> Self {
        self.dash = dash.to_string();
        self
    }

    /// Dots at the points, each with its label (pass an empty vector for dots only).
    pub fn with_markers(mut self, labels: Vec<String>) -> Self {
        self.markers = true;
        self.point_labels = labels;
        self
    }
}

/// A chart of one or more `(x, y)` curves with a legend to the right of the plot.
#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Start the y axis at 0 (for quantities whose size matters, like throughput).
    pub y_from_zero: bool,
    /// Vertical reference lines `(x, label)`, e.g. where a run restarted.
    pub x_marks: Vec<(f64, String)>,
    /// Only whole-number ticks on the x axis (e.g. worker counts).
    pub x_integer: bool,
}

impl LineChart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series: Vec::new(),
            y_from_zero: false,
            x_marks: Vec::new(),
            x_integer: false,
        }
    }

    pub fn series(mut self, s: Series) -> Self {
        self.series.push(s);
        self
    }

    pub fn y_from_zero(mut self) -> Self {
        self.y_from_zero = true;
        self
    }

    pub fn x_integer(mut self) -> Self {
        self.x_integer = true;
        self
    }

    pub fn render(&self) -> String {
        const H: f64 = 300.0;
        const L: f64 = 76.0; // y tick labels and the y axis title
        const R: f64 = 190.0; // the legend
        const T: f64 = 32.0;
        const B: f64 = 52.0; // x tick labels and the x axis title
        let (px0, px1, py0, py1) = (L, WIDTH - R, H - B, T);
        let mut svg = open(WIDTH, H, &self.title);
        title(&mut svg, (px0 + px1) / 2.0, &self.title);
        let pts: Vec<&(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|p| finite(p))
            .collect();
        if pts.is_empty() {
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="#666">no data</text></svg>"##,
                (px0 + px1) / 2.0,
                (py0 + py1) / 2.0
            );
            return svg;
        }
        let (xt, yt) = self.ticks(&pts);
        let frame = Frame {
            px: (px0, px1),
            py: (py0, py1),
            x: (xt[0], *xt.last().expect("two ticks")),
            y: (yt[0], *yt.last().expect("two ticks")),
        };
        frame.axes(&mut svg, &xt, &yt);
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
            (px0 + px1) / 2.0,
            H - 12.0,
            esc(&self.x_label)
        );
        let _ = write!(
            svg,
            r#"<text x="16" y="{0:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 16 {0:.1})">{1}</text>"#,
            (py0 + py1) / 2.0,
            esc(&self.y_label)
        );
        for (x, label) in &self.x_marks {
            if !(frame.x.0..=frame.x.1).contains(x) {
                continue;
            }
            let _ = write!(
                svg,
                r##"<line x1="{0:.1}" y1="{py0}" x2="{0:.1}" y2="{py1}" stroke="#c62828" stroke-dasharray="4 3"/><text x="{1:.1}" y="{2:.1}" font-size="10" fill="#c62828">{3}</text>"##,
                frame.sx(*x),
                frame.sx(*x) + 3.0,
                py1 + 10.0,
                esc(label)
            );
        }
        // Point labels go on top of every line, so they are written last.
        let mut labels = PointLabels::default();
        for (i, s) in self.series.iter().enumerate() {
            frame.series(&mut svg, &mut labels, s, i);
        }
        svg + &labels.svg + "</svg>"
    }

    /// The x and y ticks of the finite points `pts` (at least two each).
    fn ticks(&self, pts: &[&(f64, f64)]) -> (Vec<f64>, Vec<f64>) {
        let fold = |f: fn(&(f64, f64)) -> f64| {
            pts.iter()
                .map(|p| f(p))
                .fold((f64::MAX, f64::MIN), |a, v| (a.0.min(v), a.1.max(v)))
        };
        let (x_lo, x_hi) = fold(|p| p.0);
        let (mut y_lo, y_hi) = fold(|p| p.1);
        if self.y_from_zero {
            y_lo = y_lo.min(0.0);
        }
        let mut xt = nice_ticks(x_lo, x_hi, 6);
        if self.x_integer && xt[1] - xt[0] < 1.0 {
            let (a, b) = (xt[0].floor() as i64, xt[xt.len() - 1].ceil() as i64);
            xt = (a..=b.max(a + 1)).map(|v| v as f64).collect();
        }
        (xt, nice_ticks(y_lo, y_hi, 5))
    }
}

fn finite(p: &(f64, f64)) -> bool {
    p.0.is_finite() && p.1.is_finite()
}

/// A line chart's plot area: pixel ranges `px` (left, right) and `py` (bottom, top) showing the
/// data ranges `x` and `y`.
struct Frame {
    px: (f64, f64),
    py: (f64, f64),
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn sx(&self, x: f64) -> f64 {
        self.px.0 + (x - self.x.0) / (self.x.1 - self.x.0) * (self.px.1 - self.px.0)
    }

    fn sy(&self, y: f64) -> f64 {
        self.py.0 - (y - self.y.0) / (self.y.1 - self.y.0) * (self.py.0 - self.py.1)
    }

    /// Grid lines and labels at the ticks `xt` and `yt`, and the two axes.
    fn axes(&self, svg: &mut String, xt: &[f64], yt: &[f64]) {
        let ((px0, px1), (py0, py1)) = (self.px, self.py);
        let (x_step, y_step) = (xt[1] - xt[0], yt[1] - yt[0]);
        for &v in yt {
            let y = self.sy(v);
            let _ = write!(
                svg,
                r##"<line x1="{px0}" y1="{y:.1}" x2="{px1}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
                px0 - 6.0,
                y + 4.0,
                tick_label(v, y_step)
            );
        }
        for &v in xt {
            let x = self.sx(v);
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" y1="{py0}" x2="{x:.1}" y2="{:.1}" stroke="#444"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
                py0 + 4.0,
                py0 + 17.0,
                tick_label(v, x_step)
            );
        }
        let _ = write!(
            svg,
            r##"<line x1="{px0}" y1="{py0}" x2="{px1}" y2="{py0}" stroke="#444"/><line x1="{px0}" y1="{py0}" x2="{px0}" y2="{py1}" stroke="#444"/>"##
        );
    }

    /// Series `s` (the `i`-th): its line, its markers (their labels into `labels`) and its
    /// legend entry.
    fn series(&self, svg: &mut String, labels: &mut PointLabels, s: &Series, i: usize) {
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|p| finite(p))
            .map(|p| format!("{:.1},{:.1}", self.sx(p.0), self.sy(p.1)))
            .collect();
        let dash = if s.dash.is_empty() {
            String::new()
        } else {
            format!(r#" stroke-dasharray="{}""#, esc(&s.dash))
        };
        if path.len() > 1 {
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="2"{dash} points="{}"/>"#,
                esc(&s.colour),
                path.join(" ")
            );
        }
        if s.markers || path.len() == 1 {
            for (j, p) in s.points.iter().enumerate().filter(|(_, p)| finite(p)) {
                let (x, y) = (self.sx(p.0), self.sy(p.1));
                let _ = write!(
                    svg,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{}"/>"#,
                    esc(&s.colour)
                );
                if let Some(label) = s.point_labels.get(j).filter(|l| !l.is_empty()) {
                    labels.place(label, (x, y), self.px.1, &s.colour);
                }
            }
        }
        // Legend entry: a sample of the line, then the label.
        let ly = self.py.1 + 8.0 + 20.0 * i as f64;
        let lx = self.px.1 + 14.0;
        let _ = write!(
            svg,
            r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            lx + 28.0,
            esc(&s.colour),
            lx + 34.0,
            ly + 4.0,
            esc(&s.label)
        );
    }
}

/// Point labels written so far, and where (to keep new ones off them).
#[derive(Default)]
struct PointLabels {
    svg: String,
    /// Each label's horizontal extent and baseline.
    placed: Vec<((f64, f64), f64)>,
}

impl PointLabels {
    /// `label` for the point at `(x, y)`: below-right of it, or below-left near the plot's right
    /// edge `right`; moved further down while it would cover a label already placed.
    fn place(&mut self, label: &str, (x, y): (f64, f64), right: f64, colour: &str) {
        let w = text_width(label, 10.0);
        let (lx, anchor, left) = if x + w + 8.0 > right {
            (x - 7.0, "end", x - 7.0 - w)
        } else {
            (x + 7.0, "start", x + 7.0)
        };
        let overlaps = |ly: f64| {
            self.placed
                .iter()
                .any(|&((a, b), py)| left < b && a < left + w && (ly - py).abs() < 12.0)
        };
        let mut ly = y + 16.0;
        while overlaps(ly) {
            ly += 12.0;
        }
        self.placed.push(((left, left + w), ly));
        let _ = write!(
            self.svg,
            r##"<text x="{lx:.1}" y="{ly:.1}" font-size="10" text-anchor="{anchor}" fill="{}" stroke="#fff" stroke-width="3" paint-order="stroke">{}</text>"##,
            esc(colour),
            esc(label)
        );
    }
}

/// Horizontal bars, one per row, each split into coloured segments, with an x axis, a total after
/// each bar and the legend below.
#[derive(Debug, Clone)]
pub struct StackedBars {
    pub title: String,
    /// Axis title, naming the unit of the scaled values.
    pub x_label: String,
    /// `(name, colour)` of each segment, in drawing order.
    pub segments: Vec<(String, String)>,
    /// `(row label, value per segment)`.
    pub rows: Vec<(String, Vec<f64>)>,
    /// Values are multiplied by this for the axis and the totals (e.g. 1e3 for seconds → ms).
    pub unit_scale: f64,
    /// Suffix of the totals, e.g. " ms".
    pub unit: String,
    /// A dashed vertical reference line `(value, label)`, e.g. the ideal bubble.
    pub reference: Option<(f64, String)>,
}

impl StackedBars {
    pub fn render(&self) -> String {
        const L: f64 = 130.0;
        const R: f64 = 90.0;
        const BAR: f64 = 20.0;
        // Room above the bars for the reference line's label, clear of the title.
        let pad_top: f64 = if self.reference.is_some() { 46.0 } else { 32.0 };
        const GAP: f64 = 9.0;
        let (px0, px1) = (L, WIDTH - R);
        // Lay the legend out first: it may wrap to several lines.
        let mut legend = Vec::new();
        let (mut lx, mut line) = (px0, 0usize);
        for (name, _) in &self.segments {
            let w = 16.0 + text_width(name, 11.0) + 18.0;
            if lx + w > WIDTH - 10.0 && lx > px0 {
                lx = px0;
                line += 1;
            }
            legend.push((lx, line));
            lx += w;
        }
        let rows_h = self.rows.len() as f64 * (BAR + GAP);
        let axis_y = pad_top + rows_h + 2.0;
        let h = axis_y + 48.0 + 18.0 * (line + 1) as f64;
        let mut svg = open(WIDTH, h, &self.title);
        title(&mut svg, WIDTH / 2.0, &self.title);
        let total = |v: &[f64]| v.iter().filter(|x| x.is_finite()).sum::<f64>();
        let mut max = self.rows.iter().map(|r| total(&r.1)).fold(0.0, f64::max);
        if let Some((v, _)) = &self.reference {
            max = max.max(*v);
        }
        let ticks = nice_ticks(0.0, max.max(1e-12), 5);
        let top = *ticks.last().expect("two ticks");
        let sx = |v: f64| px0 + v / top * (px1 - px0);
        let step = (ticks[1] - ticks[0]) * self.unit_scale;
        for &v in &ticks {
            let x = sx(v);
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" y1="{pad_top}" x2="{x:.1}" y2="{axis_y:.1}" stroke="#e4e4e4"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
                axis_y + 15.0,
                tick_label(v * self.unit_scale, step)
            );
        }
        let _ = write!(
            svg,
            r##"<line x1="{px0}" y1="{axis_y:.1}" x2="{px1}" y2="{axis_y:.1}" stroke="#444"/><text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"##,
            (px0 + px1) / 2.0,
            axis_y + 32.0,
            esc(&self.x_label)
        );
        for (i, (name, vals)) in self.rows.iter().enumerate() {
            let y = pad_top + i as f64 * (BAR + GAP) + GAP / 2.0;
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"#,
                px0 - 8.0,
                y + BAR / 2.0 + 4.0,
                esc(name)
            );
            let mut x = px0;
            for (v, (seg, colour)) in vals.iter().zip(&self.segments) {
                if !v.is_finite() || *v <= 0.0 {
                    continue;
                }
                let w = sx(*v) - px0;
                let _ = write!(
                    svg,
                    r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{BAR}" fill="{}"><title>{}: {}{}</title></rect>"#,
                    esc(colour),
                    esc(seg),
                    tick_label(v * self.unit_scale, step / 100.0),
                    esc(&self.unit)
                );
                x += w;
            }
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11">{}{}</text>"#,
                x + 5.0,
                y + BAR / 2.0 + 4.0,
                tick_label(total(vals) * self.unit_scale, step / 100.0),
                esc(&self.unit)
            );
        }
        if let Some((v, label)) = &self.reference {
            let x = sx(*v);
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{axis_y:.1}" stroke="#000" stroke-width="1.5" stroke-dasharray="5 3"/><text x="{x:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"##,
                pad_top - 4.0,
                pad_top - 6.0,
                esc(label)
            );
        }
        for ((name, colour), (x, line)) in self.segments.iter().zip(&legend) {
            let y = axis_y + 46.0 + 18.0 * *line as f64;
            let _ = write!(
                svg,
                r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{y:.1}" font-size="11">{}</text>"#,
                y - 10.0,
                esc(colour),
                x + 16.0,
                esc(name)
            );
        }
        svg + "</svg>"
    }
}

/// One attempt of a run on a [`Timeline`]: the steps it covered.
#[derive(Debug, Clone)]
pub struct Span {
    pub label: String,
    pub start: f64,
    pub end: f64,
    pub colour: String,
    /// A failure at the end of the span (drawn as a red ×), with its description.
    pub failure: Option<String>,
}

/// Attempts of a run as horizontal spans over the step axis; a dashed line runs from each failure
/// down to the step the next attempt resumed from.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub title: String,
    pub x_label: String,
    pub x_max: f64,
    pub spans: Vec<Span>,
}

impl Timeline {
    pub fn render(&self) -> String {
        const L: f64 = 150.0;
        const R: f64 = 40.0;
        const T: f64 = 34.0;
        const ROW: f64 = 48.0;
        const BAR: f64 = 14.0;
        let (px0, px1) = (L, WIDTH - R);
        let axis_y = T + self.spans.len() as f64 * ROW + 4.0;
        let h = axis_y + 44.0;
        let mut svg = open(WIDTH, h, &self.title);
        title(&mut svg, WIDTH / 2.0, &self.title);
        let ticks = nice_ticks(0.0, self.x_max.max(1.0), 8);
        let top = *ticks.last().expect("two ticks");
        let sx = |v: f64| px0 + v.clamp(0.0, top) / top * (px1 - px0);
        let step = ticks[1] - ticks[0];
        for &v in &ticks {
            let x = sx(v);
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" y1="{T}" x2="{x:.1}" y2="{axis_y:.1}" stroke="#e4e4e4"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
                axis_y + 15.0,
                tick_label(v, step)
            );
        }
        let _ = write!(
            svg,
            r##"<line x1="{px0}" y1="{axis_y:.1}" x2="{px1}" y2="{axis_y:.1}" stroke="#444"/><text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"##,
            (px0 + px1) / 2.0,
            axis_y + 32.0,
            esc(&self.x_label)
        );
        let bar_y = |i: usize| T + i as f64 * ROW + 18.0;
        for (i, s) in self.spans.iter().enumerate() {
            let y = bar_y(i);
            let (x0, x1) = (sx(s.start), sx(s.end));
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text><rect x="{x0:.1}" y="{y:.1}" width="{:.1}" height="{BAR}" fill="{}"/>"#,
                px0 - 8.0,
                y + BAR / 2.0 + 4.0,
                esc(&s.label),
                (x1 - x0).max(1.0),
                esc(&s.colour)
            );
            if let Some(what) = &s.failure {
                let c = y + BAR / 2.0;
                let _ = write!(
                    svg,
                    r##"<path d="M{:.1},{:.1} L{:.1},{:.1} M{:.1},{:.1} L{:.1},{:.1}" stroke="#c62828" stroke-width="3"/>"##,
                    x1 - 6.0,
                    c - 6.0,
                    x1 + 6.0,
                    c + 6.0,
                    x1 - 6.0,
                    c + 6.0,
                    x1 + 6.0,
                    c - 6.0
                );
                let anchor = if x1 > (px0 + px1) / 2.0 {
                    "end"
                } else {
                    "start"
                };
                let _ = write!(
                    svg,
                    r##"<text x="{x1:.1}" y="{:.1}" font-size="10" fill="#c62828" text-anchor="{anchor}">{}</text>"##,
                    y - 5.0,
                    esc(what)
                );
                if let Some(next) = self.spans.get(i + 1) {
                    let nx = sx(next.start);
                    let ny = bar_y(i + 1);
                    let _ = write!(
                        svg,
                        r##"<line x1="{x1:.1}" y1="{:.1}" x2="{nx:.1}" y2="{ny:.1}" stroke="#555" stroke-dasharray="3 3"/><text x="{:.1}" y="{:.1}" font-size="10" fill="#555" text-anchor="end">resumed from {}</text>"##,
                        y + BAR + 7.0,
                        nx - 4.0,
                        ny + BAR + 12.0,
                        tick_label(next.start, 1.0)
                    );
                }
            }
        }
        svg + "</svg>"
    }
}

/// Check that `doc` (an HTML page or an SVG fragment as written by the reports) is well-formed:
/// every tag closed in order (HTML void elements excepted), attribute quotes balanced, every `&`
/// an entity, and no `http` reference other than the SVG namespace (a self-contained page).
pub fn well_formed(doc: &str) -> Result<(), String> {
    const VOID: [&str; 6] = ["meta", "br", "hr", "img", "input", "link"];
    let mut stack: Vec<String> = Vec::new();
    let mut rest = doc;
    let mut offset = 0usize;
    while let Some(lt) = rest.find('<') {
        check_entities(&rest[..lt], offset)?;
        let tag_start = offset + lt;
        let after = &rest[lt + 1..];
        let gt = after
            .find('>')
            .ok_or_else(|| format!("tag at byte {tag_start} is never closed with '>'"))?;
        let tag = &after[..gt];
        if !tag.matches('"').count().is_multiple_of(2) {
            return Err(format!(
                "unbalanced quotes in tag at byte {tag_start}: <{tag}>"
            ));
        }
        if let Some(name) = tag.strip_prefix('/') {
            let name = name.trim();
            match stack.pop() {
                Some(open) if open == name => {}
                Some(open) => return Err(format!("</{name}> at byte {tag_start} closes <{open}>")),
                None => return Err(format!("</{name}> at byte {tag_start} closes nothing")),
            }
        } else if !tag.starts_with('!') && !tag.starts_with('?') {
            let name: String = tag
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '/')
                .collect();
            if name.is_empty() {
                return Err(format!("empty tag name at byte {tag_start}"));
            }
            check_entities(tag, tag_start)?;
            if !tag.ends_with('/') && !VOID.contains(&name.to_ascii_lowercase().as_str()) {
                stack.push(name);
            }
        }
        offset = tag_start + 1 + gt + 1;
        rest = &after[gt + 1..];
    }
    check_entities(rest, offset)?;
    if let Some(open) = stack.last() {
        return Err(format!("<{open}> is never closed"));
    }
    let http = doc.matches("http").count();
    let ns = doc.matches("http://www.w3.org/2000/svg").count();
    if http != ns {
        return Err(format!(
            "{} reference(s) to http other than the SVG namespace: not self-contained",
            http - ns
        ));
    }
    for bad in ["<script", "src=", "href=", "@import", "url("] {
        if doc.contains(bad) {
            return Err(format!("contains `{bad}`: not self-contained"));
        }
    }
    Ok(())
}

fn check_entities(text: &str, offset: usize) -> Result<(), String> {
    for (i, _) in text.match_indices('&') {
        let tail = &text[i + 1..];
        let ok = ["amp;", "lt;", "gt;", "quot;", "#"]
            .iter()
            .any(|e| tail.starts_with(e));
        if !ok {
            return Err(format!("bare '&' at byte {}", offset + i));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(
            nice_ticks(0.0, 1.0, 5),
            vec![0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
        );
        let t = nice_ticks(3.0, 97.0, 5);
        assert_eq!((t[0], *t.last().unwrap(), t[1] - t[0]), (0.0, 100.0, 20.0));
        let t = nice_ticks(0.93, 0.975, 5);
        assert!(t[0] <= 0.93 && *t.last().unwrap() >= 0.975, "{t:?}");
        assert!((t[1] - t[0] - 0.01).abs() < 1e-12, "{t:?}");
        // A flat series still gets an axis.
        assert!(nice_ticks(2.0, 2.0, 5).len() >= 2);
        assert_eq!(tick_label(40000.0, 10000.0), "40k");
        assert_eq!(tick_label(0.05, 0.05), "0.05");
        assert_eq!(tick_label(-1e-9, 0.1), "0");
        assert_eq!(tick_label(0.0, 20000.0), "0");
        assert_eq!(tick_label(0.30000000000000004, 0.1), "0.3");
    }

    #[test]
    fn charts_are_well_formed_and_labelled() {
        let chart = LineChart::new("loss <&>", "step", "loss")
            .series(Series::new("a", PALETTE[0], vec![(1.0, 2.0), (2.0, 1.0)]))
            .series(
                Series::new("b", PALETTE[1], vec![(1.0, 2.0), (2.0, 1.0)])
                    .dashed(DASHES[1])
                    .with_markers(vec!["p1".into(), "p2".into()]),
            )
            .render();
        well_formed(&chart).unwrap();
        for needle in [
            "loss &lt;&amp;&gt;",
            ">step</text>",
            "rotate(-90",
            ">a</text>",
            ">p2</text>",
            "stroke-dasharray=\"9 5\"",
        ] {
            assert!(chart.contains(needle), "{needle:?} missing:\n{chart}");
        }
        assert_eq!(chart.matches("<polyline").count(), 2);
        let empty = LineChart::new("t", "x", "y").render();
        well_formed(&empty).unwrap();
        assert!(empty.contains("no data"));

        let bars = StackedBars {
            title: "time".into(),
            x_label: "ms per step".into(),
            segments: vec![
                ("a".into(), PALETTE[0].into()),
                ("b".into(), PALETTE[1].into()),
            ],
            rows: vec![
                ("r0".into(), vec![0.001, 0.002]),
                ("r1".into(), vec![0.002, 0.0]),
            ],
            unit_scale: 1e3,
            unit: " ms".into(),
            reference: Some((0.0025, "ideal".into())),
        }
        .render();
        well_formed(&bars).unwrap();
        // Three segments drawn (a zero one is skipped) plus two legend swatches.
        assert_eq!(bars.matches("<rect").count(), 5, "{bars}");
        assert!(
            bars.contains(">3.00 ms</text>") && bars.contains(">ideal</text>"),
            "{bars}"
        );

        let tl = Timeline {
            title: "attempts".into(),
            x_label: "step".into(),
            x_max: 200.0,
            spans: vec![
                Span {
                    label: "attempt 0".into(),
                    start: 0.0,
                    end: 120.0,
                    colour: PALETTE[0].into(),
                    failure: Some("rank 1 killed".into()),
                },
                Span {
                    label: "attempt 1".into(),
                    start: 100.0,
                    end: 200.0,
                    colour: PALETTE[2].into(),
                    failure: None,
                },
            ],
        }
        .render();
        well_formed(&tl).unwrap();
        assert!(
            tl.contains("resumed from 100") && tl.contains("rank 1 killed"),
            "{tl}"
        );
    }

    #[test]
    fn the_checker_catches_malformed_and_external_markup() {
        well_formed("<!DOCTYPE html><html><head><meta charset=\"utf-8\"></head><body><p>a &amp; b</p></body></html>").unwrap();
        for bad in [
            "<svg><g></svg>",
            "<svg>",
            "</p>",
            "<p>a & b</p>",
            "<p title=\"x>y</p>",
            "<img src=\"x.png\">",
            "<p>see http://example.com</p>",
            "<script>alert(1)</script>",
        ] {
            assert!(well_formed(bad).is_err(), "accepted {bad:?}");
        }
    }
}

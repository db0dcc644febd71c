//! What both test jobs share: the data (generated from the index), the `[job]` settings and
//! the misbehaviours they can be switched to.

use burn::data::dataset::{Dataset, DatasetError, InMemDataset};
use burn::tensor::{Device, Tensor, TensorData};
use lockstep::{BoxError, TrainConfig};
use serde::Deserialize;

pub const INPUTS: usize = 8;

#[derive(Clone, Debug)]
pub struct Item {
    pub x: Vec<f32>,
    pub y: f32,
}

/// The `[job]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub hidden: usize,
    pub train_samples: usize,
    /// "none", "short-dataset", "wrong-shape", "nan-loss", "panic-in-data", "hang-in-data",
    /// "out-of-memory".
    pub misbehave: String,
    /// Dropout probability after the hidden layer (burn's `Dropout`; 0 = none).
    #[serde(default)]
    pub dropout: f64,
}

/// Deterministic inputs from the index; the target is a fixed smooth function of them. A
/// poisoned item has a NaN target; a truncated one lacks its last input (a shape bug).
pub fn item(i: usize, poison: bool, truncate: bool) -> Item {
    let mut x = vec![0f32; INPUTS];
    for (k, v) in x.iter_mut().enumerate() {
        let h = (i as u64 * 2654435761 + k as u64 * 40503) % 1000;
        *v = h as f32 / 500.0 - 1.0;
    }
    let y = x
        .iter()
        .enumerate()
        .map(|(k, v)| v * (k as f32 - 3.5) / 4.0)
        .sum::<f32>()
        + (x[0] * x[1]);
    if truncate {
        x.pop();
    }
    Item {
        x,
        y: if poison { f32::NAN } else { y },
    }
}

/// Sample whose target is NaN with `misbehave = "nan-loss"`.
pub const POISONED: usize = 37;

pub const MISBEHAVIOURS: [&str; 7] = [
    "none",
    "short-dataset",
    "wrong-shape",
    "nan-loss",
    "panic-in-data",
    "hang-in-data",
    "out-of-memory",
];

/// With `misbehave = "hang-in-data"`, reading training sample [`POISONED`] never returns — once
/// only if this variable names a file that does not exist yet (it is created as the read hangs),
/// so that the restarted job reads on; every time otherwise.
pub const HANG_ONCE_ENV: &str = "LOCKSTEP_TESTJOB_HANG_ONCE";

pub fn settings(cfg: &TrainConfig) -> Result<Settings, String> {
    let s: Settings = cfg.job_section().map_err(|e| e.to_string())?;
    if MISBEHAVIOURS.contains(&s.misbehave.as_str()) {
        Ok(s)
    } else {
        Err(format!(
            "job.misbehave = `{}` is not a known misbehaviour",
            s.misbehave
        ))
    }
}

pub fn train_set(cfg: &TrainConfig) -> Result<TrainSet, BoxError> {
    let s: Settings = cfg.job_section()?;
    let n = if s.misbehave == "short-dataset" {
        10
    } else {
        s.train_samples
    };
    let nan = s.misbehave == "nan-loss";
    let short = s.misbehave == "wrong-shape";
    Ok(TrainSet {
        items: InMemDataset::new(
            (0..n)
                .map(|i| item(i, nan && i == POISONED, short))
                .collect(),
        ),
        hang: s.misbehave == "hang-in-data",
        out_of_memory: s.misbehave == "out-of-memory",
    })
}

/// The training items; with `hang` set, a dataset whose read of one sample hangs (a stuck
/// network file system, a dead data server).
pub struct TrainSet {
    items: InMemDataset<Item>,
    hang: bool,
    /// Reading sample [`POISONED`] asks for 32 TiB: the allocator fails and aborts the process.
    out_of_memory: bool,
}

impl Dataset<Item> for TrainSet {
    fn get(&self, index: usize) -> Result<Item, DatasetError> {
        if self.hang && index == POISONED && hang_this_time() {
            eprintln!("test job: reading training sample {index} hangs (deliberate)");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        if self.out_of_memory && index == POISONED {
            let huge: Vec<u8> = Vec::with_capacity(1 << 45);
            std::hint::black_box(&huge);
        }
        self.items.get(index)
    }

    fn len(&self) -> usize {
        self.items.len()
    }
}

fn hang_this_time() -> bool {
    match std::env::var_os(HANG_ONCE_ENV) {
        None => true,
        // `create_new` fails once the file exists: only the first read ever hangs.
        Some(path) => std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .is_ok(),
    }
}

pub fn eval_set(cfg: &TrainConfig) -> Result<InMemDataset<Item>, BoxError> {
    let s: Settings = cfg.job_section()?;
    if s.misbehave == "panic-in-data" {
        panic!("the evaluation files are missing (deliberate)");
    }
    Ok(InMemDataset::new(
        (0..128)
            .map(|i| item(1_000_000 + i, false, false))
            .collect(),
    ))
}

pub fn batch(items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = items.len();
    let width = items[0].x.len();
    let x: Vec<f32> = items.iter().flat_map(|it| it.x.iter().copied()).collect();
    let y: Vec<f32> = items.iter().map(|it| it.y).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, width]), device),
        Tensor::from_data(TensorData::new(y, [n, 1]), device),
    )
}

pub const CONFIG: &str =
    "[train]\nsteps = 12\nglobal_batch = 32\nmicrobatch = 8\nlr = 0.05\nwarmup_steps = 0\n\
     eval_every = 6\n[checkpoint]\nevery = 4\n\
     [job]\nhidden = 16\ntrain_samples = 512\nmisbehave = \"none\"\n";

/// With this variable set, `loss_and_metrics` returns one value more than `TRAIN_METRICS`
/// names (a job's bug the tests check lockstep's answer to).
pub const BAD_METRICS_ENV: &str = "LOCKSTEP_TESTJOB_BAD_METRICS";

/// The sum over a batch's samples of the absolute error (the `mae` metric's per-batch sum).
pub fn absolute_error(output: Tensor<2>, y: &Tensor<2>) -> f64 {
    (output - y.clone()).abs().sum().into_scalar::<f32>() as f64
}

/// The training metrics' values for a batch whose absolute error sums to `mae`.
pub fn train_metrics(mae: f64) -> Vec<f64> {
    if std::env::var_os(BAD_METRICS_ENV).is_some() {
        vec![mae, mae]
    } else {
        vec![mae]
    }
}

/// With this variable set, the job's update rule is not elementwise (it scales by the mean
/// gradient of the slice it is given), which lockstep must refuse before any worker starts.
pub const BAD_RULE_ENV: &str = "LOCKSTEP_TESTJOB_BAD_RULE";

/// Sign descent with momentum (Lion-like): `m = 0.9 m + 0.1 g`, `p -= lr · sign(m)`.
struct SignMomentum;

impl lockstep::UpdateRule for SignMomentum {
    fn name(&self) -> &str {
        "sign-momentum"
    }

    fn state_names(&self) -> Vec<String> {
        vec!["momentum".into()]
    }

    fn update(&self, _step: u64, lr: f32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
        for ((p, &g), m) in p.iter_mut().zip(g).zip(state[0].iter_mut()) {
            *m = 0.9 * *m + 0.1 * g;
            *p -= lr * m.signum();
        }
    }
}

/// Gradient descent scaled by the slice's mean absolute gradient: not elementwise.
struct SliceNormalised;

impl lockstep::UpdateRule for SliceNormalised {
    fn name(&self) -> &str {
        "slice-normalised"
    }

    fn update(&self, _step: u64, lr: f32, p: &mut [f32], g: &[f32], _state: &mut [&mut [f32]]) {
        let mean = g.iter().map(|x| x.abs()).sum::<f32>() / g.len().max(1) as f32;
        for (p, &g) in p.iter_mut().zip(g) {
            *p -= lr * g / (mean + 1e-8);
        }
    }
}

/// The test job's update rule (`optimizer.kind = "custom"`).
pub fn update_rule() -> Box<dyn lockstep::UpdateRule> {
    if std::env::var_os(BAD_RULE_ENV).is_some() {
        Box::new(SliceNormalised)
    } else {
        Box::new(SignMomentum)
    }
}

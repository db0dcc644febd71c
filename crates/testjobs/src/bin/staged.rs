//! A token model as a `StagedJob`, whose layers exchange an enum of tensors: integer token ids
//! `[n, T]` into the embedding, rank-3 float steps `[n, T, E]` between the embedding and the
//! pooling, `[n, E]` features after it. The tests cut it into pipelines of every depth. With
//! `LOCKSTEP_TESTJOB_BAD_SHAPE` set, the mixing layer drops a time step from batches of more
//! than one sample (a shape that depends on the batch), which lockstep must stop naming it.

use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use lockstep::{
    Activation, ActivationError, BoxError, JobSettings, Part, PartKind, Parts, StagedJob,
    TrainConfig,
};

/// Time steps and distinct tokens.
const STEPS: usize = 6;
const VOCAB: usize = 10;

/// The job's `[job]` table, typed: lockstep checks it before any worker starts.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    /// The embedding width.
    embed: usize,
}

/// What the layers pass on.
#[derive(Clone)]
enum Seq {
    Ids(Tensor<2, Int>),
    Steps(Tensor<3>),
    Features(Tensor<2>),
}

impl Activation for Seq {
    fn into_parts(self, parts: &mut Vec<Part>) {
        match self {
            Seq::Ids(t) => t.into_parts(parts),
            Seq::Steps(t) => t.into_parts(parts),
            Seq::Features(t) => t.into_parts(parts),
        }
    }

    fn from_parts(parts: &mut Parts) -> Result<Self, ActivationError> {
        Ok(match parts.peek() {
            Some(PartKind::Int { .. }) => Seq::Ids(parts.int()?),
            Some(PartKind::Float { rank: 3 }) => Seq::Steps(parts.float()?),
            _ => Seq::Features(parts.float()?),
        })
    }
}

#[derive(Module, Debug)]
enum Layer {
    Embed(Embedding),
    Mix(Linear),
    Pool(Linear),
    Head(Linear),
}

struct StagedTestJob;

/// Sequence `i`'s tokens and target: the share of tokens below 4 (a fixed function of `i`).
fn item(i: usize) -> ([i64; STEPS], f32) {
    let mut h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    let tokens = std::array::from_fn(|_| {
        h ^= h >> 31;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        ((h >> 40) % VOCAB as u64) as i64
    });
    let low = tokens.iter().filter(|&&t| t < 4).count();
    (tokens, low as f32 / STEPS as f32)
}

type Item = ([i64; STEPS], f32);

impl StagedJob for StagedTestJob {
    type Layer = Layer;
    type Item = Item;
    type Batch = (Tensor<2, Int>, Tensor<2>);
    type Activation = Seq;
    const SETTINGS: JobSettings = JobSettings::of::<Settings>();

    fn name(&self) -> &str {
        "testjob-staged"
    }

    fn config(&self) -> &str {
        "[train]\nsteps = 12\nglobal_batch = 32\nmicrobatch = 8\nlr = 0.05\nwarmup_steps = 0\n\
         eval_every = 6\n[checkpoint]\nevery = 4\n[job]\nembed = 8\n"
    }

    fn layers(&self, cfg: &TrainConfig, device: &Device) -> Vec<Layer> {
        let e = cfg.job_section::<Settings>().expect("checked").embed;
        vec![
            Layer::Embed(EmbeddingConfig::new(VOCAB, e).init(device)),
            Layer::Mix(LinearConfig::new(e, e).init(device)),
            Layer::Pool(LinearConfig::new(e, e).init(device)),
            Layer::Head(LinearConfig::new(e, 1).init(device)),
        ]
    }

    fn train_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        Ok(Box::new(InMemDataset::new((0..512).map(item).collect())))
    }

    fn eval_data(&self, _: &TrainConfig) -> Result<Box<dyn Dataset<Item>>, BoxError> {
        Ok(Box::new(InMemDataset::new(
            (100_000..100_128).map(item).collect(),
        )))
    }

    fn batch(&self, items: Vec<Item>, device: &Device) -> Self::Batch {
        let n = items.len();
        let ids: Vec<i64> = items.iter().flat_map(|(t, _)| *t).collect();
        let y: Vec<f32> = items.iter().map(|(_, y)| *y).collect();
        (
            Tensor::from_data(TensorData::new(ids, [n, STEPS]), device),
            Tensor::from_data(TensorData::new(y, [n, 1]), device),
        )
    }

    fn input(&self, (ids, _): &Self::Batch) -> Seq {
        Seq::Ids(ids.clone())
    }

    fn forward(&self, layer: &Layer, x: Seq) -> Seq {
        match (layer, x) {
            (Layer::Embed(e), Seq::Ids(ids)) => Seq::Steps(e.forward(ids)),
            (Layer::Mix(l), Seq::Steps(h)) => {
                let [n, t, _] = h.dims();
                let h = if n > 1 && std::env::var_os("LOCKSTEP_TESTJOB_BAD_SHAPE").is_some() {
                    h.narrow(1, 0, t - 1)
                } else {
                    h
                };
                Seq::Steps(relu(l.forward(h)))
            }
            (Layer::Pool(l), Seq::Steps(h)) => {
                let [n, _, e] = h.dims();
                Seq::Features(relu(l.forward(h.mean_dim(1).reshape([n, e]))))
            }
            (Layer::Head(l), Seq::Features(f)) => Seq::Features(l.forward(f)),
            (layer, _) => panic!("{layer:?} got the wrong kind of activation"),
        }
    }

    fn loss(&self, output: Seq, (_, y): &Self::Batch) -> Tensor<1> {
        let Seq::Features(out) = output else {
            panic!("the head gives features")
        };
        MseLoss::new().forward(out, y.clone(), Reduction::Mean)
    }
}

fn main() {
    lockstep::main(lockstep::Pipelined(StagedTestJob))
}

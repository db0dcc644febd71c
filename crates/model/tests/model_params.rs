//! Initialisation, structure identity and the flat-parameter interface.

mod common;

use common::{tiny_cnn, tiny_mlp};
use lockstep_model::{param_hash, Model, ModelError, ModelSpec, ParamHasher};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn model_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Model>();
}

#[test]
fn same_seed_gives_identical_bits_and_different_seed_differs() {
    for spec in [tiny_mlp(), tiny_cnn()] {
        let a = Model::new(&spec, 42).unwrap().params_flat();
        let b = Model::new(&spec, 42).unwrap().params_flat();
        let c = Model::new(&spec, 43).unwrap().params_flat();
        assert_eq!(bits(&a), bits(&b));
        assert_ne!(bits(&a), bits(&c));
        assert_eq!(param_hash(&a), param_hash(&b));
        assert_ne!(param_hash(&a), param_hash(&c));
    }
}

#[test]
fn init_is_he_uniform_with_zero_biases() {
    let spec = ModelSpec::Mlp {
        input: 400,
        hidden: vec![300],
        classes: 10,
    };
    let m = Model::new(&spec, 7).unwrap();
    let p = m.params_flat();
    let layout = m.layout();
    let w0 = &layout[0];
    assert_eq!(w0.name, "0.Hidden.weight");
    let w = &p[w0.offset..w0.offset + w0.len];
    let bound = (6.0f32 / 400.0).sqrt();
    assert!(w.iter().all(|v| v.abs() <= bound));
    // Uniform(-b, b): variance b^2 / 3 = 2 / fan_in. 120k samples: 1% is ~5 standard errors.
    let var = w.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / w.len() as f64;
    assert!(
        (var - 2.0 / 400.0).abs() < 0.01 * 2.0 / 400.0,
        "variance {var}"
    );
    let b0 = &layout[1];
    assert!(p[b0.offset..b0.offset + b0.len].iter().all(|&v| v == 0.0));
    // Output layer uses gain 1: bound sqrt(3 / 300).
    let w1 = &layout[2];
    let bound1 = (3.0f32 / 300.0).sqrt();
    let w = &p[w1.offset..w1.offset + w1.len];
    assert!(w.iter().all(|v| v.abs() <= bound1));
    assert!(w.iter().any(|v| v.abs() > 0.9 * bound1));
}

#[test]
fn layout_is_canonical_and_contiguous() {
    let m = Model::new(&tiny_cnn(), 1).unwrap();
    let names: Vec<_> = m.layout().iter().map(|p| p.name.clone()).collect();
    assert_eq!(
        names,
        [
            "0.Conv.conv.weight",
            "0.Conv.conv.bias",
            "1.Conv.conv.weight",
            "1.Conv.conv.bias",
            "2.Hidden.weight",
            "2.Hidden.bias",
            "3.Output.weight",
            "3.Output.bias"
        ]
    );
    let shapes: Vec<_> = m.layout().iter().map(|p| p.shape.clone()).collect();
    // 6x5 -> pool -> 3x2 -> pool -> 1x1, so the first linear layer sees 4 features.
    assert_eq!(
        shapes,
        [
            vec![3, 2, 3, 3],
            vec![3],
            vec![4, 3, 3, 3],
            vec![4],
            vec![4, 5],
            vec![5],
            vec![5, 3],
            vec![3]
        ]
    );
    let mut offset = 0;
    for p in m.layout() {
        assert_eq!(p.offset, offset);
        assert_eq!(p.len, p.shape.iter().product::<usize>());
        offset += p.len;
    }
    assert_eq!(offset, m.num_params());
    assert_eq!(m.params_flat().len(), m.num_params());

    let mlp = Model::new(&tiny_mlp(), 1).unwrap();
    // 5*7+7 + 7*6+6 + 6*3+3
    assert_eq!(mlp.num_params(), 42 + 48 + 21);
}

#[test]
fn structure_hash_identifies_the_architecture() {
    let h = |spec: &ModelSpec, seed| Model::new(spec, seed).unwrap().structure_hash();
    assert_eq!(h(&tiny_mlp(), 1), h(&tiny_mlp(), 2));
    assert_eq!(h(&tiny_cnn(), 1), h(&tiny_cnn(), 9));
    assert_ne!(h(&tiny_mlp(), 1), h(&tiny_cnn(), 1));
    let wider = ModelSpec::Mlp {
        input: 5,
        hidden: vec![7, 7],
        classes: 3,
    };
    assert_ne!(h(&tiny_mlp(), 1), h(&wider, 1));
    // Same parameter shapes, different reading of the input: 8x8 and 4x16 both pool to 4x4
    // and 2x8, i.e. 16 features per channel.
    let cnn = |height, width| ModelSpec::Cnn {
        channels: 1,
        height,
        width,
        conv: vec![2],
        hidden: 4,
        classes: 2,
    };
    let (a, b) = (
        Model::new(&cnn(8, 8), 1).unwrap(),
        Model::new(&cnn(4, 16), 1).unwrap(),
    );
    assert_eq!(a.layout(), b.layout());
    assert_ne!(a.structure_hash(), b.structure_hash());
}

#[test]
fn set_params_round_trips_and_checks_length() {
    let mut m = Model::new(&tiny_cnn(), 3).unwrap();
    let p: Vec<f32> = (0..m.num_params())
        .map(|i| i as f32 * 0.001 - 0.3)
        .collect();
    m.set_params_flat(&p).unwrap();
    assert_eq!(bits(&m.params_flat()), bits(&p));

    let err = m.set_params_flat(&p[1..]).unwrap_err();
    assert_eq!(
        err,
        ModelError::ParamLength {
            what: "set_params_flat",
            expected: p.len(),
            got: p.len() - 1
        }
    );
    let msg = err.to_string();
    assert!(msg.contains(&p.len().to_string()) && msg.contains(&(p.len() - 1).to_string()));
    // The failed call left the parameters untouched.
    assert_eq!(bits(&m.params_flat()), bits(&p));
}

#[test]
fn param_hash_is_sha256_of_little_endian_bytes() {
    // 5000 values span the 4096-value blocks the hash is fed in.
    let values: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut bytes = Vec::new();
    for v in &values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    use sha2::Digest;
    assert_eq!(
        param_hash(&values),
        hex::encode(sha2::Sha256::digest(&bytes))
    );
    // 1.0f32 is 00 00 80 3f in little-endian order.
    assert_eq!(
        param_hash(&[1.0]),
        hex::encode(sha2::Sha256::digest([0, 0, 0x80, 0x3f]))
    );
    assert_eq!(
        param_hash(&[]),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    // Fed in pieces (stage by stage, of any lengths, empty ones too): the same hash.
    for cuts in [
        vec![0, 5000],
        vec![1, 4096, 4097],
        vec![0, 0, 2500, 2500, 4999],
    ] {
        let mut hasher = ParamHasher::default();
        let mut at = 0;
        for cut in cuts.into_iter().chain([5000]) {
            hasher.update(&values[at..cut]);
            at = cut;
        }
        assert_eq!(hasher.finish(), param_hash(&values));
    }
}

#[test]
fn bad_specs_and_inputs_are_refused_with_context() {
    let bad = ModelSpec::Mlp {
        input: 4,
        hidden: vec![3, 0],
        classes: 2,
    };
    let err = Model::new(&bad, 1).unwrap_err().to_string();
    assert!(err.contains("hidden[1]"), "{err}");
    let tiny_image = ModelSpec::Cnn {
        channels: 1,
        height: 3,
        width: 8,
        conv: vec![2, 2],
        hidden: 4,
        classes: 2,
    };
    let err = Model::new(&tiny_image, 1).unwrap_err().to_string();
    assert!(err.contains("too small"), "{err}");

    let m = Model::new(&tiny_mlp(), 1).unwrap();
    let mut g = vec![0.0; m.num_params()];
    let x = vec![0.0; 10];
    assert_eq!(
        m.loss_and_grad(&x[..9], &[0, 1], 2, 1.0, &mut g)
            .unwrap_err(),
        ModelError::InputLength {
            n: 2,
            per_sample: 5,
            expected: 10,
            got: 9
        }
    );
    assert_eq!(
        m.loss_and_grad(&x, &[0], 2, 1.0, &mut g).unwrap_err(),
        ModelError::LabelLength {
            expected: 2,
            got: 1
        }
    );
    assert_eq!(
        m.evaluate(&x, &[0, 3], 2).unwrap_err(),
        ModelError::LabelOutOfRange {
            index: 1,
            label: 3,
            classes: 3
        }
    );
    assert_eq!(
        m.loss_and_grad(&x, &[0, 1], 2, 1.0, &mut g[1..])
            .unwrap_err(),
        ModelError::ParamLength {
            what: "grad_out",
            expected: m.num_params(),
            got: m.num_params() - 1
        }
    );
    assert_eq!(m.evaluate(&[], &[], 0).unwrap_err(), ModelError::EmptyBatch);
}

/// A released burn module holds no parameter values (ZeRO 3 between steps) and is filled again,
/// bit for bit, from a flat vector and the shapes it had.
#[test]
fn a_released_module_frees_its_values_and_is_refilled_from_its_shapes() {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;
    use lockstep_model::flat;

    #[derive(Module, Debug)]
    struct Two {
        a: Linear,
        b: Linear,
    }
    let device = Device::flex().autodiff();
    let net = Two {
        a: LinearConfig::new(5, 7).init(&device),
        b: LinearConfig::new(7, 3).init(&device),
    };
    let layout = flat::layout(&net);
    let n: usize = layout.iter().map(|p| p.len).sum();
    let values = flat::read(&net, n);
    let released = flat::release(net, &device);
    assert!(
        flat::read(&released, 0).is_empty(),
        "values kept after release"
    );
    assert!(flat::layout(&released).iter().all(|p| p.len == 0));
    let refilled = flat::write_shaped(released, &values, &device, &layout);
    assert_eq!(flat::layout(&refilled), layout);
    assert_eq!(bits(&flat::read(&refilled, n)), bits(&values));
}

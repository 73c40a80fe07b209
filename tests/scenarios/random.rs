//! Graph-safe randomness: `DeviceRng` draws fresh masks on every call and every replay, keeps
//! the requested rate, follows the host reference sequence, and a graphed `GraphDropout`
//! equals an eager one seeded alike (outputs and gradients).

use burn::prelude::*;
use burn_graphed::{DeviceRng, GraphDropout, Graphed, GraphedConfig, reference_mask};
use burn_graphed_testkit::TensorComparison;

use super::{batch, supports_graphs, tolerance_for};

fn values(tensor: Tensor<2>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 data")
}

/// Two draws differ, each keeps about `keep` of the elements with the right scale, and both
/// equal the host reference of the sequence.
pub fn device_rng_draws_fresh_masks(device: &Device) {
    let rng = DeviceRng::new(42, device);
    let like = Tensor::<2>::zeros([256, 256], device);
    let (keep, scale) = (0.75f32, 1.0 / 0.75f32);
    let first = values(rng.dropout_mask(&like, keep, scale));
    let second = values(rng.dropout_mask(&like, keep, scale));
    assert_ne!(first, second, "two draws gave the same mask");
    for (draw, mask) in [&first, &second].into_iter().enumerate() {
        assert!(
            mask.iter().all(|v| *v == 0.0 || *v == scale),
            "values are 0 or the scale"
        );
        let kept = mask.iter().filter(|v| **v != 0.0).count() as f64 / mask.len() as f64;
        // 65536 Bernoulli(0.75) draws: standard deviation 0.0017.
        assert!(
            (kept - 0.75).abs() < 0.01,
            "draw {draw} kept {kept}, expected 0.75"
        );
        let reference = reference_mask(42, draw as u64, mask.len(), keep, scale);
        assert_eq!(
            mask, &reference,
            "draw {draw} differs from the host reference"
        );
    }
}

/// A graphed `GraphDropout` (input requiring grad, no parameters) against an eager one seeded
/// alike: every replay draws a new mask, outputs and input gradients equal eager.
pub fn graph_dropout_matches_eager(device: &Device, steps: usize) {
    let device = device.clone().autodiff();
    let graphed_dropout = GraphDropout::new(0.5, DeviceRng::new(11, &device)).expect("prob");
    let eager_dropout = GraphDropout::new(0.5, DeviceRng::new(11, &device)).expect("prob");
    let graphed = Graphed::new(
        graphed_dropout,
        |m: &GraphDropout, x: Tensor<2>| m.forward(x),
        batch([64, 64], 0, &device).require_grad(),
        &GraphedConfig::new(),
    )
    .expect("capture with device randomness passes replay validation");
    let tolerance = tolerance_for(&device);
    let mut patterns = Vec::new();
    for step in 0..steps {
        let x = batch([64, 64], step, &device).require_grad();
        let xe = batch([64, 64], step, &device).require_grad();
        let g = graphed.forward(x.clone()).expect("graphed call");
        let e = eager_dropout.forward(xe.clone());
        let (gv, ev) = (values(g.clone()), values(e.clone()));
        let comparison = TensorComparison::new(
            format!("step {step} output"),
            &TensorData::new(gv.clone(), [64, 64]),
            &TensorData::new(ev, [64, 64]),
            tolerance,
        );
        assert!(comparison.passed(), "{comparison:?}");
        patterns.push(gv.iter().map(|v| *v == 0.0).collect::<Vec<_>>());
        let gg = g.powi_scalar(2).sum().backward();
        let ge = e.powi_scalar(2).sum().backward();
        let (gx, ex) = (x.grad(&gg).expect("grad"), xe.grad(&ge).expect("grad"));
        let comparison = TensorComparison::new(
            format!("step {step} input gradient"),
            &gx.into_data(),
            &ex.into_data(),
            tolerance,
        );
        assert!(comparison.passed(), "{comparison:?}");
    }
    for window in patterns.windows(2) {
        assert_ne!(window[0], window[1], "two steps dropped the same elements");
    }
    if supports_graphs(&device) {
        let stats = graphed.stats();
        assert_eq!(
            (stats.forward_replays, stats.backward_replays),
            (steps as u64, steps as u64),
            "{stats:?}"
        );
        assert_eq!(stats.total_fallbacks(), 0, "{stats:?}");
    }
}

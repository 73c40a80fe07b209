//! `OutputPolicy::Guarded`: outputs and gradients handed out as the static buffers, without
//! copies, and a call that would overwrite one still held by user code runs eagerly instead.

use super::*;
use burn_graphed::{FusedAdamConfig, OutputPolicy};
use burn_graphed_testkit::deep_copy;

/// The usual loop holds nothing across steps: every call replays, no copies are handed out,
/// and training (with `FusedAdam`, per parameter or multi-tensor: no parameter copies either)
/// equals eager training with burn's `Adam`. README's recommended loop is the multi-tensor one.
pub fn guarded_training_matches_eager(device: &Device, steps: usize, multi_tensor: bool) {
    let config = GraphedConfig::new().with_outputs(OutputPolicy::Guarded);
    let adam = FusedAdamConfig::new();
    let report = if multi_tensor {
        mlp_against_eager(device, steps, config, adam.init_multi_tensor())
    } else {
        mlp_against_eager(device, steps, config, adam.init())
    };
    if report.summary.graphed {
        assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.total_fallbacks(), 0, "{report}");
        assert_eq!(
            report.stats.param_copies, report.summary.params as u64,
            "{report}"
        );
    }
}

/// An output kept across a step, then a gradient kept across a step: each keeps its value,
/// and the calls made while it lives run eagerly (`OutputStillHeld`); once it is dropped,
/// calls replay again. Parameters stay equal to eager training throughout.
pub fn guarded_hand_outs_keep_their_values(device: &Device) {
    let device = device.clone().autodiff();
    let lr = 1e-2;
    let model = Mlp::new(16, 2, 4, &device);
    let mut eager = deep_copy(&model);
    let mut graphed = Graphed::new(
        model,
        mlp_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new().with_outputs(OutputPolicy::Guarded),
    )
    .expect("capture");
    let (mut adam, mut graphed_adam) = (AdamConfig::new().init(), AdamConfig::new().init());
    let head_bias = graphed.module().head.bias.as_ref().map(|b| b.id);
    let mut kept_output = None;
    let mut kept_grad = None;
    for step in 0..8 {
        let x = batch([8, 16], step, &device);
        let eager_out = eager.forward(x.clone());
        let out = graphed.forward(x).expect("call");
        // Every step's output against eager's (this also reads the fresh output back).
        let comparison = burn_graphed_testkit::TensorComparison::new(
            format!("step {step} output"),
            &eager_out.clone().into_data(),
            &out.clone().into_data(),
            tolerance_for(&device),
        );
        assert!(comparison.passed(), "{comparison}");
        if step == 2 {
            let (output, values): (Tensor<2>, _) = kept_output.take().expect("kept at step 1");
            output.into_data().assert_eq(&values, true);
        }
        if step == 1 {
            kept_output = Some((out.clone(), out.clone().into_data()));
        }
        let loss = square_mean(out);
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        if step == 5 {
            let (grad, values): (Tensor<1>, _) = kept_grad.take().expect("kept at step 4");
            // Step 5 ran eagerly, so its backward did not overwrite the kept gradient.
            grad.into_data().assert_eq(&values, true);
        }
        if step == 4 {
            let bias: Tensor<1> = head_bias.and_then(|id| grads.get(id)).expect("bias grad");
            kept_grad = Some((bias.clone(), bias.into_data()));
        }
        graphed = graphed_adam.step(lr, graphed, grads);
        eager = {
            let loss = square_mean(eager_out);
            let grads = GradientsParams::from_grads(loss.backward(), &eager);
            adam.step(lr, eager, grads)
        };
    }
    assert_params_close("guarded", &eager, &graphed, tolerance_for(&device));
    let stats = graphed.stats();
    println!("guarded hand-outs: {stats:?}");
    if graphed.summary().graphed {
        // Step 2 (output of step 1 held) and step 5 (gradient of step 4 held) ran eagerly.
        assert_eq!(
            stats.fallbacks.get(&FallbackReason::OutputStillHeld),
            Some(&2),
            "{stats:?}"
        );
        assert_eq!(stats.forward_replays, 6, "{stats:?}");
    }
}

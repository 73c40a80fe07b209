//! `OutputPolicy::Guarded`: outputs and gradients handed out as the static buffers, without
//! copies, and a call that would overwrite one still held by user code runs eagerly instead.

use super::*;
use burn_graphed::OutputPolicy;
use burn_graphed_testkit::{deep_copy, host_data};

/// The usual loop holds nothing across steps: every call replays, no copies are handed out,
/// and training (with `FusedAdam`, per parameter or multi-tensor: no parameter copies either)
/// equals eager training with burn's `Adam`. README's recommended loop is the multi-tensor one.
pub fn guarded_training_matches_eager(device: &Device, steps: usize, multi_tensor: bool) {
    let config = GraphedConfig::new().with_outputs(OutputPolicy::Guarded);
    let adam = fused_adam_config();
    let report = if multi_tensor {
        mlp_against_eager(device, steps, config, adam.init_multi_tensor())
    } else {
        mlp_against_eager(device, steps, config, adam.init())
    };
    if report.summary.graphed {
        assert_eq!(report.stats.forward_replays, steps as u64, "{report}");
        assert_eq!(report.stats.total_eager(), 0, "{report}");
        assert_eq!(
            report.stats.param_copies, report.summary.params as u64,
            "{report}"
        );
    }
}

/// README's loop on the defaults: `GraphedConfig::new()` hands out under `Guarded`, and with
/// the loss inside the callable and `MultiTensorAdam` every step replays both graphs, no call
/// runs eagerly, only the first call copies parameters, and training equals eager training
/// with burn's `Adam`.
pub fn default_loop_replays_every_step(device: &Device, steps: usize) {
    let config = GraphedConfig::new();
    assert_eq!(
        config.outputs,
        OutputPolicy::Guarded,
        "the default hand-out"
    );
    loss_inside_training_matches_eager(device, steps, config);
}

/// An output kept across a step, then a gradient kept across a step: each keeps its value,
/// and the calls made while it lives run eagerly (`OutputStillHeld`); once it is dropped,
/// calls replay again, with the parameters of the steps in between.
///
/// Every step is checked against an eager forward and backward of a copy of the graphed
/// model's parameters *of that step* (outputs and every gradient), not against a separately
/// trained eager twin: a stale parameter or input is off by a whole Adam update, while a twin
/// drifts by itself on CUDA. Measured on an H100 with a twin: step 6's output off by 1.1e-3
/// where its largest value was about 0.1, in one run of seven (the one run after other tests
/// in the same process). The likely cause, not traced: the graphs and eager steps may run
/// matrix products of different precision (fusion cuts them differently, each cut is
/// autotuned apart, some candidates round to TF32), and Adam turns a near-zero gradient
/// element whose sign the rounding flipped into a full `2 * lr` parameter difference.
pub fn guarded_hand_outs_keep_their_values(device: &Device) {
    let device = device.clone().autodiff();
    let lr = 1e-2;
    let tolerance = tolerance_for(&device);
    let model = Mlp::new(16, 2, 4, &device);
    let mut graphed = Graphed::new(
        model,
        mlp_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new().with_outputs(OutputPolicy::Guarded),
    )
    .expect("capture");
    let mut graphed_adam = adam_config().init();
    let head_bias = graphed.module().head.bias.as_ref().map(|b| b.id);
    let mut kept_output = None;
    let mut kept_grad = None;
    // The parameters before each optimizer step (calls and backward passes leave them alone).
    let mut params = param_values(graphed.module()).expect("read back");
    for step in 0..8 {
        let x = batch([8, 16], step, &device);
        // This step's parameters, eagerly: the reference for the output and the gradients.
        let reference = deep_copy(graphed.module());
        let reference_out = reference.forward(x.clone());
        let out = graphed.forward(x).expect("call");
        // Every step's output (this also reads the fresh output back).
        let comparison = burn_graphed_testkit::TensorComparison::new(
            format!("step {step} output"),
            &host_data(reference_out.clone()).expect("read back"),
            &host_data(out.clone()).expect("read back"),
            tolerance,
        );
        assert!(comparison.passed(), "{comparison}");
        if step == 2 {
            let (output, values): (Tensor<2>, _) = kept_output.take().expect("kept at step 1");
            output.into_data().assert_eq(&values, true);
        }
        if step == 1 {
            // Read now: a lazy read would show whatever the buffer holds when first accessed.
            kept_output = Some((out.clone(), host_data(out.clone()).expect("read back")));
        }
        let loss = square_mean(out);
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        let reference_grads =
            GradientsParams::from_grads(square_mean(reference_out).backward(), &reference);
        assert_grads_close(
            &format!("step {step}"),
            (&reference, &reference_grads),
            (&graphed, &grads),
            tolerance,
        );
        if step == 5 {
            let (grad, values): (Tensor<1>, _) = kept_grad.take().expect("kept at step 4");
            // Step 5 ran eagerly, so its backward did not overwrite the kept gradient.
            grad.into_data().assert_eq(&values, true);
        }
        if step == 4 {
            let bias: Tensor<1> = head_bias.and_then(|id| grads.get(id)).expect("bias grad");
            kept_grad = Some((bias.clone(), host_data(bias).expect("read back")));
        }
        graphed = graphed_adam.step(lr, graphed, grads);
        // The step took: the next step's reference is the updated model, not this one.
        let after = param_values(graphed.module()).expect("read back");
        let unchanged: Vec<_> = params
            .iter()
            .zip(&after)
            .filter(|((_, b), (_, a))| b == a)
            .map(|((id, _), _)| *id)
            .collect();
        assert!(
            unchanged.is_empty(),
            "step {step}: {unchanged:?} not updated"
        );
        params = after;
    }
    let stats = graphed.stats();
    println!("guarded hand-outs: {stats:?}");
    if graphed.summary().graphed {
        // Step 2 (output of step 1 held) and step 5 (gradient of step 4 held) ran eagerly.
        assert_eq!(
            stats.eager.get(&EagerReason::OutputStillHeld),
            Some(&2),
            "{stats:?}"
        );
        assert_eq!(stats.forward_replays, 6, "{stats:?}");
    }
}

//! Inference graphs after training: eval calls of a graphed model trained with the fused
//! optimizer replay forward-only graphs equal to the eager eval calls, through the shape cache
//! and under every output policy; a `GraphDropout` is the identity there; an unwritten input
//! is refused as in training.

use super::recovery::unwritten;
use super::*;
use burn_graphed::{DeviceRng, GraphDropout, OutputPolicy};

/// An MLP with a `GraphDropout` between its layers.
#[derive(Module, Debug)]
pub struct DropMlp {
    hidden: Linear,
    dropout: GraphDropout,
    out: Linear,
}

impl DropMlp {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(16, 32).init(device),
            dropout: GraphDropout::new(0.5, DeviceRng::new(3, device)).expect("prob"),
            out: LinearConfig::new(32, 4).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = Relu::new().forward(self.hidden.forward(x));
        self.out.forward(self.dropout.forward(h))
    }

    /// The eval-mode forward without the dropout, the reference of the inference graphs.
    fn forward_without_dropout(&self, x: Tensor<2>) -> Tensor<2> {
        self.out
            .forward(Relu::new().forward(self.hidden.forward(x)))
    }
}

/// 3 training steps with `MultiTensorAdam` (dropout active: new masks each replay), then eval
/// calls under `policy`: batches of 8 and of 4 (a second inference graph, through the shape
/// cache) equal the eager eval calls without dropout, and replay; an output kept across the
/// next call keeps its values under `Copy`, shows the next call's under `Static`, and makes
/// the next call run eagerly under `Guarded`. Back in training, the training graphs serve.
pub fn inference_follows_fused_training(device: &Device, policy: OutputPolicy) {
    let device = device.clone().autodiff();
    let inner = device.clone().inner();
    let graphed = Graphed::new(
        DropMlp::new(&device),
        DropMlp::forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new().with_outputs(policy),
    )
    .expect("capture");
    let mut optim = fused_adam_config().init_multi_tensor();
    let mut graphed = graphed;
    for step in 0..3 {
        let loss = square_mean(
            graphed
                .forward(batch([8, 16], step + 1, &device))
                .expect("train"),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        graphed = optim.step(1e-2, graphed, grads);
    }
    let graphs = supports_graphs(&device);
    let valid = graphed.valid();
    let mut calls = 0;
    for (step, rows) in [8, 4, 8, 4].into_iter().enumerate() {
        let x = batch([rows, 16], 10 + step, &inner);
        let expected = valid
            .module()
            .forward_without_dropout(x.clone())
            .into_data();
        let got = valid.forward(x).expect("eval call").into_data();
        assert_data_close(
            &device,
            &format!("eval call {step}, {rows} rows"),
            &expected,
            &got,
        );
        calls += 1;
    }

    // An output kept across the next call.
    let (a, b) = (batch([8, 16], 30, &inner), batch([8, 16], 31, &inner));
    let expected_a = valid
        .module()
        .forward_without_dropout(a.clone())
        .into_data();
    let expected_b = valid
        .module()
        .forward_without_dropout(b.clone())
        .into_data();
    let kept = valid.forward(a).expect("eval call");
    let next = valid.forward(b).expect("eval call");
    assert_data_close(&device, "the next call", &expected_b, &next.into_data());
    let kept = kept.into_data();
    let replays = graphed.stats().forward_replays;
    if graphs && policy == OutputPolicy::Static {
        // The static buffer: the next call's values, as PyTorch's graphs hand out.
        assert_data_close(&device, "kept output (Static)", &expected_b, &kept);
    } else {
        assert_data_close(&device, "kept output", &expected_a, &kept);
    }
    let stats = graphed.stats();
    if graphs {
        let held = u64::from(policy == OutputPolicy::Guarded);
        assert_eq!(
            stats.eager.get(&EagerReason::OutputStillHeld).copied(),
            (held > 0).then_some(held),
            "{stats:?}"
        );
        assert_eq!(replays, 3 + calls + 2 - held, "{stats:?}");
        assert_eq!(stats.backward_replays, 3, "{stats:?}");
        let cache = graphed.stats().shape_cache;
        assert_eq!(
            cache.graphs, 3,
            "one training and two inference graphs: {cache:?}"
        );
    } else {
        assert_eq!(stats.forward_replays, 0, "{stats:?}");
    }

    // Back in training, with the dropout drawing again.
    let x = batch([8, 16], 40, &device);
    let y = graphed.forward(x.clone()).expect("train call");
    let without = graphed.module().forward_without_dropout(x).into_data();
    let y_data = y.clone().into_data();
    assert_ne!(
        y_data.try_to_vec::<f32>().expect("f32"),
        without.try_to_vec::<f32>().expect("f32"),
        "training calls apply the dropout"
    );
    let _ = square_mean(y).backward();
    if graphs {
        assert_eq!(graphed.stats().backward_replays, 4);
    }
}

/// An inference call given a tensor the device never wrote is refused with
/// `InputNotWritten`, as a training call is, and the next call replays.
pub fn unwritten_input_inference_call_recovers(device: &Device) {
    let inner = device.clone().inner();
    require_graphs(device);
    let graphed = inference_mlp(&inner);
    match graphed.forward(unwritten([8, 16], &inner)) {
        Err(GraphedError::InputNotWritten { index: 0, reason }) => assert!(!reason.is_empty()),
        Err(other) => panic!("expected InputNotWritten, got {other}"),
        Ok(out) => panic!(
            "a call with an unwritten input returned {:?}",
            out.into_data()
        ),
    }
    let x = batch([8, 16], 1, &inner);
    let expected = graphed.module().forward(x.clone()).into_data();
    let got = graphed
        .forward(x)
        .expect("call after the refused one")
        .into_data();
    assert_data_close(device, "call after the refused one", &expected, &got);
    assert_eq!(graphed.stats().forward_replays, 1, "{:?}", graphed.stats());
}

/// A 16 -> 4 MLP's inference graph, captured on a `[8, 16]` batch (`batch(.., 0, ..)`).
fn inference_mlp(inner: &Device) -> Graphed<Mlp, Tensor<2>, Tensor<2>> {
    Graphed::inference(
        Mlp::new(16, 2, 4, inner),
        mlp_forward,
        vec![batch([8, 16], 0, inner)],
        &GraphedConfig::new(),
    )
    .expect("capture")
}

/// An inference call's input copy (after a first call, which copies the parameters in too): on
/// CUDA one driver copy where the input is laid out as the graph's buffer (row-major), cubecl's
/// copy kernel for a transposed view of the same values (other strides); elsewhere (`driver`
/// false) the kernel always. Either way the call returns the eager call's values, which a
/// stale copy (the capture's batch) would not.
pub fn input_copies_run_as_driver_copies(device: &Device, driver: bool) {
    let inner = device.clone().inner();
    require_graphs(device);
    let graphed = inference_mlp(&inner);
    let expected = |x: &Tensor<2>| graphed.module().forward(x.clone()).into_data();
    let stale = expected(&batch([8, 16], 0, &inner));
    // The first call after the capture copies the module's parameters in too.
    graphed
        .forward(batch([8, 16], 3, &inner))
        .expect("first call");
    let call = |x: Tensor<2>, layout: &str, copied_by_driver: bool| {
        let want = expected(&x);
        let before = burn_graphed::testing::driver_copies();
        let got = graphed.forward(x).expect("call").into_data();
        let copies = burn_graphed::testing::driver_copies() - before;
        assert_eq!(
            copies,
            usize::from(copied_by_driver),
            "{layout} input: driver copies"
        );
        assert_data_close(device, layout, &want, &got);
        assert_ne!(got, stale, "{layout} input: the capture's batch came back");
    };
    call(batch([8, 16], 1, &inner), "row-major", driver);
    call(batch([16, 8], 2, &inner).transpose(), "transposed", false);
    assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
}

//! Callables captured together (`make_graphed_callables`): a chain of three modules trained
//! graphed and eagerly side by side, and the rules that keep shared buffers safe.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::activation::{relu, tanh};
use burn_graphed::{
    Callable, EagerReason, Graphed, GraphedConfig, GraphedError, OutputPolicy, TensorGroup,
    make_graphed_callables,
};
use burn_graphed_testkit::{
    EquivalenceReport, TensorComparison, Tolerance, compare_params, deep_copy, grad_values,
};

use super::{adam_config, assert_data_close, batch, supports_graphs, tolerance_for};

/// First of the chain: two outputs, one of which (`tanh`) its backward reads back.
#[derive(Module, Debug)]
pub struct Encoder {
    hidden: Linear,
    side: Linear,
}

impl Encoder {
    pub fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(16, 8).init(device),
            side: LinearConfig::new(16, 8).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
        (tanh(self.hidden.forward(x.clone())), self.side.forward(x))
    }
}

/// Second: takes both outputs of the encoder.
#[derive(Module, Debug)]
pub struct Mixer {
    layer: Linear,
}

impl Mixer {
    pub fn new(device: &Device) -> Self {
        Self {
            layer: LinearConfig::new(8, 8).init(device),
        }
    }

    pub fn forward(&self, (h, s): (Tensor<2>, Tensor<2>)) -> Tensor<2> {
        relu(self.layer.forward(h) + s)
    }
}

/// Last: one input, one output.
#[derive(Module, Debug)]
pub struct Decoder {
    layer: Linear,
}

impl Decoder {
    pub fn new(device: &Device) -> Self {
        Self {
            layer: LinearConfig::new(8, 16).init(device),
        }
    }

    pub fn forward(&self, z: Tensor<2>) -> Tensor<2> {
        self.layer.forward(z)
    }
}

/// Reconstruction error plus a penalty on the encoder's side output, which therefore gets its
/// gradient from two places (the mixer and the loss).
fn loss(x: Tensor<2>, side: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (y - x).powi_scalar(2).mean() + side.powi_scalar(2).mean()
}

fn read(tensor: Tensor<1>) -> TensorData {
    tensor.inner().into_data()
}

/// Compares every parameter gradient of `eager` and `graphed` (then steps both optimizers and
/// compares the parameters) and returns the updated modules.
#[allow(clippy::too_many_arguments)]
fn compare_and_step<M: Module, I: TensorGroup, O: TensorGroup>(
    name: &str,
    step: usize,
    eager: M,
    graphed: Graphed<M, I, O>,
    eager_grads: &mut burn::tensor::Gradients,
    graphed_grads: &mut burn::tensor::Gradients,
    optimizers: &mut (ModuleOptimizer, ModuleOptimizer),
    tolerance: Tolerance,
    out: &mut Vec<TensorComparison>,
) -> (M, Graphed<M, I, O>) {
    let ge = GradientsParams::from_module(eager_grads, &eager);
    let gg = GradientsParams::from_module(graphed_grads, &graphed);
    for (index, (e, g)) in grad_values(&eager, &ge)
        .expect("read back")
        .iter()
        .zip(&grad_values(&graphed, &gg).expect("read back"))
        .enumerate()
    {
        let (Some(e), Some(g)) = (e, g) else {
            panic!("step {step} {name} grad {index}: present in one run only");
        };
        out.push(TensorComparison::new(
            format!("step {step} {name} grad {index}"),
            e,
            g,
            tolerance,
        ));
    }
    let eager = optimizers.0.step(1e-2, eager, ge);
    let graphed = optimizers.1.step(1e-2, graphed, gg);
    out.extend(
        compare_params(&format!("step {step} {name}"), &eager, &graphed, tolerance)
            .expect("read back"),
    );
    (eager, graphed)
}

/// Encoder -> mixer -> decoder captured together (the mixer and decoder chained), trained with
/// Adam for `steps` steps graphed and eagerly from the same parameters and batches: losses,
/// outputs, every gradient and every parameter agree, and nothing is copied between the chained
/// callables in either direction.
pub fn chained_group_matches_eager(device: &Device, steps: usize, outputs: OutputPolicy) {
    let device = device.clone().autodiff();
    let tolerance = tolerance_for(&device);
    let (encoder, mixer, decoder) = (
        Encoder::new(&device),
        Mixer::new(&device),
        Decoder::new(&device),
    );
    let (mut enc_e, mut mix_e, mut dec_e) =
        (deep_copy(&encoder), deep_copy(&mixer), deep_copy(&decoder));
    let (mut enc_g, mut mix_g, mut dec_g) = make_graphed_callables(
        (
            Callable::new(encoder, Encoder::forward, batch([8, 16], 0, &device)),
            Callable::chained(mixer, Mixer::forward),
            Callable::chained(decoder, Decoder::forward),
        ),
        &GraphedConfig::new().with_outputs(outputs),
    )
    .expect("capture");
    let adam = || (adam_config().init(), adam_config().init());
    let (mut opt_enc, mut opt_mix, mut opt_dec) = (adam(), adam(), adam());
    let mut tensors = Vec::new();
    for step in 0..steps {
        let x = batch([8, 16], step + 1, &device);
        let (h, s) = enc_e.forward(x.clone());
        let y = dec_e.forward(mix_e.forward((h, s.clone())));
        let loss_e = loss(x.clone(), s, y.clone());
        let (hg, sg) = enc_g.forward(x.clone()).expect("encoder");
        let yg = dec_g
            .forward(mix_g.forward((hg, sg.clone())).expect("mixer"))
            .expect("decoder");
        let loss_g = loss(x, sg, yg.clone());
        tensors.push(TensorComparison::new(
            format!("step {step} output"),
            &y.inner().into_data(),
            &yg.inner().into_data(),
            tolerance,
        ));
        tensors.push(TensorComparison::new(
            format!("step {step} loss"),
            &read(loss_e.clone()),
            &read(loss_g.clone()),
            tolerance,
        ));
        let (mut ge, mut gg) = (loss_e.backward(), loss_g.backward());
        (enc_e, enc_g) = compare_and_step(
            "encoder",
            step,
            enc_e,
            enc_g,
            &mut ge,
            &mut gg,
            &mut opt_enc,
            tolerance,
            &mut tensors,
        );
        (mix_e, mix_g) = compare_and_step(
            "mixer",
            step,
            mix_e,
            mix_g,
            &mut ge,
            &mut gg,
            &mut opt_mix,
            tolerance,
            &mut tensors,
        );
        (dec_e, dec_g) = compare_and_step(
            "decoder",
            step,
            dec_e,
            dec_g,
            &mut ge,
            &mut gg,
            &mut opt_dec,
            tolerance,
            &mut tensors,
        );
    }
    let report = EquivalenceReport {
        tensors,
        stats: dec_g.stats(),
        summary: dec_g.summary().clone(),
        shape_cache: dec_g.stats().shape_cache,
    };
    println!("chained group ({outputs:?}): {report}");
    assert!(report.passed(), "{report}");
    // What follows counts replays and copies: graphs only. Without graphs (Flex) the
    // comparison with eager above is the check.
    if !supports_graphs(&device) {
        return;
    }
    let steps = steps as u64;
    let (enc, mix, dec) = (enc_g.stats(), mix_g.stats(), dec_g.stats());
    for stats in [&enc, &mix, &dec] {
        assert_eq!(
            (stats.forward_replays, stats.backward_replays),
            (steps, steps),
            "{stats:?}"
        );
        assert_eq!(stats.total_eager(), 0, "{stats:?}");
    }
    // A new batch every step; the chained callables read the previous graph's outputs where
    // they are.
    assert_eq!(
        (enc.input_copies, mix.input_copies, dec.input_copies),
        (steps, 0, 0)
    );
    // The decoder's output gradient comes from the loss (a copy); the mixer's output gradient
    // is the decoder's input gradient, where the decoder's backward graph wrote it; of the
    // encoder's two outputs, `h` likewise, while `s` sums the mixer's and the loss's
    // contributions (a new tensor: one copy).
    assert_eq!(
        (enc.grad_copies, mix.grad_copies, dec.grad_copies),
        (steps, 0, steps)
    );
    let memory = dec_g.memory();
    assert_eq!(memory.group_static_bytes, enc_g.memory().group_static_bytes);
    assert_eq!(
        memory.group_static_bytes,
        enc_g.summary().static_bytes + mix_g.summary().static_bytes + dec_g.summary().static_bytes
    );
}

/// A two-callable chain for the buffer-sharing rules.
type Pair = (
    Graphed<Encoder, Tensor<2>, (Tensor<2>, Tensor<2>)>,
    Graphed<Mixer, (Tensor<2>, Tensor<2>), Tensor<2>>,
);

fn pair(device: &Device) -> (Encoder, Mixer, Pair) {
    let (encoder, mixer) = (Encoder::new(device), Mixer::new(device));
    let eager = (deep_copy(&encoder), deep_copy(&mixer));
    let graphed = make_graphed_callables(
        (
            Callable::new(encoder, Encoder::forward, batch([8, 16], 0, device)),
            Callable::chained(mixer, Mixer::forward),
        ),
        &GraphedConfig::new(),
    )
    .expect("capture");
    (eager.0, eager.1, graphed)
}

fn assert_grads_match<M: Module>(
    device: &Device,
    eager: &M,
    graphed: &M,
    ge: &mut burn::tensor::Gradients,
    gg: &mut burn::tensor::Gradients,
) {
    let (pe, pg) = (
        GradientsParams::from_module(ge, eager),
        GradientsParams::from_module(gg, graphed),
    );
    for (index, (e, g)) in grad_values(eager, &pe)
        .expect("read back")
        .iter()
        .zip(&grad_values(graphed, &pg).expect("read back"))
        .enumerate()
    {
        let (Some(e), Some(g)) = (e, g) else {
            panic!("a gradient is missing");
        };
        assert_data_close(device, &format!("grad {index}"), e, g);
    }
}

/// The chained callable's input buffers are the previous callable's outputs, which that
/// callable's backward may read: a foreign input is copied in only when that backward is not
/// pending (else the call runs eagerly), and the previous callable does not replay while the
/// chained one's backward still reads those buffers. Gradients stay equal to eager throughout.
pub fn chained_group_shares_buffers_safely(device: &Device) {
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let (enc_e, mix_e, (enc_g, mix_g)) = pair(&device);
    let x = batch([8, 16], 1, &device);
    // Tensors that need a gradient, as the encoder's outputs do (the chained inputs' spec).
    let other = || {
        (
            batch([8, 8], 2, &device).require_grad(),
            batch([8, 8], 3, &device).require_grad(),
        )
    };

    // 1. The encoder replayed and waits for its backward; the mixer gets other tensors: it
    //    runs eagerly rather than overwrite the encoder's outputs.
    let (h, s) = enc_e.forward(x.clone());
    let (o1, o2) = other();
    let loss_e = (h + s).sum()
        + mix_e
            .forward((o1.clone(), o2.clone()))
            .powi_scalar(2)
            .mean();
    let (hg, sg) = enc_g.forward(x.clone()).expect("encoder");
    let (p1, p2) = other();
    let loss_g = (hg + sg).sum()
        + mix_g
            .forward((p1.clone(), p2))
            .expect("mixer")
            .powi_scalar(2)
            .mean();
    let (mut ge, mut gg) = (loss_e.backward(), loss_g.backward());
    assert_data_close(
        &device,
        "mixer input grad",
        &o1.grad(&ge).expect("eager input grad").into_data(),
        &p1.grad(&gg).expect("graphed input grad").into_data(),
    );
    assert_grads_match(&device, &enc_e, enc_g.module(), &mut ge, &mut gg);
    assert_grads_match(&device, &mix_e, mix_g.module(), &mut ge, &mut gg);
    assert_eq!(
        mix_g.stats().eager.get(&EagerReason::SharedBufferBusy),
        Some(&1)
    );

    // 2. Nothing pending: the mixer copies other tensors into the shared buffers and replays;
    //    while its backward is pending, the encoder must not overwrite them: it runs eagerly.
    let (o1, o2) = other();
    let (p1, p2) = other();
    let z_e = mix_e.forward((o1, o2));
    let z_g = mix_g.forward((p1, p2)).expect("mixer");
    let (h, s) = enc_e.forward(x.clone());
    let (hg, sg) = enc_g.forward(x).expect("encoder");
    let loss_e = z_e.powi_scalar(2).mean() + (h * s).mean();
    let loss_g = z_g.powi_scalar(2).mean() + (hg * sg).mean();
    assert_data_close(
        &device,
        "loss",
        &read(loss_e.clone()),
        &read(loss_g.clone()),
    );
    let (mut ge, mut gg) = (loss_e.backward(), loss_g.backward());
    assert_grads_match(&device, &enc_e, enc_g.module(), &mut ge, &mut gg);
    assert_grads_match(&device, &mix_e, mix_g.module(), &mut ge, &mut gg);
    let (enc, mix) = (enc_g.stats(), mix_g.stats());
    assert_eq!((mix.forward_replays, mix.input_copies), (1, 2), "{mix:?}");
    assert_eq!(enc.forward_replays, 1, "{enc:?}");
    assert_eq!(
        enc.eager.get(&EagerReason::SharedBufferBusy),
        Some(&1),
        "{enc:?}"
    );
}

/// A chained first callable, and a chained callable whose inputs do not fit the previous
/// outputs, are refused with `GraphedError::Chain`.
pub fn chain_errors(device: &Device) {
    let device = device.clone().autodiff();
    let error = make_graphed_callables(
        (
            Callable::<Mixer, (Tensor<2>, Tensor<2>), Tensor<2>>::chained(
                Mixer::new(&device),
                Mixer::forward,
            ),
        ),
        &GraphedConfig::new(),
    )
    .map(|_| ())
    .expect_err("nothing to chain to");
    assert!(
        matches!(error, GraphedError::Chain { index: 0, .. }),
        "{error}"
    );
    // The decoder takes one tensor; the encoder returns two.
    let error = make_graphed_callables(
        (
            Callable::new(
                Encoder::new(&device),
                Encoder::forward,
                batch([8, 16], 0, &device),
            ),
            Callable::chained(Decoder::new(&device), Decoder::forward),
        ),
        &GraphedConfig::new(),
    )
    .map(|_| ())
    .expect_err("two outputs into one input");
    assert!(
        matches!(error, GraphedError::Chain { index: 1, .. }),
        "{error}"
    );
    // A frozen parameter in the second callable: the error says which callable.
    let error = make_graphed_callables(
        (
            Callable::new(
                Encoder::new(&device),
                Encoder::forward,
                batch([8, 16], 0, &device),
            ),
            Callable::chained(Mixer::new(&device).no_grad(), Mixer::forward),
        ),
        &GraphedConfig::new(),
    )
    .map(|_| ())
    .expect_err("a non-trainable parameter in callable 1");
    match &error {
        GraphedError::InGroup { callable: 1, error } => assert!(
            matches!(**error, GraphedError::NonTrainableState { index: 0, .. }),
            "{error}"
        ),
        other => panic!("expected InGroup for callable 1, got {other}"),
    }
    assert!(
        error.to_string().starts_with("callable 1 of the group: "),
        "{error}"
    );
}

//! Robustness over time and shapes: the shape cache (captures of new batch sizes, LRU
//! evictions) and a soak run (many steps with optimizer updates and periodic eval, device
//! memory that must stop growing, equality with eager at checkpoints).

use burn::backend::{Backend, Dispatch};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig, momentum::MomentumConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_graphed::{Graphed, GraphedConfig};
use burn_graphed_testkit::{
    ParamMovement, TensorComparison, TrainingComparison, compare_training, deep_copy, param_values,
    values_only,
};

use super::{
    Mlp, adam_config, batch, capture_mlp, mlp_forward, square_mean, supports_graphs, tolerance_for,
};

/// Batch sizes that change from step to step (as the last batch of an epoch does, more often):
/// with `max_graphs` 2 the shape cache captures each new size, evicts the least recently used
/// one, and training equals eager at every step.
pub fn shape_cache_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    // With the sample's 16 cached first: hit, capture, hit, capture (evicts 8), capture (evicts
    // 16), capture (evicts 4), capture (evicts 8), hit.
    let sizes = [16, 8, 16, 4, 8, 16, 4, 4];
    let report = compare_training(TrainingComparison {
        model: Mlp::new(32, 2, 8, &device),
        call: mlp_forward,
        optimizer: adam_config().init(),
        learning_rate: 1e-2,
        batch: &mut |step| batch([sizes.get(step).copied().unwrap_or(16), 32], step, &device),
        loss: square_mean,
        steps: sizes.len(),
        graphed: GraphedConfig::new().with_max_graphs(2),
        tolerance: tolerance_for(&device),
        noise_step: 0.0,
    })
    .expect("comparison runs");
    println!("shape cache: {report}; {:?}", report.shape_cache);
    assert!(report.passed(), "{report}");
    if report.summary.graphed {
        let cache = &report.shape_cache;
        assert_eq!(
            (cache.hits, cache.captures, cache.evictions, cache.graphs),
            (3, 5, 4, 2),
            "{cache:?}"
        );
        let steps = sizes.len() as u64;
        assert_eq!(
            (report.stats.forward_replays, report.stats.backward_replays),
            (steps, steps),
            "{report}"
        );
        assert_eq!(report.stats.total_eager(), 0, "{report}");
    }
}

/// Overwrites a module's float parameters, in visiting order, with `values` (same ids).
struct Overwrite<'a> {
    values: std::slice::Iter<'a, TensorData>,
}

impl ModuleMapper for Overwrite<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let data = self.values.next().expect("same parameter count");
        param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            Tensor::<D>::from_data(data.clone(), &tensor.device()).set_require_grad(require_grad)
        })
    }
}

/// What a soak run measured.
#[derive(Debug)]
pub struct SoakFigures {
    /// Training steps run (graphed and eager side by side).
    pub steps: usize,
    /// Checkpoints at which parameters were compared (and re-synchronized).
    pub checkpoints: usize,
    /// Eval passes compared.
    pub evals: usize,
    /// Device bytes reserved after the first `settle` steps, and at the end.
    pub reserved_after_settle: u64,
    /// See `reserved_after_settle`.
    pub reserved_at_end: u64,
    /// Largest reserved bytes seen after settling.
    pub reserved_peak: u64,
    /// Live allocations after settling and at the end.
    pub allocs_after_settle: u64,
    /// See `allocs_after_settle`.
    pub allocs_at_end: u64,
    /// Graph replays (forward) over the run.
    pub replays: u64,
    /// The largest parameter difference between the graphed and the eager model seen at a
    /// checkpoint (before re-synchronization).
    pub max_drift: f64,
}

/// Trains a graphed MLP and an eager copy side by side for `steps` steps. Every `eval_every`
/// steps, the graphed model is checked against eager execution *on its own parameters*, so
/// that the check does not depend on how far the two trajectories drifted: the replayed
/// training forward against an eager forward, and the eval-mode call (an inference graph's
/// replay) against an eager eval forward; both within the device's tolerance. Every
/// `checkpoint_every` steps the two models' parameters must agree within the device's tolerance
/// relative to how far the eager one moved since the last checkpoint (`ParamMovement`, its net
/// distance: the bound `Tolerance` derives for the path, made tighter; where f32 products may
/// round to TF32 in one path and not the other, 1e-2 of it, which a missed Adam step at lr 1e-3
/// exceeds for checkpoints up to about 100 steps apart), and the graphed one is
/// re-synchronized to the eager one (through new parameter tensors, as loading
/// a record does). After `settle` steps (make it
/// a multiple of `checkpoint_every`, so that every kind of work, eval and re-synchronization
/// included, has run once: new kernel metadata is cached on the device) the device's reserved
/// bytes and live allocations must not grow.
///
/// `optimizer`: Adam where the backend passes kernel scalars as launch constants (CUDA). Where
/// it puts them in the cached metadata buffers (wgpu), Adam's per-step bias corrections are new
/// metadata every step, which cubecl caches (up to 4096 buffers, eager training alike): use an
/// optimizer with constant scalars there (SGD with momentum) to see the graphs' own memory.
pub fn soak(
    device: &Device,
    optimizer: fn() -> ModuleOptimizer,
    steps: usize,
    eval_every: usize,
    checkpoint_every: usize,
    settle: usize,
) -> Option<SoakFigures> {
    let figures = soak_run(
        device,
        optimizer,
        steps,
        eval_every,
        checkpoint_every,
        settle,
    )?;
    assert!(
        figures.reserved_peak <= figures.reserved_after_settle,
        "device memory grew after {settle} steps: {figures:?}"
    );
    assert!(
        figures.allocs_at_end <= figures.allocs_after_settle,
        "live allocations grew after {settle} steps: {figures:?}"
    );
    Some(figures)
}

/// [`soak`] without its memory checks: the run and its figures (every call replayed, no
/// fallback, replays and eval calls equal eager execution, parameters within the drift
/// tolerance at every checkpoint), whatever the device's memory did.
pub fn soak_run(
    device: &Device,
    optimizer: fn() -> ModuleOptimizer,
    steps: usize,
    eval_every: usize,
    checkpoint_every: usize,
    settle: usize,
) -> Option<SoakFigures> {
    let device = device.clone().autodiff();
    if !supports_graphs(&device) {
        return None;
    }
    let inner = device.clone().inner();
    let dispatch = inner.as_dispatch();
    let tolerance = tolerance_for(&device);
    let model = Mlp::new(32, 3, 8, &device);
    let mut eager = deep_copy(&model);
    let mut graphed = Graphed::new(
        model,
        mlp_forward,
        batch([16, 32], 0, &device),
        &super::copy_config(),
    )
    .expect("capture");
    let mut eager_optimizer = optimizer();
    let mut graphed_optimizer = optimizer();
    let usage = || {
        device.sync().expect("sync");
        Dispatch::memory_pool_usage(dispatch).expect("pool usage")
    };
    let mut figures = SoakFigures {
        steps,
        checkpoints: 0,
        evals: 0,
        reserved_after_settle: 0,
        reserved_at_end: 0,
        reserved_peak: 0,
        allocs_after_settle: 0,
        allocs_at_end: 0,
        replays: 0,
        max_drift: 0.0,
    };
    let mut movement = ParamMovement::new(values_only(param_values(&eager).expect("read back")));
    for step in 0..steps {
        let check = (step + 1) % eval_every == 0;
        let x = batch([16, 32], step, &device);
        let eager_loss = square_mean(mlp_forward(&eager, x.clone()));
        let graphed_out = graphed.forward(x.clone()).expect("graphed call");
        if check {
            // The replay against eager execution on the graphed model's own parameters.
            let own = mlp_forward(&graphed.module().valid(), x.inner()).into_data();
            let comparison = TensorComparison::new(
                format!("replay at step {step}"),
                &own,
                &graphed_out.clone().into_data(),
                tolerance,
            );
            assert!(comparison.passed(), "{comparison:?}");
        }
        let graphed_loss = square_mean(graphed_out);
        let eager_grads = GradientsParams::from_grads(eager_loss.backward(), &eager);
        let graphed_grads = GradientsParams::from_grads(graphed_loss.backward(), &graphed);
        eager = eager_optimizer.step(1e-3, eager, eager_grads);
        graphed = graphed_optimizer.step(1e-3, graphed, graphed_grads);

        if check {
            let x = batch([16, 32], step + 7, &inner);
            let own = mlp_forward(&graphed.module().valid(), x.clone()).into_data();
            let g = graphed.valid().forward(x).expect("eval call").into_data();
            let comparison =
                TensorComparison::new(format!("eval after step {step}"), &own, &g, tolerance);
            assert!(comparison.passed(), "{comparison:?}");
            figures.evals += 1;
        }
        if (step + 1) % checkpoint_every == 0 {
            let eager_params = values_only(param_values(&eager).expect("read back"));
            let graphed_params = values_only(param_values(&graphed).expect("read back"));
            let what = format!("after step {step}");
            for comparison in movement.compare(&what, &eager_params, &graphed_params, tolerance) {
                figures.max_drift = figures.max_drift.max(comparison.max_abs);
                assert!(comparison.passed(), "{comparison}");
            }
            graphed = graphed.map(&mut Overwrite {
                values: eager_params.iter(),
            });
            movement = ParamMovement::new(eager_params);
            figures.checkpoints += 1;
        }
        if step + 1 == settle {
            let now = usage();
            figures.reserved_after_settle = now.bytes_reserved;
            figures.allocs_after_settle = now.number_allocs;
        }
        if step + 1 > settle && (step + 1) % checkpoint_every == 0 {
            let now = usage();
            figures.reserved_peak = figures.reserved_peak.max(now.bytes_reserved);
            println!(
                "soak step {}: reserved {} B, live allocations {}",
                step + 1,
                now.bytes_reserved,
                now.number_allocs
            );
        }
    }
    let end = usage();
    figures.reserved_at_end = end.bytes_reserved;
    figures.allocs_at_end = end.number_allocs;
    figures.reserved_peak = figures.reserved_peak.max(end.bytes_reserved);
    let stats = graphed.stats();
    figures.replays = stats.forward_replays;
    println!("soak: {figures:?}");
    // Every training step replays its graphs, and every eval call its inference graph.
    assert_eq!(
        (figures.replays, stats.backward_replays),
        ((steps + figures.evals) as u64, steps as u64),
        "every call replays: {stats:?}"
    );
    assert!(stats.eager.is_empty(), "{stats:?}");
    Some(figures)
}

/// Adam, as most training uses.
pub fn adam() -> ModuleOptimizer {
    adam_config().init()
}

/// SGD with momentum: per-step kernel scalars that never change.
pub fn sgd_momentum() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

/// A linear layer followed by burn's (host-seeded) dropout.
#[derive(Module, Debug)]
pub struct DropNet {
    pub linear: burn::nn::Linear,
    pub dropout: burn::nn::Dropout,
}

fn dropnet_forward(m: &DropNet, x: Tensor<2>) -> Tensor<2> {
    m.dropout.forward(m.linear.forward(x))
}

/// `dropnet_forward` for batches of 5 rows, the linear layer alone for others: a callable whose
/// capture fails (replay validation) at one batch size only.
fn dropout_at_five(m: &DropNet, x: Tensor<2>) -> Tensor<2> {
    if x.dims()[0] == 5 {
        dropnet_forward(m, x)
    } else {
        m.linear.forward(x)
    }
}

/// Scales the MLP's output by a value read on the host: a graph would replay the value read at
/// capture.
fn host_scaled_forward(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    let y = m.forward(x);
    let scale = y.clone().abs().mean().into_scalar::<f32>();
    y.mul_scalar(scale)
}

/// Replay validation refuses what a graph would silently freeze (burn's dropout mask) with an
/// error that names the fix, leaves the module untouched and the device usable;
/// `validate_replay = false` accepts frozen randomness. A value read on the host that decides
/// the output is refused before that, by the backend, inside the forward recording
/// (`GraphedError::Capture`), the module untouched.
pub fn replay_validation_refuses_frozen_values(device: &Device) {
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let net = DropNet {
        linear: burn::nn::LinearConfig::new(32, 64).init(&device),
        dropout: burn::nn::DropoutConfig::new(0.5).init(),
    };
    let before = param_values(&net).expect("read back");
    let refused = Graphed::new(
        net.clone(),
        dropnet_forward,
        batch([8, 32], 0, &device),
        &GraphedConfig::new(),
    );
    match refused {
        Err(
            error @ burn_graphed::GraphedError::ReplayDiffers {
                callable: 0,
                output: 0,
                ..
            },
        ) => {
            let text = error.to_string();
            assert!(
                text.contains("GraphDropout") && text.contains("validate_replay"),
                "{text}"
            );
            println!("dropout refused: {text}");
        }
        other => panic!("expected ReplayDiffers for burn's dropout, got {other:?}"),
    }
    super::assert_params_unchanged(&net, &before);
    let frozen = Graphed::new(
        net,
        dropnet_forward,
        batch([8, 32], 0, &device),
        &GraphedConfig::new().with_validate_replay(false),
    );
    assert!(
        frozen.is_ok_and(|g| g.summary().graphed),
        "frozen randomness accepted on request"
    );

    // The backend refuses the read inside the forward recording (wgpu: a capture window
    // records dispatches only; CUDA: the read waits on an event of the capturing stream).
    let mlp = Mlp::new(16, 1, 4, &device);
    let before = param_values(&mlp).expect("read back");
    let host_read = Graphed::new(
        mlp.clone(),
        host_scaled_forward,
        batch([8, 16], 0, &device),
        &GraphedConfig::new(),
    );
    match host_read {
        Err(burn_graphed::GraphedError::Capture {
            phase: burn_graphed::CapturePhase::Forward,
            reason,
        }) => {
            println!("host read refused by the backend during the forward capture: {reason}")
        }
        other => panic!("a host read that decides the output must be refused, got {other:?}"),
    }
    super::assert_params_unchanged(&mlp, &before);
    // The device still trains and captures correctly.
    super::mlp_training_matches_eager(&device, 2);
}

/// A call from another thread than the capture runs eagerly (graphs replay on the capturing
/// thread's stream only), with the eager result, and is counted.
pub fn other_thread_runs_eagerly(device: &Device) {
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let graphed = capture_mlp(Mlp::new(16, 1, 4, &device), batch([8, 16], 0, &device));
    let other = graphed.clone();
    let thread_device = device.clone();
    let from_thread = std::thread::spawn(move || {
        let y = other
            .forward(batch([8, 16], 1, &thread_device))
            .expect("call from another thread");
        let _ = square_mean(y.clone()).backward();
        y.into_data()
    })
    .join()
    .expect("the other thread");
    let eager = mlp_forward(graphed.module(), batch([8, 16], 1, &device)).into_data();
    from_thread.assert_approx_eq::<f32>(&eager, Default::default());
    assert_eq!(
        graphed
            .stats()
            .eager
            .get(&burn_graphed::EagerReason::OtherThread),
        Some(&1)
    );
}

/// An input on another device than the capture's is refused with a typed error naming the
/// input and both devices, before anything runs; the module is untouched and the next call
/// replays.
pub fn input_on_another_device_is_refused(device: &Device, other: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 1, 4, &device);
    let before = param_values(&model).expect("read back");
    let graphed = capture_mlp(model, batch([8, 16], 0, &device));
    let foreign = batch([8, 16], 0, &other.clone().autodiff());
    match graphed.forward(foreign) {
        Err(burn_graphed::GraphedError::InputDevice {
            index: 0,
            expected,
            got,
        }) => {
            assert_ne!(expected, got);
        }
        other => panic!("expected InputDevice for input 0, got {other:?}"),
    }
    super::assert_params_unchanged(graphed.module(), &before);
    let y = graphed
        .forward(batch([8, 16], 1, &device))
        .expect("a call on the right device");
    let _ = square_mean(y).backward();
    if graphed.summary().graphed {
        assert_eq!(graphed.stats().total_eager(), 0, "{:?}", graphed.stats());
        assert_eq!(graphed.stats().forward_replays, 1);
    }
}

/// `release_capture_memory` (the default) returns the pages that only the capture's warm-ups
/// used: the same capture grows the device's pools less with it than without it. (Training
/// with it equals eager: every other scenario runs with the default.)
pub fn capture_releases_warmup_memory(device: &Device) {
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let growth = |release: bool| {
        // The previous capture's graphs are dropped: its pages are empty and unguarded.
        device.memory_cleanup();
        let graphed = Graphed::new(
            Mlp::new(512, 4, 512, &device),
            mlp_forward,
            batch([512, 512], 0, &device),
            &super::copy_config().with_release_capture_memory(release),
        )
        .expect("capture");
        assert!(graphed.summary().graphed);
        let memory = graphed.memory();
        // One graphed step, so that the graphs run after the cleanup.
        let loss = square_mean(
            graphed
                .forward(batch([512, 512], 1, &device))
                .expect("call"),
        );
        let _ = loss.backward();
        assert_eq!(graphed.stats().total_eager(), 0, "{:?}", graphed.stats());
        memory
    };
    let kept = growth(false);
    let released = growth(true);
    println!("capture pool growth: kept {kept:?}, released {released:?}");
    assert_eq!(kept.static_bytes, released.static_bytes);
    assert_eq!(kept.capture_released_bytes, 0, "{kept:?}");
    assert!(released.capture_released_bytes > 0, "{released:?}");
    assert!(
        released.capture_pool_growth_bytes < kept.capture_pool_growth_bytes,
        "release_capture_memory returned nothing: {released:?} against {kept:?}"
    );
}

/// `Graphed::prepare` captures graphs for a new batch size ahead of use: the first training
/// step at that size then replays them (no capture, no fallback) and its gradients equal
/// eager's, and prepare trains nothing itself. Asked again, or for the capture's own
/// signature, it finds the graphs cached. It says why a signature will run eagerly (a call
/// from another thread, a callable captured in a group, no graph capture on the backend), and
/// returns a failed capture's error without recording it: the module is untouched, the
/// device usable, and the signature is tried again by the next call.
pub fn prepare_captures_ahead(device: &Device) {
    use burn_graphed::{Callable, EagerReason, GraphedError, Prepared, make_graphed_callables};

    let device = device.clone().autodiff();
    let model = Mlp::new(16, 1, 4, &device);
    let eager = deep_copy(&model);
    // Copies: the loss and gradients of the prepared size stay alive to the last call.
    let graphed = Graphed::new(
        model,
        mlp_forward,
        batch([8, 16], 0, &device),
        &super::copy_config(),
    )
    .expect("capture");
    let small = |seed| batch([3, 16], seed, &device);
    if !supports_graphs(&device) {
        assert_eq!(
            graphed.prepare(small(1)),
            Ok(Prepared::Eager(EagerReason::Unsupported))
        );
        return;
    }
    assert_eq!(
        graphed.prepare(batch([8, 16], 1, &device)),
        Ok(Prepared::Cached),
        "the capture's own signature"
    );
    assert_eq!(graphed.prepare(small(1)), Ok(Prepared::Captured));
    assert_eq!(graphed.prepare(small(2)), Ok(Prepared::Cached));
    let cache = graphed.stats().shape_cache;
    assert_eq!((cache.captures, cache.graphs), (1, 2), "{cache:?}");
    assert_eq!(graphed.stats().forward_replays, 0, "prepare trains nothing");

    let x = small(3);
    let loss_graphed = square_mean(graphed.forward(x.clone()).expect("graphed call"));
    let loss_eager = square_mean(eager.forward(x));
    let grads_graphed = GradientsParams::from_grads(loss_graphed.backward(), &graphed);
    let grads_eager = GradientsParams::from_grads(loss_eager.backward(), &eager);
    super::assert_grads_close(
        "prepared batch size",
        (&eager, &grads_eager),
        (graphed.module(), &grads_graphed),
        tolerance_for(&device),
    );
    let stats = graphed.stats();
    super::assert_every_call_replayed(&stats, 1);
    assert_eq!(
        graphed.stats().shape_cache.captures,
        1,
        "the step at the prepared size captured nothing"
    );

    // Calls from another thread run eagerly: prepare there says so and captures nothing.
    let other = graphed.clone();
    let thread_device = device.clone();
    let from_thread = std::thread::spawn(move || other.prepare(batch([5, 16], 4, &thread_device)))
        .join()
        .expect("the other thread");
    assert_eq!(from_thread, Ok(Prepared::Eager(EagerReason::OtherThread)));
    assert_eq!(graphed.stats().shape_cache.graphs, 2);

    // A callable captured in a group of several captures no other signature.
    let member = || {
        Callable::new(
            Mlp::new(16, 1, 4, &device),
            mlp_forward,
            batch([8, 16], 0, &device),
        )
    };
    let (member, _other) = make_graphed_callables((member(), member()), &GraphedConfig::new())
        .expect("capture of a group of two");
    assert_eq!(
        member.prepare(small(5)),
        Ok(Prepared::Eager(EagerReason::Shape { index: 0 }))
    );

    // A capture that fails (burn's dropout at 5 rows, refused by replay validation) is
    // returned, not recorded; the module is untouched and the next call tries again.
    let net = DropNet {
        linear: burn::nn::LinearConfig::new(16, 8).init(&device),
        dropout: burn::nn::DropoutConfig::new(0.5).init(),
    };
    let before = param_values(&net).expect("read back");
    let graphed_net = Graphed::new(
        net,
        dropout_at_five,
        batch([8, 16], 0, &device),
        &GraphedConfig::new(),
    )
    .expect("capture without the dropout");
    let five = || batch([5, 16], 6, &device);
    match graphed_net.prepare(five()) {
        Err(GraphedError::ReplayDiffers { .. }) => {}
        other => panic!("expected ReplayDiffers for burn's dropout, got {other:?}"),
    }
    super::assert_params_unchanged(graphed_net.module(), &before);
    let cache = graphed_net.stats().shape_cache;
    assert_eq!(
        (cache.captures, cache.failed_captures, cache.graphs),
        (0, 0, 1),
        "{cache:?}"
    );
    assert!(cache.last_capture_error.is_none(), "{cache:?}");
    // The next call tries the capture again (and, failing, runs eagerly and records it).
    let y = graphed_net.forward(five()).expect("an eager call");
    assert_eq!(y.dims(), [5, 8]);
    assert_eq!(
        graphed_net.stats().eager.get(&EagerReason::CaptureFailed),
        Some(&1)
    );
    assert_eq!(graphed_net.stats().shape_cache.failed_captures, 1);
    // The device is usable: the first graphed model still replays.
    let y = graphed.forward(small(7)).expect("graphed call");
    let _ = square_mean(y).backward();
    assert_eq!(graphed.stats().forward_replays, 2);
}

/// The MLP's forward on its input cast to f32: a callable that runs on inputs of any float
/// dtype (eagerly; its graphs hold the capture's dtype).
fn cast_forward(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    m.forward(x.cast(burn::tensor::FloatDType::F32))
}

/// An input of another dtype than the capture's f32 (f16, else bf16 or f64: the first the
/// device supports). A callable that captures one signature only (`max_graphs = 1`) runs the
/// call eagerly, counted as `EagerReason::DType { index: 0 }` (`Unsupported` where nothing
/// is captured), with the eager result; under `MismatchPolicy::Error` the call is
/// `GraphedError::Mismatch` naming the input, the dtype given and the one captured, on every
/// backend. With room in the shape cache (the default) the new dtype is a new signature,
/// captured at its first call and replayed after.
pub fn dtype_change_falls_back_or_errors(device: &Device) {
    use burn::tensor::{DType, FloatDType};
    use burn_graphed::{EagerReason, GraphedError, MismatchPolicy};
    let device = device.clone().autodiff();
    let Some((dtype, float)) = [
        (DType::F16, FloatDType::F16),
        (DType::BF16, FloatDType::BF16),
        (DType::F64, FloatDType::F64),
    ]
    .into_iter()
    .find(|(dtype, _)| device.supports_dtype(*dtype)) else {
        return super::skip::skip("the device supports no float dtype besides f32");
    };
    let graphs = supports_graphs(&device);
    let other = |seed| batch([8, 16], seed, &device).cast(float);
    let model = Mlp::new(16, 1, 4, &device);
    let one = GraphedConfig::new().with_max_graphs(1);
    let graphed = Graphed::new(
        model.clone(),
        cast_forward,
        batch([8, 16], 0, &device),
        &one,
    )
    .expect("capture");
    let x = other(1);
    let y = graphed.forward(x.clone()).expect("an eager call");
    super::assert_data_close(
        &device,
        "the eager call",
        &cast_forward(&model, x).into_data(),
        &y.clone().into_data(),
    );
    let _ = square_mean(y).backward();
    let reason = if graphs {
        EagerReason::DType { index: 0 }
    } else {
        EagerReason::Unsupported
    };
    let stats = graphed.stats();
    assert_eq!(stats.eager.get(&reason), Some(&1), "{stats:?}");
    assert_eq!(stats.total_eager(), 1, "{stats:?}");

    let strict = Graphed::new(
        model.clone(),
        cast_forward,
        batch([8, 16], 0, &device),
        &one.clone().with_on_mismatch(MismatchPolicy::Error),
    )
    .expect("capture");
    assert_eq!(
        strict.forward(other(2)).err(),
        Some(GraphedError::Mismatch {
            reason: EagerReason::DType { index: 0 },
            detail: format!("input 0: given Float {dtype:?} [8, 16], captured Float F32 [8, 16]"),
        }),
    );
    assert_eq!(strict.stats().total_eager(), 0);

    if graphs {
        let cached = Graphed::new(
            model,
            cast_forward,
            batch([8, 16], 0, &device),
            &GraphedConfig::new(),
        )
        .expect("capture");
        for seed in 3..5 {
            let y = cached.forward(other(seed)).expect("graphed call");
            let _ = square_mean(y).backward();
        }
        let (stats, cache) = (cached.stats(), cached.stats().shape_cache);
        assert_eq!((cache.captures, cache.graphs), (1, 2), "{cache:?}");
        super::assert_every_call_replayed(&stats, 2);
    }
}

/// What [`ChangeFirst`] does to the first float parameter (in visiting order).
#[derive(Clone, Copy)]
enum Change {
    /// A new id, as replacing a layer after capture would.
    NewId,
    /// One more element along its last dimension, same id.
    Reshape,
}

/// Changes the first float parameter (in visiting order) as its [`Change`] says.
struct ChangeFirst(Option<Change>);

impl ModuleMapper for ChangeFirst {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.0.take() {
            None => param,
            Some(Change::NewId) => Param::initialized(ParamId::new(), param.val()),
            Some(Change::Reshape) => {
                let mut dims: [usize; D] = param.shape().dims();
                dims[D - 1] += 1;
                let value = Tensor::<D>::zeros(dims, &param.val().device()).require_grad();
                Param::initialized(param.id, value)
            }
        }
    }
}

/// Parameters replaced (a new id), reshaped, added (LoRA adapters attached after capture) or
/// removed (adapters merged after a capture that had them): a call is
/// `GraphedError::ParametersChanged`, whose detail names the parameter (replaced, reshaped: its
/// index, and what it is now and was at capture) or the counts (added, removed), on every
/// backend (the check needs no graphs). Nothing runs: the graphed values they were made from
/// count no call, and still replay.
pub fn changed_parameters_are_refused(device: &Device) {
    use burn::module::Lora;
    use burn_graphed::GraphedError;
    let device = device.clone().autodiff();
    let sample = || batch([4, 8], 0, &device);
    let refused = |changed: &Graphed<Mlp, Tensor<2>, Tensor<2>>, what: &str| -> String {
        match changed.forward(batch([4, 8], 1, &device)) {
            Err(GraphedError::ParametersChanged { detail }) => detail,
            other => panic!("{what}: expected ParametersChanged, got {other:?}"),
        }
    };
    let ids = |module: &Graphed<Mlp, Tensor<2>, Tensor<2>>| -> Vec<ParamId> {
        param_values(module)
            .expect("read back")
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    };
    let captured = Graphed::new(
        Mlp::new(8, 1, 2, &device),
        mlp_forward,
        sample(),
        &GraphedConfig::new(),
    )
    .expect("capture");
    let at_capture = ids(&captured);
    assert_eq!(at_capture.len(), 4, "two layers' weights and biases");

    let replaced = captured.clone().map(&mut ChangeFirst(Some(Change::NewId)));
    let now = ids(&replaced)[0];
    assert_eq!(
        refused(&replaced, "replaced"),
        format!("parameter 0 has id {now} now, {} at capture", at_capture[0])
    );
    let reshaped = captured
        .clone()
        .map(&mut ChangeFirst(Some(Change::Reshape)));
    assert_eq!(
        refused(&reshaped, "reshaped"),
        "parameter 0 has shape [8, 9] now, [8, 8] at capture"
    );
    // LoRA attaches two factors to each of the two weights.
    let adapted = captured.clone().apply_lora(Lora::new(2, 4.0));
    assert_eq!(
        refused(&adapted, "added"),
        "8 float parameters now, 4 at capture"
    );
    // A model captured with its adapters (their bases frozen), merged after.
    let with_adapters = Graphed::new(
        Mlp::new(8, 1, 2, &device).apply_lora(Lora::new(2, 4.0)),
        mlp_forward,
        sample(),
        &GraphedConfig::new().with_allow_non_trainable_params(true),
    )
    .expect("capture");
    let merged = with_adapters.clone().materialize();
    assert_eq!(
        refused(&merged, "removed"),
        "4 float parameters now, 8 at capture"
    );

    for graphed in [&captured, &with_adapters] {
        assert_eq!(
            super::counters(graphed.stats()),
            Default::default(),
            "a refused call counts nothing"
        );
        let y = graphed.forward(batch([4, 8], 2, &device)).expect("a call");
        let _ = square_mean(y).backward();
        if supports_graphs(&device) {
            let stats = graphed.stats();
            assert_eq!(
                (stats.forward_replays, stats.total_eager()),
                (1, 0),
                "{stats:?}"
            );
        }
    }
}

/// A bad callable in a group of several is named: the error is `GraphedError::InGroup` with
/// the callable's position and its own error ("callable 1 of the group: ..."), for a module
/// without autodiff (found before anything runs) and an input that requires grad but is
/// unused (found in the backward recording). `chain_errors` (`group.rs`) has the frozen
/// parameter and the chains that do not fit.
pub fn group_errors_name_the_callable(device: &Device) {
    use burn_graphed::{Callable, GraphedError, make_graphed_callables};
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let inner = device.clone().inner();
    let first = || {
        Callable::new(
            Mlp::new(16, 1, 4, &device),
            mlp_forward,
            batch([8, 16], 0, &device),
        )
    };
    let error = make_graphed_callables(
        (
            first(),
            Callable::new(
                Mlp::new(16, 1, 4, &inner),
                mlp_forward,
                batch([8, 16], 0, &inner),
            ),
        ),
        &GraphedConfig::new(),
    )
    .map(|_| ())
    .expect_err("callable 1's module is not on autodiff");
    match &error {
        GraphedError::InGroup { callable: 1, error } => assert!(
            matches!(
                **error,
                GraphedError::NotAutodiff {
                    what: "the module",
                    ..
                }
            ),
            "{error}"
        ),
        other => panic!("expected InGroup for callable 1, got {other}"),
    }
    assert!(
        error
            .to_string()
            .starts_with("callable 1 of the group: capture needs the module"),
        "{error}"
    );

    let unused = (
        batch([4, 16], 0, &device),
        batch([4, 8], 0, &device),
        batch([4, 3], 0, &device).require_grad(),
    );
    let error = make_graphed_callables(
        (
            first(),
            Callable::new(
                super::TwoHeads::new(&device),
                super::two_heads_forward,
                unused,
            ),
        ),
        &GraphedConfig::new(),
    )
    .map(|_| ())
    .expect_err("callable 1's third input is unused");
    assert_eq!(
        error,
        GraphedError::InGroup {
            callable: 1,
            error: Box::new(GraphedError::UnusedInput { index: 2 }),
        }
    );
    // The device captures and trains after both.
    super::mlp_training_matches_eager(&device, 2);
}

/// `model = optim.step(lr, model.clone(), grads)` with `FusedAdam`: the clone holds the
/// parameters during the step. Training equals eager training with burn's `Adam`, every call
/// replays (the clone is gone by the next call), and the parameters are copied into the graphs
/// at every other call: the first call copies the module's own tensors in; a step whose
/// parameters are other tensors than the graphs' buffers writes its update into those buffers
/// (the next call copies nothing), and the step after, whose parameters are then the graphs'
/// buffers, held twice, writes new buffers (the next call copies them in). Without the clone
/// (`optim.rs::graphed_fused_adam_matches_eager`) only the first call copies.
pub fn fused_adam_stepping_a_clone_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    super::require_graphs(&device);
    let steps = 4;
    let model = Mlp::new(16, 2, 4, &device);
    let mut eager = deep_copy(&model);
    let mut check = super::ParamsCheck::new(&device, &model);
    let mut graphed = capture_mlp(model, batch([8, 16], 0, &device));
    let params = graphed.summary().params as u64;
    let mut fused_adam = super::fused_adam_config().init();
    let mut adam = adam_config().init();
    for call in 1..=steps {
        let x = batch([8, 16], call, &device);
        let loss = square_mean(graphed.forward(x.clone()).expect("graphed call"));
        let stats = graphed.stats();
        assert_eq!(
            stats.param_copies,
            params * call.div_ceil(2) as u64,
            "copies at calls 1, 3, ...: {stats:?}"
        );
        let grads = GradientsParams::from_grads(loss.backward(), &graphed);
        graphed = fused_adam.step(1e-2, graphed.clone(), grads);
        let loss = square_mean(mlp_forward(&eager, x));
        let grads = GradientsParams::from_grads(loss.backward(), &eager);
        eager = adam.step(1e-2, eager, grads);
        check.assert(&format!("step {call}"), &eager, &graphed);
    }
    let stats = graphed.stats();
    super::assert_every_call_replayed(&stats, steps as u64);
}

/// `GraphedConfig::require_graphs`: where the backend cannot capture (Flex), `Graphed::new` and
/// `GraphedStep::new` are `GraphedError::Unsupported` naming the device instead of a model
/// whose every call runs eagerly; where it can, both capture.
pub fn require_graphs_refuses_a_backend_without_graphs(device: &Device) {
    use burn_graphed::{GraphedError, GraphedStep};
    let device = device.clone().autodiff();
    let config = GraphedConfig::new().with_require_graphs(true);
    let graphed = Graphed::new(
        Mlp::new(16, 1, 4, &device),
        mlp_forward,
        batch([8, 16], 0, &device),
        &config,
    );
    fn mean_square(model: &Mlp, x: Tensor<2>) -> Tensor<1> {
        square_mean(model.forward(x))
    }
    let step = GraphedStep::new(
        Mlp::new(16, 1, 4, &device),
        mean_square,
        &adam_config(),
        batch([8, 16], 0, &device),
        &config,
    );
    if supports_graphs(&device) {
        assert!(graphed.expect("capture").summary().graphed);
        assert!(step.expect("capture").is_graphed());
    } else {
        let refused = |error: Option<GraphedError>| match error {
            Some(GraphedError::Unsupported { device }) => assert!(!device.is_empty()),
            other => panic!("expected Unsupported, got {other:?}"),
        };
        refused(graphed.err());
        refused(step.err());
    }
}

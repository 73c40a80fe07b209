//! The timed runs behind [`run`] by kind of mode: data-parallel, inference, graphed, whole-step
//! and first-step runs.

use super::*;

/// Every parameter's values, by id ([`param_values`]).
pub(crate) type ParamValues = Vec<(ParamId, TensorData)>;

/// A `ddp_*` run ([`Mode::Ddp`]) of `case` on `options.ranks` GPUs, the first being `device`;
/// `None` (with a `skipped:` line) where the machine has fewer. Every rank trains a replica of
/// one model on batches of its own; after the timed steps the replicas must be bitwise equal.
/// The row is rank 0's step time (every rep starts at a barrier of all ranks), with the ranks
/// and the samples per second of all of them.
pub(crate) fn data_parallel<M, I, O>(
    case: &Case<M, I, O>,
    ddp: DdpStep,
    device: &Device,
    options: &Options,
    before: u64,
    unmeasured_before: usize,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let mode = Mode::Ddp(ddp);
    let label = format!("{} {}", case.name, mode.label());
    // The whole process runs one mode: the switches hold for its captures (each rank's
    // process sets them, as it runs the same mode).
    burn_graphed::testing::overlap_all_reduces(matches!(
        ddp,
        DdpStep::InGraphOverlap
            | DdpStep::ThreadsInGraphOverlap
            | DdpStep::ThreadsInGraphOverlapOneStream
    ));
    burn_graphed::testing::overlap_on_side_stream(ddp != DdpStep::ThreadsInGraphOverlapOneStream);
    if let DdpStep::InGraph
    | DdpStep::InGraphOverlap
    | DdpStep::BetweenGraphs
    | DdpStep::InGraphSockets = ddp
    {
        let in_graph = ddp != DdpStep::BetweenGraphs;
        if ddp == DdpStep::InGraphSockets {
            super::processes::require_sockets(&label);
        }
        return super::processes::data_parallel(case, mode, in_graph, device, options, before);
    }
    let (devices, collective) = ddp_devices(device, options);
    let collective = match ddp {
        DdpStep::ThreadsInGraph
        | DdpStep::ThreadsInGraphOverlap
        | DdpStep::ThreadsInGraphOverlapOneStream => Collective::Nccl { in_graph: true },
        _ => collective,
    };
    let group = DataParallel::group(devices.len(), Duration::from_secs(600), collective)
        .expect("a data-parallel group");
    let model = (case.make)(device);
    let ranks: Vec<(Vec<f64>, ParamValues, Option<StepCheck>)> = std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .zip(&devices)
            .map(|(dp, device)| {
                let (model, label) = (model.clone(), &label);
                scope.spawn(move || {
                    // One host profile per run (`--host-profile`): rank 0's, which samples
                    // every thread of the process, the other ranks' too.
                    let options = &Options {
                        host_profile: options
                            .host_profile
                            .clone()
                            .filter(|_| dp.ranks().rank() == 0),
                        ..options.clone()
                    };
                    let replica = replica_on(&model, device);
                    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
                    let rank_label = format!("{label}, rank {}", dp.ranks().rank());
                    let mut check = None;
                    let (per_step, values) = match ddp {
                        DdpStep::WholeStep
                        | DdpStep::InGraph
                        | DdpStep::InGraphOverlap
                        | DdpStep::BetweenGraphs
                        | DdpStep::InGraphSockets
                        | DdpStep::ThreadsInGraph
                        | DdpStep::ThreadsInGraphOverlap
                        | DdpStep::ThreadsInGraphOverlapOneStream => {
                            let (per_step, step) = timed_ddp_whole_step(
                                &dp,
                                replica,
                                case.call_loss,
                                &inputs,
                                &rank_label,
                                device,
                                options,
                            );
                            let values = param_values(&step.module());
                            drop(step);
                            check = options
                                .check
                                .then(|| check_data_parallel(case, &dp, device, options, label))
                                .flatten();
                            (per_step, values)
                        }
                        DdpStep::Graphed => {
                            let config = GraphedConfig::new().with_outputs(OutputPolicy::Static);
                            let replica = dp
                                .in_turn("capture", device, || {
                                    Graphed::new(replica, case.call, inputs[0].clone(), &config)
                                })
                                .expect("every rank captures");
                            let call = |model: &Graphed<M, I, O>, input: I| {
                                model.forward(input).expect("graphed call")
                            };
                            let (per_step, replica) = train_steps(
                                replica,
                                call,
                                case.loss,
                                &inputs,
                                &mut Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
                                &rank_label,
                                device,
                                options,
                                Some(&dp),
                            );
                            let replica = replica.expect("the trained replica");
                            let stats = replica.stats();
                            eprintln!("# {rank_label}: {stats:?}");
                            assert!(
                                stats.eager.is_empty(),
                                "{label}: a step ran eagerly: {stats:?}"
                            );
                            (per_step, param_values(replica.module()))
                        }
                        DdpStep::Eager => {
                            let (per_step, replica) = train_steps(
                                replica,
                                case.call,
                                case.loss,
                                &inputs,
                                &mut Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
                                &rank_label,
                                device,
                                options,
                                Some(&dp),
                            );
                            let replica = replica.expect("the trained replica");
                            (per_step, param_values(&replica))
                        }
                    };
                    let values = values.unwrap_or_else(|error| {
                        panic!("{label}: not a result: parameters do not read back ({error})")
                    });
                    require_finite(&values)
                        .unwrap_or_else(|error| panic!("{label}: not a result: {error}"));
                    (per_step, values, check)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("a rank's thread"))
            .collect()
    });
    let identical = ranks.windows(2).all(|pair| pair[0].1 == pair[1].1);
    eprintln!("# {label}: replicas bitwise equal after the run: {identical}");
    assert!(identical, "{label}: the replicas' parameters differ");
    let (per_step, _, check) = ranks.into_iter().next().unwrap_or_default();
    let mut row = Row::timed(
        case,
        mode,
        per_step,
        device,
        before,
        options,
        unmeasured_before,
    );
    row.ranks = Some((devices.len(), case.batch));
    row.check = check.map(Check::Steps);
    row
}

/// The autodiff devices of a `ddp_*` run, rank 0 being `device`, and their collective: with
/// `cuda`, the first `options.ranks` GPUs (each in the run's float type) and burn's NCCL
/// all-reduce; without (a smoke run of the bench), `device` for every rank, averaging through
/// the host. Exits the process with a `skipped:` line where there are fewer GPUs.
pub(crate) fn ddp_devices(device: &Device, options: &Options) -> (Vec<Device>, Collective) {
    #[cfg(feature = "cuda")]
    {
        let count = cudarc::driver::result::init()
            .and_then(|()| cudarc::driver::result::device::get_count())
            .unwrap_or(0) as usize;
        if count < options.ranks {
            println!(
                "# skipped: the ddp modes need {} GPUs, this machine has {count}",
                options.ranks
            );
            std::process::exit(0);
        }
        let inner: Vec<Device> = (0..options.ranks)
            .map(|rank| {
                if rank == 0 {
                    return device.clone().inner();
                }
                let mut gpu = Device::cuda(rank);
                if options.dtype == "bf16" {
                    gpu.configure(FloatDType::BF16)
                        .expect("bf16 before any tensor");
                }
                gpu
            })
            .collect();
        let devices = inner.iter().map(|d| d.clone().autodiff()).collect();
        (devices, Collective::AllReduce { devices: inner })
    }
    #[cfg(not(feature = "cuda"))]
    (vec![device.clone(); options.ranks], Collective::Host)
}

/// The timed forward calls of an inference mode at `batch` rows, on the device without
/// autodiff: eagerly, or (`graphed`) through `Graphed::inference` with its default
/// configuration, whose outputs are first checked against the eager call's (through the
/// case's loss, on a batch other than the capture's; not under `SkipInputCopy`, whose values
/// are wrong), with `fault` built into its graph. Prints the graphed model's counters and the
/// host's time per call (from the call to its return, the device's work queued).
pub(crate) fn timed_inference<M, I, O>(
    case: &Case<M, I, O>,
    graphed: bool,
    batch: usize,
    fault: FaultInjection,
    label: &str,
    device: &Device,
    options: &Options,
) -> (Vec<f64>, Option<OutputCheck>)
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let device = device.clone().inner();
    let model = (case.make)(&device);
    let input = case.forward_input.unwrap_or(case.input);
    let inputs: Vec<I> = (0..4).map(|_| input(&device, batch)).collect();
    if !graphed {
        let mut call = |i: usize| drop((case.call)(&model, inputs[i % inputs.len()].clone()));
        return (time(&device, options, label, &mut call), None);
    }
    trace_phase("capture");
    // The check's eager reference, computed before the graphs exist: the outputs of the batch
    // the check feeds the graph (not the capture's) and, as the control, of the capture's.
    let (checked, control) = (1, 0);
    let reference = options.check.then(|| {
        let outputs = |i: usize| output_values((case.call)(&model, inputs[i].clone()));
        (outputs(checked), outputs(control))
    });
    let injected = burn_graphed::testing::inject(fault);
    let graphed = Graphed::inference(
        model,
        case.call,
        vec![inputs[0].clone()],
        &GraphedConfig::new(),
    )
    .expect("capture");
    drop(injected);
    let (mut host, mut count) = (Duration::ZERO, 0u32);
    let mut call = |i: usize| {
        let clock = Instant::now();
        let output = graphed
            .forward(inputs[i % inputs.len()].clone())
            .expect("graphed call");
        host += clock.elapsed();
        count += 1;
        drop(output);
    };
    burn_graphed::testing::time_phases(true);
    let per_step = time(&device, options, label, &mut call);
    eprintln!(
        "# {label}: host {:.1} us per call (queueing: copy, check, replay)",
        host.as_secs_f64() * 1e6 / f64::from(count.max(1))
    );
    if let Some((calls, phases)) = burn_graphed::testing::phase_times() {
        let phases: Vec<String> = phases
            .iter()
            .map(|(phase, time)| {
                let per_call = time.as_secs_f64() * 1e6 / calls.max(1) as f64;
                format!("{phase:?} {per_call:.1}")
            })
            .collect();
        eprintln!(
            "# {label}: host us per call by phase ({calls} calls): {}",
            phases.join(", ")
        );
    }
    burn_graphed::testing::time_phases(false);
    let stats = graphed.stats();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    if graphed.summary().graphed {
        let calls = (WARM_UP + options.reps * options.steps) as u64;
        assert!(stats.forward_replays >= calls, "{label}: {stats:?}");
    }
    eprintln!("# {label}: {stats:?}");
    // After the timed calls, on the graphs they timed.
    trace_phase("check");
    let check = reference.map(|(eager, stale)| {
        let replayed = output_values(
            graphed
                .forward(inputs[checked].clone())
                .expect("graphed call"),
        );
        let check = OutputCheck::new(&options.dtype, &eager, &replayed, &stale);
        eprintln!("# {label}: value check {check}");
        check
    });
    (per_step, check)
}

/// The timed steps of a graphed `mode`, `call` graphed: per-step times; prints the graphed
/// model's counters and memory.
#[allow(clippy::too_many_arguments)]
pub(crate) fn timed_graphed<M, I, O>(
    model: M,
    call: fn(&M, I) -> O,
    loss: fn(O, &I) -> Tensor<1>,
    mode: Mode,
    inputs: &[I],
    optimizer: &mut Optimizer,
    label: &str,
    device: &Device,
    options: &Options,
) -> Vec<f64>
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    trace_phase("capture");
    let fault = burn_graphed::testing::inject(mode.fault());
    let graphed = Graphed::new(model, call, inputs[0].clone(), &mode.config()).expect("capture");
    drop(fault);
    let call = |model: &Graphed<M, I, O>, input: I| model.forward(input).expect("graphed call");
    let (per_step, model) = train_steps(
        graphed, call, loss, inputs, optimizer, label, device, options, None,
    );
    let stats = model.as_ref().map(|m| m.stats()).unwrap_or_default();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    eprintln!("# {label}: {stats:?}");
    // What the capture added to the pools and what its static buffers take: the graphed part
    // of the memory column.
    if let Some(model) = &model {
        eprintln!("# {label}: {:?}", model.memory());
        assert_ran(model, label);
    }
    per_step
}

/// The timed steps of a whole-step `mode` (`floor`: no input copy, one learning rate): one
/// `GraphedStep::run` per step; prints its counters.
pub(crate) fn timed_whole_step<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    floor: bool,
    inputs: &[I],
    label: &str,
    device: &Device,
    options: &Options,
) -> Vec<f64>
where
    M: Module,
    I: TensorGroup + Clone,
{
    trace_phase("capture");
    let started = Instant::now();
    let mut step = whole_step(model, loss, &inputs[0], Mode::WholeStep(floor));
    eprintln!(
        "# {label}: capture {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let mut host = std::time::Duration::ZERO;
    let mut count = 0u32;
    let mut run = |i: usize| {
        // A schedule changes the rate every step (a write before each replay); the floor
        // keeps one rate.
        let lr = if floor {
            1e-4
        } else {
            1e-4 * (1.0 - 1e-7 * i as f64)
        };
        let clock = Instant::now();
        let loss = step
            .run(inputs[i % inputs.len()].clone(), lr)
            .expect("whole step");
        host += clock.elapsed();
        count += 1;
        drop(loss);
    };
    let per_step = time(device, options, label, &mut run);
    eprintln!(
        "# {label}: host {:.1} us per step (queueing: copy, lr write, replay, loss copy)",
        host.as_secs_f64() * 1e6 / f64::from(count.max(1))
    );
    let stats = step.stats();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    eprintln!("# {label}: {stats:?}");
    assert_ran(&step.module(), label);
    per_step
}

/// Times a rank's data-parallel whole steps (`GraphedStep::data_parallel` with burn's Adam, a
/// learning rate changing every step as in [`timed_whole_step`]), every rep starting at a
/// barrier of all ranks; returns the per-step times and the trained step.
pub(crate) fn timed_ddp_whole_step<M, I>(
    dp: &DataParallel,
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    inputs: &[I],
    label: &str,
    device: &Device,
    options: &Options,
) -> (Vec<f64>, GraphedStep<M, I>)
where
    M: Module,
    I: TensorGroup + Clone,
{
    trace_phase("capture");
    let started = Instant::now();
    let mut step = GraphedStep::data_parallel(
        dp,
        model,
        loss,
        &AdamConfig::new(),
        vec![inputs[0].clone()],
        &GraphedConfig::new(),
    )
    .expect("every rank captures");
    eprintln!(
        "# {label}: capture {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    // Per call, for the median: the first calls also set NCCL's communicator up.
    let mut host = Vec::new();
    let mut run = |i: usize| {
        let clock = Instant::now();
        let loss = step
            .run(
                inputs[i % inputs.len()].clone(),
                1e-4 * (1.0 - 1e-7 * i as f64),
            )
            .expect("data-parallel whole step");
        host.push(clock.elapsed().as_secs_f64() * 1e6);
        drop(loss);
    };
    let before_rep = || {
        dp.ranks()
            .barrier("a rep's start")
            .expect("every rank starts the rep");
    };
    let per_step = time_with(device, options, label, &before_rep, &mut run);
    host.sort_by(f64::total_cmp);
    eprintln!(
        "# {label}: host {:.1} us per step, median (copy, lr write, gradient replay, \
         agreement, all-reduce, update replay, loss copy)",
        host.get(host.len() / 2).copied().unwrap_or(f64::NAN)
    );
    let stats = step.stats();
    eprintln!("# {label}: {stats:?}");
    assert_eq!(
        stats.total_eager(),
        0,
        "{label}: a step ran eagerly: {stats:?}"
    );
    (per_step, step)
}

/// A `GraphedStep` of `model` with burn's Adam, captured on `sample` with `mode`'s fault.
pub(crate) fn whole_step<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    sample: &I,
    mode: Mode,
) -> GraphedStep<M, I>
where
    M: Module,
    I: TensorGroup + Clone,
{
    let _fault = burn_graphed::testing::inject(mode.fault());
    GraphedStep::new(
        model,
        loss,
        &AdamConfig::new(),
        sample.clone(),
        &GraphedConfig::new(),
    )
    .expect("capture")
}

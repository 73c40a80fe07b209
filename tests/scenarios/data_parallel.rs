//! Data-parallel training with `DataParallel`: two graphed replicas, each on half of every
//! batch, their gradients averaged, against one model trained eagerly on the whole batch; and
//! the failures that must end every rank's step, not hang it.
//!
//! Long on purpose: the thread scenarios share one model, one split of the batch and the
//! checks of `whole_steps_match_one_model` (with its controls); the process scenarios, which
//! need a child process each, are in `processes.rs`.

use std::thread;
use std::time::Duration;

use burn::optim::SgdConfig;
use burn_graphed::{Collective, DataParallel, EagerReason, GraphedStep, replica_on};
use burn_graphed_testkit::deep_copy;

use super::*;

/// `examples/train_ddp.rs`, whose loop runs here on the suite's devices.
#[path = "../../examples/train_ddp.rs"]
#[allow(dead_code)]
mod train_ddp;

pub(super) const STEPS: usize = 3;
pub(super) const RANKS: usize = 2;
pub(super) const ROWS: usize = 8;

/// Rank `rank`'s share (of `ranks`) of step `step`'s batch of [`ROWS`] rows, on `device`.
pub(super) fn shard(step: usize, rank: usize, ranks: usize, device: &Device) -> Tensor<2> {
    let share = ROWS / ranks;
    batch([ROWS, 16], step, device).narrow(0, rank * share, share)
}

/// How long a rank waits for the others. Long: on a CUDA machine whose kernel cache is cold, a
/// rank's turn at capturing a new shape compiles and autotunes its kernels while the others
/// wait (minutes for the shapes of one test).
const RANK_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs `body` on one thread per rank of a fresh group of [`RANKS`] ranks averaging with
/// `collective`; the results in rank order.
fn on_ranks<T: Send>(collective: &Collective, body: impl Fn(DataParallel) -> T + Sync) -> Vec<T> {
    on_group(RANKS, collective, body)
}

/// [`on_ranks`] with `size` ranks.
fn on_group<T: Send>(
    size: usize,
    collective: &Collective,
    body: impl Fn(DataParallel) -> T + Sync,
) -> Vec<T> {
    let group = DataParallel::group(size, RANK_TIMEOUT, collective.clone()).expect("group");
    let body = &body;
    thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .map(|dp| scope.spawn(move || body(dp)))
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("rank thread"))
            .collect()
    })
}

/// Ranks that are threads of one process draw alike in turn: each rank seeds burn's generator
/// and draws the bench's check draws (four `[8, 128, 256]` tensors) inside
/// `DataParallel::in_turn`, and every rank's draws must equal rank 0's, bit for bit. burn's
/// cubecl backends take a draw's seed from one process-wide generator when the draw's kernel
/// launches, and fusion launches lazily: a turn that ended before its draws ran would let the
/// next rank's seeding land between them (the data-parallel bench check's shards then differed
/// from the ones rank 0 compared with, on 2 GPUs). The control: the same turns without the
/// drain at their end (barriers in rank order) must give draws that are not all alike, or the
/// test cannot see the difference on this machine and says so. In the GPU suite only, which
/// runs one test at a time in a process: any other thread's draw between a rank's seeding and
/// its draws would change them too (the CPU suite's parallel tests did, on Flex), and on the
/// CPU backends (one wgpu device shared by the ranks, Flex) the draws come out alike either
/// way.
pub fn draws_in_turn_are_alike(devices: &[Device]) {
    const SEED: u64 = 2024;
    let draws = |device: &Device| {
        device.seed(SEED);
        (0..4)
            .map(|_| {
                Tensor::<3>::random([8, 128, 256], burn::tensor::Distribution::Default, device)
            })
            .collect::<Vec<_>>()
    };
    let values = |tensors: Vec<Tensor<3>>| -> Vec<f32> {
        tensors
            .into_iter()
            .flat_map(|t| t.into_data().try_to_vec::<f32>().expect("f32 values"))
            .collect()
    };
    // Each rank's body under `run`: a rank that fails ends the group, not its peers' wait.
    let in_turn: Vec<Vec<f32>> = on_group(devices.len(), &Collective::Host, |dp| {
        dp.run(|dp| {
            let device = &devices[dp.ranks().rank()];
            let mine = dp.in_turn("the draws", device, || Ok(draws(device)))?;
            Ok(values(mine))
        })
        .expect("draws in turn")
    });
    for (rank, drawn) in in_turn.iter().enumerate() {
        assert!(
            drawn == &in_turn[0],
            "rank {rank}'s draws in turn differ from rank 0's"
        );
    }
    // Control: turns in rank order that end at a barrier without draining the device.
    let undrained: Vec<Vec<f32>> = on_group(devices.len(), &Collective::Host, |dp| {
        dp.run(|dp| {
            let (rank, size) = (dp.ranks().rank(), dp.ranks().size());
            let device = &devices[rank];
            let mut mine = None;
            for turn in 0..size {
                if turn == rank {
                    mine = Some(draws(device));
                }
                dp.ranks().barrier("a turn")?;
            }
            Ok(values(mine.expect("this rank's turn came")))
        })
        .expect("draws in turns without the drain")
    });
    if undrained.iter().all(|drawn| drawn == &undrained[0]) {
        super::skip::skip(&format!(
            "{:?}: draws in turns without the drain came out alike too, so the control cannot \
             fail on this machine",
            devices[0]
        ));
    }
}

/// Trains a graphed replica of `model` per rank, rank `i` on `devices[i]` and its shard, for
/// [`STEPS`] steps with burn's `Adam`, the gradients averaged by `DataParallel` with
/// `collective` unless `average` is off; the replicas, in rank order. Each rank captures its
/// graphs on its own thread, one rank at a time (`DataParallel::in_turn`).
fn train_replicas(
    model: &Mlp,
    devices: &[Device],
    collective: &Collective,
    average: bool,
) -> Vec<Mlp> {
    let replicas: Vec<Mlp> = devices
        .iter()
        .map(|device| replica_on(model, device))
        .collect();
    on_ranks(collective, |dp| {
        let rank = dp.ranks().rank();
        let (replica, device) = (replicas[rank].clone(), &devices[rank]);
        let mut graphed = dp
            .in_turn("capture", device, || {
                Graphed::new(
                    replica,
                    mlp_forward,
                    shard(0, rank, RANKS, device),
                    &GraphedConfig::new(),
                )
            })
            .expect("captures");
        let mut optim = adam_config().init();
        for step in 0..STEPS {
            let loss = square_mean(
                graphed
                    .forward(shard(step, rank, RANKS, device))
                    .expect("call"),
            );
            let grads = GradientsParams::from_grads(loss.backward(), &graphed);
            let grads = if average {
                dp.average(&graphed, grads).expect("average")
            } else {
                grads
            };
            graphed = optim.step(1e-2, graphed, grads);
        }
        if supports_graphs(device) {
            let stats = graphed.stats();
            assert_eq!(
                stats.forward_replays, STEPS as u64,
                "rank {rank}: {stats:?}"
            );
            assert!(stats.eager.is_empty(), "rank {rank}: {stats:?}");
        }
        deep_copy(graphed.module())
    })
}

/// Two graphed replicas, rank `i` on `devices[i]`, on half batches, gradients averaged with
/// `collective`: after the run each equals one model trained eagerly on the whole batches on
/// the first device (within its tolerance), and the two replicas are bitwise identical.
/// Without the averaging (the negative control) the replicas differ.
pub fn replicas_match_one_model(devices: &[Device], collective: Collective) {
    assert_eq!(devices.len(), RANKS, "one device per rank");
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let device = devices[0].clone();
    let model = Mlp::new(16, 2, 4, &device);
    let mut single = deep_copy(&model);
    let mut optim = adam_config().init();
    for step in 0..STEPS {
        let loss = square_mean(single.forward(batch([ROWS, 16], step, &device)));
        let grads = GradientsParams::from_grads(loss.backward(), &single);
        single = optim.step(1e-2, single, grads);
    }

    let replicas = train_replicas(&model, &devices, &collective, true);
    let apart = train_replicas(&model, &devices, &collective, false);
    assert_averaged_and_apart(
        "graphed", &model, &single, &replicas, &apart, &device, false,
    );
}

/// `replicas` (trained with averaging from `start`) each close to `single` (one model on the
/// whole batches) and bitwise equal to each other; with `compare_updates`, their updates
/// (trained minus `start`) close to `single`'s too; the updates of `apart` (the same without
/// averaging) differ, or the check is blind. Updates, not parameters: a few small SGD steps
/// move the parameters by less than the tensor-core tolerance, so that a sum instead of a mean,
/// or no averaging at all, would pass a comparison of parameters. Not for Adam's updates, which
/// a mean and a sum give alike, and whose near-zero gradients turn rounding into a full step.
pub(super) fn assert_averaged_and_apart(
    what: &str,
    start: &Mlp,
    single: &Mlp,
    replicas: &[Mlp],
    apart: &[Mlp],
    device: &Device,
    compare_updates: bool,
) {
    let tolerance = tolerance_for(device);
    // Relative to how far `single` moved from `start` (its net distance: the steps are not
    // seen one by one, which makes the bound tighter than the path's, never looser).
    let mut check = ParamsCheck::new(device, start);
    let start = param_values(start).expect("read back");
    let single_update = compare_updates.then(|| update(&start, single));
    for (rank, replica) in replicas.iter().enumerate() {
        check.assert(
            &format!("{what}: rank {rank} against one model"),
            single,
            replica,
        );
        let Some(single_update) = &single_update else {
            continue;
        };
        for (index, (eager, averaged)) in single_update
            .iter()
            .zip(update(&start, replica))
            .enumerate()
        {
            let comparison = burn_graphed_testkit::TensorComparison::new(
                format!("{what}: rank {rank}'s update of parameter {index} against one model's"),
                eager,
                &averaged,
                tolerance,
            );
            assert!(comparison.passed(), "{comparison}");
        }
    }
    let first = param_values(&replicas[0]).expect("read back");
    for replica in &replicas[1..] {
        assert_params_unchanged(replica, &first);
    }
    let differs = update(&start, &apart[0])
        .iter()
        .zip(update(&start, &apart[1]))
        .any(|(a, b)| {
            !burn_graphed_testkit::TensorComparison::new(what, a, &b, tolerance).passed()
        });
    assert!(
        differs,
        "{what}: replicas trained on different shards without averaging made the same updates: \
         the check is blind"
    );
}

/// Every parameter's update from `before` (the start's values) to `trained`, in visiting order,
/// as f32 values.
fn update(before: &[(burn::module::ParamId, TensorData)], trained: &Mlp) -> Vec<TensorData> {
    let after = param_values(trained).expect("read back");
    assert_eq!(before.len(), after.len(), "parameter count");
    before
        .iter()
        .zip(after)
        .map(|((_, b), (_, a))| {
            let shape = a.shape().to_vec();
            let (b, a) = (
                b.clone().convert::<f32>().try_to_vec::<f32>().expect("f32"),
                a.convert::<f32>().try_to_vec::<f32>().expect("f32"),
            );
            let delta: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a - b).collect();
            TensorData::new(delta, shape)
        })
        .collect()
}

/// One rank's capture failing (a sample of the wrong width) is an error on every rank,
/// naming that rank, after every other rank captured; every device then captures and trains
/// again with the group's `collective` (rank `i` on `devices[i]`).
pub fn failed_capture_fails_every_rank(devices: &[Device], collective: Collective) {
    assert_eq!(devices.len(), RANKS, "one device per rank");
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    require_graphs(&devices[0]);
    let model = Mlp::new(16, 2, 4, &devices[0]);
    let results = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let width = if rank == 1 { 15 } else { 16 };
        dp.in_turn("capture", device, || {
            Graphed::new(
                replica_on(&model, device),
                mlp_forward,
                batch([4, width], 0, device),
                &GraphedConfig::new(),
            )
        })
        .map(|_| ())
    });
    for result in results {
        assert!(
            matches!(&result, Err(GraphedError::RankFailed { rank: 1, what, .. }) if what == "capture"),
            "{result:?}"
        );
    }
    // Every device captures and trains again, averaging through the collective.
    let replicas = train_replicas(&model, &devices, &collective, true);
    let first = param_values(&replicas[0]).expect("read back");
    assert_params_unchanged(&replicas[1], &first);
}

/// A rank whose module has other parameters (a replica of another architecture) ends the
/// step on every rank with `RanksDisagree`; a rank that never comes ends it with
/// `RankTimeout`, within the timeout, not a hang.
pub fn mismatched_ranks_fail_on_every_rank(device: &Device) {
    let device = device.clone().autodiff();
    let results = on_ranks(&Collective::Host, |dp| {
        let depth = 1 + dp.ranks().rank();
        let model = Mlp::new(16, depth, 4, &device);
        let loss = square_mean(model.forward(batch([4, 16], 0, &device)));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        dp.average(&model, grads).map(|_| ())
    });
    for result in results {
        assert!(
            matches!(result, Err(GraphedError::RanksDisagree { .. })),
            "{result:?}"
        );
    }

    // NCCL would join one device once for two ranks and wait forever: refused up front.
    let shared = DataParallel::group(
        RANKS,
        Duration::from_secs(1),
        Collective::AllReduce {
            devices: vec![device.clone(), device.clone()],
        },
    );
    assert!(
        matches!(
            &shared,
            Err(GraphedError::InvalidArgument {
                argument: "collective",
                ..
            })
        ),
        "{:?}",
        shared.map(|_| ())
    );
    // NCCL needs the cuda feature, which this suite's build lacks: refused up front, saying so.
    #[cfg(not(feature = "cuda"))]
    {
        let threads = DataParallel::group(
            RANKS,
            Duration::from_secs(1),
            Collective::Nccl { in_graph: true },
        );
        assert!(
            matches!(
                &threads,
                Err(GraphedError::Collective { reason }) if reason.contains("cuda feature")
            ),
            "{:?}",
            threads.map(|_| ())
        );
    }

    let group =
        DataParallel::group(RANKS, Duration::from_millis(500), Collective::Host).expect("group");
    let started = std::time::Instant::now();
    let model = Mlp::new(16, 1, 4, &device);
    let loss = square_mean(model.forward(batch([4, 16], 0, &device)));
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    // Rank 1 never comes.
    let result = group[0].average(&model, grads);
    assert!(
        matches!(&result, Err(GraphedError::RankTimeout { missing, .. }) if missing == &vec![1]),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "no hang");

    // A rank whose training fails inside `DataParallel::run` stops the others at their next
    // step together, well within the group's timeout (300 s), with the failing rank named.
    let started = std::time::Instant::now();
    let results = on_ranks(&Collective::Host, |dp| {
        dp.run(|dp| {
            if dp.ranks().rank() == 1 {
                return Err(GraphedError::NoInputs);
            }
            let model = Mlp::new(16, 1, 4, &device);
            let loss = square_mean(model.forward(batch([4, 16], 0, &device)));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            dp.average(&model, grads).map(|_| ())
        })
    });
    assert!(
        matches!(results[1], Err(GraphedError::NoInputs)),
        "{results:?}"
    );
    assert!(
        matches!(&results[0], Err(GraphedError::RankFailed { rank: 1, .. })),
        "{results:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "no hang");

    // A rank whose body panics inside `run` releases the others too, then goes on panicking.
    let started = std::time::Instant::now();
    let group = DataParallel::group(RANKS, RANK_TIMEOUT, Collective::Host).expect("group");
    let results: Vec<std::thread::Result<Result<(), GraphedError>>> = thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .map(|dp| {
                scope.spawn(move || {
                    dp.run(|dp| {
                        if dp.ranks().rank() == 1 {
                            panic!("rank 1's body panics (on purpose)");
                        }
                        dp.ranks().barrier("a step")
                    })
                })
            })
            .collect();
        ranks.into_iter().map(|rank| rank.join()).collect()
    });
    assert!(results[1].is_err(), "rank 1 panicked");
    assert!(
        matches!(
            &results[0],
            Ok(Err(GraphedError::RankFailed { rank: 1, .. }))
        ),
        "{:?}",
        results[0]
    );
    assert!(started.elapsed() < Duration::from_secs(30), "no hang");
}

/// The whole-step loss of these scenarios: a mean over the batch, so that the mean of the
/// ranks' losses on equal shards is the loss of the whole batch.
pub(super) fn square_loss(model: &Mlp, x: Tensor<2>) -> Tensor<1> {
    square_mean(model.forward(x))
}

pub(super) const LR: f64 = 1e-2;

/// Trains a data-parallel `GraphedStep` per rank, rank `i` on `devices[i]` and its shard, for
/// [`STEPS`] steps; the replicas, in rank order. `together`: the ranks form one group averaging
/// with `collective`; otherwise each rank is a group of its own (no averaging).
pub(super) fn train_whole_steps(
    model: &Mlp,
    devices: &[Device],
    collective: &Collective,
    together: bool,
    sgd: bool,
) -> Vec<Mlp> {
    let replicas: Vec<Mlp> = devices
        .iter()
        .map(|device| replica_on(model, device))
        .collect();
    let ranks = devices.len();
    // One graph a step with the all-reduce inside; otherwise its two halves.
    let graphs = match collective {
        Collective::Nccl { in_graph: true } if together => 1,
        _ => 2,
    };
    let body = |dp: DataParallel, rank: usize| {
        let (replica, device) = (replicas[rank].clone(), &devices[rank]);
        let trained = dp.run(|dp| {
            let sample = vec![shard(0, rank, ranks, device)];
            let config = GraphedConfig::new();
            let mut step = if sgd {
                GraphedStep::data_parallel(
                    dp,
                    replica,
                    square_loss,
                    &SgdConfig::new(),
                    sample,
                    &config,
                )
            } else {
                GraphedStep::data_parallel(
                    dp,
                    replica,
                    square_loss,
                    &adam_config(),
                    sample,
                    &config,
                )
            }?;
            for s in 0..STEPS {
                step.run(shard(s, rank, ranks, device), LR)?;
            }
            Ok(step)
        });
        let step = trained.unwrap_or_else(|error| panic!("rank {rank}: {error}"));
        assert_eq!(step.steps(), STEPS as u64, "rank {rank}: updates done");
        if supports_graphs(device) {
            let stats = step.stats();
            assert_eq!(stats.replays, STEPS as u64, "rank {rank}: {stats:?}");
            assert_eq!(stats.total_eager(), 0, "rank {rank}: {stats:?}");
            assert_eq!(
                stats.shape_cache.hits, STEPS as u64,
                "one hit a step: {stats:?}"
            );
            assert_eq!(stats.graphs.len(), graphs, "rank {rank}: {stats:?}");
        }
        deep_copy(&step.module())
    };
    if together {
        return on_group(ranks, collective, |dp| {
            let rank = dp.ranks().rank();
            body(dp, rank)
        });
    }
    // One rank after another: each alone captures without turns, and on CUDA a capture must
    // not overlap another thread's work on any device (global capture mode).
    thread::scope(|scope| {
        (0..ranks)
            .map(|rank| {
                let body = &body;
                scope
                    .spawn(move || {
                        let alone = DataParallel::group(1, RANK_TIMEOUT, Collective::Host)
                            .expect("group")
                            .remove(0);
                        body(alone, rank)
                    })
                    .join()
                    .expect("rank thread")
            })
            .collect()
    })
}

/// Data-parallel whole steps (`GraphedStep::data_parallel`), one rank per device, rank `i` on
/// `devices[i]` and its share of every batch, averaged with `collective`: every step replays
/// both halves of the graph, each replica equals one model trained eagerly on the whole
/// batches (within its tolerance), and the replicas are bitwise identical; with burn's Adam,
/// then with plain SGD (whose step is proportional to the gradient: a sum instead of a mean
/// shows). Ranks each in a group of their own (the negative control) end apart.
pub fn whole_steps_match_one_model(devices: &[Device], collective: Collective) {
    whole_steps_match_with(devices, &collective, false);
    whole_steps_match_with(devices, &collective, true);
}

fn whole_steps_match_with(devices: &[Device], collective: &Collective, sgd: bool) {
    let ranks = devices.len();
    assert!(
        ranks >= 2 && ROWS.is_multiple_of(ranks),
        "{ranks} ranks: expected at least 2 that divide {ROWS} rows"
    );
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let device = devices[0].clone();
    let model = Mlp::new(16, 2, 4, &device);
    let single = one_model_on_whole_batches(&model, &device, sgd);
    let replicas = train_whole_steps(&model, &devices, collective, true, sgd);
    let apart = train_whole_steps(&model, &devices, collective, false, sgd);
    let what = if sgd {
        "whole steps, SGD"
    } else {
        "whole steps, Adam"
    };
    assert_averaged_and_apart(what, &model, &single, &replicas, &apart, &device, sgd);
}

/// One thread rank averaging with NCCL inside its whole step's graph (a group of one, on
/// `device`): the group's communicator, the warm-ups' all-reduces and the recording with the
/// all-reduce inside run as with more ranks; every step replays one graph, and the replica
/// equals one model trained eagerly on the same batches with SGD. The control: the same
/// comparison with that model one step short must fail (the bound is below one step).
pub fn one_rank_in_graph_matches_one_model(device: &Device) {
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 2, 4, &device);
    let in_graph = Collective::Nccl { in_graph: true };
    let reductions = burn_graphed::testing::nccl_reductions();
    let starts = burn_graphed::testing::overlap_starts();
    let replicas = train_whole_steps(&model, std::slice::from_ref(&device), &in_graph, true, true);
    // By default the all-reduce follows the backward, in one bucket: none starts during it.
    let started = burn_graphed::testing::overlap_starts();
    assert_eq!(
        started, starts,
        "buckets (started during the backward, after it)"
    );
    // Every all-reduce of the step (the eager first step's, each warm-up's, the recording's)
    // reduces the bucket in its own buffer: one copy of the bucket per rank.
    let now = burn_graphed::testing::nccl_reductions();
    assert!(
        now.0 > reductions.0 && now.1 == reductions.1,
        "all-reduces (in place, into a new buffer) went from {reductions:?} to {now:?}: every \
         one of the step's must be in place"
    );
    let single = one_model_for(&model, &device, true, STEPS);
    ParamsCheck::new(&device, &model).assert("one rank, in graph", &single, &replicas[0]);
    let short = one_model_for(&model, &device, true, STEPS - 1);
    let control = ParamsCheck::new(&device, &model).compare("control", &short, &replicas[0]);
    assert!(
        control.iter().any(|comparison| !comparison.passed()),
        "the control is blind: a model one SGD step short passed the comparison"
    );
}

/// A copy of `model` trained eagerly on `device` on the whole batches ([`ROWS`] rows) for
/// [`STEPS`] steps, with burn's SGD (`sgd`) or Adam: what data-parallel replicas must equal.
pub(super) fn one_model_on_whole_batches(model: &Mlp, device: &Device, sgd: bool) -> Mlp {
    one_model_for(model, device, sgd, STEPS)
}

/// [`one_model_on_whole_batches`] for the first `steps` steps.
fn one_model_for(model: &Mlp, device: &Device, sgd: bool, steps: usize) -> Mlp {
    let mut single = deep_copy(model);
    let mut adam = adam_config().init();
    let mut plain = SgdConfig::new().init();
    for step in 0..steps {
        let loss = square_loss(&single, batch([ROWS, 16], step, device));
        let grads = GradientsParams::from_grads(loss.backward(), &single);
        single = if sgd {
            plain.step(LR, single, grads)
        } else {
            adam.step(LR, single, grads)
        };
    }
    single
}

/// Data-parallel whole steps whose batches change shape (every rank's at once, then one
/// rank's only, as an uneven last batch) run the step that meets the new shape eagerly on the
/// ranks without its graphs, capture it after the update (the ranks in turn), and replay it
/// from then on; the replicas train and stay bitwise equal: rank `i` on `devices[i]`,
/// averaging with `collective`.
pub fn whole_steps_capture_new_shapes_together(devices: &[Device], collective: Collective) {
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let model = Mlp::new(16, 2, 4, &devices[0]);
    // Per step, rank 0's rows and the last rank's (the others as rank 0).
    let rows = [(4, 4), (4, 4), (2, 2), (2, 2), (4, 3), (4, 3), (4, 4)];
    let replicas = on_group(devices.len(), &collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let step = dp.run(|dp| {
            let mut step = GraphedStep::data_parallel(
                dp,
                replica_on(&model, device),
                square_loss,
                &adam_config(),
                vec![batch([4, 16], rank, device)],
                &GraphedConfig::new(),
            )?;
            let last = dp.ranks().size() - 1;
            for (s, &(first, other)) in rows.iter().enumerate() {
                let rows = if rank == last { other } else { first };
                step.run(batch([rows, 16], 10 * s + rank, device), LR)?;
            }
            Ok(step)
        });
        let step = step.unwrap_or_else(|error| panic!("rank {rank}: {error}"));
        if supports_graphs(device) {
            // One eager step per shape met anew: 2 rows on every rank, 3 rows on the last.
            let last = rank == devices.len() - 1;
            let (new_shapes, graphs) = if last { (2, 3) } else { (1, 2) };
            let stats = step.stats();
            let waited = stats.eager.get(&EagerReason::CaptureAfterStep).copied();
            assert_eq!(waited, Some(new_shapes), "rank {rank}: {stats:?}");
            assert_eq!(stats.total_eager(), new_shapes, "rank {rank}: {stats:?}");
            assert_eq!(
                stats.replays,
                rows.len() as u64 - new_shapes,
                "rank {rank}: {stats:?}"
            );
            assert_eq!(stats.shape_cache.graphs, graphs, "rank {rank}: {stats:?}");
        }
        assert_eq!(step.steps(), rows.len() as u64, "rank {rank}: updates done");
        deep_copy(&step.module())
    });
    let first = param_values(&replicas[0]).expect("read back");
    assert_ne!(
        first,
        param_values(&model).expect("read back"),
        "the replicas did not train"
    );
    for replica in &replicas[1..] {
        assert_params_unchanged(replica, &first);
    }
}

/// Gradients that hold no values on one rank (a launch skipped upstream: here, an input the
/// device never wrote) end the step on every rank with `RankFailed` naming that rank, with
/// `GradientsNotWritten`'s account, before the collective: cubecl skips the all-reduce of a
/// bucket that holds no values, and the other ranks would then wait in NCCL for good. Through
/// `DataParallel::average` (eager gradients) and through a data-parallel whole step meeting a
/// shape it has no graphs for (an eager half). Afterwards every device trains again.
pub fn unwritten_gradients_fail_every_rank(devices: &[Device], collective: Collective) {
    assert_eq!(devices.len(), RANKS, "one device per rank");
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    // Only cubecl's backends keep tensors without values.
    require_graphs(&devices[0]);
    let model = Mlp::new(16, 2, 4, &devices[0]);
    let input = |rank: usize, rows: usize, device: &Device| {
        if rank == 1 {
            super::recovery::unwritten([rows, 16], device)
        } else {
            batch([rows, 16], rank, device)
        }
    };
    let hold_no_values = |result: &Result<(), GraphedError>| {
        matches!(result, Err(GraphedError::RankFailed { rank: 1, reason, .. })
            if reason.contains("gradients to average hold no values"))
    };
    // Copies of their own: eager work on unwritten operands may leave what it read unreadable
    // on CUDA (UPSTREAM.md 6).
    let averaged = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let replica = deep_copy(&replica_on(&model, device));
        let loss = square_loss(&replica, input(rank, 4, device));
        let grads = GradientsParams::from_grads(loss.backward(), &replica);
        dp.average(&replica, grads).map(|_| ())
    });
    for result in &averaged {
        assert!(hold_no_values(result), "average: {result:?}");
    }
    let stepped = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        dp.run(|dp| {
            let mut step = GraphedStep::data_parallel(
                dp,
                deep_copy(&replica_on(&model, device)),
                square_loss,
                &adam_config(),
                vec![batch([4, 16], rank, device)],
                &GraphedConfig::new(),
            )?;
            step.run(batch([4, 16], 10 + rank, device), LR)?;
            // Two rows: no graphs yet, so both ranks run the gradient half eagerly.
            step.run(input(rank, 2, device), LR).map(|_| ())
        })
    });
    for result in &stepped {
        assert!(hold_no_values(result), "whole step: {result:?}");
    }
    let replicas = train_replicas(&model, &devices, &collective, true);
    let first = param_values(&replicas[0]).expect("read back");
    assert_params_unchanged(&replicas[1], &first);
}

/// Data-parallel whole steps whose ranks differ end together with a typed error, never a hang,
/// on `devices` (rank `i` on `devices[i]`) with `collective`: rank 1's capture failing (a
/// sample of another width) is `RankFailed` naming it on both ranks; a learning rate that
/// differs between the ranks, and replicas that start apart, are `RanksDisagree` on both; a step
/// refused on one rank before it started is `RankFailed` on both.
pub fn whole_step_ranks_that_differ_fail_together(devices: &[Device], collective: Collective) {
    assert_eq!(devices.len(), RANKS, "one device per rank");
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let model = Mlp::new(16, 2, 4, &devices[0]);
    let started = std::time::Instant::now();
    let step_on = |dp: &DataParallel, width: usize| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        GraphedStep::data_parallel(
            dp,
            replica_on(&model, device),
            square_loss,
            &adam_config(),
            vec![batch([4, width], 0, device)],
            &GraphedConfig::new(),
        )
    };
    let graphs = supports_graphs(&devices[0]);
    if graphs {
        let failed = on_ranks(&collective, |dp| {
            let width = if dp.ranks().rank() == 1 { 15 } else { 16 };
            step_on(&dp, width).map(|_| ())
        });
        // In turn, the capture's agreement names it; with the all-reduce inside, the ranks
        // capture at once and the capture's first agreement, before the warm-up's all-reduce
        // (where rank 1's forward fails), may name it instead.
        let in_graph = matches!(collective, Collective::Nccl { in_graph: true });
        let named = |what: &str| {
            what == "capturing a whole step"
                || (in_graph && what == "a warm-up's gradients, before their all-reduce")
        };
        for result in failed {
            assert!(
                matches!(&result, Err(GraphedError::RankFailed { rank: 1, what, .. }) if named(what)),
                "{result:?}"
            );
        }
    }

    let lr = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let mut step = step_on(&dp, 16)?;
        step.run(batch([4, 16], 1, device), LR)?;
        step.run(batch([4, 16], 2, device), LR * (1 + rank) as f64)
    });
    for result in lr {
        assert!(
            matches!(&result, Err(GraphedError::RanksDisagree { decisions, .. }) if decisions.contains("0.02")),
            "{result:?}"
        );
    }

    // Replicas that start from different parameters would stay apart: refused at the start.
    let apart = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let own = Mlp::new(16, 2, 4, device);
        GraphedStep::data_parallel(
            &dp,
            own,
            square_loss,
            &adam_config(),
            vec![batch([4, 16], 0, device)],
            &GraphedConfig::new(),
        )
        .map(|_| ())
    });
    for result in apart {
        assert!(
            matches!(&result, Err(GraphedError::RanksDisagree { what, .. }) if what.contains("starting parameters")),
            "{result:?}"
        );
    }

    // A step refused on one rank before it started (another number of micro-batches) is an
    // error on the other too.
    let refused = on_ranks(&collective, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let mut step = step_on(&dp, 16)?;
        let batches = vec![batch([4, 16], 1, device); 1 + rank];
        step.run_accumulated(batches, LR)
    });
    for result in &refused {
        assert!(
            matches!(result, Err(GraphedError::RankFailed { rank: 1, .. })),
            "{refused:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(120), "no hang");
}

/// `examples/train_ddp.rs`'s loop on `devices` (rank `i` on `devices[i]`) averaging with
/// `collective`: every rank captures and replays every step, and the replicas end bitwise
/// equal, and trained (moved from where they started).
pub fn example_trains_equal_replicas(devices: &[Device], collective: Collective) {
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let model = train_ddp::Mlp::new(16, 2, &devices[0]);
    let before = param_values(&model).expect("read back");
    let runs = train_ddp::train(&model, &devices, collective, 4, 8).expect("trains");
    assert_eq!(runs.len(), devices.len());
    let first = param_values(&runs[0].model).expect("read back");
    assert_ne!(first, before, "the replicas did not train");
    for (rank, run) in runs.iter().enumerate() {
        if supports_graphs(&devices[rank]) {
            assert_eq!(run.replays, 4, "rank {rank}: every step replays");
        }
        assert!(
            run.losses.iter().all(|l| l.is_finite()),
            "rank {rank}: {:?}",
            run.losses
        );
        assert_params_unchanged(&run.model, &first);
    }
}

/// `replica_on` copies every parameter to the target device, float, int and bool alike, with
/// the same values and ids; float parameters become leaves keeping their `require_grad`.
/// `source` and `target` are devices of two backends, so a parameter left behind shows.
pub fn replica_moves_every_parameter(source: &Device, target: &Device) {
    use burn::module::{Param, ParamId};
    use burn::tensor::{Bool, Int};

    #[derive(Module, Debug)]
    struct Mixed {
        weight: Param<Tensor<2>>,
        frozen: Param<Tensor<1>>,
        ids: Param<Tensor<1, Int>>,
        mask: Param<Tensor<1, Bool>>,
    }

    let (source, target) = (source.clone().autodiff(), target.clone().autodiff());
    let ids = Tensor::<1, Int>::arange(0..4, &source);
    let model = Mixed {
        weight: Param::from_tensor(batch([2, 3], 0, &source)),
        frozen: Param::from_tensor(batch([1, 3], 1, &source).reshape([3])).set_require_grad(false),
        mask: Param::initialized(ParamId::new(), ids.clone().equal_elem(2)),
        ids: Param::initialized(ParamId::new(), ids),
    };
    let replica = replica_on(&model, &target);
    assert_eq!(replica.weight.val().device(), target);
    assert_eq!(replica.frozen.val().device(), target);
    assert_eq!(replica.ids.val().device(), target);
    assert_eq!(replica.mask.val().device(), target);
    assert!(replica.weight.is_require_grad() && !replica.frozen.is_require_grad());
    assert_eq!(
        (replica.weight.id, replica.ids.id, replica.mask.id),
        (model.weight.id, model.ids.id, model.mask.id)
    );
    assert_eq!(
        replica.weight.val().into_data(),
        model.weight.val().into_data()
    );
    assert_eq!(replica.ids.val().into_data(), model.ids.val().into_data());
    // A bool's storage differs between backends (u32 on wgpu): compared as ints.
    let mask = |m: &Mixed| m.mask.val().int().into_data().convert::<i64>();
    assert_eq!(mask(&replica), mask(&model));
}

/// NCCL's mean reduces a bucket in its own buffer where the all-reduce holds the bucket's only
/// reference (as a step hands its gradients' bucket over: one copy of the bucket per rank), and
/// into a new buffer where anything else holds the bucket too, which then keeps its values.
/// Rank `i` on `devices[i]` fills its bucket with `i + 1`: on two GPUs the mean (1.5) differs
/// from every rank's values, so a bucket clobbered in place would show; on one the counts of
/// in-place and new-buffer reductions tell the two paths apart.
pub fn nccl_mean_in_place_only_when_unshared(devices: &[Device]) {
    const LEN: usize = 1000;
    let ranks = devices.len();
    let mean = (1..=ranks).sum::<usize>() as f32 / ranks as f32;
    let (in_place, into_new) = burn_graphed::testing::nccl_reductions();
    on_group(ranks, &Collective::Nccl { in_graph: false }, |dp| {
        let rank = dp.ranks().rank();
        let device = &devices[rank];
        let filled = || Tensor::<1>::full([LEN], rank as f32 + 1.0, device);
        let values = |tensor: Tensor<1>| tensor.into_data().try_to_vec::<f32>().expect("f32");
        let bucket = filled();
        let kept = bucket.clone();
        let shared =
            burn_graphed::testing::all_reduce_mean(&dp, bucket).expect("mean of a shared bucket");
        assert_eq!(
            values(shared),
            vec![mean; LEN],
            "rank {rank}: shared bucket's mean"
        );
        assert_eq!(
            values(kept),
            vec![rank as f32 + 1.0; LEN],
            "rank {rank}: a bucket held elsewhere must keep its values"
        );
        let whole =
            burn_graphed::testing::all_reduce_mean(&dp, filled()).expect("mean of a bucket");
        assert_eq!(values(whole), vec![mean; LEN], "rank {rank}: bucket's mean");
    });
    let (now_in_place, now_into_new) = burn_graphed::testing::nccl_reductions();
    assert_eq!(
        (now_in_place - in_place, now_into_new - into_new),
        (ranks, ranks),
        "(in place, into a new buffer) over {ranks} ranks: one of each per rank"
    );
}

/// [`whole_steps_match_one_model`] with NCCL inside the graph and the all-reduces started
/// during the backward (`overlap_all_reduces(true)`), a bucket per parameter (caps of one
/// byte: as many all-reduces on the side stream beside the backward as there are parameters,
/// each joined before the update reads it): the replicas are bitwise equal and equal one
/// model trained on the whole batches; replicas trained apart differ. Every backward starts
/// every bucket before it returns.
pub fn overlapped_whole_steps_match_one_model(devices: &[Device]) {
    use burn_graphed::testing::{overlap_all_reduces, overlap_bucket_caps, overlap_starts};
    overlap_all_reduces(true);
    overlap_bucket_caps(Some((1, 1)));
    let starts = overlap_starts();
    whole_steps_match_one_model(devices, Collective::Nccl { in_graph: true });
    let started = overlap_starts();
    overlap_bucket_caps(None);
    overlap_all_reduces(false);
    assert!(
        started.0 > starts.0 && started.1 == starts.1,
        "buckets (started during the backward, after it) went from {starts:?} to {started:?}: \
         every bucket must start during the backward"
    );
}

/// One rank, the all-reduce inside the graph, its all-reduces started during the backward
/// (`overlap_all_reduces(true)`) with a bucket per parameter (caps of one byte): every bucket
/// starts while the backward goes on (each parameter's gradient is final before the backward
/// ends), the replica equals one model trained eagerly, and equals the replica of the same
/// steps with the all-reduce after the backward in one bucket (the default), bit for bit; so
/// does the replica whose buckets' all-reduces ran on the backward's own stream
/// (`overlap_on_side_stream(false)`, the A/B of the side stream's cost).
pub fn one_rank_in_graph_buckets_start_during_the_backward(device: &Device) {
    use burn_graphed::testing::{overlap_all_reduces, overlap_bucket_caps, overlap_starts};
    let device = device.clone().autodiff();
    let model = Mlp::new(16, 2, 4, &device);
    let in_graph = Collective::Nccl { in_graph: true };
    let devices = std::slice::from_ref(&device);
    overlap_all_reduces(true);
    overlap_bucket_caps(Some((1, 1)));
    let starts = overlap_starts();
    let buckets = train_whole_steps(&model, devices, &in_graph, true, true);
    let started = overlap_starts();
    overlap_bucket_caps(None);
    overlap_all_reduces(false);
    let params = count_float_params(&model);
    assert!(
        started.0 - starts.0 >= params && started.1 == starts.1,
        "buckets (started during the backward, after it) went from {starts:?} to {started:?}; \
         each backward of {params} parameters starts {params} during it"
    );
    let single = one_model_for(&model, &device, true, STEPS);
    ParamsCheck::new(&device, &model).assert("a bucket per parameter", &single, &buckets[0]);
    overlap_all_reduces(true);
    overlap_bucket_caps(Some((1, 1)));
    burn_graphed::testing::overlap_on_side_stream(false);
    let one_stream = train_whole_steps(&model, devices, &in_graph, true, true);
    burn_graphed::testing::overlap_on_side_stream(true);
    overlap_bucket_caps(None);
    overlap_all_reduces(false);
    assert_eq!(
        param_values(&buckets[0]).expect("read"),
        param_values(&one_stream[0]).expect("read"),
        "the buckets' replica on the side stream and on the backward's stream, bit for bit"
    );
    let starts = overlap_starts();
    let after = train_whole_steps(&model, devices, &in_graph, true, true);
    let unchanged = overlap_starts();
    assert_eq!(unchanged, starts, "no bucket starts with the overlap off");
    assert_eq!(
        param_values(&buckets[0]).expect("read"),
        param_values(&after[0]).expect("read"),
        "the buckets' replica and the one-bucket replica, bit for bit"
    );
}

/// The float parameters of `model`.
fn count_float_params(model: &Mlp) -> usize {
    struct Count(usize);
    impl burn::module::ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, _: &burn::module::Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

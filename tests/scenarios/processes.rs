//! Data-parallel whole steps with one process per GPU, as `cargo xtask launch` or `torchrun`
//! starts them, averaging with NCCL ([`Collective::Nccl`]): the parent test starts one child
//! process of its own binary per rank with the launcher's variables (`RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`) and the rank's GPU; each child joins the group
//! (`DataParallel::join`), trains a `GraphedStep::data_parallel` on its shard of every batch
//! and prints its parameters' bits; the parent reads them back into replicas and compares them
//! with one model trained eagerly on the whole batches (`data_parallel`'s checks: within the
//! device's tolerance, updates too with SGD, replicas bitwise equal, and replicas trained
//! apart must differ).

use std::process::Command;
use std::time::Duration;

use burn::module::{ModuleMapper, Param};
use burn::optim::SgdConfig;
use burn_graphed::{Collective, DataParallel, GraphedStep, ProcessEnv};
use burn_graphed_testkit::deep_copy;

use super::data_parallel::{
    LR, RANKS, STEPS, assert_averaged_and_apart, one_model_on_whole_batches, shard, square_loss,
    train_whole_steps,
};
use super::*;

/// Set in a child: the all-reduce's place ([`Place::name`]) and the optimizer (`adam` or
/// `sgd`), as `in_graph,adam`.
pub const CHILD: &str = "BURN_GRAPHED_PROCESS_CHILD";

/// Where a data-parallel step's all-reduce runs.
#[derive(Clone, Copy, PartialEq)]
pub enum Place {
    /// Inside the step's one graph, after the backward in one bucket.
    InGraph,
    /// Inside the step's one graph, started during the backward, a bucket per parameter
    /// (`testing::overlap_all_reduces(true)`, caps of one byte).
    InGraphOverlap,
    /// Between the step's two graphs.
    TwoGraphs,
}

impl Place {
    /// Its name in [`CHILD`].
    pub fn name(self) -> &'static str {
        match self {
            Place::InGraph => "in_graph",
            Place::InGraphOverlap => "in_graph_overlap",
            Place::TwoGraphs => "two_graphs",
        }
    }

    fn parse(what: &str) -> Self {
        match what.split(',').next() {
            Some("in_graph") => Place::InGraph,
            Some("in_graph_overlap") => Place::InGraphOverlap,
            Some("two_graphs") => Place::TwoGraphs,
            other => panic!("{CHILD}={what}: no place {other:?}"),
        }
    }
}

/// How long a rank waits for the others: a cold kernel cache compiles for minutes.
const TIMEOUT: Duration = Duration::from_secs(600);

/// The model every rank and the parent start from: [`Mlp`]'s shape with deterministic values
/// (the same in every process, where random initialization would differ).
pub fn start_model(device: &Device) -> Mlp {
    Mlp::new(16, 2, 4, device).map(&mut Fill { salt: 0 })
}

/// Fills every float parameter with values in about [-0.3, 0.3], different per parameter.
struct Fill {
    salt: usize,
}

impl ModuleMapper for Fill {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.salt += 1;
        let salt = self.salt;
        let require_grad = param.is_require_grad();
        param.map(|tensor| {
            let (shape, device) = (tensor.shape(), tensor.device());
            let n = shape.num_elements();
            let values: Vec<f32> = (0..n)
                .map(|i| ((i as f32 * 0.37 + salt as f32 * 1.7).sin()) * 0.3)
                .collect();
            let filled = Tensor::<1>::from_floats(values.as_slice(), &device).reshape(shape);
            if require_grad {
                filled.require_grad()
            } else {
                filled
            }
        })
    }
}

/// Writes `values` (every float parameter's, in visiting order) into the parameters.
struct Load<'a> {
    values: &'a [f32],
    offset: usize,
}

impl ModuleMapper for Load<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let offset = self.offset;
        let values = self.values;
        let require_grad = param.is_require_grad();
        let mut taken = 0;
        let param = param.map(|tensor| {
            let (shape, device) = (tensor.shape(), tensor.device());
            taken = shape.num_elements();
            let part = &values[offset..offset + taken];
            let loaded = Tensor::<1>::from_floats(part, &device).reshape(shape);
            if require_grad {
                loaded.require_grad()
            } else {
                loaded
            }
        });
        self.offset += taken;
        param
    }
}

/// The child's part: joins the group from the launcher's variables, trains its replica and
/// prints `params: BITS` (every parameter's `f32` bits, in visiting order) and its counts.
pub fn child(device: &Device) {
    let what = std::env::var(CHILD).expect("run by a parent test");
    let place = Place::parse(&what);
    let in_graph = place != Place::TwoGraphs;
    let sgd = what.ends_with("sgd");
    if place == Place::InGraphOverlap {
        burn_graphed::testing::overlap_all_reduces(true);
        burn_graphed::testing::overlap_bucket_caps(Some((1, 1)));
    }
    let starts = burn_graphed::testing::overlap_starts();
    let env = ProcessEnv::from_env().expect("the launcher's variables, set by the parent");
    let dp = DataParallel::join(&env, TIMEOUT, Collective::Nccl { in_graph }).expect("joined");
    let (rank, ranks) = (env.rank, env.world_size);
    let device = device.clone().autodiff();
    let model = start_model(&device);
    let trained = dp.run(|dp| {
        let sample = vec![shard(0, rank, ranks, &device)];
        let config = GraphedConfig::new();
        let mut step = if sgd {
            GraphedStep::data_parallel(dp, model, square_loss, &SgdConfig::new(), sample, &config)
        } else {
            let adam = adam_config();
            GraphedStep::data_parallel(dp, model, square_loss, &adam, sample, &config)
        }?;
        for s in 0..STEPS {
            step.run(shard(s, rank, ranks, &device), LR)?;
        }
        Ok(step)
    });
    let step = trained.unwrap_or_else(|error| panic!("rank {rank}: {error}"));
    let stats = step.stats();
    let started = burn_graphed::testing::overlap_starts();
    println!(
        "rank {rank}: steps {}, replays {}, eager {}, buckets started during the backward {}, \
         after it {}, graphs {:?}",
        step.steps(),
        stats.replays,
        stats.total_eager(),
        started.0 - starts.0,
        started.1 - starts.1,
        stats.graphs
    );
    let bits: Vec<String> = param_values(&step.module())
        .expect("read back")
        .into_iter()
        .flat_map(|(_, data)| data.convert::<f32>().try_to_vec::<f32>().expect("f32"))
        .map(|v| v.to_bits().to_string())
        .collect();
    println!("params: {}", bits.join(","));
}

/// A free port of the loopback for rank 0.
pub(super) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// NCCL on its network transport over the loopback, as between two machines: sockets, no
/// peer-to-peer or shared memory between the GPUs of the host; its log at `INFO`, which names
/// the transport of every channel.
const OVER_SOCKETS: &[(&str, &str)] = &[
    ("NCCL_P2P_DISABLE", "1"),
    ("NCCL_SHM_DISABLE", "1"),
    ("NCCL_IB_DISABLE", "1"),
    ("NCCL_NET", "Socket"),
    ("NCCL_SOCKET_IFNAME", "lo"),
    ("NCCL_DEBUG", "INFO"),
];

/// A child of this test binary (`child_test`, run with `--ignored`) as rank `rank` of
/// [`RANKS`] on GPU `rank` alone, with the launcher's variables for a rank 0 listening on the
/// loopback at `port`.
pub(super) fn rank_command(child_test: &str, rank: usize, port: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("this test binary"));
    command
        .args(["--exact", child_test, "--ignored", "--nocapture"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", RANKS.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("CUDA_VISIBLE_DEVICES", rank.to_string());
    command
}

/// Starts one child of this test binary per rank ([`rank_command`]), with the variables
/// `extra` besides the launcher's, and waits for all: each rank's parameters, its counts line
/// and everything it printed.
fn launch(child_test: &str, what: &str, extra: &[(&str, &str)]) -> Vec<(Vec<f32>, String, String)> {
    let port = free_port().to_string();
    let children: Vec<_> = (0..RANKS)
        .map(|rank| {
            rank_command(child_test, rank, &port)
                .env(CHILD, what)
                .envs(extra.iter().copied())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("a rank's process")
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, child)| {
            let out = child.wait_with_output().expect("the rank's end");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "rank {rank} ({what}) failed: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let params = stdout
                .lines()
                .find_map(|line| line.strip_prefix("params: "))
                .unwrap_or_else(|| panic!("rank {rank} printed no parameters: {stdout}"))
                .split(',')
                .map(|bits| f32::from_bits(bits.parse().expect("bits")))
                .collect();
            let counts = stdout
                .lines()
                .find(|line| line.starts_with(&format!("rank {rank}: steps")))
                .unwrap_or_default()
                .to_string();
            let printed = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            (params, counts, printed)
        })
        .collect()
}

/// Two processes, one per GPU (`devices`, the parent's view of both), averaging with NCCL
/// at `place`: every step of every rank replays, and the replicas equal one model trained
/// eagerly on the whole batches on `devices[0]`, with Adam and with SGD; the replicas trained
/// apart (no averaging, in this process) differ, or the check is blind. Buckets start during
/// the backward where the place says so, and only there.
pub fn nccl_processes_match_one_model(child_test: &str, devices: &[Device], place: Place) {
    match_one_model(child_test, devices, place, &[]);
}

/// [`nccl_processes_match_one_model`] in graph, NCCL on sockets over the loopback
/// ([`OVER_SOCKETS`]): a stand-in for two machines. Every rank's NCCL log must name the socket
/// transport (else the run proved nothing of it).
pub fn nccl_over_sockets_matches_one_model(child_test: &str, devices: &[Device]) {
    for printed in match_one_model(child_test, devices, Place::InGraph, OVER_SOCKETS) {
        assert!(
            printed.contains("via NET/Socket"),
            "NCCL ran over sockets: {}",
            printed
                .lines()
                .filter(|l| l.contains("NCCL INFO"))
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// The ranks' training, compared: see [`nccl_processes_match_one_model`]. What each rank's
/// process printed, for each optimizer.
fn match_one_model(
    child_test: &str,
    devices: &[Device],
    place: Place,
    extra: &[(&str, &str)],
) -> Vec<String> {
    let mut printed = Vec::new();
    assert_eq!(devices.len(), RANKS, "one GPU per rank");
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let device = devices[0].clone();
    let model = start_model(&device);
    for sgd in [false, true] {
        let single = one_model_on_whole_batches(&model, &device, sgd);
        let in_graph = place != Place::TwoGraphs;
        let place = place.name();
        let optimizer = if sgd { "sgd" } else { "adam" };
        let ranks = launch(child_test, &format!("{place},{optimizer}"), extra);
        printed.extend(ranks.iter().map(|(_, _, text)| text.clone()));
        let replicas: Vec<Mlp> = ranks
            .iter()
            .map(|(values, counts, _)| {
                println!("{place}, {optimizer}: {counts}");
                assert!(
                    counts.contains(&format!("replays {STEPS}, eager 0")),
                    "every step replays: {counts}"
                );
                let overlapped = !counts.contains("during the backward 0,");
                assert_eq!(
                    overlapped,
                    place == Place::InGraphOverlap.name(),
                    "buckets start during the backward with the overlap only: {counts}"
                );
                assert!(
                    counts.contains("after it 0,"),
                    "no bucket after it: {counts}"
                );
                // One graph a step with the all-reduce inside, two around it.
                let graphs = if in_graph { 1 } else { 2 };
                assert_eq!(
                    counts.matches("GraphContents").count(),
                    graphs,
                    "graphs per step: {counts}"
                );
                deep_copy(&model).map(&mut Load { values, offset: 0 })
            })
            .collect();
        let apart = train_whole_steps(&model, &devices, &Collective::Host, false, sgd);
        let what = format!("processes, NCCL {place}, {optimizer}");
        assert_averaged_and_apart(&what, &model, &single, &replicas, &apart, &device, sgd);
    }
    printed
}

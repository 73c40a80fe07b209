//! Data parallel with one process per rank, as `cargo xtask launch` or `torchrun` starts them:
//! each child process of this test binary reads its place from the environment
//! (`ProcessEnv::from_env`), joins the group at rank 0's address (`DataParallel::join`) and
//! trains its replica on its shard of every batch, its gradients averaged through the host. On
//! Flex, so that a run costs no kernel compilation; the arithmetic of the averaging is the
//! same on every backend.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use burn::module::Param;
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_graphed::{Collective, DataParallel, ProcessEnv};

/// Set in a child: what it does (`train`; `die`: rank 1 ends its process mid-training;
/// `in_turn`: a capture's turn, which processes take at once).
const ROLE: &str = "BURN_GRAPHED_PROCESS_ROLE";

/// Set in a child of the `in_turn` role: the folder where each rank says it started.
const MEETING: &str = "BURN_GRAPHED_PROCESS_MEETING";

/// How long a rank's `work` waits to see every rank's inside theirs.
const MEET_WITHIN: Duration = Duration::from_secs(3);

const RANKS: usize = 2;
const ROWS: usize = 8;
const STEPS: usize = 4;
/// How long a rank waits for the others: long against a loaded CI machine; the failure tests
/// must end long before it (a rank's end is seen at once, not waited out).
const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Module, Debug)]
struct Net {
    hidden: Param<Tensor<2>>,
    out: Param<Tensor<2>>,
}

/// Deterministic values in about [-1, 1], different for each `salt`.
fn values(shape: [usize; 2], salt: usize, device: &Device) -> Tensor<2> {
    Tensor::<1, Int>::arange(0..(shape[0] * shape[1]) as i64, device)
        .float()
        .add_scalar(salt as f32 * 7.0)
        .mul_scalar(0.37)
        .sin()
        .reshape(shape)
}

impl Net {
    /// A replica initialized as rank `rank`'s process would on its own: each its own values
    /// (and ids), as random initialization gives.
    fn new(rank: usize, device: &Device) -> Self {
        Self {
            hidden: Param::from_tensor(values([6, 8], 1 + 100 * rank, device)),
            out: Param::from_tensor(values([8, 1], 2 + 100 * rank, device)),
        }
    }

    fn loss(&self, x: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
        let y = burn::tensor::activation::relu(x.matmul(self.hidden.val())).matmul(self.out.val());
        (y - target).powi_scalar(2).mean()
    }
}

/// Rank `rank`'s share of step `step`'s batch (inputs, targets).
fn shard(step: usize, rank: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let share = ROWS / RANKS;
    let x = values([ROWS, 6], 10 + step, device).narrow(0, rank * share, share);
    let t = values([ROWS, 1], 20 + step, device).narrow(0, rank * share, share);
    (x, t)
}

/// The parameters' bits, in visiting order.
fn bits(net: &Net) -> Vec<u32> {
    [net.hidden.val(), net.out.val()]
        .into_iter()
        .flat_map(|t| t.into_data().try_to_vec::<f32>().expect("f32"))
        .map(f32::to_bits)
        .collect()
}

/// What a rank does with its group.
#[derive(Clone, Copy)]
struct Use {
    /// Start from rank 0's values (`DataParallel::broadcast`).
    broadcast: bool,
    /// Average the gradients (`DataParallel::average`).
    average: bool,
}

const BOTH: Use = Use {
    broadcast: true,
    average: true,
};

/// Trains this rank's replica, made apart, with `dp` as `with` says; `stop` ends the process
/// before the step it names (the `die` role's rank 1).
fn train(rank: usize, dp: &DataParallel, with: Use, stop: Option<usize>) -> Result<Net, String> {
    let device = Device::flex().autodiff();
    let mut net = Net::new(rank, &device);
    if with.broadcast {
        net = dp.broadcast(net).map_err(|e| e.to_string())?;
    }
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        if stop == Some(step) {
            std::process::exit(3);
        }
        let (x, target) = shard(step, rank, &device);
        let grads = GradientsParams::from_grads(net.loss(x, target).backward(), &net);
        let grads = if with.average {
            dp.average(&net, grads).map_err(|e| e.to_string())?
        } else {
            grads
        };
        net = optim.step(1e-2, net, grads);
    }
    Ok(net)
}

/// The child process of the tests below, which run it.
#[test]
#[ignore = "a child process of this binary's tests, which run it"]
fn process_group_child() {
    let role = std::env::var(ROLE).expect("run by this binary's tests");
    let env = ProcessEnv::from_env().expect("RANK, WORLD_SIZE, MASTER_PORT set by the test");
    if role == "nccl" {
        let joined = DataParallel::join(&env, TIMEOUT, Collective::Nccl { in_graph: true });
        println!("nccl: {:?}", joined.map(|_| ()).map_err(|e| e.to_string()));
        return;
    }
    let dp = DataParallel::join(&env, TIMEOUT, Collective::Host).expect("joined");
    if role == "in_turn" {
        let meeting = std::path::PathBuf::from(std::env::var(MEETING).expect("the folder"));
        println!("met: {:?}", meet_in_turn(&dp, &meeting));
        return;
    }
    let stop = (role == "die" && env.rank == 1).then_some(2);
    let started = Instant::now();
    match train(env.rank, &dp, BOTH, stop) {
        Ok(net) => println!("params: {:?}", bits(&net)),
        Err(error) => println!(
            "stopped after {} ms: {error}",
            started.elapsed().as_millis()
        ),
    }
}

/// `DataParallel::in_turn` with `work` that marks this rank started in `meeting` and waits up to
/// [`MEET_WITHIN`] to see every rank started: whether the ranks' `work` overlapped.
fn meet_in_turn(dp: &DataParallel, meeting: &std::path::Path) -> Result<bool, String> {
    let rank = dp.ranks().rank();
    dp.in_turn("a capture", &Device::flex(), || {
        std::fs::write(meeting.join(format!("started-{rank}")), b"").expect("a mark");
        let deadline = Instant::now() + MEET_WITHIN;
        while Instant::now() < deadline {
            if (0..RANKS).all(|r| meeting.join(format!("started-{r}")).exists()) {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(false)
    })
    .map_err(|e| e.to_string())
}

/// A free port of the loopback for rank 0.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Starts one child per rank with the launcher's variables, and waits for all.
fn launch(role: &str) -> Vec<(Output, String)> {
    launch_with(role, &[])
}

/// [`launch`] with more variables.
fn launch_with(role: &str, vars: &[(&str, &std::ffi::OsStr)]) -> Vec<(Output, String)> {
    let port = free_port().to_string();
    let children: Vec<_> = (0..RANKS)
        .map(|rank| {
            Command::new(std::env::current_exe().expect("this test binary"))
                .args(["--exact", "process_group_child", "--ignored", "--nocapture"])
                .env(ROLE, role)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", RANKS.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(vars.iter().copied())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("a rank's process")
        })
        .collect();
    children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().expect("the rank's end");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            (out, stdout)
        })
        .collect()
}

/// The same training with the ranks as threads of this process (`DataParallel::group`).
fn train_on_threads(with: Use) -> Vec<Vec<u32>> {
    let group = DataParallel::group(RANKS, TIMEOUT, Collective::Host).expect("group");
    std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .iter()
            .map(|dp| {
                scope.spawn(move || {
                    let rank = dp.ranks().rank();
                    bits(&train(rank, dp, with, None).expect("trained"))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().expect("rank")).collect()
    })
}

#[test]
fn data_parallel_process_per_rank_trains_what_threads_train() {
    let threads = train_on_threads(BOTH);
    assert_eq!(threads[0], threads[1], "the threads' replicas are equal");
    // The controls: without the averaging, or from the replicas' own starting values, the
    // replicas differ; so equal bits mean both took effect.
    for with in [
        Use {
            average: false,
            ..BOTH
        },
        Use {
            broadcast: false,
            ..BOTH
        },
    ] {
        let apart = train_on_threads(with);
        assert_ne!(apart[0], apart[1]);
    }
    for (rank, (out, stdout)) in launch("train").into_iter().enumerate() {
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let params = stdout
            .lines()
            .find_map(|line| line.strip_prefix("params: "))
            .unwrap_or_else(|| panic!("rank {rank} printed no parameters: {stdout}"));
        assert_eq!(
            params,
            format!("{:?}", threads[0]),
            "rank {rank}'s replica is not the threads' replica, bit for bit"
        );
    }
}

#[test]
fn data_parallel_process_rank_dies_fails_the_others_at_once() {
    let started = Instant::now();
    let ranks = launch("die");
    let elapsed = started.elapsed();
    let (zero, zero_out) = &ranks[0];
    let (one, _) = &ranks[1];
    assert_eq!(one.status.code(), Some(3), "rank 1 ended its process");
    assert!(zero.status.success(), "rank 0: {zero_out}");
    let stopped = zero_out
        .lines()
        .find(|line| line.starts_with("stopped after "))
        .unwrap_or_else(|| panic!("rank 0 did not stop: {zero_out}"));
    assert!(
        stopped.contains("rank 1") && stopped.contains("its process ended"),
        "rank 0's error names rank 1's end: {stopped}"
    );
    assert!(
        elapsed < TIMEOUT / 2,
        "rank 0 was released by rank 1's end, not by the timeout: {elapsed:?}"
    );
}

#[test]
fn data_parallel_process_ranks_capture_at_once_threads_in_turn() {
    let meeting = std::env::temp_dir().join(format!("burn-graphed-meeting-{}", std::process::id()));
    let fresh = |name: &str| {
        let dir = meeting.join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a folder");
        dir
    };
    // The control: threads of one process take turns, so rank 0's work ends before rank 1's
    // starts and sees it alone; rank 1's sees both.
    let threads = fresh("threads");
    let group = DataParallel::group(RANKS, TIMEOUT, Collective::Host).expect("group");
    let met: Vec<Result<bool, String>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .iter()
            .map(|dp| scope.spawn(|| meet_in_turn(dp, &threads)))
            .collect();
        ranks.into_iter().map(|r| r.join().expect("rank")).collect()
    });
    assert_eq!(met, vec![Ok(false), Ok(true)], "threads take turns");
    // Processes share no process: their captures run at once.
    let processes = fresh("processes");
    let started = Instant::now();
    let ranks = launch_with("in_turn", &[(MEETING, processes.as_os_str())]);
    let _ = std::fs::remove_dir_all(&meeting);
    for (rank, (out, stdout)) in ranks.into_iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {stdout}");
        assert!(
            stdout.contains("met: Ok(true)"),
            "rank {rank} did not see the other's work at the same time: {stdout}"
        );
    }
    assert!(started.elapsed() < TIMEOUT, "no hang");
}

/// NCCL where rank 0 cannot mint its id (this suite's builds have no `cuda` feature; with it,
/// a machine without `libnccl`): every rank's join fails with rank 0's reason, none waits.
/// Where NCCL does load (a CUDA build on a machine with NCCL), the join succeeds on both ranks
/// and the test says so and counts as skipped: the GPU suite trains with it.
#[test]
fn data_parallel_process_nccl_without_nccl_fails_every_rank() {
    let ranks = launch("nccl");
    let outcomes: Vec<String> = ranks
        .iter()
        .enumerate()
        .map(|(rank, (out, stdout))| {
            assert!(out.status.success(), "rank {rank}: {stdout}");
            stdout
                .lines()
                .find_map(|line| line.strip_prefix("nccl: "))
                .unwrap_or_else(|| panic!("rank {rank} printed no outcome: {stdout}"))
                .to_string()
        })
        .collect();
    if outcomes.iter().all(|o| o == "Ok(())") {
        let test = "data_parallel_process_nccl_without_nccl_fails_every_rank";
        println!("skipped: {test}: NCCL loads here: both ranks joined");
        return;
    }
    for (rank, outcome) in outcomes.iter().enumerate() {
        assert!(
            outcome.starts_with("Err(")
                && outcome.contains("rank 0 failed")
                && outcome.contains("NCCL"),
            "rank {rank}'s join names rank 0's failure: {outcome}"
        );
    }
}

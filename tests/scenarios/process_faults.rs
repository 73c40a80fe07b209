//! Faults of a data-parallel group of processes (one per GPU, NCCL's all-reduce inside each
//! step's graph), each made on purpose in a child process of the test binary, and what every
//! other rank must get: a typed error within a bounded time, and a device that still computes.
//!
//! - A rank dies mid-step: it ends (no destructor runs) right after the ranks agreed on a step,
//!   so its peer enters the step's all-reduce, which it never joins. The peer's device would
//!   spin there for good; the group's end aborts its communicator. The negative control turns
//!   the abort off and the peer must still be waiting well after the death.
//! - NCCL reports an error (injected into the watchdog's poll, as a failing network would; the
//!   communicator itself stays healthy).
//! - A rank's capture fails (a sample of the wrong width).
//! - The rendezvous never completes (a rank whose peers never start).
//!
//! The children print `fault: rank R: error after MS ms: ERROR` (or `fault: rank R: none`),
//! then `device: V` (a small product read back after the fault).

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use burn_graphed::{Collective, DataParallel, GraphedStep, ProcessEnv};

use super::data_parallel::{LR, shard, square_loss};
use super::processes::{free_port, rank_command, start_model};
use super::*;

/// Set in a child: the fault to make (`dies`, `dies,no_abort`, `nccl_error`, `capture`,
/// `rendezvous`).
pub const FAULT: &str = "BURN_GRAPHED_PROCESS_FAULT";

/// Steps a child trains; the faults happen at [`AT`].
const STEPS: usize = 6;
const AT: usize = 3;

/// A dying rank's exit code.
const DIES: i32 = 17;

/// The group's timeout in the children: the bound every error must beat by far, so that an
/// error within [`BOUND`] comes from the fault's own path, not from waiting for the timeout.
const TIMEOUT: Duration = Duration::from_secs(600);

/// The rendezvous's timeout in its test.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(5);

/// How long after a fault every other rank must have its error: the watchdog's drain grace
/// (2 s) and abort, with room for a loaded machine.
const BOUND: Duration = Duration::from_secs(30);

/// How long the negative control's peer must still be waiting after the death.
const STILL_WAITING: Duration = Duration::from_secs(20);

/// The most a whole fault test may take (a cold kernel cache compiles for minutes).
const LIMIT: Duration = Duration::from_secs(420);

/// A child's part: see the module docs.
pub fn child(device: &Device) {
    let fault = std::env::var(FAULT).expect("run by a parent test");
    let env = ProcessEnv::from_env().expect("the launcher's variables, set by the parent");
    let rank = env.rank;
    let timeout = if fault == "rendezvous" {
        RENDEZVOUS_TIMEOUT
    } else {
        TIMEOUT
    };
    if fault.contains("no_abort") {
        burn_graphed::testing::nccl_abort(false);
    }
    let device = device.clone().autodiff();
    let mut fault_started = Instant::now();
    let outcome =
        DataParallel::join(&env, timeout, Collective::Nccl { in_graph: true }).and_then(|dp| {
            dp.run(|dp| {
                let ranks = dp.ranks().size();
                let sample = if fault == "capture" && rank == 1 {
                    // A sample of the wrong width: this rank's capture fails.
                    shard(0, rank, ranks, &device).narrow(1, 0, 15)
                } else {
                    shard(0, rank, ranks, &device)
                };
                fault_started = Instant::now();
                let config = GraphedConfig::new();
                let adam = adam_config();
                let mut step = GraphedStep::data_parallel(
                    dp,
                    start_model(&device),
                    square_loss,
                    &adam,
                    vec![sample],
                    &config,
                )?;
                if fault.starts_with("dies") && rank == 1 {
                    burn_graphed::testing::exit_after_agreement(AT as u64, DIES);
                }
                for s in 0..STEPS {
                    if s == AT {
                        fault_started = Instant::now();
                    }
                    let loss = step.run(shard(s, rank, ranks, &device), LR)?;
                    if fault == "nccl_error" && rank == 1 && s == AT {
                        burn_graphed::testing::inject_nccl_error(
                            "injected by the test, as a failing network",
                        );
                        // The network fails while the step runs: the watchdog's poll (every
                        // 100 ms) sees it before this rank's next agreement.
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    // Each step's loss read back: the host waits for the device, as a training
                    // loop that logs its loss does.
                    let loss = loss.into_scalar::<f32>();
                    println!("rank {rank}: step {s}, loss {loss}");
                }
                Ok(())
            })
        });
    match outcome {
        Ok(()) => println!("fault: rank {rank}: none"),
        Err(error) => println!(
            "fault: rank {rank}: error after {} ms: {error}",
            fault_started.elapsed().as_millis()
        ),
    }
    let product = (Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device) * 2.0)
        .sum()
        .into_scalar::<f32>();
    println!("device: {product}");
}

/// A child's end: its exit code (`None` where the test killed it) and what it printed.
struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// When the parent saw it end, from the launch.
    at: Duration,
}

impl Ended {
    /// The `fault:` line's error, with the milliseconds it took.
    fn error(&self) -> Option<(u64, &str)> {
        let line = self.stdout.lines().find(|l| l.starts_with("fault: "))?;
        let rest = line.split(": error after ").nth(1)?;
        let (ms, error) = rest.split_once(" ms: ")?;
        Some((ms.parse().ok()?, error))
    }

    fn device_works(&self) -> bool {
        self.stdout.lines().any(|l| l == "device: 12")
    }

    fn describe(&self) -> String {
        format!(
            "exit {:?} at {:?}\n--- stdout\n{}\n--- stderr (end)\n{}",
            self.code,
            self.at,
            self.stdout,
            tail(&self.stderr, 4000)
        )
    }
}

fn tail(text: &str, chars: usize) -> &str {
    let start = text.len().saturating_sub(chars);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    &text[start..]
}

/// Starts the ranks `ranks` of a group of two as children of this test binary
/// ([`rank_command`]) making `fault`; waits until all ended, killing those still
/// running `kill_after` after the first one ended (or at [`LIMIT`]). Their ends, in the order
/// of `ranks`.
fn run_ranks(
    child_test: &str,
    fault: &str,
    ranks: &[usize],
    kill_after: Option<Duration>,
) -> Vec<Ended> {
    let port = free_port().to_string();
    let dir = std::env::temp_dir().join(format!("bg-fault-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder for the children's output");
    let out = |rank: usize, what: &str| -> PathBuf { dir.join(format!("{rank}.{what}")) };
    let started = Instant::now();
    let mut children: Vec<(usize, Child, Option<Duration>)> = ranks
        .iter()
        .map(|&rank| {
            let file = |what| Stdio::from(File::create(out(rank, what)).expect("an output file"));
            let child = rank_command(child_test, rank, &port)
                .env(FAULT, fault)
                .stdout(file("out"))
                .stderr(file("err"))
                .spawn()
                .expect("a rank's process");
            (rank, child, None)
        })
        .collect();
    let mut first_end: Option<Duration> = None;
    loop {
        let now = started.elapsed();
        for (_, child, ended) in &mut children {
            if ended.is_none() && child.try_wait().expect("a child's state").is_some() {
                *ended = Some(now);
                first_end.get_or_insert(now);
            }
        }
        if children.iter().all(|(_, _, ended)| ended.is_some()) {
            break;
        }
        let kill = now >= LIMIT || kill_after.zip(first_end).is_some_and(|(k, f)| now >= f + k);
        if kill {
            for (_, child, ended) in &mut children {
                if ended.is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let ends = children
        .into_iter()
        .map(|(rank, mut child, at)| {
            let status = child.wait().expect("a child's end");
            let read = |what| std::fs::read_to_string(out(rank, what)).unwrap_or_default();
            Ended {
                code: if at.is_some() { status.code() } else { None },
                stdout: read("out"),
                stderr: read("err"),
                at: at.unwrap_or(LIMIT),
            }
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    ends
}

/// Asserts that `end` is a rank that got a typed error naming `names` within `bound` of the
/// fault, exited cleanly, and whose device still computes.
fn assert_failed_in_time(what: &str, end: &Ended, names: &str, bound: Duration) {
    let described = end.describe();
    let (ms, error) = end
        .error()
        .unwrap_or_else(|| panic!("{what}: no typed error: {described}"));
    println!("{what}: error after {ms} ms: {error}");
    assert!(
        error.contains(names),
        "{what}: names {names:?}: {described}"
    );
    assert!(
        Duration::from_millis(ms) < bound,
        "{what}: {ms} ms, over the bound {bound:?}: {described}"
    );
    assert_eq!(end.code, Some(0), "{what}: exits cleanly: {described}");
    assert!(
        end.device_works(),
        "{what}: the device computes: {described}"
    );
}

/// Rank 1 dies right after step [`AT`]'s agreement: rank 0, inside that step's all-reduce,
/// gets `RankFailed` naming rank 1 within [`BOUND`] (the group's end aborts its
/// communicator), and its device computes after. Negative control: with the abort off, rank 0
/// is still waiting [`STILL_WAITING`] after the death.
pub fn rank_dies_mid_step_fails_the_others(child_test: &str) {
    let ends = run_ranks(child_test, "dies", &[0, 1], None);
    let (zero, one) = (&ends[0], &ends[1]);
    assert_eq!(one.code, Some(DIES), "rank 1 died: {}", one.describe());
    assert!(
        one.stdout.contains(&format!("rank 1: step {}", AT - 1)) && one.error().is_none(),
        "rank 1 trained until it died: {}",
        one.describe()
    );
    assert!(
        zero.stdout.contains(&format!("rank 0: step {AT}")),
        "rank 0 ran the step its peer never joined (and read its loss): {}",
        zero.describe()
    );
    assert_failed_in_time("rank 0 after rank 1's death", zero, "rank 1", BOUND);
    assert!(zero.at < one.at + BOUND, "rank 0 ended soon after rank 1");

    let ends = run_ranks(child_test, "dies,no_abort", &[0, 1], Some(STILL_WAITING));
    let (zero, one) = (&ends[0], &ends[1]);
    assert_eq!(
        one.code,
        Some(DIES),
        "control: rank 1 died: {}",
        one.describe()
    );
    assert_eq!(
        zero.code,
        None,
        "control: without the abort, rank 0 is still waiting in NCCL {STILL_WAITING:?} after \
         the death (else the test above could not fail): {}",
        zero.describe()
    );
    assert!(
        zero.error().is_none(),
        "control: no error: {}",
        zero.describe()
    );
}

/// NCCL reports an error on rank 1 during step [`AT`] (injected: the communicator itself is
/// healthy, so its streams drain and nothing is aborted): both ranks get a typed error within
/// [`BOUND`], rank 1 its communicator's failure, rank 0 `RankFailed` naming rank 1; both exit
/// cleanly and their devices compute after.
pub fn nccl_error_fails_every_rank(child_test: &str) {
    let ends = run_ranks(child_test, "nccl_error", &[0, 1], None);
    let failed = "NCCL's communicator failed";
    assert_failed_in_time("rank 1, whose NCCL failed", &ends[1], failed, BOUND);
    assert_failed_in_time("rank 0", &ends[0], "rank 1", BOUND);
}

/// Rank 1's capture fails: both ranks get `RankFailed` naming rank 1, and both devices compute
/// after. Timed from the capture's start, which compiles kernels (minutes with a cold cache):
/// the bound is half the group's timeout, so the error came from the agreement, not from it.
pub fn capture_fails_on_one_rank_fails_every_rank(child_test: &str) {
    let ends = run_ranks(child_test, "capture", &[0, 1], None);
    for (rank, end) in ends.iter().enumerate() {
        assert_failed_in_time(&format!("rank {rank}"), end, "rank 1", TIMEOUT / 2);
    }
}

/// A rank whose peer never starts: rank 0 alone (hosting, its first round never completes)
/// and rank 1 alone (rank 0 never listens) each get a typed error after the group's timeout,
/// not a hang.
pub fn rendezvous_never_completes_fails_in_bounded_time(child_test: &str) {
    for (rank, names) in [
        (0, "ranks [1] did not reach"),
        (1, "rank 0 was not reached"),
    ] {
        let ends = run_ranks(child_test, "rendezvous", &[rank], None);
        let end = &ends[0];
        let (ms, _) = end
            .error()
            .unwrap_or_else(|| panic!("rank {rank} alone: no error: {}", end.describe()));
        assert!(
            Duration::from_millis(ms) >= RENDEZVOUS_TIMEOUT,
            "rank {rank} alone: waited the timeout ({ms} ms): {}",
            end.describe()
        );
        let bound = RENDEZVOUS_TIMEOUT + BOUND;
        assert_failed_in_time(&format!("rank {rank} alone"), end, names, bound);
    }
}

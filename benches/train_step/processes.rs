//! The `ddp_*` modes with one process per GPU (`ddp_whole_step_in_graph`,
//! `ddp_whole_step_processes`): the run's process is rank 0 on GPU 0 and starts one copy of
//! itself per other rank (the same arguments, the launcher's variables, GPU `r` alone), as
//! `cargo xtask launch` would; every rank joins with NCCL (`Collective::Nccl`), starts from rank
//! 0's parameters, trains on batches of its own, and after the timed steps the ranks agree that
//! their replicas are bitwise equal (a digest of every parameter's bytes), or the run fails;
//! then every rank takes part in the value check (`ddp_check.rs`). Rank 0 prints the row; the
//! others exit.

use std::hash::{Hash, Hasher};
use std::process::{Child, Command};

use burn_graphed::ProcessEnv;

use super::*;

/// What `ddp_whole_step_in_graph_sockets` needs in the run's environment (which the copies
/// inherit), for NCCL to run on its network transport over the loopback as between two
/// machines: sockets, no peer-to-peer or shared memory between the host's GPUs.
pub(crate) const SOCKETS: &[(&str, &str)] = &[
    ("NCCL_P2P_DISABLE", "1"),
    ("NCCL_SHM_DISABLE", "1"),
    ("NCCL_IB_DISABLE", "1"),
    ("NCCL_NET", "Socket"),
    ("NCCL_SOCKET_IFNAME", "lo"),
];

/// Ends the run unless its environment holds [`SOCKETS`] (set before the process starts: NCCL
/// reads them at its first call, and this process's threads already run).
pub(crate) fn require_sockets(label: &str) {
    let missing: Vec<String> = SOCKETS
        .iter()
        .filter(|(name, value)| std::env::var(name).ok().as_deref() != Some(*value))
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    assert!(
        missing.is_empty(),
        "{label}: run it with {} in the environment",
        missing.join(" ")
    );
}

/// Set in the copies rank 0 starts: their rank.
const RANK_OF_COPY: &str = "BURN_GRAPHED_BENCH_RANK";

/// A `ddp_*` run of `case` with one process per GPU (`options.ranks` of them), the all-reduce
/// inside the step's graph (`in_graph`) or between its two graphs. See the module docs.
pub(crate) fn data_parallel<M, I, O>(
    case: &Case<M, I, O>,
    mode: Mode,
    in_graph: bool,
    device: &Device,
    options: &Options,
    before: u64,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let label = format!("{} {}", case.name, mode.label());
    if !cfg!(feature = "cuda") {
        println!("# skipped: {} needs NCCL (the cuda feature)", mode.label());
        std::process::exit(0);
    }
    let copy = std::env::var(RANK_OF_COPY).is_ok();
    let (env, copies) = if copy {
        let env = ProcessEnv::from_env().expect("the launcher's variables");
        (env, Vec::new())
    } else {
        // The machine must have the GPUs (exits with a `skipped:` line otherwise).
        let _ = ddp_devices(device, options);
        start_copies(options.ranks)
    };
    let dp = DataParallel::join(
        &env,
        Duration::from_secs(600),
        Collective::Nccl { in_graph },
    )
    .expect("the group of processes");
    let rank_label = format!("{label}, rank {}", env.rank);
    let model = dp
        .broadcast((case.make)(device))
        .expect("rank 0's parameters");
    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
    let (per_step, step) = timed_ddp_whole_step(
        &dp,
        model,
        case.call_loss,
        &inputs,
        &rank_label,
        device,
        options,
    );
    let values = param_values(&step.module())
        .unwrap_or_else(|error| panic!("{label}: parameters do not read back ({error})"));
    require_finite(&values).unwrap_or_else(|error| panic!("{label}: not a result: {error}"));
    let mut digest = std::collections::hash_map::DefaultHasher::new();
    for (_, data) in &values {
        data.as_bytes().hash(&mut digest);
    }
    dp.ranks()
        .agree(
            "the replicas' parameters after the run",
            Ok(digest.finish()),
        )
        .unwrap_or_else(|error| panic!("{label}: {error}"));
    eprintln!("# {label}: replicas bitwise equal after the run: true");
    drop(step);
    let check = options
        .check
        .then(|| check_data_parallel(case, &dp, device, options, &label))
        .flatten();
    if copy {
        std::process::exit(0);
    }
    for (rank, mut child) in copies {
        let status = child.wait().expect("a rank's process");
        assert!(status.success(), "{label}: rank {rank} ended with {status}");
    }
    let mut row = Row::timed(case, mode, per_step, device, before, options, 0);
    row.ranks = Some((options.ranks, case.batch));
    row.check = check.map(Check::Steps);
    row
}

/// Rank 0's place in a group of `ranks` processes on the loopback, and one copy of this
/// process started per other rank (GPU `r` alone, the launcher's variables), their rows
/// discarded.
fn start_copies(ranks: usize) -> (ProcessEnv, Vec<(usize, Child)>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let exe = std::env::current_exe().expect("the bench binary's own path");
    let copies = (1..ranks)
        .map(|rank| {
            let child = Command::new(&exe)
                .args(std::env::args().skip(1))
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", ranks.to_string())
                .env("LOCAL_RANK", "0")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("CUDA_VISIBLE_DEVICES", rank.to_string())
                .env(RANK_OF_COPY, rank.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("a rank's process");
            (rank, child)
        })
        .collect();
    let env = ProcessEnv {
        rank: 0,
        world_size: ranks,
        local_rank: 0,
        master: format!("127.0.0.1:{port}"),
    };
    (env, copies)
}

//! `cargo xtask launch --nproc N [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
//! [--grace S] -- PROGRAM [ARGS...]`: one process per rank, as `torchrun` starts them. Each
//! gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
//! (`burn_graphed::ProcessEnv`); its output lines come through prefixed `[rank R] `. When a rank
//! fails, the others are given `--grace` seconds (default 30) to end on their own, which a
//! burn-graphed group does at its next step together, and are then killed; the launcher exits
//! non-zero naming every rank that failed. The ranks share the launcher's process group, so a
//! Ctrl-C reaches them all. On several machines, run it on each with the same
//! `--nnodes`, `--master-addr` (rank 0's machine) and `--master-port`, and its `--node-rank`.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What `launch` was asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// `None`: a free port of this machine (one machine only).
    pub master_port: Option<u16>,
    pub grace: Duration,
    pub program: Vec<String>,
}

/// How long the launcher waits for the ranks' last output lines after they ended.
const ECHO_WAIT: Duration = Duration::from_secs(5);

const USAGE: &str = "usage: cargo xtask launch --nproc N [--nnodes M --node-rank K] \
                     [--master-addr A] [--master-port P] [--grace SECONDS] -- PROGRAM [ARGS...]";

impl Launch {
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let split = args.iter().position(|a| a == "--").ok_or(USAGE)?;
        let (options, program) = (&args[..split], &args[split + 1..]);
        if program.is_empty() {
            return Err(format!("no program to launch after `--`\n{USAGE}"));
        }
        let mut launch = Launch {
            nproc: 0,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(30),
            program: program.to_vec(),
        };
        let mut it = options.iter();
        while let Some(option) = it.next() {
            let value = it
                .next()
                .ok_or_else(|| format!("{option} needs a value\n{USAGE}"))?;
            let number = || {
                value
                    .parse::<usize>()
                    .map_err(|_| format!("{option}: given {value:?}, expected a whole number"))
            };
            match option.as_str() {
                "--nproc" => launch.nproc = number()?,
                "--nnodes" => launch.nnodes = number()?,
                "--node-rank" => launch.node_rank = number()?,
                "--master-addr" => launch.master_addr = value.clone(),
                "--master-port" => {
                    let port = number()?;
                    launch.master_port =
                        Some(u16::try_from(port).ok().filter(|p| *p > 0).ok_or_else(|| {
                            format!("--master-port: given {port}, expected 1 to 65535")
                        })?);
                }
                "--grace" => launch.grace = Duration::from_secs(number()? as u64),
                other => return Err(format!("unknown option {other}\n{USAGE}")),
            }
        }
        if launch.nproc == 0 {
            return Err(format!("--nproc: expected at least 1 process\n{USAGE}"));
        }
        if launch.node_rank >= launch.nnodes {
            return Err(format!(
                "--node-rank: given {}, expected a node below --nnodes {}",
                launch.node_rank, launch.nnodes
            ));
        }
        if launch.nnodes > 1 && launch.master_port.is_none() {
            return Err("--master-port: every machine must name the same port".into());
        }
        Ok(launch)
    }
}

/// Runs `launch`'s processes to their end; `Err` names every rank that failed.
pub fn run(launch: &Launch) -> Result<(), String> {
    let port = match launch.master_port {
        Some(port) => port,
        None => std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port for rank 0: {e}"))?
            .port(),
    };
    let world = launch.nproc * launch.nnodes;
    let mut ranks: Vec<(usize, Child)> = Vec::new();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut echoes = 0;
    for local in 0..launch.nproc {
        let rank = launch.node_rank * launch.nproc + local;
        // In the launcher's process group, as `torchrun`'s ranks: a Ctrl-C reaches every rank.
        let spawned = Command::new(&launch.program[0])
            .args(&launch.program[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", &launch.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                for (_, started) in &mut ranks {
                    let _ = started.kill();
                    let _ = started.wait();
                }
                return Err(format!(
                    "rank {rank}: {} did not start: {e}",
                    launch.program[0]
                ));
            }
        };
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let done = done_tx.clone();
            echoes += 1;
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let mut line = Vec::new();
                // Bytes, not text: a line that is not UTF-8 is shown, not the end of the echo.
                while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                    let text = String::from_utf8_lossy(&line);
                    println!("[rank {rank}] {}", text.trim_end_matches(['\n', '\r']));
                    line.clear();
                }
                let _ = done.send(());
            });
        }
        ranks.push((rank, child));
    }
    let failed = wait(&mut ranks, launch.grace);
    // The ranks' last lines, unless a process a rank left behind holds its output open.
    let deadline = Instant::now() + ECHO_WAIT;
    for _ in 0..echoes {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} failed", failed.join(", ")))
    }
}

/// Waits for every rank; after the first failure, kills those still running once `grace` has
/// passed. What each failed rank did, first failure first.
fn wait(ranks: &mut [(usize, Child)], grace: Duration) -> Vec<String> {
    let mut failed = Vec::new();
    let mut running: Vec<bool> = vec![true; ranks.len()];
    let mut deadline: Option<Instant> = None;
    while running.iter().any(|r| *r) {
        for (index, (rank, child)) in ranks.iter_mut().enumerate() {
            if !running[index] {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                running[index] = false;
                if !status.success() {
                    failed.push(format!("rank {rank} ({status})"));
                    deadline.get_or_insert_with(|| Instant::now() + grace);
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for (index, (rank, child)) in ranks.iter_mut().enumerate() {
                if running[index] {
                    let _ = child.kill();
                    let _ = child.wait();
                    running[index] = false;
                    failed.push(format!(
                        "rank {rank} (killed {} s after the first failure)",
                        grace.as_secs()
                    ));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Vec<String> {
        text.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options_are_read_and_bad_ones_refused() {
        let launch = Launch::parse(&args("--nproc 2 --grace 5 -- prog a b")).expect("parsed");
        assert_eq!(launch.nproc, 2);
        assert_eq!(launch.grace, Duration::from_secs(5));
        assert_eq!(launch.program, args("prog a b"));
        for bad in [
            "--nproc 2 prog",
            "--nproc 0 -- prog",
            "--nproc x -- prog",
            "--nproc 2 --nnodes 2 --node-rank 0 -- prog",
            "--nproc 2 --nnodes 2 --node-rank 2 --master-port 9 -- prog",
            "--nproc 2 --master-port 0 -- prog",
            "--nproc 2 --",
        ] {
            assert!(Launch::parse(&args(bad)).is_err(), "{bad}");
        }
    }

    fn launch(nproc: usize, grace: u64, script: &str) -> Launch {
        Launch {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs(grace),
            program: vec!["sh".into(), "-c".into(), script.into()],
        }
    }

    #[test]
    fn every_rank_gets_its_place_and_a_clean_run_succeeds() {
        let dir = std::env::temp_dir().join(format!("xtask-launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder");
        let script = format!(
            "echo $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT > {}/$RANK",
            dir.display()
        );
        let result = run(&launch(3, 5, &script));
        let seen: Vec<String> = (0..3)
            .map(|rank| std::fs::read_to_string(dir.join(rank.to_string())).unwrap_or_default())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(result, Ok(()));
        let port = seen[0]
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_string();
        assert!(port.parse::<u16>().is_ok(), "{seen:?}");
        for (rank, line) in seen.iter().enumerate() {
            assert_eq!(
                line.trim(),
                format!("{rank} {rank} 3 127.0.0.1 {port}"),
                "rank {rank}"
            );
        }
    }

    #[test]
    fn a_failing_rank_is_named_and_the_others_are_killed_after_the_grace() {
        let started = Instant::now();
        let result = run(&launch(
            2,
            1,
            "if [ $RANK = 1 ]; then exit 3; else exec sleep 60; fi",
        ));
        let error = result.expect_err("a rank failed");
        assert!(error.starts_with("rank 1 ("), "{error}");
        assert!(error.contains("rank 0 (killed 1 s after"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(30), "no hang");
    }
}

//! Agreement between the ranks of a data-parallel group: before anything that decides what a
//! device runs (replay or eager, a capture, a collective), every rank states what it is about
//! to do, and all go on only if all agree.
//!
//! NCCL collectives block until every rank has launched the same collective; a rank that
//! replays while another runs eagerly, or that failed and stopped, leaves the others waiting
//! forever. [`RankGroup::agree`] turns each such case into the same typed error on every rank:
//! one rank's failure ([`GraphedError::RankFailed`]), different decisions
//! ([`GraphedError::RanksDisagree`]), or a rank that never arrives within the group's timeout
//! ([`GraphedError::RankTimeout`]). After an error the group is spent: every later call fails
//! at once with the same error, so no rank goes on into a collective the others left.
//!
//! The ranks are threads of one process ([`RankGroup::new`]) or processes, one per GPU, on one
//! machine or several ([`RankGroup::join`], `process.rs`); the rounds themselves are one piece
//! of code (`round.rs`) either way.
//!
//! Over 600 lines: its tests, two thirds of the file, run each behaviour on a group of
//! threads and again on a group joined over the loopback, as processes join.

mod process;
mod round;
mod wire;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

pub use self::process::ProcessEnv;
use self::process::{Hub, Link};
pub(crate) use self::round::OnEnd;
use self::round::{Combine, Entry, Gathered, Rounds};
use crate::error::GraphedError;

/// One rank's handle on its group: `size` handles are made together by [`RankGroup::new`], one
/// per device thread, or one per process by [`RankGroup::join`].
#[derive(Debug, Clone)]
pub struct RankGroup {
    transport: Transport,
    rank: usize,
}

/// How a rank's statements reach the group's rounds.
#[derive(Debug, Clone)]
enum Transport {
    /// The rounds are in this process, a group of threads.
    Here(Arc<Rounds>),
    /// Rank 0 of a group of processes: the rounds are here, served to the other ranks.
    Hub(Arc<Hub>),
    /// Another rank of a group of processes: the rounds are in rank 0's process.
    Remote(Arc<Link>),
}

impl RankGroup {
    /// The handles of a group of `size` ranks (rank `i` is element `i`); a rank that waits
    /// longer than `timeout` for the others ends the group with [`GraphedError::RankTimeout`].
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] for `size` 0 or a zero `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Result<Vec<RankGroup>, GraphedError> {
        check(size, timeout)?;
        let rounds = Arc::new(Rounds::new(size, timeout));
        Ok((0..size)
            .map(|rank| RankGroup {
                transport: Transport::Here(rounds.clone()),
                rank,
            })
            .collect())
    }

    /// This process's handle on a group of processes (one per GPU, as `torchrun` starts them):
    /// rank 0 listens at `env.master` and serves the group, every other rank connects to it
    /// (trying again until `timeout`: the processes may start in any order). A rank that waits
    /// longer than `timeout` for the others, or whose peer's process ends, gets the same typed
    /// errors as in a group of threads, on every rank.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] for a zero `timeout` or an `env` of no rank;
    /// [`GraphedError::Rendezvous`] when rank 0 cannot listen at `env.master`, or another rank
    /// cannot reach it there within `timeout` or is refused (another group size, a rank taken
    /// twice).
    pub fn join(env: &ProcessEnv, timeout: Duration) -> Result<RankGroup, GraphedError> {
        check(env.world_size, timeout)?;
        if env.rank >= env.world_size {
            return Err(GraphedError::InvalidArgument {
                argument: "env",
                detail: format!(
                    "given rank {}, expected a rank below the world size {}",
                    env.rank, env.world_size
                ),
            });
        }
        let transport = if env.world_size == 1 {
            // Nobody to serve: no port to take.
            Transport::Here(Arc::new(Rounds::new(1, timeout)))
        } else if env.rank == 0 {
            Transport::Hub(process::host(env, timeout)?)
        } else {
            Transport::Remote(Arc::new(Link::connect(env, timeout)?))
        };
        Ok(RankGroup {
            transport,
            rank: env.rank,
        })
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether the ranks are processes of their own ([`RankGroup::join`]), not threads of
    /// one process.
    pub(crate) fn is_process_group(&self) -> bool {
        matches!(self.transport, Transport::Hub(_) | Transport::Remote(_))
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        match &self.transport {
            Transport::Here(rounds) => rounds.size(),
            Transport::Hub(hub) => hub.size(),
            Transport::Remote(link) => link.size(),
        }
    }

    /// States this rank's `local` outcome of `what` and waits for every rank's; returns `local`
    /// when every rank succeeded with an equal value (compared by its `Debug` text).
    ///
    /// # Errors
    ///
    /// On every rank alike: [`GraphedError::RankFailed`] when a rank's outcome was an error
    /// (the first such rank's; the failing rank gets it too, with its own reason),
    /// [`GraphedError::RanksDisagree`] when the ranks decided differently or were deciding
    /// different things, [`GraphedError::RankTimeout`] when a rank did not arrive within the
    /// timeout; and the group's first error again on any call after one.
    pub fn agree<T: Debug>(
        &self,
        what: &str,
        local: Result<T, GraphedError>,
    ) -> Result<T, GraphedError> {
        self.agree_and_vote(what, local, false)
            .map(|(value, _)| value)
    }

    /// As [`agree`](Self::agree), with a vote that may differ between ranks: returns `local`
    /// and whether any rank voted yes (the same answer on every rank). For a step that all ranks
    /// take, after which some of them need something all must join (a capture, in turn).
    ///
    /// # Errors
    ///
    /// As [`agree`](Self::agree).
    pub(crate) fn agree_and_vote<T: Debug>(
        &self,
        what: &str,
        local: Result<T, GraphedError>,
        vote: bool,
    ) -> Result<(T, bool), GraphedError> {
        let entry = Entry {
            what: what.to_string(),
            decision: match &local {
                Ok(value) => Ok(format!("{value:?}")),
                Err(error) => Err(error.to_string()),
            },
            vote,
            payload: Vec::new(),
            combine: Combine::Gather,
        };
        let gathered = self.exchange(entry)?;
        // Every rank succeeded with the same decision, this one's included.
        local.map(|value| (value, gathered.any))
    }

    /// Every rank's `local` values, in rank order, on every rank: an agreement on `what` whose
    /// decision is the number of values (equal on every rank, or the ranks disagree).
    ///
    /// # Errors
    ///
    /// As [`agree`](Self::agree).
    #[cfg(test)]
    pub(crate) fn all_gather(
        &self,
        what: &str,
        local: Result<Vec<f32>, GraphedError>,
    ) -> Result<Arc<Vec<Vec<f32>>>, GraphedError> {
        self.values(what, local, Combine::Gather)
            .map(|gathered| gathered.payloads)
    }

    /// The mean of every rank's `local` values (summed in rank order: the same bits on every
    /// rank), agreed on as by [`all_gather`](Self::all_gather). Across processes each rank
    /// sends its values and receives the mean.
    ///
    /// # Errors
    ///
    /// As [`agree`](Self::agree).
    pub(crate) fn mean(
        &self,
        what: &str,
        local: Result<Vec<f32>, GraphedError>,
    ) -> Result<Vec<f32>, GraphedError> {
        self.values(what, local, Combine::Mean)
            .map(|gathered| gathered.payloads.first().cloned().unwrap_or_default())
    }

    /// Rank 0's `local` values on every rank (every rank states how many it holds; only rank
    /// 0's travel).
    ///
    /// # Errors
    ///
    /// As [`agree`](Self::agree).
    pub(crate) fn rank_0_values(
        &self,
        what: &str,
        local: Result<Vec<f32>, GraphedError>,
    ) -> Result<Vec<f32>, GraphedError> {
        self.values(what, local, Combine::First)
            .map(|gathered| gathered.payloads.first().cloned().unwrap_or_default())
    }

    /// A round on `what` carrying `local`'s values, combined as `combine` says; the decision
    /// every rank agrees on is how many values it holds. Values no rank gets back (a rank
    /// other than 0's, for [`Combine::First`]) stay here.
    fn values(
        &self,
        what: &str,
        local: Result<Vec<f32>, GraphedError>,
        combine: Combine,
    ) -> Result<Gathered, GraphedError> {
        let (decision, payload) = match local {
            Ok(values) => {
                let decision = Ok(format!("{} values", values.len()));
                if combine == Combine::First && self.rank != 0 {
                    (decision, Vec::new())
                } else {
                    (decision, values)
                }
            }
            Err(error) => (Err(error.to_string()), Vec::new()),
        };
        self.exchange(Entry {
            what: what.to_string(),
            decision,
            vote: false,
            payload,
            combine,
        })
    }

    /// Waits at a barrier with nothing to decide: [`agree`](Self::agree) on `()`.
    ///
    /// # Errors
    ///
    /// As [`agree`](Self::agree).
    pub fn barrier(&self, what: &str) -> Result<(), GraphedError> {
        self.agree(what, Ok(()))
    }

    /// Ends the group with `error` on every rank: a rank that cannot go on (its thread is
    /// leaving) releases the others instead of letting them wait for the timeout. Across
    /// processes the others get [`GraphedError::RankFailed`] naming this rank.
    pub fn abandon(&self, error: GraphedError) {
        match &self.transport {
            Transport::Here(rounds) => rounds.abandon(error),
            Transport::Hub(hub) => hub.abandon(error),
            Transport::Remote(link) => link.abandon(error),
        }
    }

    /// Calls `call` once, from the thread that learns of it, when the group ends in a way that
    /// may leave a collective unfinished: a rank's process gone, a rank that never arrived
    /// within the timeout, a rank's abandonment (an agreement that ends in an error does not:
    /// every rank is at the agreement then). At once if the group already ended so.
    pub(crate) fn on_end(&self, call: OnEnd) {
        match &self.transport {
            Transport::Here(rounds) => rounds.on_end(call),
            Transport::Hub(hub) => hub.on_end(call),
            Transport::Remote(link) => link.on_end(call),
        }
    }

    fn exchange(&self, mut entry: Entry) -> Result<Gathered, GraphedError> {
        match &self.transport {
            Transport::Here(rounds) => rounds.exchange(self.rank, entry),
            Transport::Hub(hub) => {
                over_the_wire(&mut entry);
                hub.exchange(entry)
            }
            Transport::Remote(link) => {
                debug_assert_eq!(link.rank(), self.rank);
                over_the_wire(&mut entry);
                link.exchange(entry)
            }
        }
    }
}

/// A statement whose values no frame between processes carries becomes this rank's failure,
/// which the round then makes every rank's (instead of a frame refused mid-way).
fn over_the_wire(entry: &mut Entry) {
    if entry.payload.len() > wire::MAX_VALUES {
        entry.decision = Err(format!(
            "{} values, over the {} one round between processes carries",
            entry.payload.len(),
            wire::MAX_VALUES
        ));
        entry.payload = Vec::new();
    }
}

/// A group's size and timeout, checked.
fn check(size: usize, timeout: Duration) -> Result<(), GraphedError> {
    if size == 0 {
        return Err(GraphedError::InvalidArgument {
            argument: "size",
            detail: "given 0 ranks, expected at least 1".into(),
        });
    }
    if timeout.is_zero() {
        return Err(GraphedError::InvalidArgument {
            argument: "timeout",
            detail: "given 0, expected a positive duration".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;
    use std::time::Instant;

    const LONG: Duration = Duration::from_secs(20);

    /// Runs `body(rank)` on one thread per rank of a fresh group; the results in rank order.
    fn on_ranks<T: Send + 'static>(
        size: usize,
        timeout: Duration,
        body: impl Fn(RankGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = Arc::new(body);
        RankGroup::new(size, timeout)
            .expect("group")
            .into_iter()
            .map(|group| {
                let body = body.clone();
                thread::spawn(move || body(group))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|handle| handle.join().expect("rank thread"))
            .collect()
    }

    #[test]
    fn equal_decisions_pass_round_after_round() {
        let results = on_ranks(4, LONG, |group| {
            (0..50)
                .map(|step| group.agree("replay", Ok(("replay", step))).map(|v| v.1))
                .collect::<Result<Vec<_>, _>>()
        });
        for result in results {
            assert_eq!(result.expect("agreed"), (0..50).collect::<Vec<_>>());
        }
    }

    #[test]
    fn any_rank_s_vote_reaches_every_rank() {
        // Round `step`: rank `step % 4` votes yes on odd steps; nobody on even steps.
        let results = on_ranks(4, LONG, |group| {
            let rank = group.rank();
            (0..20)
                .map(|step| {
                    let vote = step % 2 == 1 && step % 4 == rank;
                    group
                        .agree_and_vote("a step", Ok(step), vote)
                        .map(|(_, any)| any)
                })
                .collect::<Result<Vec<_>, _>>()
        });
        let expected: Vec<bool> = (0..20).map(|step| step % 2 == 1).collect();
        for result in results {
            assert_eq!(result.expect("agreed"), expected);
        }
    }

    /// A group of `size` ranks running a body: as threads ([`on_ranks`]) or joined over the
    /// loopback ([`on_joined_ranks`]).
    type OnGroup<T> = fn(usize, Duration, fn(RankGroup) -> T) -> Vec<T>;

    type FailureThenNext = (Result<&'static str, GraphedError>, Result<(), GraphedError>);

    /// Rank 2 fails a capture: every rank gets its error, and then the group is spent.
    fn one_failure_spends_the_group(on_group: OnGroup<FailureThenNext>) {
        let results = on_group(3, LONG, |group| {
            let local = if group.rank() == 2 {
                Err(GraphedError::NoInputs)
            } else {
                Ok("capture")
            };
            let first = group.agree("capture", local);
            let after = group.barrier("next step");
            (first, after)
        });
        for (first, after) in results {
            let error = first.expect_err("every rank fails");
            assert!(
                matches!(&error, GraphedError::RankFailed { rank: 2, what, .. } if what == "capture"),
                "{error}"
            );
            assert_eq!(after.expect_err("spent"), error);
        }
    }

    #[test]
    fn one_failure_is_an_error_on_every_rank_and_spends_the_group() {
        one_failure_spends_the_group(on_ranks);
    }

    #[test]
    fn different_decisions_are_refused_on_every_rank() {
        let results = on_ranks(2, LONG, |group| {
            let decision = if group.rank() == 0 {
                "replay"
            } else {
                "eager: OutputStillHeld"
            };
            group.agree("step 7", Ok(decision))
        });
        for result in results {
            match result {
                Err(GraphedError::RanksDisagree { what, decisions }) => {
                    assert_eq!(what, "step 7");
                    assert!(
                        decisions.contains("rank 1: \"eager: OutputStillHeld\""),
                        "{decisions}"
                    );
                }
                other => panic!("expected RanksDisagree, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let started = Instant::now();
        let results = on_ranks(3, Duration::from_millis(300), |group| {
            if group.rank() == 1 {
                // This rank never arrives at the barrier.
                return None;
            }
            Some(group.barrier("all-reduce"))
        });
        assert!(started.elapsed() < Duration::from_secs(10), "no hang");
        for result in results.into_iter().flatten() {
            match result {
                Err(GraphedError::RankTimeout { what, missing, .. }) => {
                    assert_eq!(what, "all-reduce");
                    assert!(missing.contains(&1), "{missing:?}");
                }
                other => panic!("expected RankTimeout, got {other:?}"),
            }
        }
    }

    #[test]
    fn an_abandoning_rank_releases_the_others() {
        let started = Instant::now();
        let results = on_ranks(2, LONG, |group| {
            if group.rank() == 0 {
                group.abandon(GraphedError::NoOutputs);
                return None;
            }
            Some(group.barrier("step"))
        });
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "released before the timeout"
        );
        assert_eq!(results[1], Some(Err(GraphedError::NoOutputs)));
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        assert!(matches!(
            RankGroup::new(0, LONG),
            Err(GraphedError::InvalidArgument {
                argument: "size",
                ..
            })
        ));
        assert!(matches!(
            RankGroup::new(2, Duration::ZERO),
            Err(GraphedError::InvalidArgument {
                argument: "timeout",
                ..
            })
        ));
    }

    /// A free port of the loopback (the OS's pick, released again: another program could take
    /// it between, which a test would see as a `Rendezvous` error, never as a pass).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    }

    fn env(rank: usize, size: usize, port: u16) -> ProcessEnv {
        ProcessEnv {
            rank,
            world_size: size,
            local_rank: rank,
            master: format!("127.0.0.1:{port}"),
        }
    }

    /// Runs `body(group)` on one thread per rank of a group joined over the loopback, each
    /// rank through its own connection as a process's would be; the results in rank order.
    fn on_joined_ranks<T: Send + 'static>(
        size: usize,
        timeout: Duration,
        body: impl Fn(RankGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let body = Arc::new(body);
        (0..size)
            .map(|rank| {
                let body = body.clone();
                thread::spawn(move || {
                    body(RankGroup::join(&env(rank, size, port), timeout).expect("joined"))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|handle| handle.join().expect("rank thread"))
            .collect()
    }

    #[test]
    fn joined_ranks_agree_vote_and_gather_as_threads_do() {
        let results = on_joined_ranks(3, LONG, |group| {
            let rank = group.rank();
            (0..30)
                .map(|step| {
                    let vote = step % 2 == 1 && step % 3 == rank;
                    let (value, any) = group.agree_and_vote("a step", Ok(step), vote)?;
                    let gathered =
                        group.all_gather("values", Ok(vec![rank as f32, step as f32]))?;
                    let mean = group.mean("mean", Ok(vec![rank as f32, 0.1 * step as f32]))?;
                    let first = group.rank_0_values("rank 0's", Ok(vec![rank as f32; 3]))?;
                    assert_eq!(first, vec![0.0; 3], "rank {rank}: rank 0's values");
                    let expected_mean = {
                        // Summed in rank order, then divided: the bits every rank must get.
                        let mut sum = [0.0f32; 2];
                        for r in 0..3 {
                            sum[0] += r as f32;
                            sum[1] += 0.1 * step as f32;
                        }
                        vec![sum[0] / 3.0, sum[1] / 3.0]
                    };
                    assert_eq!(mean, expected_mean, "rank {rank}, step {step}");
                    Ok((value, any, gathered.as_ref().clone()))
                })
                .collect::<Result<Vec<_>, GraphedError>>()
        });
        for result in results {
            for (step, (value, any, gathered)) in result.expect("agreed").into_iter().enumerate() {
                assert_eq!(value, step);
                assert_eq!(any, step % 2 == 1, "step {step}");
                let expected: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32, step as f32]).collect();
                assert_eq!(gathered, expected, "every rank's values in rank order");
            }
        }
    }

    #[test]
    fn a_joined_rank_s_failure_or_other_decision_reaches_every_rank() {
        one_failure_spends_the_group(on_joined_ranks);
        let results = on_joined_ranks(2, LONG, |group| {
            group.agree(
                "step 7",
                Ok(if group.rank() == 0 { "replay" } else { "eager" }),
            )
        });
        for result in results {
            assert!(
                matches!(&result, Err(GraphedError::RanksDisagree { what, .. }) if what == "step 7"),
                "{result:?}"
            );
        }
    }

    #[test]
    fn a_joined_rank_whose_connection_ends_fails_the_others_at_once() {
        let started = Instant::now();
        let results = on_joined_ranks(3, LONG, |group| {
            if group.rank() == 1 {
                // As a process that ends: its connection closes.
                drop(group);
                return None;
            }
            Some(group.barrier("all-reduce"))
        });
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "released before the timeout"
        );
        for result in results.into_iter().flatten() {
            assert!(
                matches!(&result, Err(GraphedError::RankFailed { rank: 1, .. })),
                "{result:?}"
            );
        }
    }

    #[test]
    fn an_abandoning_joined_rank_releases_the_others() {
        for abandoning in [0, 1] {
            let results = on_joined_ranks(2, LONG, move |group| {
                if group.rank() == abandoning {
                    group.abandon(GraphedError::RankFailed {
                        rank: abandoning,
                        what: "its training".into(),
                        reason: "it panicked".into(),
                    });
                    return None;
                }
                Some(group.barrier("step"))
            });
            let other = results[1 - abandoning].clone().expect("waited");
            assert!(
                matches!(&other, Err(GraphedError::RankFailed { rank, reason, .. })
                    if *rank == abandoning && reason == "it panicked"),
                "{other:?}"
            );
        }
    }

    #[test]
    fn a_rank_that_never_joins_times_out_on_the_others() {
        let started = Instant::now();
        let port = free_port();
        let handles: Vec<_> = [0, 1]
            .into_iter()
            .map(|rank| {
                thread::spawn(move || {
                    // Long enough that rank 1 reaches rank 0 on a loaded machine (a miss
                    // would be `Rendezvous`, and fail the test); short for the timeout itself.
                    RankGroup::join(&env(rank, 3, port), Duration::from_secs(3))
                        .and_then(|group| group.barrier("the first step"))
                })
            })
            .collect();
        for handle in handles {
            let result = handle.join().expect("rank thread");
            assert!(
                matches!(&result, Err(GraphedError::RankTimeout { missing, .. }) if missing.contains(&2)),
                "{result:?}"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    }

    #[test]
    fn rendezvous_failures_are_typed_errors() {
        // Rank 0's port is taken.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = taken.local_addr().expect("its address").port();
        let result = RankGroup::join(&env(0, 2, port), LONG).map(|_| ());
        assert!(
            matches!(&result, Err(GraphedError::Rendezvous { rank: 0, address, .. })
                if *address == format!("127.0.0.1:{port}")),
            "{result:?}"
        );
        // No rank 0 answers (the port's listener never accepts in time, or nobody listens).
        let started = Instant::now();
        let result = RankGroup::join(&env(1, 2, free_port()), Duration::from_millis(300));
        assert!(
            matches!(&result, Err(GraphedError::Rendezvous { rank: 1, .. })),
            "{result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "no hang");
        // A rank started for another group size is refused, and rank 0's group goes on.
        let port = free_port();
        let zero = thread::spawn(move || {
            RankGroup::join(&env(0, 2, port), LONG).and_then(|g| g.barrier("start"))
        });
        thread::sleep(Duration::from_millis(100));
        let refused = RankGroup::join(&env(1, 3, port), LONG).map(|_| ());
        assert!(
            matches!(&refused, Err(GraphedError::Rendezvous { reason, .. }) if reason.contains("group of 3")),
            "{refused:?}"
        );
        let one = RankGroup::join(&env(1, 2, port), LONG).and_then(|g| g.barrier("start"));
        assert_eq!(one, Ok(()));
        assert_eq!(zero.join().expect("rank 0"), Ok(()));
    }

    #[test]
    fn the_environment_is_read_with_typed_errors() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let read = ProcessEnv::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_PORT", "29500"),
        ]));
        assert_eq!(
            read,
            Ok(ProcessEnv {
                rank: 1,
                world_size: 4,
                local_rank: 1,
                master: "127.0.0.1:29500".into()
            })
        );
        for (pairs, argument) in [
            (&[("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..], "RANK"),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..],
                "RANK",
            ),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..],
                "RANK",
            ),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")][..], "MASTER_PORT"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")][..],
                "MASTER_PORT",
            ),
        ] {
            let pairs: &'static [(&'static str, &'static str)] = pairs;
            match ProcessEnv::from_vars(vars(pairs)) {
                Err(GraphedError::InvalidArgument { argument: a, .. }) => assert_eq!(a, argument),
                other => panic!("{pairs:?}: expected InvalidArgument {argument}, got {other:?}"),
            }
        }
    }

    /// What `group`'s [`OnEnd`] calls receive: each call's error, as text.
    fn watched(group: &RankGroup) -> std::sync::mpsc::Receiver<String> {
        let (send, receive) = std::sync::mpsc::channel();
        let send = std::sync::Mutex::new(send);
        group.on_end(Arc::new(move |error| {
            let _ = crate::sync::lock(&send).send(error.to_string());
        }));
        receive
    }

    /// A rank's part in [`a_rank_s_end_reaches_every_watcher`]: its watcher set, then rank 1
    /// leaves (`BY_DROP`: its handle dropped, as a process that ends closes its connection;
    /// otherwise it abandons the group) and every rank still there waits for its watcher's
    /// call, and nothing else: what it was called with, or `None` for rank 1 gone.
    fn watch_while_rank_1_leaves<const BY_DROP: bool>(
        group: RankGroup,
    ) -> Option<Result<String, String>> {
        let seen = watched(&group);
        group.barrier("watchers set").expect("all joined");
        if group.rank() == 1 {
            if BY_DROP {
                drop(group);
                return None;
            }
            group.abandon(GraphedError::RankFailed {
                rank: 1,
                what: "its step".into(),
                reason: "its device failed".into(),
            });
        }
        Some(
            seen.recv_timeout(Duration::from_secs(10))
                .map_err(|e| e.to_string()),
        )
    }

    /// Ranks whose devices wait in a collective are in no round: rank 1's end (its
    /// abandonment; across processes also its connection's end, `by_drop`) reaches every other
    /// rank's watchers at once, while they wait for nothing but the watchers.
    fn a_rank_s_end_reaches_every_watcher(
        on_group: OnGroup<Option<Result<String, String>>>,
        by_drop: &[bool],
    ) {
        for &leave_by_drop in by_drop {
            let body = if leave_by_drop {
                watch_while_rank_1_leaves::<true>
            } else {
                watch_while_rank_1_leaves::<false>
            };
            let started = Instant::now();
            let results = on_group(3, LONG, body);
            assert!(started.elapsed() < Duration::from_secs(10), "at once");
            let mut seen = 0;
            for (rank, result) in results.into_iter().enumerate() {
                let Some(result) = result else { continue };
                let text = result.unwrap_or_else(|e| panic!("rank {rank}: no call ({e})"));
                assert!(text.contains("rank 1"), "rank {rank}: {text}");
                seen += 1;
            }
            // By drop, rank 1 is gone and watches nothing; it abandoned, it watches too.
            assert_eq!(seen, if leave_by_drop { 2 } else { 3 });
        }
    }

    #[test]
    fn a_rank_s_end_reaches_every_watcher_in_threads() {
        // A thread's group has no connection to drop: its abandonment is the end to see.
        a_rank_s_end_reaches_every_watcher(on_ranks, &[false]);
    }

    #[test]
    fn a_joined_rank_s_end_reaches_every_watcher_at_once() {
        a_rank_s_end_reaches_every_watcher(on_joined_ranks, &[false, true]);
    }

    #[test]
    fn an_agreement_that_fails_calls_no_watcher() {
        for on_group in [on_ranks, on_joined_ranks] as [OnGroup<_>; 2] {
            let results = on_group(2, LONG, |group| {
                // Every rank keeps its handle until all have looked: a handle dropped is a
                // connection closed, which is an end the others' watchers must see.
                static LOOKED: std::sync::OnceLock<std::sync::Barrier> = std::sync::OnceLock::new();
                let looked = LOOKED.get_or_init(|| std::sync::Barrier::new(2));
                let seen = watched(&group);
                let agreed = group.agree("step 3", Ok(group.rank()));
                // Every rank is at the agreement: no collective waits for anyone.
                let called = seen.recv_timeout(Duration::from_millis(300)).ok();
                looked.wait();
                (agreed.is_err(), called)
            });
            for (rank, (failed, called)) in results.into_iter().enumerate() {
                assert!(failed, "rank {rank}: the ranks disagreed");
                assert_eq!(called, None, "rank {rank}");
            }
        }
    }
}

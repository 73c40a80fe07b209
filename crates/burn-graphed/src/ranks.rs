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

use std::fmt::Debug;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::GraphedError;
use crate::sync::lock;

/// One rank's handle on its group: `size` handles are made together by [`RankGroup::new`], one
/// per device thread.
#[derive(Debug, Clone)]
pub struct RankGroup {
    shared: Arc<Shared>,
    rank: usize,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Agreements completed so far; the current one's number.
    round: u64,
    /// What each rank stated in the current round.
    entries: Vec<Option<Entry>>,
    /// The outcome of round `round - 1`, read by the ranks that waited for it: whether any
    /// rank voted, or the error.
    last: Option<Result<bool, GraphedError>>,
    /// The error that ended the group, returned by every later call.
    spent: Option<GraphedError>,
}

/// A rank's statement: what it is deciding, and its decision or its failure.
#[derive(Debug, Clone)]
struct Entry {
    what: String,
    decision: Result<String, String>,
    /// A yes/no that need not be the same on every rank ([`RankGroup::agree_and_vote`]).
    vote: bool,
}

impl RankGroup {
    /// The handles of a group of `size` ranks (rank `i` is element `i`); a rank that waits
    /// longer than `timeout` for the others ends the group with [`GraphedError::RankTimeout`].
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] for `size` 0 or a zero `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Result<Vec<RankGroup>, GraphedError> {
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
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                entries: vec![None; size],
                ..State::default()
            }),
            arrived: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| RankGroup {
                shared: shared.clone(),
                rank,
            })
            .collect())
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
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
        };
        let any = self.exchange(entry)?;
        // Every rank succeeded with the same decision, this one's included.
        local.map(|value| (value, any))
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
    /// leaving) releases the others instead of letting them wait for the timeout.
    pub fn abandon(&self, error: GraphedError) {
        let mut state = lock(&self.shared.state);
        state.spent.get_or_insert(error);
        self.shared.arrived.notify_all();
    }

    fn exchange(&self, entry: Entry) -> Result<bool, GraphedError> {
        let shared = &self.shared;
        let mut state = lock(&shared.state);
        if let Some(error) = &state.spent {
            return Err(error.clone());
        }
        let round = state.round;
        state.entries[self.rank] = Some(entry);
        if state.entries.iter().all(Option::is_some) {
            let entries: Vec<Entry> = state.entries.iter_mut().filter_map(Option::take).collect();
            let outcome = outcome(&entries).map(|()| entries.iter().any(|e| e.vote));
            if let Err(error) = &outcome {
                state.spent = Some(error.clone());
            }
            state.last = Some(outcome.clone());
            state.round += 1;
            shared.arrived.notify_all();
            return outcome;
        }
        let deadline = Instant::now() + shared.timeout;
        loop {
            if state.round != round {
                // The round this rank joined completed; no later one can have, since it needs
                // this rank.
                return state.last.clone().unwrap_or(Ok(false));
            }
            if let Some(error) = &state.spent {
                return Err(error.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let error = GraphedError::RankTimeout {
                    what: state.entries[self.rank]
                        .as_ref()
                        .map_or_else(String::new, |e| e.what.clone()),
                    missing: (0..shared.size)
                        .filter(|&r| state.entries[r].is_none())
                        .collect(),
                    waited_ms: shared.timeout.as_millis() as u64,
                };
                state.spent = Some(error.clone());
                shared.arrived.notify_all();
                return Err(error);
            }
            state = shared
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// The outcome of a round in which every rank stated `entries` (in rank order).
fn outcome(entries: &[Entry]) -> Result<(), GraphedError> {
    let first = &entries[0];
    if entries.iter().any(|e| e.what != first.what) {
        return Err(GraphedError::RanksDisagree {
            what: first.what.clone(),
            decisions: listing(entries, |e| e.what.clone()),
        });
    }
    if let Some((rank, reason)) = entries
        .iter()
        .enumerate()
        .find_map(|(rank, e)| e.decision.as_ref().err().map(|reason| (rank, reason)))
    {
        return Err(GraphedError::RankFailed {
            rank,
            what: first.what.clone(),
            reason: reason.clone(),
        });
    }
    if entries.iter().any(|e| e.decision != first.decision) {
        return Err(GraphedError::RanksDisagree {
            what: first.what.clone(),
            decisions: listing(entries, |e| {
                e.decision.clone().unwrap_or_else(|reason| reason)
            }),
        });
    }
    Ok(())
}

/// "rank 0: A; rank 1: B" of what `text` says of each entry.
fn listing(entries: &[Entry], text: impl Fn(&Entry) -> String) -> String {
    entries
        .iter()
        .enumerate()
        .map(|(rank, e)| format!("rank {rank}: {}", text(e)))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

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

    #[test]
    fn one_failure_is_an_error_on_every_rank_and_spends_the_group() {
        let results = on_ranks(3, LONG, |group| {
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
}

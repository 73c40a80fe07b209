//! A group whose ranks are processes, one per GPU, on one machine or several, as `torchrun`
//! starts them: each process reads its place from the environment ([`ProcessEnv`]), rank 0's
//! process serves the group's rounds on `MASTER_ADDR:MASTER_PORT` (`host`), and every other
//! rank holds one connection to it ([`Link`]). Rank 0 runs each remote rank's statement
//! through the same in-memory rounds as a group of threads (`super::round`), so the outcome,
//! and every error, is the same on every rank whichever transport carried it.
//!
//! No rank waits without a bound: a rank that cannot reach rank 0 within the group's timeout
//! gets [`GraphedError::Rendezvous`]; a rank whose process ends (or closes its connection)
//! ends the group with [`GraphedError::RankFailed`] naming it on every other rank at once;
//! rank 0's end is the same error, naming rank 0, on the others; a machine that vanishes
//! without closing its connections misses the next round, which the timeout ends.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::round::{Entry, Gathered, OnEnd, Rounds, Watchers};
use super::wire::{self, FromHub, ToHub};
use crate::error::GraphedError;
use crate::sync::lock;

/// How long a rank waits for rank 0's answer beyond the group's timeout (the time rank 0's
/// rounds may wait for the slowest rank) before it takes rank 0 for gone.
const ANSWER_SLACK: Duration = Duration::from_secs(10);

/// Between two tries to reach rank 0 that has not started listening yet.
const RETRY: Duration = Duration::from_millis(50);

/// A process's place in a group of processes, read from the environment variables `torchrun`
/// sets: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the GPU of this machine to use; `RANK` if unset),
/// `MASTER_ADDR` (rank 0's host; `127.0.0.1` if unset) and `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes in the group.
    pub world_size: usize,
    /// This process's index among the group's processes on its machine: the device to use.
    pub local_rank: usize,
    /// Where rank 0's process listens: `host:port`.
    pub master: String,
}

impl ProcessEnv {
    /// Reads the variables of this process.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming the variable that is missing or not a number,
    /// or `RANK` when it is not below `WORLD_SIZE`.
    pub fn from_env() -> Result<Self, GraphedError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`ProcessEnv::from_env`] from `var`, which answers a variable's value.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, GraphedError> {
        let number = |name: &'static str, default: Option<usize>| match (var(name), default) {
            (Some(text), _) => {
                text.trim()
                    .parse::<usize>()
                    .map_err(|_| GraphedError::InvalidArgument {
                        argument: name,
                        detail: format!("given {text:?}, expected a whole number"),
                    })
            }
            (None, Some(default)) => Ok(default),
            (None, None) => Err(GraphedError::InvalidArgument {
                argument: name,
                detail: "not set; a launcher (cargo xtask launch, torchrun) sets RANK, \
                             WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process"
                    .into(),
            }),
        };
        let rank = number("RANK", None)?;
        let world_size = number("WORLD_SIZE", None)?;
        let local_rank = number("LOCAL_RANK", Some(rank))?;
        let port = number("MASTER_PORT", None)?;
        if port == 0 || port > usize::from(u16::MAX) {
            return Err(GraphedError::InvalidArgument {
                argument: "MASTER_PORT",
                detail: format!("given {port}, expected a port from 1 to 65535"),
            });
        }
        if rank >= world_size {
            return Err(GraphedError::InvalidArgument {
                argument: "RANK",
                detail: format!("given {rank}, expected a rank below WORLD_SIZE {world_size}"),
            });
        }
        let host = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        // An IPv6 address takes brackets before its port.
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master: format!("{host}:{port}"),
        })
    }

    fn rendezvous(&self, reason: impl std::fmt::Display) -> GraphedError {
        GraphedError::Rendezvous {
            rank: self.rank,
            address: self.master.clone(),
            reason: reason.to_string(),
        }
    }

    fn address(&self) -> Result<SocketAddr, GraphedError> {
        self.master
            .to_socket_addrs()
            .map_err(|e| self.rendezvous(format!("the address does not resolve ({e})")))?
            .next()
            .ok_or_else(|| self.rendezvous("the address resolves to nothing"))
    }
}

/// Rank 0's side of a group of processes: the group's rounds, which rank 0 states in directly,
/// and what the threads serving the other ranks have sent them.
#[derive(Debug)]
pub(crate) struct Hub {
    rounds: Arc<Rounds>,
    delivery: Mutex<Delivery>,
    delivered: Condvar,
    /// Each joined rank's connection, written by its serving thread (the rounds' outcomes) and
    /// by the group's end ([`FromHub::Ended`]); `None` before it joined and once it is gone.
    writers: Mutex<Vec<Option<TcpStream>>>,
}

#[derive(Debug)]
struct Delivery {
    /// Rounds rank 0 completed with an outcome (its own statements).
    own: u64,
    /// Outcomes written to each rank's connection.
    sent: Vec<u64>,
    /// Whether each rank's connection is gone.
    gone: Vec<bool>,
}

impl Hub {
    pub(crate) fn size(&self) -> usize {
        self.rounds.size()
    }

    pub(crate) fn abandon(&self, error: GraphedError) {
        self.rounds.abandon(error);
    }

    pub(crate) fn on_end(&self, call: OnEnd) {
        self.rounds.on_end(call);
    }

    /// Writes `message` to `rank`'s connection; an error when it is gone or the write failed.
    fn send(&self, rank: usize, message: &FromHub) -> io::Result<()> {
        let mut writers = lock(&self.writers);
        let writer = writers[rank]
            .as_mut()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "gone"))?;
        wire::send_from_hub(writer, message)
    }

    /// Tells every rank still connected that the group ended (as [`OnEnd`] says), at once:
    /// a rank whose device waits in a collective is not reading its connection for a round.
    fn tell_ended(&self, error: &GraphedError) {
        for rank in 1..self.size() {
            let _ = self.send(rank, &FromHub::Ended(error.clone()));
        }
    }

    /// Rank 0's statement. Where the round completed (a success, or a failure every rank
    /// agreed on, such as rank 0's own), returns once every rank still connected has been sent
    /// its outcome (or the timeout passed), so that a rank 0 that ends right after does not
    /// close the connections before the others read how the round ended. (Where the group
    /// ended instead, the others were told at once: nothing to wait for.)
    pub(crate) fn exchange(&self, entry: Entry) -> Result<Gathered, GraphedError> {
        // The round this statement joins: it cannot complete without rank 0's statement.
        let joined = self.rounds.completed();
        let outcome = self.rounds.exchange(0, entry);
        if self.rounds.completed() > joined {
            let mut delivery = lock(&self.delivery);
            delivery.own += 1;
            let round = delivery.own;
            let deadline = Instant::now() + self.rounds.timeout();
            while (1..self.size()).any(|r| !delivery.gone[r] && delivery.sent[r] < round) {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                delivery = self
                    .delivered
                    .wait_timeout(delivery, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
        outcome
    }

    /// A serving thread wrote `rank` an outcome (`sent`), or lost its connection.
    fn note(&self, rank: usize, sent: bool) {
        let mut delivery = lock(&self.delivery);
        if sent {
            delivery.sent[rank] += 1;
        } else {
            delivery.gone[rank] = true;
        }
        self.delivered.notify_all();
    }
}

/// Rank 0's side: listens at `env.master` and serves every other rank's connection with the
/// group's rounds, which rank 0's own process states in through the returned [`Hub`].
///
/// # Errors
///
/// [`GraphedError::Rendezvous`] when it cannot listen there (the port is taken).
pub(crate) fn host(env: &ProcessEnv, timeout: Duration) -> Result<Arc<Hub>, GraphedError> {
    let listener = TcpListener::bind(env.address()?)
        .map_err(|e| env.rendezvous(format!("rank 0 cannot listen there ({e})")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| env.rendezvous(e))?;
    let size = env.world_size;
    let hub = Arc::new(Hub {
        rounds: Arc::new(Rounds::new(size, timeout)),
        delivery: Mutex::new(Delivery {
            own: 0,
            sent: vec![0; size],
            gone: vec![false; size],
        }),
        delivered: Condvar::new(),
        writers: Mutex::new((0..size).map(|_| None).collect()),
    });
    // The hub holds the rounds, which hold this call: a weak handle, or the two would keep
    // each other alive.
    let told = Arc::downgrade(&hub);
    hub.on_end(Arc::new(move |error| {
        if let Some(hub) = told.upgrade() {
            hub.tell_ended(error);
        }
    }));
    let served = hub.clone();
    let accepting = std::thread::Builder::new()
        .name("burn-graphed-rank-hub".into())
        .spawn(move || accept(&listener, &served));
    if let Err(e) = accepting {
        return Err(env.rendezvous(format!("no thread to serve the group ({e})")));
    }
    Ok(hub)
}

/// Takes the other ranks' connections until all joined or the timeout passed (then the group
/// ends with [`GraphedError::RankTimeout`] naming the ranks that never came).
fn accept(listener: &TcpListener, hub: &Arc<Hub>) {
    let size = hub.size();
    let joined = Arc::new(Mutex::new({
        let mut joined = vec![false; size];
        joined[0] = true;
        joined
    }));
    let deadline = Instant::now() + hub.rounds.timeout();
    while lock(&joined).iter().any(|j| !j) {
        // A failure other than "nobody yet" (out of file handles) is tried again, until the
        // deadline like the rest.
        if let Ok((stream, _)) = listener.accept() {
            let (hub, joined) = (hub.clone(), joined.clone());
            let _ = std::thread::Builder::new()
                .name("burn-graphed-rank-serve".into())
                .spawn(move || serve(stream, &hub, &joined, deadline));
            continue;
        }
        if Instant::now() >= deadline {
            let missing = (0..size).filter(|&r| !lock(&joined)[r]).collect();
            hub.abandon(GraphedError::RankTimeout {
                what: "joining the group".into(),
                missing,
                waited_ms: hub.rounds.timeout().as_millis() as u64,
            });
            return;
        }
        std::thread::sleep(RETRY);
    }
}

/// One remote rank's connection: its greeting, then its statements, each answered with the
/// round's outcome. The connection's end ends the group (the rank's process is gone).
fn serve(mut stream: TcpStream, hub: &Hub, joined: &Mutex<Vec<bool>>, deadline: Instant) {
    let rounds = &hub.rounds;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    // At least a millisecond: a zero timeout is refused, and would leave the read unbounded.
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
    // A peer that is not a rank (no greeting) is dropped, and the group goes on.
    let Ok((rank, size)) = wire::read_hello(&mut stream) else {
        return;
    };
    let refusal = if size != rounds.size() {
        Some(format!(
            "rank {rank} was started for a group of {size}, rank 0 for {}",
            rounds.size()
        ))
    } else if rank == 0 || rank >= size {
        Some(format!(
            "rank {rank} is not a rank rank 0 waits for (1 to {})",
            size - 1
        ))
    } else if std::mem::replace(&mut lock(joined)[rank], true) {
        Some(format!("rank {rank} joined twice"))
    } else {
        None
    };
    if let Some(reason) = refusal {
        let _ = wire::send_from_hub(&mut stream, &FromHub::Refused(reason));
        return;
    }
    // Between rounds a rank may compute for as long as it likes: no timeout here. A rank's
    // process that ends closes the connection (read at once); a machine that vanishes without
    // closing it misses its next round, which the round's timeout ends on every rank.
    let _ = stream.set_read_timeout(None);
    if wire::send_from_hub(&mut stream, &FromHub::Welcome).is_err() {
        return gone(hub, rank, "its greeting's answer could not be sent");
    }
    match stream.try_clone() {
        Ok(writer) => lock(&hub.writers)[rank] = Some(writer),
        Err(e) => return gone(hub, rank, &e.to_string()),
    }
    loop {
        match wire::read_to_hub(&mut stream) {
            Ok(ToHub::Round(entry)) => {
                let outcome = rounds.exchange(rank, entry);
                if hub.send(rank, &FromHub::Outcome(outcome)).is_err() {
                    return gone(hub, rank, "the round's outcome could not be sent");
                }
                hub.note(rank, true);
            }
            Ok(ToHub::Abandon { what, reason }) => {
                rounds.abandon(GraphedError::RankFailed { rank, what, reason });
            }
            Ok(ToHub::Hello { .. }) => return gone(hub, rank, "it greeted twice"),
            Err(e) => return gone(hub, rank, &e.to_string()),
        }
    }
}

fn gone(hub: &Hub, rank: usize, detail: &str) {
    lock(&hub.writers)[rank] = None;
    hub.note(rank, false);
    hub.rounds.abandon(GraphedError::RankFailed {
        rank,
        what: "its connection to rank 0".into(),
        reason: format!("its process ended or closed the connection ({detail})"),
    });
}

/// A rank's connection to rank 0's process.
#[derive(Debug)]
pub(crate) struct Link {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// The outcomes of this rank's statements, in order, as the reading thread received them.
    answers: Mutex<Receiver<Result<Gathered, GraphedError>>>,
    /// The connection, written briefly (a statement, an abandonment) and never held while
    /// waiting.
    writer: Mutex<TcpStream>,
    ending: Arc<Ending>,
}

/// How a rank's group ended, shared by its [`Link`] and the thread that reads its connection.
#[derive(Debug, Default)]
struct Ending {
    spent: Mutex<Option<GraphedError>>,
    watchers: Watchers,
    /// This rank closed the connection itself ([`Link`]'s drop): its end is nobody's failure.
    closed: AtomicBool,
}

impl Ending {
    /// Ends the group with `error` (the first error stays); `fire`: as [`OnEnd`] says.
    fn end(&self, error: GraphedError, fire: bool) -> GraphedError {
        let spent = lock(&self.spent).get_or_insert(error).clone();
        if fire {
            self.watchers.fire(&spent);
        }
        spent
    }
}

/// The error of a rank whose connection to rank 0 ended or went silent.
fn hub_gone(what: &str, detail: &str) -> GraphedError {
    GraphedError::RankFailed {
        rank: 0,
        what: what.to_string(),
        reason: format!("rank 0's process ended or stopped answering ({detail})"),
    }
}

/// Reads rank 0's messages for as long as the connection lasts: the outcomes go to the
/// statements waiting for them; the group's end ([`FromHub::Ended`]), or the connection's,
/// ends the group here at once, while this rank's own thread may be waiting on its device.
/// A statement in flight when the group ended still gets its round's outcome from rank 0 (the
/// round may have completed just before the end, and then it holds), so only the connection's
/// end answers it here.
fn read_answers(
    mut stream: TcpStream,
    answers: &Sender<Result<Gathered, GraphedError>>,
    ending: &Ending,
) {
    loop {
        let error = match wire::read_from_hub(&mut stream) {
            Ok(FromHub::Outcome(outcome)) => {
                if let Err(error) = &outcome {
                    ending.end(error.clone(), false);
                }
                let _ = answers.send(outcome);
                continue;
            }
            Ok(FromHub::Ended(error)) => {
                ending.end(error, true);
                continue;
            }
            Ok(other) => hub_gone(
                "its connection to rank 0",
                &format!("an unexpected message {other:?}"),
            ),
            Err(_) if ending.closed.load(Ordering::SeqCst) => return,
            Err(e) => hub_gone("its connection to rank 0", &e.to_string()),
        };
        let spent = ending.end(error, true);
        let _ = answers.send(Err(spent));
        return;
    }
}

impl Link {
    /// Reaches rank 0 at `env.master` (trying again until the timeout: rank 0 may start later)
    /// and greets it; a thread of its own then reads rank 0's answers.
    ///
    /// # Errors
    ///
    /// [`GraphedError::Rendezvous`] when rank 0 cannot be reached within `timeout`, or refuses
    /// the greeting (another group size, a rank already taken).
    pub(crate) fn connect(env: &ProcessEnv, timeout: Duration) -> Result<Self, GraphedError> {
        let address = env.address()?;
        let deadline = Instant::now() + timeout;
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&address, left.max(RETRY)) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(env.rendezvous(format!(
                        "rank 0 was not reached within {} ms ({e})",
                        timeout.as_millis()
                    )));
                }
                Err(_) => std::thread::sleep(RETRY),
            }
        };
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(timeout.max(RETRY)))
            .map_err(|e| env.rendezvous(e))?;
        let hello = ToHub::Hello {
            rank: env.rank,
            size: env.world_size,
        };
        wire::send_to_hub(&mut stream, &hello).map_err(|e| env.rendezvous(e))?;
        match wire::read_from_hub(&mut stream) {
            Ok(FromHub::Welcome) => {}
            Ok(FromHub::Refused(reason)) => return Err(env.rendezvous(reason)),
            Ok(other) => return Err(env.rendezvous(format!("an unexpected answer {other:?}"))),
            Err(e) => return Err(env.rendezvous(format!("no answer to the greeting ({e})"))),
        }
        // Between rounds a rank computes for as long as it likes: the reading thread waits
        // without a bound, and a statement waits for its outcome at most the group's timeout
        // and the slack.
        stream
            .set_read_timeout(None)
            .map_err(|e| env.rendezvous(e))?;
        let writer = stream.try_clone().map_err(|e| env.rendezvous(e))?;
        let ending = Arc::new(Ending::default());
        let (send, answers) = mpsc::channel();
        let reading = ending.clone();
        std::thread::Builder::new()
            .name("burn-graphed-rank-link".into())
            .spawn(move || read_answers(stream, &send, &reading))
            .map_err(|e| env.rendezvous(format!("no thread to read rank 0's answers ({e})")))?;
        Ok(Self {
            rank: env.rank,
            size: env.world_size,
            timeout,
            answers: Mutex::new(answers),
            writer: Mutex::new(writer),
            ending,
        })
    }

    pub(crate) fn on_end(&self, call: OnEnd) {
        self.ending.watchers.add(call);
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// States `entry` in the next round and waits for its outcome.
    pub(crate) fn exchange(&self, entry: Entry) -> Result<Gathered, GraphedError> {
        if let Some(error) = lock(&self.ending.spent).clone() {
            return Err(error);
        }
        let what = entry.what.clone();
        let answers = lock(&self.answers);
        if let Err(e) = wire::send_to_hub(&mut *lock(&self.writer), &ToHub::Round(entry)) {
            return Err(self.ending.end(hub_gone(&what, &e.to_string()), true));
        }
        let wait = self.timeout + ANSWER_SLACK;
        match answers.recv_timeout(wait) {
            Ok(outcome) => outcome,
            Err(RecvTimeoutError::Timeout) => Err(self.ending.end(
                hub_gone(&what, &format!("no answer within {} ms", wait.as_millis())),
                true,
            )),
            Err(RecvTimeoutError::Disconnected) => Err(lock(&self.ending.spent)
                .clone()
                .unwrap_or_else(|| hub_gone(&what, "the connection's reader ended"))),
        }
    }

    /// Ends the group with `error`: every rank gets [`GraphedError::RankFailed`] naming this
    /// rank (with `error`'s text where it is another error).
    pub(crate) fn abandon(&self, error: GraphedError) {
        let (what, reason) = match &error {
            GraphedError::RankFailed { what, reason, .. } => (what.clone(), reason.clone()),
            other => ("its training".to_string(), other.to_string()),
        };
        let _ = wire::send_to_hub(&mut *lock(&self.writer), &ToHub::Abandon { what, reason });
        self.ending.end(error, true);
    }
}

impl Drop for Link {
    /// Closes the connection, as the process's end would: the reading thread holds its own
    /// handle on it, which would keep it open.
    fn drop(&mut self) {
        self.ending.closed.store(true, Ordering::SeqCst);
        let _ = lock(&self.writer).shutdown(std::net::Shutdown::Both);
    }
}

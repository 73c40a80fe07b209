//! Data-parallel gradients: every rank's parameter gradients averaged across the group in one
//! bucket, so that every replica then takes the same optimizer step.
//!
//! A step: each rank flattens its gradients, in the module's visiting order, into one 1-D
//! bucket; the ranks agree on the bucket's layout ([`RankGroup::agree`]: replicas of another
//! architecture would otherwise reduce misaligned values, or hang in NCCL); the bucket is
//! averaged by the group's [`Collective`]; each rank splits it back into its gradients. One
//! collective per step, not one per parameter. [`GraphedStep::data_parallel`] takes the same
//! steps inside a whole step: between its two graphs, or, with [`Collective::Nccl`]'s
//! `in_graph`, inside its one graph.
//!
//! [`GraphedStep::data_parallel`]: crate::GraphedStep::data_parallel

mod params;

use std::time::Duration;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::distributed::ReduceOperation;
use burn::tensor::{Device, Tensor, TensorData};

pub use params::replica_on;
use params::{Flatten, ReadParams, Split, StartHash, WriteParams};

use crate::error::{CapturePhase, GraphedError};
use crate::ranks::{ProcessEnv, RankGroup};

/// How a group averages its gradient buckets.
#[derive(Debug, Clone)]
pub enum Collective {
    /// burn's all-reduce (`burn::tensor::distributed::all_reduce`, NCCL on CUDA), over
    /// `devices`, the group's devices in rank order. burn has it on CUDA only (the GPU suite
    /// runs it on 2 GPUs; the CPU suite runs [`Collective::Host`]).
    AllReduce {
        /// One device per rank, rank `i` on `devices[i]`.
        devices: Vec<Device>,
    },
    /// Through host memory: every rank reads its bucket back, all ranks sum the buckets in rank
    /// order (so every rank gets the same bits) and write the mean back. For backends without
    /// collectives and for tests; a device sync per step.
    Host,
    /// NCCL with burn-graphed's own communicator (CUDA only), between processes, one per GPU
    /// ([`DataParallel::join`]: rank 0 mints the communicator's id and the group's rendezvous
    /// hands it to every rank), or between the threads of one process, one per GPU
    /// ([`DataParallel::group`]: the id minted there); the mean of the buckets (`ncclAvg`) is
    /// enqueued on the stream the model's kernels run on. With `in_graph`, a
    /// [`GraphedStep::data_parallel`] records the all-reduce inside its one graph per step
    /// (forward, backward, all-reduce, clipping, update), as PyTorch's DDP under whole-network
    /// capture does, the ranks warming up, recording and replaying at once; without, the step
    /// is two graphs with the all-reduce between their replays (the fallback).
    ///
    /// [`GraphedStep::data_parallel`]: crate::GraphedStep::data_parallel
    Nccl {
        /// Record the all-reduce inside the whole step's graph.
        in_graph: bool,
    },
}

/// One rank's handle on a data-parallel group: [`DataParallel::group`] makes one per rank.
#[derive(Debug, Clone)]
pub struct DataParallel {
    ranks: RankGroup,
    collective: Collective,
    /// With [`Collective::Nccl`]: this process's NCCL group, as the engine numbers it.
    nccl: Option<usize>,
}

impl DataParallel {
    /// The handles of a group of `size` ranks (rank `i` is element `i`), averaging with
    /// `collective`; a rank that waits longer than `timeout` for the others ends the step with
    /// [`GraphedError::RankTimeout`] on every rank.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] for `size` 0, a zero `timeout`, or an
    /// [`Collective::AllReduce`] whose device count is not `size`; [`GraphedError::Collective`]
    /// for [`Collective::Nccl`] where NCCL cannot mint an id (built without `cuda`, `libnccl`
    /// not found). Each rank of an NCCL group must train on a GPU of its own: NCCL refuses two
    /// ranks on one device when the communicator is made, at the first step.
    pub fn group(
        size: usize,
        timeout: Duration,
        collective: Collective,
    ) -> Result<Vec<DataParallel>, GraphedError> {
        if let Collective::AllReduce { devices } = &collective {
            if devices.len() != size {
                return Err(GraphedError::InvalidArgument {
                    argument: "collective",
                    detail: format!(
                        "given {} devices for {size} ranks, expected one device per rank",
                        devices.len()
                    ),
                });
            }
            let inner: Vec<Device> = devices.iter().map(|d| d.clone().inner()).collect();
            if let Some((a, b)) = (0..size)
                .flat_map(|a| (a + 1..size).map(move |b| (a, b)))
                .find(|&(a, b)| inner[a] == inner[b])
            {
                // NCCL would join that device once and wait for the missing rank forever.
                return Err(GraphedError::InvalidArgument {
                    argument: "collective",
                    detail: format!(
                        "given device {:?} for ranks {a} and {b}, expected a device of its own \
                         for every rank",
                        inner[a]
                    ),
                });
            }
        }
        let groups = RankGroup::new(size, timeout)?;
        let id = match collective {
            Collective::Nccl { .. } => Some(
                crate::cube::nccl_unique_id()
                    .map_err(|reason| GraphedError::Collective { reason })?,
            ),
            _ => None,
        };
        groups
            .into_iter()
            .map(|ranks| {
                let nccl = id
                    .as_ref()
                    .map(|id| Self::nccl_group(&ranks, id))
                    .transpose()?;
                Ok(DataParallel {
                    ranks,
                    collective: collective.clone(),
                    nccl,
                })
            })
            .collect()
    }

    /// This process's handle on a group of processes, one per GPU, as `torchrun` or `cargo
    /// xtask launch` starts them ([`RankGroup::join`]: rank 0 serves the group at
    /// `env.master`). With [`Collective::Host`] each rank's bucket travels to rank 0, which
    /// sums them in rank order and sends the mean back, so every replica gets the same bits;
    /// with [`Collective::Nccl`] rank 0 mints NCCL's id and hands it to every rank here (the
    /// communicator itself is made at the first all-reduce, on the rank's device).
    ///
    /// # Errors
    ///
    /// [`RankGroup::join`]'s; [`GraphedError::InvalidArgument`] naming `collective` for
    /// [`Collective::AllReduce`] (burn's all-reduce joins the devices of one process, not
    /// devices of several); on every rank alike, [`GraphedError::RankFailed`] when rank 0 could
    /// not mint NCCL's id (built without `cuda`, `libnccl` not found).
    pub fn join(
        env: &ProcessEnv,
        timeout: Duration,
        collective: Collective,
    ) -> Result<DataParallel, GraphedError> {
        if let Collective::AllReduce { .. } = collective {
            return Err(GraphedError::InvalidArgument {
                argument: "collective",
                detail: "given AllReduce, expected Host or Nccl: burn's all-reduce joins the \
                         devices of one process, and a group of processes averages through \
                         the host or NCCL"
                    .into(),
            });
        }
        let ranks = RankGroup::join(env, timeout)?;
        let nccl = match collective {
            Collective::Nccl { .. } => Some(Self::nccl_group(&ranks, &Self::nccl_id(&ranks)?)?),
            _ => None,
        };
        Ok(DataParallel {
            ranks,
            collective,
            nccl,
        })
    }

    /// Rank 0's NCCL id on every rank of a group of processes (as bytes, each an `f32` of the
    /// round's values: exact).
    fn nccl_id(ranks: &RankGroup) -> Result<Vec<u8>, GraphedError> {
        let minted = if ranks.rank() == 0 {
            crate::cube::nccl_unique_id()
                .map(|id| id.into_iter().map(f32::from).collect())
                .map_err(|reason| GraphedError::Collective { reason })
        } else {
            Ok(vec![0.0; crate::cube::NCCL_ID_BYTES])
        };
        let values = ranks.rank_0_values("NCCL's communicator id from rank 0", minted)?;
        Ok(values.into_iter().map(|v| v as u8).collect())
    }

    /// This rank's NCCL group in the engine, of the communicator `id` names.
    fn nccl_group(ranks: &RankGroup, id: &[u8]) -> Result<usize, GraphedError> {
        let failed = |reason: String| GraphedError::Collective { reason };
        // The communicator's own failure (the watchdog's poll) ends the group on every rank;
        // the group's end, on whichever thread learns of it first, ends the communicator
        // (`nccl_end`: aborted unless its stream drains).
        let failing = ranks.clone();
        let on_error = Box::new(move |reason: String| {
            failing.abandon(GraphedError::Collective { reason });
        });
        let group =
            crate::cube::nccl_join(id, ranks.rank(), ranks.size(), on_error).map_err(failed)?;
        ranks.on_end(std::sync::Arc::new(move |error| {
            crate::cube::nccl_end(group, &error.to_string());
        }));
        Ok(group)
    }

    /// `module` with rank 0's parameter values on every rank (each rank calls it with its own
    /// replica, at the same point): replicas made apart (a group of processes, each
    /// initializing its model with its own random draws) start equal, as PyTorch's DDP makes
    /// them at construction. Float parameters travel as `f32` through the host,
    /// from rank 0 to every rank (once, at the start); ids, devices and `require_grad` stay
    /// this rank's.
    ///
    /// # Errors
    ///
    /// On every rank alike: [`GraphedError::RanksDisagree`] when the replicas hold other
    /// numbers of values, [`GraphedError::RankFailed`] when a rank could not read its
    /// parameters back or holds `f64` parameters (which `f32` would round), and the group's
    /// timeout.
    pub fn broadcast<M: Module>(&self, module: M) -> Result<M, GraphedError> {
        let mut read = ReadParams::default();
        module.visit(&mut read);
        let local = match read.failed {
            Some(detail) => Err(GraphedError::InvalidArgument {
                argument: "module",
                detail,
            }),
            None => Ok(read.values),
        };
        let values = self
            .ranks
            .rank_0_values("rank 0's parameters to every rank", local)?;
        Ok(module.map(&mut WriteParams {
            values: &values,
            offset: 0,
        }))
    }

    /// This handle's agreement with the other ranks (to agree on other decisions too).
    pub fn ranks(&self) -> &RankGroup {
        &self.ranks
    }

    /// Runs this rank's part of the training, `body`: when it fails, the group ends with
    /// [`GraphedError::RankFailed`] naming this rank, so that every other rank stops at its next
    /// step taken together ([`in_turn`](Self::in_turn), [`average`](Self::average)) instead of
    /// waiting there for the timeout. Returns `body`'s result.
    ///
    /// A panic in `body` ends the group too (as `RankFailed`), then goes on unwinding.
    pub fn run<T>(
        &self,
        body: impl FnOnce(&DataParallel) -> Result<T, GraphedError>,
    ) -> Result<T, GraphedError> {
        let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(self))) {
            Ok(result) => result,
            Err(panic) => {
                self.ranks.abandon(GraphedError::RankFailed {
                    rank: self.ranks.rank(),
                    what: "its training".into(),
                    reason: "it panicked".into(),
                });
                std::panic::resume_unwind(panic);
            }
        };
        if let Err(error) = &result {
            self.ranks.abandon(GraphedError::RankFailed {
                rank: self.ranks.rank(),
                what: "its training".into(),
                reason: error.to_string(),
            });
        }
        result
    }

    /// Runs `work` on every rank, one rank at a time in rank order, then agrees on its outcome:
    /// for captures, which every rank must have made before any replays. First every rank
    /// drains `device`, its own, and waits for the others; then each rank's turn comes while
    /// the others wait at a barrier, and ends when `device` has run what `work` queued (so that
    /// seeded draws in turn come out alike: burn's cubecl backends seed a draw from one
    /// process-wide generator when it launches, and nothing one rank queued runs during
    /// another's capture). Ranks that are processes of their own ([`DataParallel::join`]) share
    /// no process, so they run `work` all at once.
    /// Returns this rank's value when every rank's `work` succeeded.
    ///
    /// # Errors
    ///
    /// On every rank alike: [`GraphedError::RankFailed`] naming the first rank whose device did
    /// not drain or whose `work` failed (a failed capture leaves its module and device as they
    /// were), or the group's errors of [`RankGroup::agree`].
    pub fn in_turn<T>(
        &self,
        what: &str,
        device: &Device,
        work: impl FnOnce() -> Result<T, GraphedError>,
    ) -> Result<T, GraphedError> {
        self.turns(what, device, self.ranks.is_process_group(), work)
    }

    /// [`in_turn`](Self::in_turn) with every rank's `work` at once, threads too: for the
    /// captures of steps that hold their all-reduce ([`Collective::Nccl`] with `in_graph`),
    /// whose warm-ups each wait in an all-reduce for every rank. CUDA devices record at once
    /// (thread-local capture mode); seeded draws made at once by threads are not alike.
    pub(crate) fn at_once<T>(
        &self,
        what: &str,
        device: &Device,
        work: impl FnOnce() -> Result<T, GraphedError>,
    ) -> Result<T, GraphedError> {
        self.turns(what, device, true, work)
    }

    /// [`in_turn`](Self::in_turn), or every rank at once (`at_once`).
    fn turns<T>(
        &self,
        what: &str,
        device: &Device,
        at_once: bool,
        work: impl FnOnce() -> Result<T, GraphedError>,
    ) -> Result<T, GraphedError> {
        // The rank's device drained, or why not (`when`: before the captures, or at the end of
        // its turn).
        let drain = |when: &str| {
            device.sync().map_err(|error| GraphedError::Capture {
                phase: CapturePhase::StaticBuffers,
                reason: format!("the rank's device did not drain {when}: {error}"),
            })
        };
        self.ranks.agree(what, drain("before the captures"))?;
        let mine = if at_once {
            work()
        } else {
            let mut work = Some(work);
            let mut mine = None;
            for turn in 0..self.ranks.size() {
                if turn == self.ranks.rank() {
                    mine = work.take().map(|work| {
                        let value = work();
                        // The turn ends when its device work has run, not when it is queued,
                        // whether the work succeeded or not: fusion launches lazily, and nothing
                        // this turn queued may run in the next rank's (a capture there, or
                        // burn's random draws, which take their seeds from one process-wide
                        // generator at launch). The work's own error comes first.
                        let drained = drain("at the end of its turn");
                        value.and_then(|value| drained.map(|()| value))
                    });
                }
                self.ranks.barrier(what)?;
            }
            mine.unwrap_or(Err(GraphedError::NoInputs))
        };
        self.ranks
            .agree(what, mine.as_ref().map(|_| ()).map_err(Clone::clone))?;
        mine
    }

    /// Whether `device`, this rank's, is the one the group's collective gives this rank.
    ///
    /// # Errors
    ///
    /// [`GraphedError::InvalidArgument`] naming `model` when it is another.
    pub(crate) fn check_device(&self, device: &Device) -> Result<(), GraphedError> {
        if let Collective::Nccl { .. } = self.collective {
            if crate::cube::is_cuda(device) {
                return Ok(());
            }
            return Err(GraphedError::InvalidArgument {
                argument: "model",
                detail: format!(
                    "rank {}'s parameters are on {device:?}, expected a CUDA device (NCCL runs \
                     on CUDA; other backends average with Collective::Host)",
                    self.ranks.rank()
                ),
            });
        }
        let Collective::AllReduce { devices } = &self.collective else {
            return Ok(());
        };
        let rank = self.ranks.rank();
        let expected = devices.get(rank).map(|d| d.clone().inner());
        if expected.as_ref() == Some(&device.clone().inner()) {
            return Ok(());
        }
        Err(GraphedError::InvalidArgument {
            argument: "model",
            detail: format!(
                "rank {rank}'s parameters are on {device:?}, expected the collective's device \
                 of rank {rank}, {expected:?} (make the replica with replica_on)"
            ),
        })
    }

    /// Agrees with the other ranks that every replica starts from the same parameters (shapes
    /// and values, hashed): replicas that start apart stay apart, however equal their updates.
    /// Reads every parameter back once.
    ///
    /// # Errors
    ///
    /// On every rank alike: [`GraphedError::RanksDisagree`] when the replicas differ,
    /// [`GraphedError::RankFailed`] when a rank could not read its parameters back.
    pub(crate) fn agree_on_start<M: Module>(&self, module: &M) -> Result<(), GraphedError> {
        let mut hash = StartHash {
            hasher: std::collections::hash_map::DefaultHasher::new(),
            failed: None,
        };
        module.visit(&mut hash);
        let digest = match hash.failed {
            Some(detail) => Err(GraphedError::InvalidArgument {
                argument: "model",
                detail,
            }),
            None => Ok(std::hash::Hasher::finish(&hash.hasher)),
        };
        self.ranks
            .agree("the replicas' starting parameters (shapes, values)", digest)
            .map(|_| ())
    }

    /// `grads`, the gradients of `module`'s parameters from this rank's batch, averaged over
    /// the ranks' (each rank calls it with its own, at the same step).
    ///
    /// With equal batch shards and a loss that is a mean over the batch, the average is the
    /// gradient of the whole batch: every replica then takes the step a single device would
    /// take on the whole batch.
    ///
    /// # Errors
    ///
    /// On every rank alike: [`GraphedError::RanksDisagree`] when the ranks' buckets differ in
    /// layout (parameters of other sizes, or a gradient missing on one rank),
    /// [`GraphedError::RankFailed`] when a rank could not read its bucket back
    /// ([`Collective::Host`]), [`GraphedError::RankTimeout`] when a rank did not come.
    pub fn average<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, GraphedError> {
        let mut flatten = Flatten {
            grads: &mut grads,
            parts: Vec::new(),
            positions: Vec::new(),
            visited: 0,
        };
        module.visit(&mut flatten);
        let (parts, positions) = (flatten.parts, flatten.positions);
        // Which parameters, and their sizes (equal sizes of other parameters would reduce
        // misaligned gradients): their count, elements and a hash of positions in visiting
        // order and sizes, so that a step formats three numbers for the agreement, not a list
        // of every parameter. Positions, not ids: the replicas of a group of processes were
        // made apart, and their ids differ.
        let layout = {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            for (position, (_, numel, _)) in positions.iter().zip(&parts) {
                std::hash::Hash::hash(&(*position, *numel), &mut hasher);
            }
            let elements: usize = parts.iter().map(|(_, numel, _)| numel).sum();
            (parts.len(), elements, std::hash::Hasher::finish(&hasher))
        };
        let bucket = (!parts.is_empty())
            .then(|| Tensor::cat(parts.iter().map(|(_, _, t)| t.clone()).collect(), 0));
        // A bucket without values on one rank would skip its collective and strand the others.
        let written = bucket
            .as_ref()
            .map_or(Ok(()), |bucket| written(&bucket.clone().into_dispatch()));
        self.ranks.agree(
            "the gradient bucket's layout (parameters, elements, hash of positions and sizes)",
            written.map(|()| layout),
        )?;
        let Some(bucket) = bucket else {
            return Ok(grads);
        };
        let averaged = self.mean(bucket)?;
        let mut split = Split {
            grads: &mut grads,
            averaged,
            offset: 0,
            ids: parts.iter().map(|(id, _, _)| *id).collect(),
        };
        module.visit(&mut split);
        Ok(grads)
    }

    /// The mean of every rank's `bucket` (each rank calls it with its own, after the ranks
    /// agreed on the buckets' layout and that every bucket holds values ([`written`]): NCCL
    /// waits for every rank, and cubecl skips the collective of a rank whose bucket holds
    /// none).
    ///
    /// # Errors
    ///
    /// [`Collective::Host`]'s, on every rank alike.
    pub(crate) fn mean(&self, bucket: Tensor<1>) -> Result<Tensor<1>, GraphedError> {
        match &self.collective {
            // A buffer of the same size on every rank (`cube::collective_buffer`).
            Collective::AllReduce { devices } => Ok(burn::tensor::distributed::all_reduce(
                crate::cube::collective_buffer(bucket),
                ReduceOperation::Mean,
                devices.clone(),
            )
            .resolve()),
            Collective::Host => self.host_mean(bucket),
            Collective::Nccl { .. } => {
                let group = self.nccl.ok_or_else(|| GraphedError::Collective {
                    reason: "no NCCL group joined (DataParallel::join makes it)".into(),
                })?;
                let mean = crate::cube::nccl_mean(bucket, group);
                // Runs the all-reduce (it is lazy), so that its failure is this step's.
                let ran = crate::cube::check_written(&mean.clone().into_dispatch());
                if let Some(reason) = crate::cube::nccl_failure(group) {
                    return Err(GraphedError::Collective { reason });
                }
                ran.map_err(|reason| GraphedError::Collective { reason })?;
                Ok(mean)
            }
        }
    }

    /// The engine's NCCL group where the whole step records its all-reduce in its graph
    /// ([`Collective::Nccl`] with `in_graph`).
    pub(crate) fn in_graph_group(&self) -> Option<usize> {
        match self.collective {
            Collective::Nccl { in_graph: true } => self.nccl,
            _ => None,
        }
    }

    /// The mean of every rank's `bucket`, summed on the host in rank order.
    fn host_mean(&self, bucket: Tensor<1>) -> Result<Tensor<1>, GraphedError> {
        let (device, dtype) = (bucket.device(), bucket.dtype());
        // A read that fails (a device failure after the check of `written`) is an error to
        // agree on, not a panic that would leave the other ranks waiting.
        let values = bucket
            .try_into_data()
            .map_err(|error| GraphedError::GradientsNotWritten {
                reason: error.to_string(),
            })
            .and_then(|data| {
                data.convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|error| GraphedError::InvalidArgument {
                        argument: "grads",
                        detail: format!("the gradient bucket did not read back as f32: {error:?}"),
                    })
            });
        // Every rank learns whether every rank read its bucket, and gets their mean.
        let mean = self
            .ranks
            .mean("every rank's gradient bucket on the host", values)?;
        let len = mean.len();
        Ok(Tensor::from_data(
            TensorData::new(mean, [len]).convert_dtype(dtype),
            &device,
        ))
    }
}

/// Whether the device wrote `bucket`'s values (runs the work queued for it): what the ranks
/// agree on before a collective. cubecl skips the all-reduce of a rank whose source carries a
/// failure, and the other ranks' NCCL kernels would then wait for it for good.
///
/// # Errors
///
/// [`GraphedError::GradientsNotWritten`] with the backend's account.
pub(crate) fn written(bucket: &burn::backend::DispatchTensor) -> Result<(), GraphedError> {
    crate::cube::check_written(bucket)
        .map_err(|reason| GraphedError::GradientsNotWritten { reason })
}

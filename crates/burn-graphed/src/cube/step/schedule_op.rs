//! The whole step's *schedule*: three `f32` words on the device that the recorded update reads
//! (`update_kernel`'s device clock): the learning rate, the number of updates done so far, and
//! AdamW's decay factor `1 - lr * weight_decay` (computed on the host in `f64` and rounded, as
//! burn-optim computes it). The host writes words 0 and 2 before a replay when the learning
//! rate changed ([`write_schedule`]) and word 1 where a loaded state says how many updates were
//! done ([`write_count`]); the graph advances word 1 after each update ([`advance`]), so the
//! step count lives on the device.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::buffers::FusedTensor;
use super::super::update::update_kernel::schedule_arg;

/// Counts one more update: word 1 of the schedule.
#[cube(launch_unchecked)]
fn schedule_advance_kernel(schedule: &mut [f32]) {
    if ABSOLUTE_POS == 0 {
        schedule[1] += 1.0f32;
    }
}

/// Writes the step count (word 1), where a loaded optimizer state says how many updates were
/// done.
#[cube(launch_unchecked)]
fn schedule_count_kernel(schedule: &mut [f32], count: f32) {
    if ABSOLUTE_POS == 0 {
        schedule[1] = count;
    }
}

/// Writes the learning-rate words of the schedule (0 and 2).
#[cube(launch_unchecked)]
fn schedule_write_kernel(schedule: &mut [f32], lr: f32, keep: f32) {
    if ABSOLUTE_POS == 0 {
        schedule[0] = lr;
        schedule[2] = keep;
    }
}

/// The two small operations on a schedule buffer, as lazy fusion operations that write it in
/// place (the schedule is a static buffer that its owner holds, like a generator's state).
#[backend_extension(Cube, Fusion)]
pub(crate) trait ScheduleOps: Backend {
    /// Counts one more update on the device; returns `schedule` (the same buffer).
    #[fusion(dtype = schedule, shape = schedule)]
    fn advance_schedule(schedule: &FloatTensor<Self>) -> FloatTensor<Self>;

    /// Writes the learning rate and AdamW's decay factor; returns `schedule`.
    #[fusion(dtype = schedule, shape = schedule)]
    fn write_schedule(schedule: &FloatTensor<Self>, lr: f32, keep: f32) -> FloatTensor<Self>;

    /// Writes the step count; returns `schedule`.
    #[fusion(dtype = schedule, shape = schedule)]
    fn write_count(schedule: &FloatTensor<Self>, count: f32) -> FloatTensor<Self>;
}

impl ScheduleOps for CubeBackend {
    fn advance_schedule(schedule: &CubeTensor) -> CubeTensor {
        // SAFETY: one thread writes word 1 of the schedule (`schedule_arg` checked its size).
        unsafe {
            schedule_advance_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
            );
        }
        schedule.clone()
    }

    fn write_schedule(schedule: &CubeTensor, lr: f32, keep: f32) -> CubeTensor {
        // SAFETY: one thread writes words 0 and 2 (`schedule_arg` checked the size).
        unsafe {
            schedule_write_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
                lr,
                keep,
            );
        }
        schedule.clone()
    }

    fn write_count(schedule: &CubeTensor, count: f32) -> CubeTensor {
        // SAFETY: one thread writes word 1 (`schedule_arg` checked the size).
        unsafe {
            schedule_count_kernel::launch_unchecked(
                &schedule.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                schedule_arg(schedule),
                count,
            );
        }
        schedule.clone()
    }
}

/// Queues a write of the step count; hold the result as for [`write_schedule`].
pub(crate) fn write_count(schedule: &FusedTensor, count: f32) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::write_count(schedule, count)
}

/// Queues a write of the learning-rate words; the returned tensor must be held until the stream
/// drained (fusion skips work whose results nobody holds).
pub(crate) fn write_schedule(schedule: &FusedTensor, lr: f32, keep: f32) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::write_schedule(schedule, lr, keep)
}

/// Queues the count of one more update; hold the result as for [`write_schedule`].
pub(crate) fn advance(schedule: &FusedTensor) -> FusedTensor {
    <burn::backend::Cube as ScheduleOps>::advance_schedule(schedule)
}

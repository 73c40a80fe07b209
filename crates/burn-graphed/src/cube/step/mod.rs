//! The whole step's engine side: the shared state (parameters, optimizer states, schedule), its
//! clipping, the small kernels of its schedule, and its graphs. The update itself is the
//! engine's one update operation (`update`), its clock on the device.

pub(super) mod overlap;
pub(super) mod schedule_op;
pub(super) mod step_clip;
pub(super) mod step_graph;
pub(super) mod step_state;

//! The whole step's engine side: the shared state (parameters, optimizer states, schedule), its
//! clipping and update kernels, and its graphs.

pub(super) mod step_clip;
pub(super) mod step_graph;
pub(super) mod step_state;
pub(super) mod step_update_op;

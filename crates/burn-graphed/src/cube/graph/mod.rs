//! Recording, validating and replaying graphs: the capture driver's stages and the group, inference
//! and whole-step recipes' shared parts, the sessions and graphs the features hold, the write
//! check, progress, and the device random state.

pub(super) mod capture;
pub(super) mod driver;
pub(super) mod graphs;
pub(super) mod inspect;
pub(super) mod lifecycle;
pub(super) mod node;
pub(super) mod param_claim;
pub(super) mod progress;
pub(super) mod random_state;
pub(super) mod session;
pub(super) mod validate;
pub(super) mod write_check;

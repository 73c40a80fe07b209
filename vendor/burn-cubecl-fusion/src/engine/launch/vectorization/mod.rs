mod axis;
mod base;
mod planner;

pub use base::*;
pub use planner::*;

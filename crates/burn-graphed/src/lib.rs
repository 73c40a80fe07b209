//! burn-graphed

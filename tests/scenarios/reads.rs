//! Reading values back: burn 0.22.1's cubecl backends read lazily, so a value kept across
//! device work must be copied to the host at once (`burn_graphed_testkit::materialize`).

use super::*;
use burn_graphed_testkit::materialize;

/// `into_data` of a clone, then the original's last use: burn-fusion writes the result into
/// the original's buffer, and on cubecl backends a lazy read not yet accessed shows the new
/// values. A materialized read keeps the values of its moment. The first assertion keeps the
/// second meaningful: the write in place does happen here (if a burn upgrade stops it, this
/// fails and the harness's `materialize` may be revisited).
pub fn lazy_reads_see_later_writes(device: &Device) {
    let t: Tensor<1> = Tensor::from_floats([1.0, 2.0, 3.0, 4.0], device).mul_scalar(2.0);
    // `into_data` runs the queued `mul_scalar`; only the copy to the host is deferred.
    let lazy = t.clone().into_data();
    let kept = materialize(t.clone().into_data(), "t").expect("read");
    let updated = t.add_scalar(1.0);
    let updated = materialize(updated.into_data(), "t + 1").expect("read");
    let expected = [2.0f32, 4.0, 6.0, 8.0];
    assert_eq!(updated.try_to_vec::<f32>().unwrap(), [3.0, 5.0, 7.0, 9.0]);
    let lazy = lazy.try_to_vec::<f32>().unwrap();
    if supports_graphs(device) {
        assert_eq!(
            lazy,
            [3.0, 5.0, 7.0, 9.0],
            "a lazy read on {device:?} no longer shows a later in-place write"
        );
    } else {
        assert_eq!(lazy, expected, "Flex reads at once");
    }
    assert_eq!(kept.try_to_vec::<f32>().unwrap(), expected);
}

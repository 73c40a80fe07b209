//! `enable_kernel_cache` in a process of its own: it must come before cubecl's configuration is
//! loaded, which the first tensor operation does.

use burn::prelude::*;
use burn_graphed::GraphedError;

#[test]
fn kernel_cache_turns_on_before_the_first_operation_only() {
    let dir = std::env::temp_dir().join(format!("burn-graphed-cache-{}", std::process::id()));
    burn_graphed::enable_kernel_cache(Some(dir)).expect("first thing in the process");
    let device = Device::wgpu(Default::default());
    let sum = (Tensor::<1>::ones([4], &device) * 2.0)
        .sum()
        .into_scalar::<f32>();
    assert_eq!(sum, 8.0);
    assert_eq!(
        burn_graphed::enable_kernel_cache(None),
        Err(GraphedError::KernelCacheTooLate)
    );
}

//! `enable_kernel_cache` in a process of its own: it must come before cubecl's configuration is
//! loaded, which the first tensor operation does.

use burn::prelude::*;
use burn_graphed::GraphedError;

/// Every file under `dir`, recursively, with its size.
fn files_under(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            match entry.metadata() {
                Ok(meta) if meta.is_dir() => pending.push(path),
                Ok(meta) => files.push((path, meta.len())),
                Err(_) => {}
            }
        }
    }
    files
}

#[test]
fn kernel_cache_turns_on_before_the_first_operation_only() {
    let dir = std::env::temp_dir().join(format!("burn-graphed-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    burn_graphed::enable_kernel_cache(Some(dir.clone())).expect("first thing in the process");
    let device = Device::wgpu(Default::default());
    let sum = (Tensor::<1>::ones([4], &device) * 2.0)
        .sum()
        .into_scalar::<f32>();
    assert_eq!(sum, 8.0);
    assert_eq!(
        burn_graphed::enable_kernel_cache(None),
        Err(GraphedError::KernelCacheTooLate)
    );
    // The cache is on: the kernels just compiled were written under `dir`, and a kernel
    // compiled later (`exp`, used nowhere above) adds to what is there.
    let bytes = |files: &[(std::path::PathBuf, u64)]| files.iter().map(|(_, len)| len).sum::<u64>();
    let files = files_under(&dir);
    println!(
        "kernel cache: {} files under {}: {files:?}",
        files.len(),
        dir.display()
    );
    assert!(
        bytes(&files) > 0,
        "nothing was written under {}: {files:?}",
        dir.display()
    );
    let exp = Tensor::<1>::ones([4], &device)
        .exp()
        .sum()
        .into_scalar::<f32>();
    assert!((exp - 4.0 * std::f32::consts::E).abs() < 1e-5, "{exp}");
    let later = files_under(&dir);
    println!("kernel cache after one more kernel: {later:?}");
    assert!(
        bytes(&later) > bytes(&files),
        "a newly compiled kernel added nothing under {}: {files:?} then {later:?}",
        dir.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

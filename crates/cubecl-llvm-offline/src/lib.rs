//! Offline stand-in for `cubecl-llvm` 0.11.3.
//!
//! `cubecl-cuda` 0.11 names a handful of `cubecl-llvm` items even when it compiles kernels
//! with its CUDA C++ / NVRTC backend (its `cpp` feature), and the real crate's build script
//! downloads an LLVM bundle, which cannot work offline. The workspace root replaces the real
//! crate with this one through `[patch.crates-io]`.
//!
//! Nothing here is executed in a build that enables `cubecl-cuda/cpp` (burn-graphed always
//! does): the LLVM backend is never selected, so [`PlironCompiler::compile`] is never called.
//! If it were, it returns [`CompilationError::Generic`] saying that this build has no LLVM.
#![warn(missing_docs)]

use cubecl_core::Compiler;
use cubecl_core::prelude::KernelDefinition;
use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::CompilationError;
use cubecl_runtime::kernel::BufferIOAttr;

/// The NVPTX target items `cubecl-cuda` names.
#[cfg(feature = "nvptx")]
pub mod nvptx {
    /// The PTX ISA version for a driver.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, as the NVPTX target feature spells it: 8.7 is `87`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest PTX version a driver of CUDA `driver` (as `cuDriverGetVersion`
            /// reports it, 12.8 is `12080`) loads; `None` below CUDA 10.0.
            ///
            /// Only the LLVM backend reads it, and only to name its kernel cache; the table is
            /// the public CUDA release notes' mapping.
            pub fn for_driver(driver: i32) -> Option<Self> {
                const DRIVER_PTX: &[(i32, u32)] = &[
                    (13030, 93),
                    (13020, 92),
                    (13010, 91),
                    (13000, 90),
                    (12090, 88),
                    (12080, 87),
                    (12050, 85),
                    (12040, 84),
                    (12030, 83),
                    (12020, 82),
                    (12010, 81),
                    (12000, 80),
                    (11000, 70),
                    (10000, 63),
                ];
                DRIVER_PTX
                    .iter()
                    .find(|(first, _)| driver >= *first)
                    .map(|(_, ptx)| Self(*ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

/// Shared items of the GPU targets.
pub mod shared {
    /// Narrowing a device's advertised features to what the LLVM backend lowers.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// The GPU target a device's features would be narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA PTX.
            Nvptx,
        }

        /// Called by `cubecl-cuda` only when the LLVM backend is selected, which a build with
        /// `cubecl-cuda/cpp` never does. Leaves `props` untouched: the C++ backend honours
        /// everything the runtime advertises.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// Which target a [`PlironCompiler`] would compile for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// Host CPU.
    #[default]
    Cpu,
    /// NVIDIA PTX.
    Nvptx,
}

/// Options the LLVM backend would read; accepted and ignored.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// AMD GPU architecture; `cubecl-cuda` always leaves it `None`.
    pub arch: Option<String>,
    /// NVIDIA architecture.
    #[cfg(feature = "nvptx")]
    pub sm_arch: Option<cubecl_core::ir::nvidia::SmArch>,
    /// PTX version to emit.
    #[cfg(feature = "nvptx")]
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Pass scalars and static metadata in the kernel parameter block.
    pub grid_constants: bool,
}

/// A compiled PTX module, as the LLVM backend would produce it.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// IR for logging and cache keys.
    pub ir: String,
    /// Shared memory required per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What a compilation produces. No value of it is ever constructed by this shim.
#[derive(Clone, Debug)]
// The real crate has other artifacts, and cubecl-cuda's match has an arm for them: without
// `non_exhaustive` that arm is unreachable here, a warning in a workspace that denies them.
#[non_exhaustive]
pub enum PlironArtifact {
    /// PTX for the CUDA driver.
    NvptxCode(NvptxModule),
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
        }
    }
}

/// The LLVM compiler's place in `cubecl-cuda`'s backend enum. Compiling always fails.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The target it was configured for.
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    /// # Errors
    ///
    /// Always [`CompilationError::Generic`]: this offline build contains no LLVM. Enable
    /// `cubecl-cuda/cpp` so that the CUDA runtime compiles with NVRTC instead.
    fn compile(
        &mut self,
        kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: format!(
                "kernel `{}`: this build replaces cubecl-llvm with an offline shim and has no \
                 LLVM backend; enable the `cpp` feature of cubecl-cuda (CUDA C++ via NVRTC)",
                kernel.settings.kernel_name
            ),
            backtrace: BackTrace::capture(),
        })
    }

    fn buffer_io(repr: &Self::Representation) -> Option<Vec<BufferIOAttr>> {
        match repr {
            PlironArtifact::NvptxCode(module) => Some(module.io.clone()),
        }
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}

//! Matrix products through cuBLASLt on cubecl's own CUDA stream, so that they run in order with
//! cubecl's kernels and are recorded into the same CUDA graphs.
//!
//! Why: at the bench's shapes cubecl's tuned matmuls take about four times cuBLAS's in `bf16`
//! (BENCHMARKS.md, "Where the time goes"), and `burn_graphed::nn::Linear` is where a model's
//! products are. How: the carried cubecl-cuda patch (`vendor/README.md`) hands out, with a
//! buffer's device address, the stream whose pool holds it; a buffer made on the calling
//! thread's stream names the stream its kernels run on. Every address is taken through
//! `Client::get_resource`, which the server answers only after it has enqueued every launch
//! submitted before, and the next launch is submitted only after `cublasLtMatmul` has
//! returned: the product sits between them on the stream, eagerly and inside a capture.
//!
//! Arithmetic: `f32` products in `f32` (`CUBLAS_COMPUTE_32F`) where TF32 is turned off
//! (`burn_graphed::allow_tf32(false)`), else with operands rounded to TF32 on tensor cores
//! (`CUBLAS_COMPUTE_32F_FAST_TF32`), as cubecl's own products and PyTorch's `allow_tf32`;
//! `f16` and `bf16` products with `f32` accumulation (a split of `k` too: the pick allows only
//! the reduction that adds the parts in `f32`) and a residual read as the product's `C` (`beta =
//! 1`), rounded once at the store; the bias added in the epilogue, a ReLU where asked
//! (`RELU_BIAS` or `RELU`). cuBLASLt does not say in which precision its epilogue adds the
//! bias, and some of its kernels add it to the product already rounded to the dtype (`bf16` at
//! `[9]x16 -> 12`, `tests/scenarios/fused_linear.rs`: one rounding more, as PyTorch's
//! `addmm` through the same epilogue).
//!
//! Each stream gets a cuBLASLt handle and a workspace at its first product; the first product is
//! always eager (every capture of this library follows eager warm-ups), because allocating
//! inside a capture would end it. `BURN_GRAPHED_VENDOR_MATMUL=off` turns the path off (burn's
//! matmuls instead), for comparisons.

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::Device;
use burn_cubecl::tensor::CubeTensor;

/// Products run through cuBLASLt in this process (read by `burn_graphed::testing`).
static GEMMS: AtomicUsize = AtomicUsize::new(0);

/// Products run through cuBLASLt so far in this process.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn gemms() -> usize {
    GEMMS.load(Ordering::Relaxed)
}

/// Why a product did not run through cuBLASLt; the caller computes it with burn's matmul.
#[derive(Debug, thiserror::Error)]
// Without CUDA only `Unsupported` is made.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(in crate::cube) enum VendorError {
    /// The operands are outside what this path takes (dtype, rank, an empty inner dimension).
    #[error("not taken by cuBLASLt here: {0}")]
    Unsupported(String),
    /// cubecl refused an address (a buffer a failed launch never wrote, another device).
    #[error("cubecl did not hand out a buffer: {0}")]
    Server(String),
    /// The driver or the library failed.
    #[error("cuBLASLt: {0}")]
    Library(String),
}

/// Whether products on `device` run through cuBLASLt: a CUDA device of cubecl, `libcublasLt`
/// found, and the path not turned off.
pub(crate) fn available(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(cubecl::Device::Cuda(_))
        ) && lt::enabled()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// `op(a) op(b) (+ bias) (+ residual)`, through a ReLU where `relu` says, into a new dense
/// `[m, n]` tensor, `op` transposing where `ta` / `tb` say; `a`, `b`, `bias` (`[n]`) and
/// `residual` (`[m, n]`) of one dtype (`f32`,
/// `f16`, `bf16`), `a` and `b` in any 2-D layout (row-major with padded rows, or a transposed
/// view, is read in place; other layouts are copied first), the bias and the residual made
/// dense first where they are not.
pub(in crate::cube) fn gemm(
    a: &CubeTensor,
    b: &CubeTensor,
    bias: Option<&CubeTensor>,
    residual: Option<&CubeTensor>,
    (ta, tb): (bool, bool),
    relu: bool,
) -> Result<CubeTensor, VendorError> {
    #[cfg(feature = "cuda")]
    {
        let out = lt::gemm(a, b, bias, residual, (ta, tb), relu)?;
        GEMMS.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b, bias, residual, ta, tb, relu);
        Err(VendorError::Unsupported("built without CUDA".into()))
    }
}

#[cfg(feature = "cuda")]
mod lt {
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::{Mutex, OnceLock};

    use burn::tensor::{DType, Shape};
    use burn_cubecl::tensor::CubeTensor;
    use cudarc::cublaslt::result as lt;
    use cudarc::cublaslt::sys;
    use cudarc::driver::sys::CUstream;

    use super::super::super::cuda_stream::{CudaServer, make_current};
    use super::super::super::dense::Dense;
    use super::VendorError;

    /// The workspace each stream's products may use (PyTorch's default on Hopper).
    const WORKSPACE_BYTES: usize = 32 << 20;

    /// Whether the path is on: `BURN_GRAPHED_VENDOR_MATMUL` is not `off` and `libcublasLt`
    /// loads. Asked once per process.
    pub(in crate::cube) fn enabled() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            let off = std::env::var("BURN_GRAPHED_VENDOR_MATMUL").is_ok_and(|v| v == "off");
            // SAFETY: `is_culib_present` only tries to open the library by its names.
            !off && unsafe { sys::is_culib_present() }
        })
    }

    /// A stream's handle and workspace, made at its first product, kept for the process (a
    /// stream of cubecl lives as long as its device's server).
    struct StreamState {
        handle: sys::cublasLtHandle_t,
        workspace: u64,
        algos: HashMap<Key, sys::cublasLtMatmulAlgo_t>,
    }

    // SAFETY: the handle and the workspace address are used only under `STATES`' lock, one
    // call at a time; cuBLASLt handles may move between threads.
    unsafe impl Send for StreamState {}

    /// Every stream's state, by the stream's address.
    static STATES: Mutex<Option<HashMap<usize, StreamState>>> = Mutex::new(None);

    /// What the heuristic's pick depends on.
    #[derive(Clone, Copy, PartialEq, Eq, Hash)]
    struct Key {
        dtype: u32,
        ops: (i32, i32),
        dims: (u64, u64, u64),
        lds: (i64, i64),
        /// The alignments of cuBLASLt's A, B, D and C (C's is 0 without a residual).
        align: (u32, u32, u32, u32),
        bias: bool,
        /// Whether the epilogue ends in a ReLU.
        relu: bool,
        /// Whether `f32` operands may round to TF32 (`CUBLAS_COMPUTE_32F_FAST_TF32`).
        tf32: bool,
    }

    /// A 2-D operand as cuBLASLt reads it: column-major `rows x cols` with leading dimension `ld`.
    struct Operand {
        tensor: CubeTensor,
        rows: u64,
        cols: u64,
        ld: i64,
        /// Whether the stored matrix must be transposed to be the operand cuBLASLt needs.
        transpose: bool,
    }

    /// The column-major view of `tensor` (logical `[t0, t1]`) and whether cuBLASLt must transpose
    /// it so that it reads `op(tensor)ᵀ`: a row-major matrix is its transpose read
    /// column-major, so `op(T)ᵀ` is the stored matrix as it is exactly when `op` transposes
    /// and the storage is column-major, or neither.
    fn operand(tensor: &CubeTensor, op_transposes: bool) -> Operand {
        let [t0, t1] = tensor.meta.shape().dims::<2>();
        let strides = tensor.meta.strides();
        let (s0, s1) = (strides[0], strides[1]);
        let untiled = !tensor.meta.is_tiled();
        let (tensor, col_major, ld) = if untiled && s1 == 1 && (s0 >= t1 || t0 == 1) {
            (tensor.clone(), false, s0.max(t1).max(1))
        } else if untiled && s0 == 1 && (s1 >= t0 || t1 == 1) && t0 > 1 {
            (tensor.clone(), true, s1.max(t0).max(1))
        } else {
            (Dense::of(tensor).into_tensor(), false, t1.max(1))
        };
        let (rows, cols) = if col_major { (t0, t1) } else { (t1, t0) };
        Operand {
            tensor,
            rows: rows as u64,
            cols: cols as u64,
            ld: ld as i64,
            transpose: op_transposes != col_major,
        }
    }

    fn data_type(dtype: DType) -> Option<sys::cudaDataType> {
        match dtype {
            DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
            DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
            DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
            _ => None,
        }
    }

    /// The largest power of two dividing `address`, at most 16 bytes: the widest access a
    /// cuBLASLt kernel needs. Capped so that every buffer cubecl places (at least 16-byte
    /// aligned) gets the same pick, and a replay the eager call's product.
    fn alignment(address: u64) -> u32 {
        1 << address.trailing_zeros().min(4)
    }

    fn library(what: &str, error: impl std::fmt::Display) -> VendorError {
        VendorError::Library(format!("{what}: {error}"))
    }

    pub(in crate::cube) fn gemm(
        a: &CubeTensor,
        b: &CubeTensor,
        bias: Option<&CubeTensor>,
        residual: Option<&CubeTensor>,
        (ta, tb): (bool, bool),
        relu: bool,
    ) -> Result<CubeTensor, VendorError> {
        let dtype = a.dtype;
        let Some(cuda_type) = data_type(dtype) else {
            return Err(VendorError::Unsupported(format!("dtype {dtype:?}")));
        };
        if b.dtype != dtype
            || bias.is_some_and(|bias| bias.dtype != dtype)
            || residual.is_some_and(|residual| residual.dtype != dtype)
        {
            return Err(VendorError::Unsupported("mixed dtypes".into()));
        }
        if a.meta.shape().num_dims() != 2 || b.meta.shape().num_dims() != 2 {
            return Err(VendorError::Unsupported(
                "operands of rank other than 2".into(),
            ));
        }
        let [a0, a1] = a.meta.shape().dims::<2>();
        let [b0, b1] = b.meta.shape().dims::<2>();
        let (m, k) = if ta { (a1, a0) } else { (a0, a1) };
        let (k2, n) = if tb { (b1, b0) } else { (b0, b1) };
        if k != k2 || k == 0 || m == 0 || n == 0 {
            return Err(VendorError::Unsupported(format!(
                "a product of [{m}, {k}] and [{k2}, {n}]"
            )));
        }
        if bias.is_some_and(|bias| bias.meta.shape().dims::<1>() != [n]) {
            return Err(VendorError::Unsupported("a bias of another length".into()));
        }
        if residual.is_some_and(|residual| {
            residual.meta.shape().num_dims() != 2 || residual.meta.shape().dims::<2>() != [m, n]
        }) {
            return Err(VendorError::Unsupported(
                "a residual of another shape".into(),
            ));
        }
        // cuBLASLt computes column-major `D = op(A) op(B)`; the row-major `C = op(a) op(b)` is
        // the column-major `Cᵀ = op(b)ᵀ op(a)ᵀ`: cuBLASLt's A is `b`, its B is `a`.
        let lhs = operand(b, tb);
        let rhs = operand(a, ta);
        let bias = bias.map(|bias| Dense::of(bias).into_tensor());
        // Read as `C`, laid out as the output (dense row-major `[m, n]`).
        let residual = residual.map(|residual| Dense::of(residual).into_tensor());
        let out = Dense::new_empty(
            a.client.clone(),
            a.device.clone(),
            Shape::new([m, n]),
            dtype,
        )
        .into_tensor();

        let resource = |tensor: &CubeTensor| {
            tensor
                .client
                .get_resource::<CudaServer>(tensor.handle.clone())
                .map_err(|e| VendorError::Server(e.to_string()))
        };
        // The output first: made on this thread's stream, it names the stream to enqueue on.
        let out_res = resource(&out)?;
        let lhs_res = resource(&lhs.tensor)?;
        let rhs_res = resource(&rhs.tensor)?;
        let bias_res = bias.as_ref().map(resource).transpose()?;
        let residual_res = residual.as_ref().map(resource).transpose()?;
        let stream: CUstream = out_res.resource().stream;
        if stream.is_null() {
            return Err(VendorError::Server("the buffer names no stream".into()));
        }
        let (d_ptr, a_ptr, b_ptr) = (
            out_res.resource().ptr,
            lhs_res.resource().ptr,
            rhs_res.resource().ptr,
        );
        let bias_ptr = bias_res.as_ref().map(|r| r.resource().ptr);
        let c_ptr = residual_res.as_ref().map(|r| r.resource().ptr);

        // SAFETY: `stream` is a live stream of cubecl's server: its pool holds `out`, which we
        // hold. The library's calls then run in the context the stream belongs to.
        unsafe { make_current(stream) }.map_err(|(call, e)| library(call, e))?;

        let mut states = crate::sync::lock(&STATES);
        let states = states.get_or_insert_with(HashMap::new);
        let state = match states.entry(stream as usize) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                let handle = lt::create_handle().map_err(|e| library("cublasLtCreate", e))?;
                // SAFETY: the context is current (above); the allocation is kept for the
                // process, as the stream it serves.
                let workspace = unsafe { cudarc::driver::result::malloc_sync(WORKSPACE_BYTES) }
                    .map_err(|e| library("cuMemAlloc (workspace)", e))?;
                entry.insert(StreamState {
                    handle,
                    workspace,
                    algos: HashMap::new(),
                })
            }
        };

        let op = |transpose: bool| -> i32 { i32::from(transpose) };
        let key = Key {
            dtype: cuda_type as u32,
            ops: (op(lhs.transpose), op(rhs.transpose)),
            dims: (n as u64, m as u64, k as u64),
            lds: (lhs.ld, rhs.ld),
            align: (
                alignment(a_ptr),
                alignment(b_ptr),
                alignment(d_ptr),
                c_ptr.map_or(0, alignment),
            ),
            bias: bias_ptr.is_some(),
            relu,
            // Fixed for the process once a CUDA device exists (`allow_tf32` refuses a change).
            tf32: dtype == DType::F32 && super::super::super::tf32::allowed(),
        };
        let descriptors = Descriptors::new(&key, &lhs, &rhs, cuda_type, bias_ptr)?;
        let algo = match state.algos.get(&key) {
            Some(algo) => *algo,
            None => {
                let algo = descriptors.pick(state.handle, &key)?;
                state.algos.insert(key, algo);
                algo
            }
        };
        // With a residual, `D = A B + 1 * C` (C the residual, D's layout); without, `beta = 0`
        // and C is D, never read.
        let (alpha, beta) = (1.0f32, if c_ptr.is_some() { 1.0f32 } else { 0.0 });
        let c_ptr = c_ptr.unwrap_or(d_ptr);
        // SAFETY: the descriptors describe the buffers behind the addresses (shapes and leading
        // dimensions from their metadata, which the resources we hold keep in place until the
        // call has enqueued); `out` is a new allocation of `m * n` elements that nothing else
        // reads or writes before this product; the residual (C) is a dense `[m, n]` buffer of
        // the dtype (checked above), D's layout, and not `out`; the workspace is this stream's,
        // used by one product at a time in stream order; alpha and beta are read on the host at
        // the call.
        unsafe {
            lt::matmul(
                state.handle,
                descriptors.matmul,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a_ptr as *const c_void,
                descriptors.a,
                b_ptr as *const c_void,
                descriptors.b,
                c_ptr as *const c_void,
                descriptors.d,
                d_ptr as *mut c_void,
                descriptors.d,
                &algo,
                state.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as sys::cudaStream_t,
            )
            .map_err(|e| library("cublasLtMatmul", e))?;
        }
        drop((lhs_res, rhs_res, bias_res, residual_res, out_res));
        Ok(out)
    }

    /// The descriptors of one product, destroyed on drop.
    struct Descriptors {
        matmul: sys::cublasLtMatmulDesc_t,
        a: sys::cublasLtMatrixLayout_t,
        b: sys::cublasLtMatrixLayout_t,
        d: sys::cublasLtMatrixLayout_t,
    }

    impl Descriptors {
        fn new(
            key: &Key,
            lhs: &Operand,
            rhs: &Operand,
            cuda_type: sys::cudaDataType,
            bias: Option<u64>,
        ) -> Result<Self, VendorError> {
            let (n, m, _) = key.dims;
            let compute = if key.tf32 {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            };
            let matmul = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
                .map_err(|e| library("cublasLtMatmulDescCreate", e))?;
            let mut made = Self {
                matmul,
                a: std::ptr::null_mut(),
                b: std::ptr::null_mut(),
                d: std::ptr::null_mut(),
            };
            let layout = |o: &Operand| {
                lt::create_matrix_layout(cuda_type, o.rows, o.cols, o.ld)
                    .map_err(|e| library("cublasLtMatrixLayoutCreate", e))
            };
            made.a = layout(lhs)?;
            made.b = layout(rhs)?;
            made.d = lt::create_matrix_layout(cuda_type, n, m, n as i64)
                .map_err(|e| library("cublasLtMatrixLayoutCreate", e))?;
            let set = |attr: sys::cublasLtMatmulDescAttributes_t, buf: *const c_void, size| {
                // SAFETY: `matmul` is alive (destroyed only on drop); `buf` points to `size`
                // bytes of the attribute's type, read during the call.
                unsafe { lt::set_matmul_desc_attribute(matmul, attr, buf, size) }
                    .map_err(|e| library("cublasLtMatmulDescSetAttribute", e))
            };
            use sys::cublasLtMatmulDescAttributes_t as Attr;
            set(
                Attr::CUBLASLT_MATMUL_DESC_TRANSA,
                (&key.ops.0 as *const i32).cast(),
                4,
            )?;
            set(
                Attr::CUBLASLT_MATMUL_DESC_TRANSB,
                (&key.ops.1 as *const i32).cast(),
                4,
            )?;
            use sys::cublasLtEpilogue_t as Epilogue;
            let epilogue = match (bias.is_some(), key.relu) {
                (true, true) => Some(Epilogue::CUBLASLT_EPILOGUE_RELU_BIAS),
                (true, false) => Some(Epilogue::CUBLASLT_EPILOGUE_BIAS),
                (false, true) => Some(Epilogue::CUBLASLT_EPILOGUE_RELU),
                (false, false) => None,
            };
            if let Some(epilogue) = epilogue {
                set(
                    Attr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&epilogue as *const Epilogue).cast(),
                    std::mem::size_of::<Epilogue>(),
                )?;
            }
            if let Some(bias) = bias {
                set(
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&bias as *const u64).cast(),
                    8,
                )?;
            }
            Ok(made)
        }

        /// The heuristic's first pick for this product, within the workspace and for the
        /// operands' alignments.
        fn pick(
            &self,
            handle: sys::cublasLtHandle_t,
            key: &Key,
        ) -> Result<sys::cublasLtMatmulAlgo_t, VendorError> {
            let pref = lt::create_matmul_pref().map_err(|e| library("preference", e))?;
            use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
            let workspace = WORKSPACE_BYTES as u64;
            // Without a residual C is D.
            let c_align = if key.align.3 == 0 {
                key.align.2
            } else {
                key.align.3
            };
            // In `f16` and `bf16` a split of `k` may only be summed in `f32`: the in-place and
            // output-type schemes add the parts in the output's dtype (a rounding per part,
            // outside the contract above). In `f32` every scheme sums in `f32`.
            use sys::cublasLtReductionScheme_t as Scheme;
            let f32_sums = Scheme::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
            let half = key.dtype != sys::cudaDataType::CUDA_R_32F as u32;
            let reductions = if half {
                f32_sums
            } else {
                Scheme::CUBLASLT_REDUCTION_SCHEME_MASK
            };
            let reductions = reductions as u32;
            let prefs = [
                (
                    Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    (&reductions as *const u32).cast::<c_void>(),
                    4,
                ),
                (
                    Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&workspace as *const u64).cast::<c_void>(),
                    8,
                ),
                (
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    (&key.align.0 as *const u32).cast(),
                    4,
                ),
                (
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    (&key.align.1 as *const u32).cast(),
                    4,
                ),
                (
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    (&c_align as *const u32).cast(),
                    4,
                ),
                (
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    (&key.align.2 as *const u32).cast(),
                    4,
                ),
            ];
            let mut result = Ok(());
            for (attr, buf, size) in prefs {
                // SAFETY: `pref` is alive; `buf` points to `size` bytes of the attribute's type.
                result = result.and_then(|()| {
                    unsafe { lt::set_matmul_pref_attribute(pref, attr, buf, size) }
                        .map_err(|e| library("preference", e))
                });
            }
            // SAFETY: every descriptor is alive (`self`), `pref` too until destroyed below.
            let picked = result.and_then(|()| {
                unsafe {
                    lt::get_matmul_algo_heuristic(
                        handle,
                        self.matmul,
                        self.a,
                        self.b,
                        self.d,
                        self.d,
                        pref,
                    )
                }
                .map_err(|e| library("cublasLtMatmulAlgoGetHeuristic", e))
            });
            // SAFETY: made above, destroyed once.
            let _ = unsafe { lt::destroy_matmul_pref(pref) };
            let algo = picked?.algo;
            let (splits, scheme) = (
                algo_config(&algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)?,
                algo_config(&algo, Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)?,
            );
            if half && splits > 1 && scheme != f32_sums as u32 {
                return Err(VendorError::Unsupported(format!(
                    "cuBLASLt picked {splits} parts of k summed by scheme {scheme}, not in f32"
                )));
            }
            Ok(algo)
        }
    }

    use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;

    /// One `u32` attribute of a picked algorithm's configuration.
    fn algo_config(algo: &sys::cublasLtMatmulAlgo_t, attr: Config) -> Result<u32, VendorError> {
        let mut value = 0u32;
        let mut written = 0usize;
        // SAFETY: `algo` is a configuration the heuristic filled in; `value` is the 4 bytes of
        // the attribute's type (`uint32_t` for the split count and the reduction scheme).
        unsafe {
            let buf = (&mut value as *mut u32).cast();
            sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, buf, 4, &mut written)
        }
        .result()
        .map_err(|e| library("cublasLtMatmulAlgoConfigGetAttribute", e))?;
        Ok(value)
    }

    impl Drop for Descriptors {
        fn drop(&mut self) {
            // SAFETY: each was made by `new` (null where `new` stopped early: skipped) and is
            // destroyed once, here.
            unsafe {
                for layout in [self.a, self.b, self.d] {
                    if !layout.is_null() {
                        let _ = lt::destroy_matrix_layout(layout);
                    }
                }
                let _ = lt::destroy_matmul_desc(self.matmul);
            }
        }
    }
}

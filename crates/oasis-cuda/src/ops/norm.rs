//! The decoder's elementwise launches (`rms_norm`, `qk_norm_rope`, `silu_mul`) and the stream
//! timer `wait_stamp`.

use oasis_core::kernels::mlp::silu_mul_rows;

use super::*;
use crate::params::WaitEpochParams;

/// Threads per `silu_mul_*` block. Arbitrary.
pub const SILU_MUL_THREADS: u32 = 256;
/// Most `silu_mul_*` blocks; larger calls stride. Arbitrary (a few waves of an H100's SMs).
pub const SILU_MUL_MAX_BLOCKS: usize = 4096;

impl Gpu {
    /// GPU twin of `oasis_core::kernels::rms_norm`: HF RMSNorm of `n` rows of `hidden =
    /// weight.len()` elements (`x` holds them `x_stride` apart: a row-strided view whose slice
    /// ends with the last row), with the optional fused residual add. Bit-identical to the twin
    /// (the block's size is `rms_norm_threads(hidden)`, which fixes the order of the sum). One
    /// block per row.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape, an empty weight,
    /// a row stride below `hidden`, or a residual output that overlaps the residual without
    /// being the same buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm<T: KvElem>(
        &self,
        x: DevSlice<T>, // [n, x_stride] rows of hidden elements
        x_stride: usize,
        weight: DevSlice<T>, // [hidden]
        eps: f32,
        residual: Option<ResidualDev<T>>,
        out: DevSlice<T>, // [n, hidden]
        stream: Stream,
    ) -> Result<()> {
        guard("rms_norm", || {
            let hidden = weight.len();
            if hidden == 0 {
                return Err(OasisError::Config(
                    "rms_norm needs a non-empty weight (hidden > 0)".into(),
                )
                .into());
            }
            let n = rows("out", out.len(), &[hidden])?;
            check_rows("x", x.len(), n, x_stride, hidden)?;
            let (res, res_out) = match residual {
                Some(ResidualDev {
                    residual,
                    residual_out,
                }) => {
                    check_len("residual", residual.len(), &[n, hidden])?;
                    check_len("residual_out", residual_out.len(), &[n, hidden])?;
                    let bytes = (n * hidden * std::mem::size_of::<T>()) as u64;
                    let (a, b) = (residual.ptr(), residual_out.ptr());
                    if a != b && a < b + bytes && b < a + bytes {
                        return Err(OasisError::Invalid(
                            "residual_out overlaps residual without being the same buffer".into(),
                        )
                        .into());
                    }
                    (residual.into(), residual_out.into())
                }
                None => (DevPtr::NULL, DevPtr::NULL),
            };
            let name = entry!(T, "rms_norm");
            let x_stride = i64::try_from(x_stride)
                .map_err(|_| CudaError::Unsupported("x_stride does not fit i64".into()))?;
            let params = params!(RmsNormParams {
                ptr: { x, weight, residual = res, residual_out = res_out, out },
                int: { hidden },
                raw: { x_stride, eps },
            });
            let grid = grid_x("n", n)?;
            let threads = rms_norm_threads(hidden) as u32;
            // SAFETY: every buffer has the length its shape needs (checked above: x spans n rows
            // x_stride apart); by DevSlice's contract they are reachable and alive until the
            // stream runs the kernel and outputs overlap no other argument, except residual_out,
            // which may be residual itself (checked: identical or disjoint), which the kernel
            // handles (each element read before the same thread writes it); the stream by
            // Stream's contract.
            unsafe { self.queue(name, grid, threads, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::silu_mul`, bit for bit: `out [n, inter] = silu(gate) *
    /// up` over the rows of `gu [n, 2 * inter]` (gate columns first). A grid-stride loop of
    /// [`SILU_MUL_THREADS`]-thread blocks, at most [`SILU_MUL_MAX_BLOCKS`]; nothing is queued for
    /// `n = 0`.
    ///
    /// # Errors
    /// As `oasis_core::kernels::mlp::silu_mul_rows`, the one check of both: `inter == 0`, an
    /// `out` that is not whole rows of `inter` or a `gu` that is not `[n, 2 * inter]`.
    pub fn silu_mul<T: KvElem>(
        &self,
        gu: DevSlice<T>, // [n, 2 * inter]
        inter: usize,
        out: DevSlice<T>, // [n, inter]
        stream: Stream,
    ) -> Result<()> {
        guard("silu_mul", || {
            let n = silu_mul_rows(gu.len(), inter, out.len())?;
            if n == 0 {
                return Ok(());
            }
            let name = entry!(T, "silu_mul");
            let total = n * inter;
            let blocks = total
                .div_ceil(SILU_MUL_THREADS as usize)
                .min(SILU_MUL_MAX_BLOCKS);
            let n_rows = i64::try_from(n)
                .map_err(|_| CudaError::Unsupported("n does not fit i64".into()))?;
            let params = params!(SiluMulParams {
                ptr: { gu, out },
                int: { inter },
                raw: { n = n_rows, _pad0 = 0 },
            });
            let grid = grid_x("silu_mul blocks", blocks)?;
            // SAFETY: gu holds n rows of 2 * inter elements and out n rows of inter (checked
            // above); by DevSlice's contract both are reachable and alive until the stream runs
            // the kernel and out overlaps no argument; the stream by Stream's contract.
            unsafe { self.queue(name, grid, SILU_MUL_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::wait_stamp`: one thread stamps the device's global
    /// nanosecond timer into `stamps` (`[start, total waited, waits]`, u64) when the stream
    /// reaches it. Queued just before and just after a wait on background work, the pair times it.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] unless `stamps` has 3 elements.
    pub fn wait_stamp(
        &self,
        stamps: DevSlice<u64>,
        stamp: WaitStamp,
        stream: Stream,
    ) -> Result<()> {
        guard("wait_stamp", || {
            check_len("stamps", stamps.len(), &[3])?;
            let params = params!(WaitStampParams {
                ptr: { stamps },
                raw: { mode = stamp.mode(), _pad0 = 0 },
            });
            // SAFETY: stamps holds the 3 u64 the kernel reads and writes (checked above), reachable
            // and alive until the stream runs it by DevSlice's contract; the stream by Stream's.
            unsafe { self.queue("wait_stamp", (1, 1, 1), 32, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::wait_epoch`: one thread holds `stream` until the u64
    /// at `landed` (host memory mapped into the device's address space) reaches `epoch[0]`, or
    /// gives up after `timeout_ns` (then `stats[0] += 1`, `stats[1] = epoch[0]`); `stats[2]` adds
    /// the nanoseconds it held the stream, `stats[3]` counts the waits.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] unless `epoch` has 1 element, `stats` 4, `landed` is non-null
    /// and 8-aligned and `timeout_ns` positive.
    ///
    /// # Safety
    /// `landed` is the device address of a u64 that stays allocated (and mapped) until the
    /// stream has run the kernel.
    pub unsafe fn wait_epoch(
        &self,
        landed: u64,
        epoch: DevSlice<i64>,
        stats: DevSlice<u64>,
        timeout_ns: i64,
        stream: Stream,
    ) -> Result<()> {
        guard("wait_epoch", || {
            check_len("epoch", epoch.len(), &[1])?;
            check_len("stats", stats.len(), &[4])?;
            if landed == 0 || !landed.is_multiple_of(8) || timeout_ns <= 0 {
                return Err(CudaError::Invalid(OasisError::Invalid(format!(
                    "wait_epoch needs a non-null, 8-aligned landed word and a positive timeout, \
                     got {landed:#x} and {timeout_ns} ns"
                ))));
            }
            let params = WaitEpochParams {
                landed: DevPtr(landed),
                epoch: DevPtr::from(epoch),
                stats: DevPtr::from(stats),
                timeout_ns,
            };
            // SAFETY: epoch and stats hold the 1 and 4 elements the kernel reads and writes
            // (checked above), alive until the stream runs it by DevSlice's contract; landed by
            // this function's; the stream by Stream's.
            unsafe { self.queue("wait_epoch", (1, 1, 1), 32, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::qk_norm_rope`: from the fused QKV projection (`n =
    /// positions.len()` rows of `layout.width()` elements, `qkv_stride` apart), write `q_out`,
    /// `k_out` (optionally RMS-normalised per head with `norm = (q_weight, k_weight)`, then
    /// rotate-half RoPE at `positions`, read on the device) and `v_out` (a copy). Bit-identical to
    /// the twin, including its `kv_groups` row order of `k_out` / `v_out`. One block of
    /// [`QK_ROPE_WARPS`] warps per row and group of heads.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a layout the twin rejects or a buffer whose size does not match
    /// its shape; [`CudaError::Unsupported`] for a head_dim whose shared memory does not fit.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope<T: KvElem>(
        &self,
        layout: &HeadLayout,
        qkv: DevSlice<T>, // [n, qkv_stride] rows of (num_heads + 2 num_kv_heads) head_dim
        qkv_stride: usize,
        positions: PositionsDev,                  // [n]
        inv_freq: DevSlice<f32>,                  // [head_dim / 2]
        rope_scale: f32,                          // cos and sin times this (YaRN; else 1)
        norm: Option<(DevSlice<T>, DevSlice<T>)>, // q_norm, k_norm [head_dim]
        eps: f32,
        q_out: DevSlice<T>, // [n, num_heads, head_dim]
        k_out: DevSlice<T>, // [n, num_kv_heads, head_dim]
        v_out: DevSlice<T>, // [n, num_kv_heads, head_dim]
        kv_groups: usize,
        stream: Stream,
    ) -> Result<()> {
        guard("qk_norm_rope", || {
            layout.validate()?;
            let HeadLayout {
                num_heads: hq,
                num_kv_heads: hkv,
                head_dim: d,
            } = *layout;
            let n = positions.len();
            check_rows("qkv", qkv.len(), n, qkv_stride, layout.width())?;
            check_len("inv_freq", inv_freq.len(), &[d / 2])?;
            if let Some((qw, kw)) = norm {
                check_len("q_norm", qw.len(), &[d])?;
                check_len("k_norm", kw.len(), &[d])?;
            }
            check_len("q_out", q_out.len(), &[n, hq, d])?;
            check_len("k_out", k_out.len(), &[n, hkv, d])?;
            check_len("v_out", v_out.len(), &[n, hkv, d])?;
            check_kv_groups(n, kv_groups)?;

            let (p64, p32) = match positions {
                PositionsDev::I64(p) => (p.into(), DevPtr::NULL),
                PositionsDev::I32(p) => (DevPtr::NULL, p.into()),
            };
            let name = entry!(T, "qk_norm_rope");
            let qkv_stride = i64::try_from(qkv_stride)
                .map_err(|_| CudaError::Unsupported("qkv_stride does not fit i64".into()))?;
            let params = params!(QkNormRopeParams {
                ptr: {
                    qkv, positions_i64 = p64, positions_i32 = p32, inv_freq,
                    q_norm = norm.map(|(q, _)| q), k_norm = norm.map(|(_, k)| k), q_out, k_out,
                    v_out,
                },
                int: { num_heads = hq, num_kv_heads = hkv, head_dim = d, kv_groups },
                raw: { qkv_stride, eps, num_rows = int("n", n)?, rope_scale, _pad0 = 0 },
            });
            let heads = hq + 2 * hkv; // fits i32: HeadLayout::validate
            let grid = (
                grid_dim("n", n, GRID_X_MAX)?,
                grid_dim(
                    "head groups",
                    heads.div_ceil(QK_ROPE_WARPS as usize),
                    GRID_YZ_MAX,
                )?,
                1,
            );
            let smem = qk_norm_rope_smem_bytes(d);
            // SAFETY: every buffer has the length its shape needs (checked above); exactly one
            // positions pointer is set, and the norm weights are both set or both null, as the
            // kernel expects; reachability, lifetime and disjoint outputs by DevSlice's contract;
            // the stream by Stream's contract.
            unsafe { self.queue(name, grid, QK_ROPE_WARPS * 32, smem, stream, &params) }
        })
    }
}

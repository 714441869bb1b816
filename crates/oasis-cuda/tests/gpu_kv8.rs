//! The kv8 (FP8 E4M3) kernels on a GPU against their CPU twins in `oasis_core::kernels`: bytes
//! equal (codes, scales, dequantized `T`) for quantize / append / gather / copy, attention within
//! the bf16 attention tolerance of tests/support/reference.py (`ATTN_TOL`: 1.6e-2 / 1.6e-2).
//!
//! oasis-cuda has no GPU harness of its own (its launches are otherwise tested from Python), so
//! each test here makes the device's primary context current itself and returns early, passing,
//! with a message on stderr, when there is no driver or no device: `cargo test` on a machine
//! without a GPU runs nothing here. The host pool is pinned, mapped memory read by the kernels
//! through UVA, as in the engine.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use half::{bf16, f16};
use oasis_core::kernels::{
    append_kv_tiers, copy_pages_tiers, decode_attention_kv8, gather_blocks_tiers, quantize_kv8,
    ExtraKv, Kv8Pages, Kv8PagesMut, KvTier, KvTierMut, PagedKv8,
};
use oasis_core::{KvElem, KvGeometry};
use oasis_cuda::ops::{set_gather_launch, GatherLaunch};
use oasis_cuda::{
    driver_available, DevSlice, ExtraKvDev, Gpu, Kv8PagesDev, KvTierDev, PagedKv8Dev, SplitKv,
    Stream,
};

const BLOCK_SIZES: [usize; 3] = [8, 16, 32];
const HEAD_DIMS: [usize; 3] = [64, 96, 128];
/// The append's head dims: 256 with blocks of 32 requantizes more codes than one chunk of the
/// kernel's batched loads (OASIS_REQUANT_UNROLL words per thread).
const APPEND_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];
/// tests/support/reference.py ATTN_TOL[bfloat16]
const BF16_ATTN_TOL: (f64, f64) = (1.6e-2, 1.6e-2);

fn ok(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// The GPU with device 0's primary context current on this thread, or None (no driver/device).
fn gpu() -> Option<Arc<Gpu>> {
    if let Err(e) = driver_available() {
        eprintln!("skipped: no CUDA driver ({e})");
        return None;
    }
    // SAFETY: out-pointers valid for writes; the primary context is retained for the process.
    unsafe {
        let mut dev = 0;
        if sys::cuDeviceGet(&mut dev, 0) != CUresult::CUDA_SUCCESS {
            eprintln!("skipped: no CUDA device");
            return None;
        }
        let mut ctx = std::ptr::null_mut();
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        ok(sys::cuCtxSetCurrent(ctx), "set current");
    }
    Some(Gpu::attach(None).expect("attach"))
}

/// A device (or pinned, mapped host) buffer holding a copy of some host data.
struct Buf<T> {
    ptr: u64,
    len: usize,
    pinned: bool,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Buf<T> {
    fn new(data: &[T], pinned: bool) -> Self {
        let bytes = std::mem::size_of_val(data).max(16);
        let mut ptr = 0u64;
        // SAFETY: allocations of `bytes`, then a copy of `data` into them.
        unsafe {
            if pinned {
                let mut p = std::ptr::null_mut();
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                ok(sys::cuMemHostAlloc(&mut p, bytes, flags), "cuMemHostAlloc");
                std::ptr::copy_nonoverlapping(data.as_ptr(), p.cast::<T>(), data.len());
                ptr = p as u64; // UVA: the device sees it at the same address
            } else {
                ok(sys::cuMemAlloc_v2(&mut ptr, bytes), "cuMemAlloc");
                let n = std::mem::size_of_val(data);
                ok(sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), n), "HtoD");
            }
        }
        Buf {
            ptr,
            len: data.len(),
            pinned,
            _t: std::marker::PhantomData,
        }
    }

    fn s(&self) -> DevSlice<T> {
        // SAFETY: a live allocation of `len` T (the test keeps it until after the read-back).
        unsafe { DevSlice::from_raw(self.ptr, self.len) }
    }

    /// The contents, after every queued launch has run.
    fn read(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len);
        // SAFETY: synchronise, then copy `len` T out of the allocation.
        unsafe {
            ok(sys::cuCtxSynchronize(), "synchronize");
            if self.pinned {
                std::ptr::copy_nonoverlapping(self.ptr as *const T, out.as_mut_ptr(), self.len);
            } else {
                let n = self.len * std::mem::size_of::<T>();
                ok(
                    sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr, n),
                    "DtoH",
                );
            }
            out.set_len(self.len);
        }
        out
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated above; every launch reading it was synchronised by read() (a test
        // that panics before may leak or free early: it has failed already).
        unsafe {
            if self.pinned {
                sys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void);
            } else {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

fn dev<T: Copy>(d: &[T]) -> Buf<T> {
    Buf::new(d, false)
}
fn pinned<T: Copy>(d: &[T]) -> Buf<T> {
    Buf::new(d, true)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Random values of magnitude `scale`, with a NaN, +inf and -inf planted when `specials`.
fn values<T: KvElem>(rng: &mut Rng, n: usize, scale: f32, specials: bool) -> Vec<T> {
    let mut v: Vec<T> = (0..n).map(|_| T::from_f32(rng.unit() * scale)).collect();
    if specials && n >= 3 {
        for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let i = rng.below(n);
            v[i] = T::from_f32(x);
        }
    }
    v
}

/// Random kv8 codes (NaN codes included) and power-of-two scales.
fn kv8_pool(rng: &mut Rng, elems: usize, entries: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>) {
    let codes = |rng: &mut Rng| (0..elems).map(|_| rng.next() as u8).collect::<Vec<u8>>();
    let scales = |rng: &mut Rng| {
        (0..entries)
            .map(|_| 2f32.powi(rng.below(40) as i32 - 20))
            .collect::<Vec<f32>>()
    };
    (codes(rng), codes(rng), scales(rng), scales(rng))
}

fn bits<T: KvElem>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

#[test]
fn quantize_kv8_matches_the_twin() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for bs in BLOCK_SIZES {
        for d in HEAD_DIMS {
            let geo = KvGeometry::new(4, 2, d, bs).unwrap();
            let n = 6;
            let e = geo.page_elems();
            let mut src = Vec::new();
            for b in 0..n {
                let scale = [1e-3f32, 0.5, 3.0, 200.0, 3e4, 1e-30][b];
                src.extend(values::<bf16>(&mut rng, e, scale, b == 2));
            }
            let valid: Vec<i32> = (0..n)
                .map(|b| {
                    if b == 0 {
                        bs as i32
                    } else {
                        1 + rng.below(bs) as i32
                    }
                })
                .collect();
            let (mut codes, mut scales) = (vec![0xa5u8; n * e], vec![0f32; n * 2]);
            quantize_kv8(&geo, &src, &valid, &mut codes, &mut scales).unwrap();
            let (s, v) = (dev(&src), dev(&valid));
            let (c, sc) = (dev(&vec![0x5au8; n * e]), dev(&vec![0f32; n * 2]));
            g.quantize_kv8(&geo, s.s(), v.s(), c.s(), sc.s(), Stream::legacy_default())
                .unwrap();
            assert_eq!(c.read(), codes, "codes bs={bs} d={d}");
            assert_eq!(bits(&sc.read()), bits(&scales), "scales bs={bs} d={d}");
        }
    }
}

/// Two tiers' buffers on the device (GPU pages) or pinned (host pool), T or kv8.
enum Pool<T> {
    Elem(Vec<T>, Vec<T>),
    Kv8(Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>),
}

impl<T: KvElem> Pool<T> {
    fn new(kv8: bool, pages: usize, geo: &KvGeometry) -> Self {
        let e = pages * geo.page_elems();
        if kv8 {
            Pool::Kv8(
                vec![0; e],
                vec![0; e],
                vec![0.0; pages * geo.num_kv_heads],
                vec![0.0; pages * geo.num_kv_heads],
            )
        } else {
            Pool::Elem(vec![T::from_f32(0.0); e], vec![T::from_f32(0.0); e])
        }
    }
    fn tier(&self) -> KvTier<'_, T> {
        match self {
            Pool::Elem(k, v) => KvTier::Elem { k, v },
            Pool::Kv8(k, v, ks, vs) => KvTier::Kv8(Kv8Pages {
                k_codes: k,
                v_codes: v,
                k_scales: ks,
                v_scales: vs,
            }),
        }
    }
    fn tier_mut(&mut self) -> KvTierMut<'_, T> {
        match self {
            Pool::Elem(k, v) => KvTierMut::Elem { k, v },
            Pool::Kv8(k, v, ks, vs) => KvTierMut::Kv8(Kv8PagesMut {
                k_codes: k,
                v_codes: v,
                k_scales: ks,
                v_scales: vs,
            }),
        }
    }
    /// A copy on the device (or pinned).
    fn upload(&self, pin: bool) -> DevPool<T> {
        match self {
            Pool::Elem(k, v) => DevPool::Elem(Buf::new(k, pin), Buf::new(v, pin)),
            Pool::Kv8(k, v, ks, vs) => DevPool::Kv8(
                Buf::new(k, pin),
                Buf::new(v, pin),
                Buf::new(ks, pin),
                Buf::new(vs, pin),
            ),
        }
    }
}

enum DevPool<T> {
    Elem(Buf<T>, Buf<T>),
    Kv8(Buf<u8>, Buf<u8>, Buf<f32>, Buf<f32>),
}

impl<T: KvElem> DevPool<T> {
    fn tier(&self) -> KvTierDev<T> {
        match self {
            DevPool::Elem(k, v) => KvTierDev::Elem { k: k.s(), v: v.s() },
            DevPool::Kv8(k, v, ks, vs) => KvTierDev::Kv8(Kv8PagesDev {
                k_codes: k.s(),
                v_codes: v.s(),
                k_scales: ks.s(),
                v_scales: vs.s(),
            }),
        }
    }
    /// Byte-equal to the twin's pool (T compared by their f32 bits: NaNs too).
    fn assert_eq(&self, want: &Pool<T>, what: &str) {
        match (self, want) {
            (DevPool::Elem(k, v), Pool::Elem(wk, wv)) => {
                assert_eq!(bits(&k.read()), bits(wk), "{what}: k");
                assert_eq!(bits(&v.read()), bits(wv), "{what}: v");
            }
            (DevPool::Kv8(k, v, ks, vs), Pool::Kv8(wk, wv, wks, wvs)) => {
                assert_eq!(&k.read(), wk, "{what}: k codes");
                assert_eq!(&v.read(), wv, "{what}: v codes");
                assert_eq!(bits(&ks.read()), bits(wks), "{what}: k scales");
                assert_eq!(bits(&vs.read()), bits(wvs), "{what}: v scales");
            }
            _ => unreachable!(),
        }
    }
}

/// Sequential appends through whole blocks and past them, row magnitudes growing mid-block (the
/// kv8 scale grows and requantizes the rows before), NaN / inf rows, dense and sparse sequences:
/// every tier combination with a kv8 tier, pools compared after every step.
#[test]
fn append_kv_tiers_matches_the_twin() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for (gpu_kv8, host_kv8) in [(true, true), (false, true), (true, false)] {
        for bs in BLOCK_SIZES {
            for d in APPEND_HEAD_DIMS {
                let geo = KvGeometry::new(4, 2, d, bs).unwrap();
                let (h, seqs) = (2usize, 3usize);
                let (num_pages, num_host) = (4usize, 3usize);
                let mut gp = Pool::<bf16>::new(gpu_kv8, num_pages, &geo);
                let mut hp = Pool::<bf16>::new(host_kv8, num_host, &geo);
                let mut sums = vec![bf16::from_f32(0.0); num_host * h * 2 * d];
                let dgp = gp.upload(false);
                let dhp = hp.upload(true);
                let dsums = pinned(&sums);
                // seq 0: page 1, host block 2; seq 1: dense, page 3; seq 2: page 0, host block 0.
                let page_ids = [1, 3, 0];
                let host_ids = [2, -1, 0];
                for step in 0..bs + 3 {
                    let off = (step % bs) as i32;
                    let grow = 2f32.powi((step as i32) - (bs as i32) / 2);
                    let k: Vec<bf16> = values(&mut rng, seqs * h * d, grow, step == 3);
                    let v: Vec<bf16> = values(&mut rng, seqs * h * d, grow * 0.5, step == 5);
                    let offs = [off; 3];
                    append_kv_tiers(
                        &geo,
                        &k,
                        &v,
                        &page_ids,
                        &offs,
                        &host_ids,
                        None,
                        gp.tier_mut(),
                        hp.tier_mut(),
                        &mut sums,
                    )
                    .unwrap();
                    let (dk, dv, dp, doff, dh) =
                        (dev(&k), dev(&v), dev(&page_ids), dev(&offs), dev(&host_ids));
                    g.append_kv_tiers(
                        &geo,
                        dk.s(),
                        dv.s(),
                        dp.s(),
                        doff.s(),
                        dh.s(),
                        None,
                        dgp.tier(),
                        dhp.tier(),
                        dsums.s(),
                        Stream::legacy_default(),
                    )
                    .unwrap();
                    let what =
                        format!("gpu kv8 {gpu_kv8} host kv8 {host_kv8} bs={bs} d={d} step {step}");
                    dgp.assert_eq(&gp, &format!("{what}: gpu pages"));
                    dhp.assert_eq(&hp, &format!("{what}: host pool"));
                    assert_eq!(bits(&dsums.read()), bits(&sums), "{what}: summaries");
                }
            }
        }
    }
}

/// The gather launches [`gather_blocks_tiers_matches_the_twin`] runs, with whether the pool is in
/// device memory: the default (kv8: 12 entries staged per warp), the register paths (stage 0),
/// one entry staged per warp of a three-entry pass (batches across passes, two blocks), a stage
/// of 32 lowered to what fits the shared memory, and the pool on the device (DEVICE_SOURCE, the
/// register paths whatever is set).
fn gather_launches() -> [(GatherLaunch, bool); 5] {
    let d = GatherLaunch::DEFAULT;
    [
        (d, false),
        (
            GatherLaunch {
                stage_entries: 0,
                ..d
            },
            false,
        ),
        (
            GatherLaunch {
                max_blocks: 2,
                warps_per_block: 1,
                entries_per_warp: 3,
                stage_entries: 1,
            },
            false,
        ),
        (
            GatherLaunch {
                stage_entries: 32,
                ..d
            },
            false,
        ),
        (d, true),
    ]
}

/// Gather a random plan (negative slots, every sequence's blocks) kv8 -> kv8, kv8 -> T and
/// T -> kv8, over random codes (NaN codes included) and scales, under each of
/// [`gather_launches`] (staged and register paths, pool pinned or on the device).
#[test]
fn gather_blocks_tiers_matches_the_twin() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for (host_kv8, gpu_kv8) in [(true, true), (true, false), (false, true)] {
        for bs in BLOCK_SIZES {
            for d in HEAD_DIMS {
                let geo = KvGeometry::new(8, 2, d, bs).unwrap();
                let (h, seqs, cap, budget) = (2usize, 3usize, 4usize, 5usize);
                let (num_host, num_pages) = (7usize, 16usize);
                let host: Pool<bf16> = if host_kv8 {
                    let (k, v, ks, vs) =
                        kv8_pool(&mut rng, num_host * geo.page_elems(), num_host * h);
                    Pool::Kv8(k, v, ks, vs)
                } else {
                    let n = num_host * geo.page_elems();
                    Pool::Elem(
                        values(&mut rng, n, 3.0, true),
                        values(&mut rng, n, 0.1, true),
                    )
                };
                let mut pages: Pool<bf16> = Pool::new(gpu_kv8, num_pages, &geo);
                let host_indptr = [0, 3, 3, 7];
                let host_indices: Vec<i32> = (0..7).map(|_| rng.below(num_host) as i32).collect();
                let slot_pages: Vec<i32> = (0..(seqs * budget) as i32).collect();
                let mut slots = vec![-1i32; seqs * h * cap];
                let mut blocks = vec![0i32; seqs * h * cap];
                for s in 0..seqs {
                    let nb = (host_indptr[s + 1] - host_indptr[s]) as usize;
                    for hh in 0..h {
                        for i in 0..cap.min(nb) {
                            let at = (s * h + hh) * cap + i;
                            slots[at] = i as i32; // distinct slots per (seq, head)
                            blocks[at] = rng.below(nb) as i32;
                        }
                    }
                }
                gather_blocks_tiers(
                    &geo,
                    &slots,
                    &blocks,
                    cap,
                    &slot_pages,
                    budget,
                    &host_indptr,
                    &host_indices,
                    &host.tier(),
                    pages.tier_mut(),
                )
                .unwrap();
                let (a, b, c, ip, ix) = (
                    dev(&slots),
                    dev(&blocks),
                    dev(&slot_pages),
                    dev(&host_indptr),
                    dev(&host_indices),
                );
                for (launch, device_source) in gather_launches() {
                    set_gather_launch(launch).unwrap();
                    let dhost = host.upload(!device_source);
                    let dpages = Pool::<bf16>::new(gpu_kv8, num_pages, &geo).upload(false);
                    g.gather_blocks_tiers(
                        &geo,
                        a.s(),
                        b.s(),
                        cap,
                        c.s(),
                        budget,
                        ip.s(),
                        ix.s(),
                        dhost.tier(),
                        dpages.tier(),
                        device_source,
                        Stream::legacy_default(),
                    )
                    .unwrap();
                    dpages.assert_eq(
                        &pages,
                        &format!(
                            "gather host kv8 {host_kv8} gpu kv8 {gpu_kv8} bs={bs} d={d} \
                             {launch:?} device_source {device_source}"
                        ),
                    );
                }
                set_gather_launch(GatherLaunch::DEFAULT).unwrap();
            }
        }
    }
}

/// Whole-page copies: T -> kv8 over partial pages (`valid`), kv8 -> kv8, kv8 -> T (f16 too:
/// its NaN bits follow the twin's).
#[test]
fn copy_pages_tiers_matches_the_twin() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0x0bad_cafe_1234_5678);
    for (src_kv8, dst_kv8) in [(false, true), (true, true), (true, false)] {
        for bs in BLOCK_SIZES {
            for d in HEAD_DIMS {
                let geo = KvGeometry::new(4, 2, d, bs).unwrap();
                let (h, num_src, num_dst) = (2usize, 5usize, 6usize);
                let src: Pool<f16> = if src_kv8 {
                    let (k, v, ks, vs) =
                        kv8_pool(&mut rng, num_src * geo.page_elems(), num_src * h);
                    Pool::Kv8(k, v, ks, vs)
                } else {
                    let n = num_src * geo.page_elems();
                    Pool::Elem(
                        values(&mut rng, n, 30.0, true),
                        values(&mut rng, n, 0.01, false),
                    )
                };
                let mut dst: Pool<f16> = Pool::new(dst_kv8, num_dst, &geo);
                let src_ids = [4, 0, 2, 1];
                let dst_ids = [5, 1, 0, 3];
                let valid: Vec<i32> = (0..4).map(|_| 1 + rng.below(bs) as i32).collect();
                let dsrc = src.upload(false);
                let ddst = dst.upload(true);
                copy_pages_tiers(
                    &geo,
                    &src.tier(),
                    &src_ids,
                    dst.tier_mut(),
                    &dst_ids,
                    Some(&valid),
                )
                .unwrap();
                let (si, di, va) = (dev(&src_ids), dev(&dst_ids), dev(&valid));
                g.copy_pages_tiers(
                    &geo,
                    dsrc.tier(),
                    si.s(),
                    ddst.tier(),
                    di.s(),
                    Some(va.s()),
                    Stream::legacy_default(),
                )
                .unwrap();
                ddst.assert_eq(
                    &dst,
                    &format!("copy src kv8 {src_kv8} dst kv8 {dst_kv8} bs={bs} d={d}"),
                );
            }
        }
    }
}

/// decode_attention_kv8 (tensor-core bf16 for d 64/128 with group * rows <= 16, the generic
/// kernel otherwise; split-KV too) against the twin, over GQA groups 1-8, page_map holes and a
/// lookahead row with its extra K/V.
#[test]
fn decode_attention_kv8_matches_the_twin() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(0x5151_7272_9393_b4b4);
    for bs in BLOCK_SIZES {
        for d in HEAD_DIMS {
            for group in [1usize, 2, 4, 8] {
                for (num_rows, splits) in [(1usize, 1usize), (2, 1), (1, 3), (2, 3)] {
                    let h = 2usize;
                    let geo = KvGeometry::new(h * group, h, d, bs).unwrap();
                    let num_pages = 24usize;
                    let mut codes_k = vec![0u8; num_pages * geo.page_elems()];
                    let mut codes_v = codes_k.clone();
                    let mut ks = vec![0f32; num_pages * h];
                    let mut vs = ks.clone();
                    // Realistic pages: quantized from random K/V (no NaN: a NaN output has no tolerance).
                    let all = vec![bs as i32; num_pages];
                    let kf: Vec<bf16> = values(&mut rng, codes_k.len(), 2.0, false);
                    let vf: Vec<bf16> = values(&mut rng, codes_v.len(), 1.0, false);
                    quantize_kv8(&geo, &kf, &all, &mut codes_k, &mut ks).unwrap();
                    quantize_kv8(&geo, &vf, &all, &mut codes_v, &mut vs).unwrap();
                    let kv_indptr = [0, 9, 10, 17];
                    let kv_indices: Vec<i32> =
                        (0..17).map(|i| ((i * 7) % num_pages) as i32).collect();
                    let last = [bs as i32, 1, 1 + rng.below(bs) as i32];
                    let page_map: Vec<i32> = (0..num_pages * h)
                        .map(|i| if i % 5 == 3 { -1 } else { i as i32 })
                        .collect();
                    let seqs = 3usize;
                    let q: Vec<bf16> =
                        values(&mut rng, seqs * num_rows * h * group * d, 1.0, false);
                    let xk: Vec<bf16> = values(&mut rng, seqs * h * d, 2.0, false);
                    let xv: Vec<bf16> = values(&mut rng, seqs * h * d, 1.0, false);
                    let sm_scale = 1.0 / (d as f32).sqrt();
                    let pages = Kv8Pages {
                        k_codes: &codes_k,
                        v_codes: &codes_v,
                        k_scales: &ks,
                        v_scales: &vs,
                    };
                    let kv = PagedKv8 {
                        pages,
                        kv_indptr: &kv_indptr,
                        kv_indices: &kv_indices,
                        kv_last_page_len: &last,
                        page_map: Some(&page_map),
                    };
                    let extra = (num_rows >= 2).then_some(ExtraKv { k: &xk, v: &xv });
                    let mut want = vec![bf16::from_f32(0.0); q.len()];
                    decode_attention_kv8(
                        &geo,
                        &q,
                        num_rows,
                        &kv,
                        extra.as_ref(),
                        sm_scale,
                        &mut want,
                    )
                    .unwrap();

                    let (dck, dcv, dks, dvs) = (dev(&codes_k), dev(&codes_v), dev(&ks), dev(&vs));
                    let (dip, dix, dl, dpm) = (
                        dev(&kv_indptr),
                        dev(&kv_indices),
                        dev(&last),
                        dev(&page_map),
                    );
                    let (dq, dxk, dxv) = (dev(&q), dev(&xk), dev(&xv));
                    let out = dev(&vec![bf16::from_f32(0.0); q.len()]);
                    let ws = dev(&vec![
                        0f32;
                        oasis_cuda::ops::decode_attn_workspace_len(
                            seqs,
                            num_rows,
                            h * group,
                            d,
                            splits
                        )
                    ]);
                    let dkv = PagedKv8Dev {
                        pages: Kv8PagesDev {
                            k_codes: dck.s(),
                            v_codes: dcv.s(),
                            k_scales: dks.s(),
                            v_scales: dvs.s(),
                        },
                        kv_indptr: dip.s(),
                        kv_indices: dix.s(),
                        kv_last_page_len: dl.s(),
                        page_map: Some(dpm.s()),
                    };
                    let dextra = (num_rows >= 2).then_some(ExtraKvDev {
                        k: dxk.s(),
                        v: dxv.s(),
                    });
                    let split = (splits > 1).then_some(SplitKv {
                        num_splits: splits,
                        workspace: ws.s(),
                    });
                    g.decode_attention_kv8(
                        &geo,
                        dq.s(),
                        num_rows,
                        &dkv,
                        dextra.as_ref(),
                        sm_scale,
                        out.s(),
                        split.as_ref(),
                        Stream::legacy_default(),
                    )
                    .unwrap();
                    let got = out.read();
                    let (atol, rtol) = BF16_ATTN_TOL;
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let (a, b) = (a.to_f32() as f64, b.to_f32() as f64);
                        assert!(
                            (a - b).abs() <= atol + rtol * b.abs(),
                            "bs={bs} d={d} group={group} rows={num_rows} splits={splits} [{i}]: gpu {a}, twin {b}"
                        );
                    }
                }
            }
        }
    }
}

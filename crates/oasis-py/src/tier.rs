//! One KV tier argument of the page bindings (the GPU pages, or the host pool): `T` pages, or
//! kv8 pages (`oasis_core::kernels::kv8`: uint8 E4M3 codes and an f32 power-of-two scale per
//! (page, KV head), K and V apart). The pages' dtype says which: uint8 pages need both scale
//! tensors, float pages take none. Shapes: pages `[n, num_kv_heads, block_size, head_dim]`,
//! scales `[n, num_kv_heads]` float32.

use oasis_core::kernels::{Kv8Pages, Kv8PagesMut, KvTier, KvTierMut};
use oasis_core::KvGeometry;
use oasis_cuda::{Kv8PagesDev, KvTierDev};
use pyo3::prelude::*;

use crate::check::check_all;
use crate::errors::py_err;
use crate::tensor::{Cx, Elem, TensorArg, ANY};

/// The names the GPU pages' tensors go by in messages.
pub(crate) const GPU_TIER: [&str; 4] = ["k_pages", "v_pages", "k_scales", "v_scales"];

/// A tier's tensors and the names they go by in messages (`[k, v, k_scales, v_scales]`).
pub(crate) struct Tier<'a> {
    pub k: &'a TensorArg,
    pub v: &'a TensorArg,
    scales: Option<(&'a TensorArg, &'a TensorArg)>,
    names: [&'static str; 4],
}

impl<'a> Tier<'a> {
    /// The tier of pages `k`, `v` with the optional scales; refuses uint8 pages without both
    /// scales and scales beside float pages.
    pub fn new(
        py: Python<'_>,
        names: [&'static str; 4],
        k: &'a TensorArg,
        v: &'a TensorArg,
        k_scales: Option<&'a TensorArg>,
        v_scales: Option<&'a TensorArg>,
    ) -> PyResult<Self> {
        let [kn, _, ksn, vsn] = names;
        let kv8 = k.dtype == "uint8";
        let scales = match (kv8, k_scales, v_scales) {
            (true, Some(ks), Some(vs)) => Some((ks, vs)),
            (true, _, _) => {
                return Err(py_err(
                    py,
                    "ConfigError",
                    format!(
                        "{kn} is uint8 (fp8_e4m3 KV): pass its scales too, {ksn}= and {vsn}= \
                         ([pages, num_kv_heads] float32)"
                    ),
                ))
            }
            (false, None, None) => None,
            (false, _, _) => {
                return Err(py_err(
                    py,
                    "ConfigError",
                    format!(
                        "{ksn}/{vsn} go with uint8 (fp8_e4m3) pages, but {kn} is {}; pass no \
                         scales, or the tier's pages as uint8 codes",
                        k.dtype
                    ),
                ))
            }
        };
        Ok(Self {
            k,
            v,
            scales,
            names,
        })
    }

    pub fn is_kv8(&self) -> bool {
        self.scales.is_some()
    }

    /// Every tensor of the tier, named.
    pub fn named(&self) -> Vec<(&'static str, &'a TensorArg)> {
        let mut all = vec![(self.names[0], self.k), (self.names[1], self.v)];
        if let Some((ks, vs)) = self.scales {
            all.extend([(self.names[2], ks), (self.names[3], vs)]);
        }
        all
    }

    /// The tier's float pages (whose dtype is the call's KV dtype); none for kv8.
    pub fn float_pages(&self) -> Vec<(&'static str, &'a TensorArg)> {
        if self.is_kv8() {
            Vec::new()
        } else {
            vec![(self.names[0], self.k), (self.names[1], self.v)]
        }
    }

    /// Check the shapes (and the codes' and scales' dtypes) under `cx`; returns the pages.
    pub fn rows(&self, cx: &Cx<'_>, g: &KvGeometry) -> PyResult<usize> {
        let page = [ANY, g.num_kv_heads, g.block_size, g.head_dim];
        let pages = [(self.names[0], self.k), (self.names[1], self.v)];
        let elem = if self.is_kv8() { Elem::U8 } else { Elem::Any };
        let [n, ..] = check_all(cx, &pages, elem, page)?;
        if let Some((ks, vs)) = self.scales {
            let scales = [(self.names[2], ks), (self.names[3], vs)];
            check_all(cx, &scales, Elem::F32, [n, g.num_kv_heads])?;
        }
        Ok(n)
    }

    /// The tier's CPU buffers to read.
    ///
    /// # Safety
    /// The tensors were checked ([`Self::rows`]) to be contiguous CPU tensors of these element
    /// types, and stay alive and unwritten by others for the call.
    pub unsafe fn read<T>(&self) -> KvTier<'a, T> {
        match self.scales {
            None => KvTier::Elem {
                k: self.k.slice::<T>(),
                v: self.v.slice::<T>(),
            },
            Some((ks, vs)) => KvTier::Kv8(Kv8Pages {
                k_codes: self.k.slice::<u8>(),
                v_codes: self.v.slice::<u8>(),
                k_scales: ks.slice::<f32>(),
                v_scales: vs.slice::<f32>(),
            }),
        }
    }

    /// The tier's CPU buffers to write.
    ///
    /// # Safety
    /// As [`Self::read`], and the tier's tensors were checked disjoint from each other and from
    /// every other argument of the call.
    pub unsafe fn write<T>(&self) -> KvTierMut<'a, T> {
        match self.scales {
            None => KvTierMut::Elem {
                k: self.k.slice_mut::<T>(),
                v: self.v.slice_mut::<T>(),
            },
            Some((ks, vs)) => KvTierMut::Kv8(Kv8PagesMut {
                k_codes: self.k.slice_mut::<u8>(),
                v_codes: self.v.slice_mut::<u8>(),
                k_scales: ks.slice_mut::<f32>(),
                v_scales: vs.slice_mut::<f32>(),
            }),
        }
    }
}

impl Tier<'_> {
    /// The tier's device buffers (pinned host memory through unified addressing, or device
    /// memory).
    ///
    /// # Safety
    /// As [`TensorArg::dev`]: the tensors were checked ([`Self::rows`]) for a CUDA call.
    pub unsafe fn dev<T>(&self) -> KvTierDev<T> {
        match self.scales {
            None => KvTierDev::Elem {
                k: self.k.dev::<T>(),
                v: self.v.dev::<T>(),
            },
            Some((ks, vs)) => KvTierDev::Kv8(Kv8PagesDev {
                k_codes: self.k.dev::<u8>(),
                v_codes: self.v.dev::<u8>(),
                k_scales: ks.dev::<f32>(),
                v_scales: vs.dev::<f32>(),
            }),
        }
    }
}

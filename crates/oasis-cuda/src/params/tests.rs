//! Layout checks of the parameter structs (the Rust side; tests/params_layout.rs the C side).

use super::*;

/// The Rust side alone, for the 64-bit targets the kernels run beside: sizes by hand from
/// the field lists (8 per pointer / i64, 4 per i32 / f32), alignment 8.
#[cfg(target_pointer_width = "64")]
#[test]
fn sizes_on_64_bit_targets() {
    use std::mem::{align_of, size_of};
    assert_eq!(size_of::<DevPtr>(), 8);
    assert_eq!(size_of::<AppendKvParams>(), 11 * 8 + 6 * 4);
    assert_eq!(size_of::<BuildSummariesParams>(), 5 * 8 + 6 * 4);
    assert_eq!(size_of::<DecodeAttnParams>(), 12 * 8 + 10 * 4);
    assert_eq!(size_of::<MergeAttnStatesParams>(), 3 * 8 + 2 * 4);
    assert_eq!(size_of::<ScoreBlocksParams>(), 5 * 8 + 6 * 4);
    assert_eq!(size_of::<BuildKeyCodesParams>(), 6 * 8 + 6 * 4);
    assert_eq!(size_of::<EncodeBlocksParams>(), 7 * 8 + 6 * 4);
    assert_eq!(size_of::<ScoreBlocksBound8Params>(), 6 * 8 + 6 * 4);
    assert_eq!(size_of::<BuildBounds8Params>(), 4 * 8 + 4 * 4);
    assert_eq!(size_of::<ScoreBlocksCodesParams>(), 8 * 8 + 10 * 4);
    assert_eq!(size_of::<TopkBlocksParams>(), 5 * 8 + 6 * 4);
    assert_eq!(size_of::<ForceScoresParams>(), 3 * 8 + 4 * 4);
    assert_eq!(size_of::<TopkCandidatesParams>(), 5 * 8 + 6 * 4);
    assert_eq!(size_of::<RescoreTopkCodesParams>(), 11 * 8 + 12 * 4);
    assert_eq!(size_of::<DeltaSelectParams>(), 8 * 8 + 8 * 4);
    assert_eq!(size_of::<GatherBlocksParams>(), 9 * 8 + 12 * 4);
    assert_eq!(size_of::<CopyPagesParams>(), 7 * 8 + 2 * 4);
    assert_eq!(size_of::<RmsNormParams>(), 6 * 8 + 2 * 4);
    assert_eq!(size_of::<SiluMulParams>(), 3 * 8 + 2 * 4);
    assert_eq!(size_of::<QkNormRopeParams>(), 10 * 8 + 8 * 4);
    assert_eq!(size_of::<WaitStampParams>(), 8 + 2 * 4);
    assert_eq!(size_of::<WaitEpochParams>(), 4 * 8);
    assert_eq!(size_of::<AppendKvTiersParams>(), 15 * 8 + 6 * 4);
    assert_eq!(size_of::<GatherBlocksTiersParams>(), 13 * 8 + 12 * 4);
    assert_eq!(size_of::<CopyPagesTiersParams>(), 11 * 8 + 6 * 4);
    assert_eq!(size_of::<QuantizeKv8Params>(), 4 * 8 + 4 * 4);
    assert_eq!(size_of::<DecodeAttnKv8Params>(), 14 * 8 + 10 * 4);
    assert_eq!(align_of::<DecodeAttnParams>(), 8);
    assert_eq!(std::mem::offset_of!(DecodeAttnParams, sm_scale), 132);
    assert_eq!(std::mem::offset_of!(CopyPagesParams, page_elems), 48);
    for l in ALL {
        assert_eq!(l.align, 8, "{}", l.name);
        assert_eq!(l.size % 8, 0, "{}", l.name);
        // CUDA's limit for kernel parameters is 4 KiB; stay far below it.
        assert!(l.size <= 256, "{}: {} bytes", l.name, l.size);
    }
}

/// No implicit padding anywhere: the fields tile the struct exactly, in declaration order,
/// each at an offset aligned to its size, and the layout rules (pointers, then 8-byte, then
/// 4-byte scalars) hold. Every byte a launch copies is then a field's.
#[test]
fn fields_tile_each_struct() {
    for l in ALL {
        let mut at = 0;
        let mut last_size = 8;
        let mut seen_scalar = false;
        for f in l.fields {
            assert_eq!(f.offset, at, "{}.{}: padding before it", l.name, f.name);
            assert_eq!(f.offset % f.size, 0, "{}.{}: misaligned", l.name, f.name);
            let size = match f.kind {
                FieldKind::Ptr | FieldKind::I64 => 8,
                FieldKind::I32 | FieldKind::F32 => 4,
            };
            assert_eq!(f.size, size, "{}.{}", l.name, f.name);
            assert!(
                size <= last_size,
                "{}.{}: 8-byte after 4-byte",
                l.name,
                f.name
            );
            let is_ptr = f.kind == FieldKind::Ptr;
            assert!(
                !(is_ptr && seen_scalar),
                "{}.{}: pointer after a scalar",
                l.name,
                f.name
            );
            seen_scalar |= !is_ptr;
            last_size = size;
            at += f.size;
        }
        assert_eq!(at, l.size, "{}: tail padding", l.name);
        for f in l.fields.iter().filter(|f| f.name.starts_with("_pad")) {
            assert_eq!(f.kind, FieldKind::I32, "{}.{}", l.name, f.name);
        }
    }
}

/// Every registered entry point has exactly one parameter struct, and every struct names
/// only registered entry points.
#[test]
fn every_kernel_has_one_params_struct() {
    for src in crate::kernels::SOURCES {
        for entry in src.entry_points {
            let n = ALL.iter().filter(|l| l.kernels.contains(entry)).count();
            assert_eq!(n, 1, "{entry} is named by {n} parameter structs");
        }
    }
    for l in ALL {
        for k in l.kernels {
            assert!(
                crate::kernels::source_of(k).is_some(),
                "{}: {k} is not registered",
                l.name
            );
        }
    }
}

#[test]
fn c_type_per_entry() {
    let l = &AppendKvParams::LAYOUT;
    assert_eq!(
        l.c_type_for("append_kv_bf16"),
        "oasis::AppendKvParams<oasis::bf16>"
    );
    assert_eq!(
        l.c_type_for("append_kv_f16"),
        "oasis::AppendKvParams<oasis::f16>"
    );
    assert_eq!(
        l.c_type_for("append_kv_f32"),
        "oasis::AppendKvParams<float>"
    );
    assert_eq!(
        DecodeAttnParams::LAYOUT.c_type_for("decode_attn_tc_f16_d128"),
        "oasis::DecodeAttnParams<oasis::f16>"
    );
    assert_eq!(
        TopkBlocksParams::LAYOUT.c_type_for("topk_blocks_f32"),
        "oasis::TopkBlocksParams"
    );
    assert_eq!(
        layout_of("delta_select_warp_i32").map(|l| l.name),
        Some("DeltaSelectParams")
    );
    assert!(layout_of("no_such_kernel").is_none());
}

#[test]
fn dev_ptrs_from_slices() {
    // SAFETY: never dereferenced; only the address is read.
    let s = unsafe { DevSlice::<f32>::from_raw(0x1000, 4) };
    assert_eq!(DevPtr::from(s), DevPtr(0x1000));
    assert_eq!(DevPtr::from(Some(s)), DevPtr(0x1000));
    assert_eq!(DevPtr::from(None::<DevSlice<f32>>), DevPtr::NULL);
}

//! How many bytes a caller's batch stands for.

use arrow_array::{Array, ArrowNativeTypeOp, OffsetSizeTrait, RecordBatch};

/// Bytes of `batch`'s own rows: per column [`range_bytes`] over all its rows, so a slice
/// (`RecordBatch::slice`, or arrays with an offset) counts its rows' share of the buffers, not
/// the parent's whole buffers as `RecordBatch::get_array_memory_size` does (a 1,000-row slice of
/// a 1 M-row batch was budgeted as 139 MiB), a list slice its own child values, and a view
/// column its views and the values they point to (Arrow's `get_slice_memory_size`, used before,
/// counts a list slice's whole child and a view column's views alone: 3.2 MB for 200,000 views
/// of 7.4 MB of values, `write::tests::batch_bytes_counts_a_view_columns_values`).
pub fn batch_bytes(batch: &RecordBatch) -> usize {
    batch.columns().iter().map(|c| range_bytes(&c.to_data(), 0, c.len())).fold(0, usize::saturating_add)
}

/// Arrow bytes of the rows `at..at + len` of `data` (logical rows, after its offset), counted
/// from what those rows use: a byte array's values between their offsets, a view array's views
/// and the values of more than 12 bytes they point to, a list's (or map's) child values between
/// its offsets, a struct's children and a fixed-size list's child rows over the same range, a
/// fixed width times the rows, a validity bitmap at a bit a row. A dictionary counts its keys
/// and its values' bytes a value on average; any other layout its share of the array's bytes.
/// Unlike Arrow's `ArrayData::get_slice_memory_size`, a list's slice does not count its whole
/// child array, and a view array counts its values. Used for [`batch_bytes`] and for the data
/// file writer's steps.
pub(crate) fn range_bytes(data: &arrow_data::ArrayData, at: usize, len: usize) -> usize {
    use arrow_schema::DataType;
    let bitmap = if data.nulls().is_some() { len.div_ceil(8) } else { 0 };
    let values = match data.data_type() {
        DataType::Utf8 | DataType::Binary => byte_array_bytes::<i32>(data, at, len),
        DataType::LargeUtf8 | DataType::LargeBinary => byte_array_bytes::<i64>(data, at, len),
        // A view's low 32 bits are its value's length; a value of at most 12 bytes is inside
        // its view. (For a Parquet page's bound this still counts at least the values' bytes.)
        // When the data buffers are at most three times the views, they are counted whole
        // instead of walking the views (at most 48 bytes a row too many, never too few): the
        // walk, over views far out of the caches, made the bench's flush of lineitem (five
        // view columns of short strings, walked twice a batch) 4% slower, four pairs of four.
        // Buffers larger than that, a slice's or a filtered array's among them, are walked,
        // over the valid views alone: a null view may name any bytes ([`valid_runs`]).
        DataType::Utf8View | DataType::BinaryView => {
            let views = 16 * len;
            let buffers = data.buffers()[1..].iter().map(arrow_buffer::Buffer::len).fold(0, usize::saturating_add);
            if buffers <= 3 * views {
                views.saturating_add(buffers)
            } else {
                let all = data.buffer::<u128>(0);
                let long = |s: usize, e: usize| {
                    all[s..e].iter().fold(0usize, |sum, v| {
                        let n = (*v as u32) as usize;
                        if n > 12 { sum.saturating_add(n) } else { sum }
                    })
                };
                valid_runs(data, at, len, long).saturating_add(views)
            }
        }
        DataType::List(_) | DataType::Map(_, _) => list_bytes::<i32>(data, at, len),
        DataType::LargeList(_) => list_bytes::<i64>(data, at, len),
        DataType::FixedSizeList(_, size) => {
            let size = usize::try_from(*size).unwrap_or(0);
            range_bytes(&data.child_data()[0], (data.offset() + at) * size, len * size)
        }
        DataType::Struct(_) => data.child_data().iter().map(|c| range_bytes(c, at, len)).sum(),
        DataType::Dictionary(key, _) => {
            let dict = &data.child_data()[0];
            let per_value = range_bytes(dict, 0, dict.len()).div_ceil(dict.len().max(1));
            key.primitive_width().unwrap_or(8).saturating_add(per_value).saturating_mul(len)
        }
        DataType::Boolean => len.div_ceil(8),
        t => match t.primitive_width() {
            Some(w) => w.saturating_mul(len),
            None => data.get_slice_memory_size().unwrap_or(0).saturating_mul(len) / data.len().max(1),
        },
    };
    values.saturating_add(bitmap)
}

/// Bytes of values that the null slots of a top-level byte array (`Utf8`, `Binary` and their
/// `Large` forms) span: its offsets' whole span less its valid rows' ([`valid_runs`]); 0 for
/// an array of another type or without nulls. The WAL copies such a column out without them
/// once they reach [`NULL_SPAN_COPY_BYTES`].
pub(crate) fn null_span_bytes(array: &dyn Array) -> usize {
    use arrow_schema::DataType;
    if array.null_count() == 0 {
        return 0;
    }
    let data = array.to_data();
    match data.data_type() {
        DataType::Utf8 | DataType::Binary => offsets_null_span::<i32>(&data),
        DataType::LargeUtf8 | DataType::LargeBinary => offsets_null_span::<i64>(&data),
        _ => 0,
    }
}

/// Bytes from offset `s` to offset `e` of `o`: `o[e] − o[s]`, or 0 when that is negative (an
/// array built without validation; wrapped, then refused by the conversion).
fn offset_span<O: OffsetSizeTrait + ArrowNativeTypeOp>(o: &[O], s: usize, e: usize) -> usize {
    o[e].sub_wrapping(o[s]).to_usize().unwrap_or(0)
}

/// [`range_bytes`] of a byte array with offsets of `O` (`Utf8`/`Binary`: `i32`; their `Large`
/// forms: `i64`): its valid rows' values and an offset a row.
fn byte_array_bytes<O: OffsetSizeTrait + ArrowNativeTypeOp>(data: &arrow_data::ArrayData, at: usize, len: usize) -> usize {
    let o = data.buffer::<O>(0);
    valid_runs(data, at, len, |s, e| offset_span(o, s, e)).saturating_add(size_of::<O>() * len)
}

/// [`range_bytes`] of a list (or map) with offsets of `O`: its valid rows' child values and an
/// offset a row.
fn list_bytes<O: OffsetSizeTrait>(data: &arrow_data::ArrayData, at: usize, len: usize) -> usize {
    let o = data.buffer::<O>(0);
    let child = |s: usize, e: usize| {
        let (from, to) = (o[s].to_usize().unwrap_or(0), o[e].to_usize().unwrap_or(0));
        range_bytes(&data.child_data()[0], from, to.saturating_sub(from))
    };
    valid_runs(data, at, len, child).saturating_add(size_of::<O>() * len)
}

/// [`null_span_bytes`] of a byte array with offsets of `O`: the offsets' whole span less its
/// valid rows'.
fn offsets_null_span<O: OffsetSizeTrait + ArrowNativeTypeOp>(data: &arrow_data::ArrayData) -> usize {
    let o = data.buffer::<O>(0);
    let len = data.len();
    let span = |s: usize, e: usize| offset_span(o, s, e);
    span(0, len).saturating_sub(valid_runs(data, 0, len, span))
}

/// Null-spanned bytes ([`null_span_bytes`]) from which a column is copied out without them
/// before it is logged: below, the copy costs more than the bytes it saves.
pub(crate) const NULL_SPAN_COPY_BYTES: usize = 64 << 10;

/// The sum of `span(s, e)` over the runs `s..e` of valid rows of `data` in `at..at + len`
/// (logical rows), one call for the whole range when `data` has no null. A null's offsets may
/// span values — `arrow::compute::nullif` keeps them, and Arrow's format allows any span for a
/// null slot — which neither a delta's rows nor a data file hold: counted, a 2-row batch
/// whose null spanned 4 MiB was refused at 2 MiB as a write of 8 MiB (helper-45's F8;
/// `bytes::tests::a_nulls_span_of_values_is_not_counted`). A null view naming a long value is
/// the same case for view arrays. The walk is over runs of the validity
/// bitmap, a word at a time.
fn valid_runs(data: &arrow_data::ArrayData, at: usize, len: usize, span: impl Fn(usize, usize) -> usize) -> usize {
    match data.nulls() {
        Some(n) if n.null_count() > 0 => n.inner().slice(at, len).set_slices().map(|(s, e)| span(at + s, at + e)).fold(0, usize::saturating_add),
        _ => span(at, at + len),
    }
}

/// The bytes jemalloc hands out for a request of `n` bytes (its size class): 8, 16, then four
/// classes to each doubling, at least its 16-byte quantum apart (32, 48, 64, 80, 96, 112, 128,
/// 160, 192, …; jemalloc 5's `sz_size2index`). The engine's bookkeeping allocations are small,
/// so their class, not their size, is what a held batch keeps allocated (an `Arc` of 72 bytes
/// takes 80). glibc's malloc rounds such requests to no more than a class above.
pub const fn alloc_size_class(n: usize) -> usize {
    if n <= 8 {
        return 8;
    }
    if n <= 16 {
        return 16;
    }
    let spacing = n.next_power_of_two() / 8;
    let spacing = if spacing < 16 { 16 } else { spacing };
    n.div_ceil(spacing) * spacing
}

/// Bytes of an `Arc`'s header (its strong and weak counts) in front of the value.
const ARC_HEADER_BYTES: usize = 2 * size_of::<usize>();

/// Bytes of Arrow's `Bytes` (private to `arrow-buffer`, which every `Buffer` points at through
/// an `Arc`): a pointer, a length and a `Deallocation`, whose largest variant is `Custom` (an
/// `Arc<dyn Allocation>` and a length). 40 bytes on 64-bit targets (Arrow's `pool` feature,
/// not enabled here, would add a mutex).
const ARROW_BYTES_STRUCT: usize = size_of::<(std::ptr::NonNull<u8>, usize, std::sync::Arc<dyn arrow_buffer::alloc::Allocation>, usize)>();

/// Bytes one buffer of a batch the engine hands out keeps allocated beside its data, for each
/// buffer handle of each array (the engine's `count_batch` reserves this per buffer it
/// re-points): the `Arc<Bytes>` that `Buffer::from_custom_allocation` allocates (40 bytes,
/// 56 with the `Arc` header, allocated as 64). Measured:
/// `process::held_batches_of_a_wide_table_are_counted_as_allocated`.
pub const HELD_BUFFER_BYTES: usize = alloc_size_class(ARC_HEADER_BYTES + ARROW_BYTES_STRUCT);

/// Bytes the owner of one distinct allocation of a batch the engine hands out keeps allocated
/// beside the allocation's data (the engine's `count_batch` reserves this once per
/// allocation, with its capacity): the owner's `Arc` (header, the original `Buffer` and a
/// memctl `Reservation`: 16 + 24 + 32 = 72 bytes, allocated as 80) and the original buffer's
/// own `Arc<Bytes>` that the owner keeps alive (allocated as 64, as [`HELD_BUFFER_BYTES`]).
/// Measured: `process::held_batches_of_a_wide_table_are_counted_as_allocated`.
pub const HELD_ALLOCATION_BYTES: usize = alloc_size_class(ARC_HEADER_BYTES + size_of::<arrow_buffer::Buffer>() + size_of::<gritdb_memctl::Reservation>())
    + alloc_size_class(ARC_HEADER_BYTES + ARROW_BYTES_STRUCT);

/// Bytes one array of a batch the engine hands out keeps allocated beside its buffers, with
/// `array_struct` the size of its array struct (`size_of_val` of the `dyn Array`: 96 bytes for
/// a `PrimitiveArray`, 120 for a `StringArray`): the `Arc` that holds the struct, and its
/// `ArrayRef` (a fat pointer, 16 bytes) in the batch's column vector. The engine's
/// `count_batch` reserves this per column, with [`HELD_BUFFER_BYTES`] for each of its buffers.
pub const fn held_array_bytes(array_struct: usize) -> usize {
    size_of::<arrow_array::ArrayRef>() + alloc_size_class(ARC_HEADER_BYTES + array_struct)
}

/// The largest array struct of the types a table may hold (a byte array's: its type, offsets,
/// values and validity; a view array's: its type, views, data buffers and validity), in bytes:
/// what a reader estimates a decoded column's array costs before it knows which it is.
pub const MAX_ARRAY_STRUCT_BYTES: usize = {
    let byte = size_of::<arrow_array::StringArray>();
    let view = size_of::<arrow_array::StringViewArray>();
    let large = size_of::<arrow_array::LargeStringArray>();
    let m = if byte > view { byte } else { view };
    if m > large { m } else { large }
};

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, BooleanArray, Int32Array, LargeStringArray, ListArray, StringArray};
    use std::sync::Arc;

    /// Row 0 made null by `nullif`, its 4,000,000-byte value still between its offsets.
    fn nulled(a: &dyn Array) -> ArrayRef {
        arrow_select::nullif::nullif(a, &BooleanArray::from(vec![true, false])).unwrap()
    }

    fn batch(a: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter([("c", a)]).unwrap()
    }

    #[test]
    fn a_nulls_span_of_values_is_not_counted() {
        let long = "x".repeat(4_000_000);
        // Two offsets of 4 bytes, a bitmap byte, "hello".
        let s = nulled(&StringArray::from(vec![long.as_str(), "hello"]));
        assert!(batch(Arc::clone(&s)).get_array_memory_size() > 4_000_000);
        assert_eq!(batch_bytes(&batch(Arc::clone(&s))), 2 * 4 + 1 + 5);
        assert_eq!(null_span_bytes(s.as_ref()), 4_000_000);
        // Slices: the null alone, the value alone.
        assert_eq!(batch_bytes(&batch(s.slice(0, 1))), 4 + 1);
        // (A slice without nulls has no bitmap in its `ArrayData`.)
        assert_eq!(batch_bytes(&batch(s.slice(1, 1))), 4 + 5);
        assert_eq!(null_span_bytes(s.slice(1, 1).as_ref()), 0);
        let l = nulled(&LargeStringArray::from(vec![long.as_str(), "hello"]));
        assert_eq!(batch_bytes(&batch(Arc::clone(&l))), 2 * 8 + 1 + 5);
        assert_eq!(null_span_bytes(l.as_ref()), 4_000_000);
        // A null list over 1,000,000 child values; the valid list holds two.
        let child = Int32Array::from_iter_values(0..1_000_002);
        let offsets = arrow_buffer::OffsetBuffer::new(vec![0, 1_000_000, 1_000_002].into());
        let field = Arc::new(arrow_schema::Field::new("item", arrow_schema::DataType::Int32, false));
        let list = nulled(&ListArray::new(field, offsets, Arc::new(child), None));
        assert_eq!(batch_bytes(&batch(list)), 2 * 4 + 1 + 2 * 4);
        // A null view naming a 4,000,000-byte value: two views, a bitmap byte, "hello" inline.
        let v = nulled(&arrow_array::StringViewArray::from(vec![long.as_str(), "hello"]));
        assert_eq!(batch_bytes(&batch(Arc::clone(&v))), 2 * 16 + 1);
        assert_eq!(batch_bytes(&batch(v.slice(0, 1))), 16 + 1);
        let longer = format!("{long}y");
        let both = arrow_array::StringViewArray::from(vec![long.as_str(), longer.as_str()]);
        assert_eq!(batch_bytes(&batch(Arc::new(both.clone()))), 2 * 16 + 8_000_001, "the buffers whole");
        assert_eq!(batch_bytes(&batch(nulled(&both))), 2 * 16 + 4_000_001 + 1, "the valid view's value alone");
        // Without nulls, the whole span, as before.
        let plain: ArrayRef = Arc::new(StringArray::from(vec!["ab", "cde"]));
        assert_eq!(batch_bytes(&batch(Arc::clone(&plain))), 2 * 4 + 5);
        assert_eq!(null_span_bytes(plain.as_ref()), 0);
    }
}

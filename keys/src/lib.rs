//! gritdb key rules: what makes two primary keys the same key, in one place.
//!
//! The delta store (`gritdb-unify`) and the data files' key index (`gritdb-storage`) sit side
//! by side and never call each other, yet a key written to the delta before a flush must be
//! found in the file after it. Both therefore encode keys here:
//!
//! - [`key_converter`] + [`encode_keys`]: `arrow-row` bytes, one `SortField` per key column
//!   with default options, floats made canonical first ([`canonical_key_columns`]). Equal keys
//!   are equal bytes and compare with `memcmp`.
//! - [`canonical_floats`]: the float values that are one value (0.0 and −0.0; every NaN),
//!   for keys and for scan filters alike.
//! - [`type_depth`] and [`MAX_TYPE_DEPTH`]: how deep an Arrow type nests, and the deepest one
//!   the engine looks at (column types and filter literals alike).
//!
//! Before this crate each side had its own copy of these rules, marked "SAME-RULE" and kept
//! equal by a test; one copy now serves both.

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef};
use arrow_row::{RowConverter, Rows, SortField};
use arrow_schema::{ArrowError, DataType};
use std::sync::Arc;

/// Deepest Arrow type the engine looks at: a type nested deeper is refused before anything
/// formats or compares it (Arrow's `Display`, `Debug` and `PartialEq` of a `DataType` recurse
/// once per level). No nested type is a supported column type, so the bound only decides which
/// error a nested type gets; 64 is the flatbuffer verifier's default depth in arrow-ipc, beyond
/// which no Arrow IPC stream (the WAL's format) can carry a schema anyway.
pub const MAX_TYPE_DEPTH: usize = 64;

/// Nesting depth of an Arrow type: 1 for a flat type, one more than its deepest child for
/// lists, structs, maps, unions, dictionaries and run-end encoded types. Walked with a heap
/// stack, so it is safe on a type of any depth (10,000 levels on a 2 MiB thread stack is
/// tested in `gritdb-unify`).
pub fn type_depth(t: &DataType) -> usize {
    // Every write checks its columns' types: a flat type (the common case) needs no stack.
    let nested = matches!(
        t,
        DataType::List(_)
            | DataType::LargeList(_)
            | DataType::ListView(_)
            | DataType::LargeListView(_)
            | DataType::FixedSizeList(..)
            | DataType::Map(..)
            | DataType::Struct(_)
            | DataType::Union(..)
            | DataType::Dictionary(..)
            | DataType::RunEndEncoded(..)
    );
    if !nested {
        return 1;
    }
    let mut deepest = 1;
    let mut todo = vec![(t, 1usize)];
    while let Some((t, d)) = todo.pop() {
        deepest = deepest.max(d);
        match t {
            DataType::List(f)
            | DataType::LargeList(f)
            | DataType::ListView(f)
            | DataType::LargeListView(f)
            | DataType::FixedSizeList(f, _)
            | DataType::Map(f, _) => todo.push((f.data_type(), d + 1)),
            DataType::Struct(fields) => todo.extend(fields.iter().map(|f| (f.data_type(), d + 1))),
            DataType::Union(fields, _) => todo.extend(fields.iter().map(|(_, f)| (f.data_type(), d + 1))),
            DataType::Dictionary(k, v) => todo.extend([(k.as_ref(), d + 1), (v.as_ref(), d + 1)]),
            DataType::RunEndEncoded(r, v) => todo.extend([(r.data_type(), d + 1), (v.data_type(), d + 1)]),
            _ => {}
        }
    }
    deepest
}

/// Key columns made canonical for key identity ([`canonical_floats`] of each): 0.0 and −0.0
/// (equal under IEEE 754 `==`) are one key, and so are NaNs of any sign or payload
/// (`PostgreSQL`'s rule for keys and `GROUP BY`: NaN equals NaN). `arrow-row` encodes floats
/// in IEEE 754 totalOrder, where all of these differ, so without this a table could hold 0.0
/// and −0.0 as two rows of "one" key. Only the key bytes change: the rows keep the values
/// written. Other columns, and float columns holding no such value, are returned as they are
/// (no copy).
pub fn canonical_key_columns(cols: Vec<ArrayRef>) -> Vec<ArrayRef> {
    cols.into_iter().map(canonical_floats).collect()
}

/// `col` with its float values made canonical: in a `Float16`, `Float32` or `Float64` array
/// (or the values of a dictionary of one), −0.0 becomes 0.0 and every NaN the positive quiet
/// NaN (`f64::NAN`, `f32::NAN`, `0x7e00`). Nulls stay null. Any other array, and a float
/// array holding no −0.0 and no other NaN, is returned as it is (no copy).
///
/// Compared in IEEE 754 totalOrder afterwards (as `arrow-row` and Arrow's comparison kernels
/// compare floats), canonical values order as `PostgreSQL` and `DuckDB` order floats:
/// −0.0 = 0.0, NaN = NaN, and NaN above every number, +∞ included. The key rules
/// ([`canonical_key_columns`]) and scan filters (`gritdb-storage`'s `ScanFilter`) both compare
/// through it, so a filter `k = 0.0` finds the row whose key was written as −0.0.
pub fn canonical_floats(col: ArrayRef) -> ArrayRef {
    use arrow_array::types::{Float16Type, Float32Type, Float64Type};
    type F16 = <Float16Type as arrow_array::ArrowPrimitiveType>::Native;
    fn fix<T: arrow_array::ArrowPrimitiveType>(col: ArrayRef, odd: impl Fn(T::Native) -> bool, canonical: impl Fn(T::Native) -> T::Native) -> ArrayRef {
        let a = col.as_primitive::<T>();
        if a.values().iter().any(|&v| odd(v)) { Arc::new(a.unary::<_, T>(canonical)) } else { col }
    }
    match col.data_type() {
        DataType::Float64 => fix::<Float64Type>(
            col,
            |v| v.to_bits() == (-0.0f64).to_bits() || (v.is_nan() && v.to_bits() != f64::NAN.to_bits()),
            |v| {
                if v == 0.0 {
                    0.0
                } else if v.is_nan() {
                    f64::NAN
                } else {
                    v
                }
            },
        ),
        DataType::Float32 => fix::<Float32Type>(
            col,
            |v| v.to_bits() == (-0.0f32).to_bits() || (v.is_nan() && v.to_bits() != f32::NAN.to_bits()),
            |v| {
                if v == 0.0 {
                    0.0
                } else if v.is_nan() {
                    f32::NAN
                } else {
                    v
                }
            },
        ),
        DataType::Float16 => fix::<Float16Type>(
            col,
            |v| v.to_bits() == 0x8000 || (v.is_nan() && v.to_bits() != 0x7e00),
            |v| {
                if v.to_bits() == 0x8000 {
                    F16::from_bits(0)
                } else if v.is_nan() {
                    F16::from_bits(0x7e00)
                } else {
                    v
                }
            },
        ),
        DataType::Dictionary(_, v) if v.is_floating() => {
            let d = col.as_any_dictionary();
            let values = canonical_floats(Arc::clone(d.values()));
            if Arc::ptr_eq(&values, d.values()) { col } else { d.with_values(values) }
        }
        _ => col,
    }
}

/// The key encoder for key columns of the types `key_types`, in key order: one `SortField`
/// per column, default options (ascending, nulls first; key columns hold no nulls).
///
/// # Errors
/// `ArrowError::NotYetImplemented` when a type cannot be row-encoded.
pub fn key_converter(key_types: impl IntoIterator<Item = DataType>) -> Result<RowConverter, ArrowError> {
    RowConverter::new(key_types.into_iter().map(SortField::new).collect())
}

/// Key bytes of rows whose key columns are `cols` (in key order, one array per column, all of
/// one length), floats made canonical first ([`canonical_key_columns`]).
///
/// # Errors
/// `ArrowError::InvalidArgumentError` when `cols` do not match the converter's types or
/// lengths.
pub fn encode_keys(conv: &RowConverter, cols: Vec<ArrayRef>) -> Result<Rows, ArrowError> {
    conv.convert_columns(&canonical_key_columns(cols))
}

/// Bytes `arrow-row` encodes a non-null variable-width value (`Utf8`, `LargeUtf8`,
/// `Utf8View`, `Binary`, `LargeBinary`, `BinaryView`) of `len` bytes into, as one key column:
/// a sentinel byte, then up to 32 bytes in four 8-byte mini-blocks of 9 bytes (each with its
/// continuation byte), longer values in 33-byte blocks of 32. The formula is arrow-row
/// 59.3's `non_null_padded_length` (`src/variable.rs`, not public); the test
/// `variable_key_bytes_is_the_encoders_length` holds it to the encoder. So a key's encoded
/// length with that value cut to `cut` bytes is `key − variable_key_bytes(len) +
/// variable_key_bytes(cut)`.
#[must_use]
pub const fn variable_key_bytes(len: usize) -> usize {
    const BLOCK: usize = 32;
    const MINI: usize = 8;
    if len <= BLOCK { 1 + len.div_ceil(MINI) * (MINI + 1) } else { BLOCK / MINI + len.div_ceil(BLOCK) * (BLOCK + 1) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Float32Array, Float64Array, Int64Array};
    use arrow_schema::Field;

    /// [`variable_key_bytes`] is the length the encoder gives a one-column key of every
    /// variable-width type, at each block edge (0, 1, 8, 9, 32, 33, 64, 65) and far past them.
    #[test]
    fn variable_key_bytes_is_the_encoders_length() {
        use arrow_array::{BinaryArray, BinaryViewArray, LargeStringArray, StringArray, StringViewArray};
        let lens = [0usize, 1, 7, 8, 9, 16, 31, 32, 33, 63, 64, 65, 100, 1000, 150_000];
        let texts: Vec<String> = lens.iter().map(|&n| "x".repeat(n)).collect();
        let cols: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from_iter_values(&texts)),
            Arc::new(LargeStringArray::from_iter_values(&texts)),
            Arc::new(StringViewArray::from_iter_values(&texts)),
            Arc::new(BinaryArray::from_iter_values(texts.iter().map(String::as_bytes))),
            Arc::new(BinaryViewArray::from_iter_values(texts.iter().map(String::as_bytes))),
        ];
        for col in cols {
            let conv = key_converter([col.data_type().clone()]).unwrap();
            let rows = encode_keys(&conv, vec![Arc::clone(&col)]).unwrap();
            for (i, &n) in lens.iter().enumerate() {
                assert_eq!(rows.row(i).as_ref().len(), variable_key_bytes(n), "{} of {n} bytes", col.data_type());
            }
        }
    }

    #[test]
    fn canonical_key_columns_fixes_zero_signs_and_nans_only() {
        let odd_nan = f64::from_bits(0xfff8_0000_0000_0001);
        let floats: ArrayRef = Arc::new(Float64Array::from(vec![Some(-0.0), Some(0.0), None, Some(odd_nan), Some(-2.5), Some(f64::NAN)]));
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5, 6]));
        let out = canonical_key_columns(vec![Arc::clone(&floats), Arc::clone(&ints)]);
        let f = out[0].as_primitive::<arrow_array::types::Float64Type>();
        let bits: Vec<u64> = f.values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits[0], 0, "-0.0 -> 0.0");
        assert_eq!(bits[1], 0);
        assert_eq!((bits[3], bits[5]), (f64::NAN.to_bits(), f64::NAN.to_bits()));
        assert_eq!(bits[4], (-2.5f64).to_bits());
        assert!(f.is_null(2) && f.null_count() == 1, "nulls stay nulls");
        assert!(Arc::ptr_eq(&out[1], &ints), "other types are not copied");
        // Nothing to fix: the same array back, no copy.
        let clean: ArrayRef = Arc::new(Float64Array::from(vec![0.0, 1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY]));
        assert!(Arc::ptr_eq(&canonical_key_columns(vec![Arc::clone(&clean)])[0], &clean));
    }

    /// Float16, Float32 and dictionaries of floats are made canonical too, and the canonical
    /// values compare in totalOrder as `PostgreSQL` compares floats: −0.0 = 0.0, NaN = NaN,
    /// NaN above +∞, −∞ below every number.
    #[test]
    fn canonical_floats_of_every_float_type_order_as_postgresql() {
        use arrow_array::types::{Float16Type, Float32Type, Float64Type, Int8Type};
        use arrow_array::{DictionaryArray, Float16Array, Int8Array};
        use std::cmp::Ordering::{Equal, Greater, Less};
        type F16 = <Float16Type as arrow_array::ArrowPrimitiveType>::Native;
        let h: ArrayRef = Arc::new(Float16Array::from(vec![F16::from_bits(0x8000), F16::from_bits(0xfe01), F16::from_bits(0x3c00)]));
        let h = canonical_floats(h);
        let hb: Vec<u16> = h.as_primitive::<Float16Type>().values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(hb, [0, 0x7e00, 0x3c00]);
        let f: ArrayRef = Arc::new(Float32Array::from(vec![-0.0f32, f32::from_bits(0xffc0_0001), 1.5]));
        let fb: Vec<u32> = canonical_floats(f).as_primitive::<Float32Type>().values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(fb, [0, f32::NAN.to_bits(), 1.5f32.to_bits()]);
        // A dictionary of floats: its values are fixed, its keys kept.
        let d: ArrayRef = Arc::new(DictionaryArray::<Int8Type>::new(Int8Array::from(vec![1, 0, 1]), Arc::new(Float64Array::from(vec![-0.0, -f64::NAN]))));
        let d = canonical_floats(d);
        let d = d.as_dictionary::<Int8Type>();
        assert_eq!(d.keys().values().to_vec(), [1, 0, 1]);
        let vb: Vec<u64> = d.values().as_primitive::<Float64Type>().values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(vb, [0, f64::NAN.to_bits()]);
        // A dictionary of other values and a clean one come back uncopied.
        let clean: ArrayRef = Arc::new(DictionaryArray::<Int8Type>::new(Int8Array::from(vec![0]), Arc::new(Float64Array::from(vec![2.0]))));
        assert!(Arc::ptr_eq(&canonical_floats(Arc::clone(&clean)), &clean));
        // The order of canonical values.
        let raw = [f64::NEG_INFINITY, -1.0, -0.0, 0.0, 1.0, f64::INFINITY, f64::NAN, -f64::NAN, f64::from_bits(0x7ff0_0000_0000_0001)];
        let c = canonical_floats(Arc::new(Float64Array::from(raw.to_vec())));
        let c = c.as_primitive::<Float64Type>().values();
        let pg = |a: f64, b: f64| match (a.is_nan(), b.is_nan()) {
            (true, true) => Equal,
            (true, false) => Greater,
            (false, true) => Less,
            _ => a.partial_cmp(&b).unwrap(),
        };
        for i in 0..raw.len() {
            for j in 0..raw.len() {
                assert_eq!(c[i].total_cmp(&c[j]), pg(raw[i], raw[j]), "{} vs {}", raw[i], raw[j]);
            }
        }
    }

    /// 0.0 and −0.0, and NaNs of two signs and payloads, encode to one key each; 1.0 and 2.0
    /// stay apart and in order.
    #[test]
    fn equal_floats_encode_to_equal_key_bytes() {
        let conv = key_converter([DataType::Float32, DataType::Int64]).unwrap();
        let nan2 = f32::from_bits(0xffc0_0001);
        let rows =
            encode_keys(&conv, vec![Arc::new(Float32Array::from(vec![0.0, -0.0, f32::NAN, nan2, 1.0, 2.0])), Arc::new(Int64Array::from(vec![7; 6]))]).unwrap();
        assert_eq!(rows.row(0), rows.row(1));
        assert_eq!(rows.row(2), rows.row(3));
        assert_ne!(rows.row(0), rows.row(2));
        assert!(rows.row(4) < rows.row(5));
        // A column of the wrong type is an error, not a panic.
        assert!(encode_keys(&conv, vec![Arc::new(Int64Array::from(vec![1])), Arc::new(Int64Array::from(vec![1]))]).is_err());
    }

    /// A `List` of a `List` of ... `Int64`, `depth` levels deep (built without recursion).
    fn deep_list(depth: usize) -> DataType {
        let mut t = DataType::Int64;
        for _ in 1..depth {
            t = DataType::List(Arc::new(Field::new("item", t, true)));
        }
        t
    }

    /// `type_depth` counts levels of every nested kind; a flat type is 1.
    #[test]
    fn type_depth_counts_levels() {
        assert_eq!(type_depth(&DataType::Utf8), 1);
        assert_eq!(type_depth(&deep_list(3)), 3);
        let item = |t: DataType| Arc::new(Field::new("item", t, true));
        let st = DataType::Struct(vec![Field::new("a", DataType::Int8, true), Field::new("b", deep_list(4), true)].into());
        assert_eq!(type_depth(&st), 5);
        assert_eq!(type_depth(&DataType::LargeList(item(st.clone()))), 6);
        assert_eq!(type_depth(&DataType::FixedSizeList(item(st.clone()), 2)), 6);
        assert_eq!(type_depth(&DataType::Dictionary(Box::new(DataType::Int32), Box::new(deep_list(2)))), 3);
        let entries = DataType::Struct(vec![Field::new("k", DataType::Utf8, false), Field::new("v", st, true)].into());
        assert_eq!(type_depth(&DataType::Map(Arc::new(Field::new("entries", entries, false)), false)), 7);
        assert_eq!(type_depth(&deep_list(1_000)), 1_000);
    }
}

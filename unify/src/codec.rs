use crate::error::UnifyError;
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, RecordBatch};

use arrow_row::{RowConverter, Rows};
use arrow_schema::{DataType, SchemaRef};
pub use gritdb_keys::{MAX_TYPE_DEPTH, type_depth};
use std::sync::Arc;

/// Bytes of the row header: op (1) + seq (8) + key length (4).
pub(crate) const HEADER: usize = 13;
/// `op` of a put row.
pub(crate) const OP_PUT: u8 = 1;
/// `op` of a tombstone.
pub(crate) const OP_DELETE: u8 = 2;

/// How a column is laid out in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ColKind {
    /// One byte, 0 or 1.
    Bool,
    /// A fixed-width value of this many bytes, copied as Arrow stores it (little endian).
    Fixed(usize),
    /// A `Decimal128` of precision at most 18, stored in 8 bytes: the low half of Arrow's
    /// little-endian `i128`, sign-extended back on decode. Exact, because [`RowCodec::validate`]
    /// refuses a value of more digits than the precision, and `10^18 - 1 < 2^63`; Parquet
    /// stores these decimals as `INT64` for the same reason (Parquet format, `LogicalTypes.md`,
    /// DECIMAL: "int64: for 1 <= precision <= 18"). Saves 8 bytes a value in the row blocks
    /// (TPC-H lineitem's four decimals: 32 of ~198 bytes a row).
    Decimal64,
    /// Utf8 / Binary (`i32` offsets in Arrow).
    Off32,
    /// `LargeUtf8` / `LargeBinary` (`i64` offsets in Arrow).
    Off64,
    /// `Utf8View` / `BinaryView`.
    View,
}

impl ColKind {
    fn of(dt: &DataType) -> Option<Self> {
        Some(match dt {
            DataType::Boolean => ColKind::Bool,
            DataType::Int8 | DataType::UInt8 => ColKind::Fixed(1),
            DataType::Int16 | DataType::UInt16 | DataType::Float16 => ColKind::Fixed(2),
            DataType::Int32 | DataType::UInt32 | DataType::Float32 | DataType::Date32 | DataType::Time32(_) => ColKind::Fixed(4),
            DataType::Int64
            | DataType::UInt64
            | DataType::Float64
            | DataType::Date64
            | DataType::Time64(_)
            | DataType::Timestamp(_, _)
            | DataType::Duration(_) => ColKind::Fixed(8),
            // Parquet cannot store a negative decimal scale, a scale above the precision or a
            // precision outside 1..=38 (Arrow's own rule for `Decimal128`, which its
            // `DataType` does not enforce: parquet's writer asserts on a 39-digit column and
            // panicked the flush): refuse them up front rather than accept rows that could
            // never be flushed.
            DataType::Decimal128(precision, scale) if !decimal128_storable(*precision, *scale) => return None,
            DataType::Decimal128(precision, _) if *precision <= 18 => ColKind::Decimal64,
            DataType::Decimal128(..) => ColKind::Fixed(16),
            DataType::Utf8 | DataType::Binary => ColKind::Off32,
            DataType::LargeUtf8 | DataType::LargeBinary => ColKind::Off64,
            DataType::Utf8View | DataType::BinaryView => ColKind::View,
            _ => return None,
        })
    }

    /// Bytes of this column's fixed slot in a row.
    fn slot_width(self) -> usize {
        match self {
            ColKind::Bool => 1,
            ColKind::Fixed(w) => w,
            ColKind::Decimal64 => 8,
            ColKind::Off32 | ColKind::Off64 | ColKind::View => 4,
        }
    }

    pub(crate) fn is_var(self) -> bool {
        matches!(self, ColKind::Off32 | ColKind::Off64 | ColKind::View)
    }
}

/// [`UnifyError::TypeTooDeep`] for a column whose type nests deeper than [`MAX_TYPE_DEPTH`].
fn check_type_depth(column: &str, t: &DataType) -> Result<(), UnifyError> {
    let depth = type_depth(t);
    if depth > MAX_TYPE_DEPTH {
        return Err(UnifyError::TypeTooDeep { column: column.to_owned(), depth, limit: MAX_TYPE_DEPTH });
    }
    Ok(())
}

/// Largest row the row format can hold, and so the largest `max_row_bytes` a [`RowCodec`]
/// takes (a larger one is taken as this): a row's key length and the end offsets of its
/// variable-length values are `u32`s in the row, and so is a row's length in its row block
/// ([`gritdb_memctl::MAX_ROW_LEN`]). A larger row would wrap them silently.
pub const MAX_ROW_BYTES: usize = gritdb_memctl::MAX_ROW_LEN;

/// Whether a `Decimal128(precision, scale)` column can be stored: precision 1..=38
/// ([`arrow_schema::DECIMAL128_MAX_PRECISION`]) and scale 0..=precision.
fn decimal128_storable(precision: u8, scale: i8) -> bool {
    (1..=arrow_schema::DECIMAL128_MAX_PRECISION).contains(&precision) && u8::try_from(scale).is_ok_and(|s| s <= precision)
}

/// Encodes primary keys as `arrow-row` bytes: canonical (floats through
/// [`gritdb_keys::canonical_key_columns`]), memcmp-comparable, and identical to the storage
/// crate's key bytes, as both encode through [`gritdb_keys`].
#[derive(Debug)]
pub struct KeyEncoder {
    converter: RowConverter,
    columns: Vec<usize>,
}

impl KeyEncoder {
    /// An encoder for the key columns `columns` (indices into `schema`).
    ///
    /// # Errors
    /// [`UnifyError::Arrow`] when a key type cannot be row-encoded.
    pub fn new(schema: &SchemaRef, columns: &[usize]) -> Result<Self, UnifyError> {
        let converter = gritdb_keys::key_converter(columns.iter().map(|&i| schema.field(i).data_type().clone()))?;
        Ok(Self { converter, columns: columns.to_vec() })
    }

    /// Key bytes of every row of a full-schema batch.
    ///
    /// # Errors
    /// [`UnifyError::Arrow`] on an encoding failure.
    pub fn encode_batch(&self, batch: &RecordBatch) -> Result<Rows, UnifyError> {
        let cols: Vec<ArrayRef> = self.columns.iter().map(|&i| Arc::clone(batch.column(i))).collect();
        Ok(gritdb_keys::encode_keys(&self.converter, cols)?)
    }

    /// Key bytes of every row of a batch holding only the key columns, in key order.
    ///
    /// # Errors
    /// [`UnifyError::Arrow`] on an encoding failure.
    pub fn encode_key_columns(&self, cols: &[ArrayRef]) -> Result<Rows, UnifyError> {
        Ok(gritdb_keys::encode_keys(&self.converter, cols.to_vec())?)
    }

    /// Decodes key bytes back into key columns.
    ///
    /// # Errors
    /// [`UnifyError::Arrow`] on a decoding failure.
    pub fn decode<'a>(&self, keys: impl IntoIterator<Item = &'a [u8]>) -> Result<Vec<ArrayRef>, UnifyError> {
        let parser = self.converter.parser();
        let rows: Vec<arrow_row::Row<'_>> = keys.into_iter().map(|k| parser.parse(k)).collect();
        Ok(self.converter.convert_rows(rows)?)
    }

    /// Key column indices in the table schema.
    pub fn columns(&self) -> &[usize] {
        &self.columns
    }
}

/// The row codec of one table: validates batches against the schema and knows the row layout.
#[derive(Debug)]
pub struct RowCodec {
    schema: SchemaRef,
    kinds: Vec<ColKind>,
    slot_offsets: Vec<usize>,
    bitmap_len: usize,
    fixed_len: usize,
    /// Slot offset of the last variable-length column: its slot holds the end of the row's
    /// var-len bytes, so the row's length (see [`Self::row_len`]).
    last_var_slot: Option<usize>,
    keys: KeyEncoder,
    max_row_bytes: usize,
}

/// One row's string and binary values, from [`RowCodec::value_bytes_by_row`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowValueBytes {
    /// Index in the schema of the column holding the largest value (0 when the row has none).
    pub column: usize,
    /// The largest value's length in bytes (0 when the row has none).
    pub largest: usize,
    /// All the row's string and binary values together, in bytes.
    pub values: usize,
    /// Those of them in key columns, in bytes.
    pub key_values: usize,
}

impl RowCodec {
    /// A codec for `schema` with primary-key columns `key_columns` (indices), refusing rows
    /// that encode to more than `max_row_bytes` (at most [`MAX_ROW_BYTES`]: a larger value is
    /// taken as that).
    ///
    /// # Errors
    /// [`UnifyError::UnsupportedType`] for a column type outside the supported list;
    /// [`UnifyError::TypeTooDeep`] for one nested deeper than [`MAX_TYPE_DEPTH`] (checked first).
    pub fn new(schema: SchemaRef, key_columns: &[usize], max_row_bytes: usize) -> Result<Self, UnifyError> {
        for f in schema.fields() {
            check_type_depth(f.name(), f.data_type())?;
        }
        let max_row_bytes = max_row_bytes.min(MAX_ROW_BYTES);
        let mut kinds = Vec::with_capacity(schema.fields().len());
        let mut slot_offsets = Vec::with_capacity(schema.fields().len());
        let bitmap_len = schema.fields().len().div_ceil(8);
        let mut off = 0;
        for f in schema.fields() {
            let kind = ColKind::of(f.data_type()).ok_or_else(|| UnifyError::UnsupportedType { column: f.name().clone(), data_type: f.data_type().clone() })?;
            kinds.push(kind);
            slot_offsets.push(off);
            off += kind.slot_width();
        }
        let keys = KeyEncoder::new(&schema, key_columns)?;
        let last_var_slot = kinds.iter().zip(&slot_offsets).rev().find(|(k, _)| matches!(k, ColKind::Off32 | ColKind::Off64 | ColKind::View)).map(|(_, &o)| o);
        Ok(Self { schema, kinds, slot_offsets, bitmap_len, fixed_len: off, last_var_slot, keys, max_row_bytes })
    }

    /// The table schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The key encoder.
    pub fn keys(&self) -> &KeyEncoder {
        &self.keys
    }

    pub(crate) fn kinds(&self) -> &[ColKind] {
        &self.kinds
    }

    pub(crate) fn slot_offset(&self, col: usize) -> usize {
        self.slot_offsets[col]
    }

    pub(crate) fn bitmap_len(&self) -> usize {
        self.bitmap_len
    }

    pub(crate) fn fixed_len(&self) -> usize {
        self.fixed_len
    }

    /// Checks a full-row batch against the table: same column names, types in order; no null
    /// in a key column or a non-nullable column. Nullability declared on the batch's fields is
    /// not compared (Arrow producers often mark every field nullable); actual nulls are.
    ///
    /// # Errors
    /// [`UnifyError::SchemaMismatch`], [`UnifyError::NullKey`], [`UnifyError::NullInNonNullable`],
    /// [`UnifyError::ValueOutOfRange`]; [`UnifyError::TypeTooDeep`] for a batch column whose
    /// type nests deeper than [`MAX_TYPE_DEPTH`].
    pub fn validate(&self, batch: &RecordBatch) -> Result<(), UnifyError> {
        let want = self.schema.fields();
        let got = batch.schema();
        check_columns(want.iter().map(|f| (f.name(), f.data_type())), got.fields().iter().map(|f| (f.name(), f.data_type())))?;
        for (i, f) in want.iter().enumerate() {
            check_decimal_precision(f, batch.column(i).as_ref())?;
            check_utf8(f, batch.column(i).as_ref())?;
        }
        for (i, f) in want.iter().enumerate() {
            let col = batch.column(i);
            if col.null_count() == 0 {
                continue;
            }
            let row = first_null(col.as_ref());
            if self.keys.columns.contains(&i) {
                return Err(UnifyError::NullKey { column: f.name().clone(), row });
            }
            if !f.is_nullable() {
                return Err(UnifyError::NullInNonNullable { column: f.name().clone(), row });
            }
        }
        Ok(())
    }

    /// Checks a batch that holds only the key columns (for delete).
    ///
    /// # Errors
    /// [`UnifyError::SchemaMismatch`], [`UnifyError::NullKey`], [`UnifyError::TypeTooDeep`].
    pub fn validate_keys(&self, batch: &RecordBatch) -> Result<(), UnifyError> {
        let want = self.keys.columns.iter().map(|&i| self.schema.field(i));
        let got = batch.schema();
        check_columns(want.map(|f| (f.name(), f.data_type())), got.fields().iter().map(|f| (f.name(), f.data_type())))?;
        for (j, &i) in self.keys.columns.iter().enumerate() {
            let col = batch.column(j);
            check_decimal_precision(self.schema.field(i), col.as_ref())?;
            check_utf8(self.schema.field(i), col.as_ref())?;
            if col.null_count() > 0 {
                return Err(UnifyError::NullKey { column: self.schema.field(i).name().clone(), row: first_null(col.as_ref()) });
            }
        }
        Ok(())
    }

    /// Refuses a batch with a row whose encoding would pass the maximum row size, before any
    /// memory is asked for the batch: a row that can never fit is [`UnifyError::RowTooLarge`]
    /// at any memory limit, not a `MemoryLimit` that raising the limit would not cure.
    /// `keys` are the batch's key bytes. Cheap for usual batches: when even the whole batch's
    /// Arrow memory (`RecordBatch::get_array_memory_size`, at least every value byte) plus one
    /// row's header, null bitmap and fixed slots and all the keys' bytes (`Rows::size`, at
    /// least the longest key) is within the maximum, no row is measured; otherwise each row
    /// is, as the write does.
    ///
    /// # Errors
    /// [`UnifyError::RowTooLarge`] naming the first row above the maximum.
    pub fn check_row_sizes(&self, batch: &RecordBatch, keys: &Rows) -> Result<(), UnifyError> {
        let bound = (HEADER + self.bitmap_len + self.fixed_len).saturating_add(keys.size()).saturating_add(batch.get_array_memory_size());
        if bound <= self.max_row_bytes {
            return Ok(());
        }
        let readers: Vec<ColReader<'_>> = batch.columns().iter().zip(self.kinds()).map(|(a, k)| ColReader::new(a, *k)).collect();
        self.row_sizes(keys, &readers).map(|_| ())
    }

    /// Each row's string and binary values (nulls and fixed-width values count nothing), one
    /// [`RowValueBytes`] a row of `batch`: the largest value's column and bytes, all of them
    /// together and those in key columns, in bytes. For a check a caller makes only when
    /// `batch.get_array_memory_size()` (at least every value's bytes) is above its bound: it
    /// reads every row's length.
    pub fn value_bytes_by_row(&self, batch: &RecordBatch) -> Vec<RowValueBytes> {
        let mut out = vec![RowValueBytes::default(); batch.num_rows()];
        let mut lens = vec![0usize; batch.num_rows()];
        for (c, (a, k)) in batch.columns().iter().zip(self.kinds()).enumerate().filter(|(_, (_, k))| k.is_var()) {
            lens.fill(0);
            ColReader::new(a, *k).add_var_lens(&mut lens);
            let in_key = self.keys().columns().contains(&c);
            for (o, &len) in out.iter_mut().zip(&lens) {
                o.values += len;
                if in_key {
                    o.key_values += len;
                }
                // The first column of the largest length: later columns must be longer.
                if len > o.largest {
                    o.largest = len;
                    o.column = c;
                }
            }
        }
        out
    }

    /// Encoded size in bytes of each row of `batch` whose key bytes are `keys`.
    ///
    /// # Errors
    /// [`UnifyError::RowTooLarge`] naming the first row above the maximum.
    pub(crate) fn row_sizes(&self, keys: &Rows, readers: &[ColReader<'_>]) -> Result<Vec<usize>, UnifyError> {
        let base = HEADER + self.bitmap_len + self.fixed_len;
        let mut sizes: Vec<usize> = keys.iter().map(|k| base + k.as_ref().len()).collect();
        for r in readers {
            r.add_var_lens(&mut sizes);
        }
        if let Some((row, &bytes)) = sizes.iter().enumerate().find(|(_, s)| **s > self.max_row_bytes) {
            return Err(UnifyError::RowTooLarge { row, bytes, max: self.max_row_bytes });
        }
        Ok(sizes)
    }

    /// Length in bytes of the encoded row that starts `row` (which may run on past the row's
    /// end): header and key for a tombstone; plus null bitmap, fixed slots and var-len bytes
    /// (the last var-len column's end offset) for a put.
    #[inline]
    pub(crate) fn row_len(&self, row: &[u8]) -> usize {
        let head = HEADER + key_len(row);
        if row[0] != OP_PUT {
            return head;
        }
        let body = head + self.bitmap_len + self.fixed_len;
        match self.last_var_slot {
            Some(slot) => {
                let at = head + self.bitmap_len + slot;
                body + u32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]) as usize
            }
            None => body,
        }
    }

    /// Groups a batch's columns by how [`Self::encode_row`] writes them (see [`EncodePlan`]).
    pub(crate) fn plan<'r, 'a>(&self, readers: &'r [ColReader<'a>]) -> EncodePlan<'r, 'a> {
        let mut plan = EncodePlan { readers, f4: Vec::new(), f8: Vec::new(), f16: Vec::new(), d64: Vec::new(), other: Vec::new(), vars: Vec::new() };
        for (j, (r, &slot)) in readers.iter().zip(&self.slot_offsets).enumerate() {
            match &r.values {
                Values::Fixed { values, start, width, stored } if r.nulls.is_none() => {
                    let v = &values.as_slice()[*start..];
                    match (width, stored) {
                        (4, 4) => plan.f4.push((slot, v)),
                        (8, 8) => plan.f8.push((slot, v)),
                        (16, 16) => plan.f16.push((slot, v)),
                        (16, 8) => plan.d64.push((slot, v)),
                        _ => plan.other.push(j),
                    }
                }
                Values::Bool(_) | Values::Fixed { .. } => plan.other.push(j),
                &Values::Var(src) => plan.vars.push(VarCol { col: j, slot, src }),
            }
        }
        plan
    }

    /// Writes row `i` of the batch read by `plan`'s readers (from [`Self::plan`]) into `buf` (exactly its encoded size, as [`Self::row_sizes`]
    /// computed it): header, key, null bitmap, fixed slots, var-len bytes.
    #[inline]
    pub(crate) fn encode_row(&self, buf: &mut [u8], op: u8, seq: u64, key: &[u8], plan: &EncodePlan<'_, '_>, i: usize) {
        let readers = plan.readers;
        let (head, body) = buf.split_at_mut(HEADER + key.len());
        head[0] = op;
        head[1..9].copy_from_slice(&seq.to_le_bytes());
        head[9..13].copy_from_slice(&(key.len() as u32).to_le_bytes());
        copy_short(&mut head[HEADER..], key);
        let (bitmap, rest) = body.split_at_mut(self.bitmap_len);
        bitmap.fill(0);
        let (fixed, var) = rest.split_at_mut(self.fixed_len);
        for &(slot, v) in &plan.f8 {
            fixed[slot..slot + 8].copy_from_slice(&v[i * 8..i * 8 + 8]);
        }
        for &(slot, v) in &plan.f4 {
            fixed[slot..slot + 4].copy_from_slice(&v[i * 4..i * 4 + 4]);
        }
        for &(slot, v) in &plan.f16 {
            fixed[slot..slot + 16].copy_from_slice(&v[i * 16..i * 16 + 16]);
        }
        for &(slot, v) in &plan.d64 {
            fixed[slot..slot + 8].copy_from_slice(&v[i * 16..i * 16 + 8]);
        }
        for &j in &plan.other {
            let r = &readers[j];
            let slot = &mut fixed[self.slot_offsets[j]..];
            if r.is_null(i) {
                bitmap[j / 8] |= 1 << (j % 8);
                match &r.values {
                    Values::Fixed { stored, .. } => slot[..*stored].fill(0),
                    _ => slot[0] = 0,
                }
                continue;
            }
            match &r.values {
                Values::Bool(values) => slot[0] = u8::from(values.value(i)),
                Values::Fixed { values, start, width, stored } => {
                    let at = start + i * width;
                    slot[..*stored].copy_from_slice(&values[at..at + stored]);
                }
                Values::Var(_) => {}
            }
        }
        // Var-len bytes are laid out in column order: `vars` is in schema order. A null
        // writes no bytes; its slot repeats the end so far.
        let mut var_pos = 0usize;
        for v in &plan.vars {
            if readers[v.col].is_null(i) {
                bitmap[v.col / 8] |= 1 << (v.col % 8);
            } else {
                var_pos += v.src.write(i, &mut var[var_pos..]);
            }
            fixed[v.slot..v.slot + 4].copy_from_slice(&(var_pos as u32).to_le_bytes());
        }
    }
}

/// Copies `src` into `dst` (of the same length) without a call to `memcpy` for up to 32
/// bytes: two overlapping loads and stores of 8 or 16 bytes, the way `memcpy`
/// implementations copy short lengths. Most keys and string values of a row are this short,
/// and the call was a fifth of [`RowCodec::encode_row`] (callgrind, lineitem).
#[inline(always)]
#[expect(
    clippy::inline_always,
    reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
)]
fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    debug_assert_eq!(dst.len(), n);
    if n > 32 {
        dst.copy_from_slice(src);
    } else if n >= 16 {
        let (a, b) = (u128_at(src, 0), u128_at(src, n - 16));
        dst[..16].copy_from_slice(&a);
        dst[n - 16..n].copy_from_slice(&b);
    } else if n >= 8 {
        let (a, b) = (u64_at(src, 0), u64_at(src, n - 8));
        dst[..8].copy_from_slice(&a);
        dst[n - 8..n].copy_from_slice(&b);
    } else if n >= 4 {
        let (a, b) = (u32_at(src, 0), u32_at(src, n - 4));
        dst[..4].copy_from_slice(&a);
        dst[n - 4..n].copy_from_slice(&b);
    } else if n > 0 {
        // 1 to 3 bytes: first, middle, last (they overlap for n < 3).
        let (a, m, b) = (src[0], src[n / 2], src[n - 1]);
        dst[0] = a;
        dst[n / 2] = m;
        dst[n - 1] = b;
    }
}

#[inline(always)]
#[expect(
    clippy::inline_always,
    reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
)]
fn u128_at(s: &[u8], at: usize) -> [u8; 16] {
    let mut b = [0u8; 16];
    b.copy_from_slice(&s[at..at + 16]);
    b
}

#[inline(always)]
#[expect(
    clippy::inline_always,
    reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
)]
fn u64_at(s: &[u8], at: usize) -> [u8; 8] {
    let mut b = [0u8; 8];
    b.copy_from_slice(&s[at..at + 8]);
    b
}

#[inline(always)]
#[expect(
    clippy::inline_always,
    reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
)]
fn u32_at(s: &[u8], at: usize) -> [u8; 4] {
    let mut b = [0u8; 4];
    b.copy_from_slice(&s[at..at + 4]);
    b
}

/// Key length in bytes from an encoded row's header (`op u8 | seq u64 | key_len u32`).
#[inline]
pub(crate) fn key_len(row: &[u8]) -> usize {
    u32::from_le_bytes([row[9], row[10], row[11], row[12]]) as usize
}

fn check_columns<'a>(
    want: impl ExactSizeIterator<Item = (&'a String, &'a DataType)>,
    got: impl ExactSizeIterator<Item = (&'a String, &'a DataType)>,
) -> Result<(), UnifyError> {
    let want: Vec<_> = want.collect();
    let got: Vec<_> = got.collect();
    // Before a type is compared or formatted below (both recurse once per level of nesting).
    for (name, dt) in &got {
        check_type_depth(name, dt)?;
    }
    for (i, (name, dt)) in want.iter().enumerate() {
        match got.get(i) {
            None => {
                return Err(UnifyError::SchemaMismatch { detail: format!("missing column `{name}` ({dt}) at position {i}") });
            }
            Some((gname, gdt)) if gname != name => {
                return Err(UnifyError::SchemaMismatch { detail: format!("column {i} is `{gname}`, expected `{name}` ({dt})") });
            }
            Some((_, gdt)) if gdt != dt => {
                return Err(UnifyError::SchemaMismatch { detail: format!("column `{name}` has type {gdt}, expected {dt}") });
            }
            _ => {}
        }
    }
    if got.len() > want.len() {
        let (name, dt) = got[want.len()];
        return Err(UnifyError::SchemaMismatch { detail: format!("extra column `{name}` ({dt}) not in the table") });
    }
    Ok(())
}

fn first_null(a: &dyn Array) -> usize {
    (0..a.len()).find(|&i| a.is_null(i)).unwrap_or(0)
}

/// A batch's columns grouped by how rows are encoded, built once per batch so the per-row loop
/// copies fixed-width values without a per-value type dispatch or null test: fixed-width
/// columns of 4, 8 and 16 bytes without nulls each get a list of (slot offset, values);
/// everything else (booleans, other widths, columns with nulls, variable-length columns in
/// schema order) goes through the per-value path. (callgrind: the dispatch was most of
/// `encode_row`'s ~1,370 instructions per lineitem row.)
pub(crate) struct EncodePlan<'r, 'a> {
    readers: &'r [ColReader<'a>],
    f4: Vec<(usize, &'r [u8])>,
    f8: Vec<(usize, &'r [u8])>,
    f16: Vec<(usize, &'r [u8])>,
    /// Null-free [`ColKind::Decimal64`] columns: 16-byte values, the low 8 bytes stored.
    d64: Vec<(usize, &'r [u8])>,
    /// Column indices: booleans, other widths, fixed-width columns with nulls.
    other: Vec<usize>,
    /// Variable-length columns, in schema order.
    vars: Vec<VarCol<'a>>,
}

/// A variable-length column of an [`EncodePlan`]: its index, slot offset and value source.
pub(crate) struct VarCol<'a> {
    col: usize,
    slot: usize,
    src: VarSrc<'a>,
}

/// Where a variable-length column's values live, resolved once per batch.
#[derive(Clone, Copy)]
pub(crate) enum VarSrc<'a> {
    /// Utf8 / Binary.
    Off32 { offsets: &'a [i32], values: &'a [u8] },
    /// `LargeUtf8` / `LargeBinary`.
    Off64 { offsets: &'a [i64], values: &'a [u8] },
    /// `Utf8View` / `BinaryView` (Arrow columnar format, "Variable-size Binary View Layout":
    /// length in the low 32 bits; up to 12 bytes inline after it, else buffer index and offset
    /// in the high 64). `bytes` is the views buffer as bytes, for the inline values.
    View { views: &'a [u128], bytes: &'a [u8], buffers: &'a [arrow_buffer::Buffer] },
}

impl<'a> VarSrc<'a> {
    fn of_view<T: arrow_array::types::ByteViewType + ?Sized>(a: &'a arrow_array::GenericByteViewArray<T>) -> Self {
        VarSrc::View { views: a.views(), bytes: a.views().inner().as_slice(), buffers: a.data_buffers() }
    }

    /// Bytes of value `i` (not null), read from the buffers directly rather than through the
    /// array's `value` (callgrind: `GenericByteViewArray::value` was 7% of `encode_row`).
    #[inline(always)]
    #[expect(
        clippy::inline_always,
        reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
    )]
    fn value(&self, i: usize) -> &'a [u8] {
        match *self {
            VarSrc::Off32 { offsets, values } => &values[offsets[i] as usize..offsets[i + 1] as usize],
            VarSrc::Off64 { offsets, values } => &values[offsets[i] as usize..offsets[i + 1] as usize],
            VarSrc::View { views, bytes, buffers } => {
                let view = views[i];
                let len = view as u32 as usize;
                if len <= 12 {
                    &bytes[i * 16 + 4..i * 16 + 4 + len]
                } else {
                    let (buffer, offset) = ((view >> 64) as u32 as usize, (view >> 96) as u32 as usize);
                    &buffers[buffer][offset..offset + len]
                }
            }
        }
    }

    /// Writes value `i` (not null) at the start of `dst` and returns its length in bytes.
    #[inline(always)]
    #[expect(
        clippy::inline_always,
        reason = "measured: with #[inline] the call stays and all inserts cost 630 M instead of 603 M instructions (callgrind, SF 0.02)"
    )]
    fn write(&self, i: usize, dst: &mut [u8]) -> usize {
        if let VarSrc::View { views, .. } = *self {
            // An inline value is copied out of the view already loaded (reading it back
            // through `value`'s slice of the views buffer cost encode_row 216 M → 242 M
            // instructions, callgrind SF 0.02).
            let view = views[i];
            let len = view as u32 as usize;
            if len <= 12 {
                let inline = view.to_le_bytes();
                copy_short(&mut dst[..len], &inline[4..4 + len]);
                return len;
            }
        }
        let v = self.value(i);
        copy_short(&mut dst[..v.len()], v);
        v.len()
    }
}

/// Reads values of one Arrow column for encoding.
pub(crate) struct ColReader<'a> {
    /// The column's validity, `None` when it has no null (checked once per batch, so the
    /// per-value null test is one branch).
    nulls: Option<&'a arrow_buffer::NullBuffer>,
    values: Values<'a>,
}

pub(crate) enum Values<'a> {
    Bool(arrow_buffer::BooleanBuffer),
    /// The array's whole values buffer; its first value is at byte `start`, values are `width`
    /// bytes apart, and the row keeps the low `stored` bytes of each (`width` but for
    /// [`ColKind::Decimal64`]).
    Fixed {
        values: arrow_buffer::Buffer,
        start: usize,
        width: usize,
        stored: usize,
    },
    /// Every variable-length kind.
    Var(VarSrc<'a>),
}

impl<'a> ColReader<'a> {
    pub(crate) fn new(a: &'a ArrayRef, kind: ColKind) -> Self {
        let values = match kind {
            ColKind::Bool => Values::Bool(a.as_boolean().values().clone()),
            ColKind::Fixed(_) | ColKind::Decimal64 => {
                // Every fixed-width Arrow type keeps its values in buffer 0, `width` bytes each,
                // little endian, starting at the array's offset. (Cloning the buffer is an
                // `Arc` increment.)
                let (width, stored) = match kind {
                    ColKind::Fixed(w) => (w, w),
                    _ => (16, 8),
                };
                let data = a.to_data();
                Values::Fixed { values: data.buffers()[0].clone(), start: data.offset() * width, width, stored }
            }
            ColKind::Off32 => Values::Var(if a.data_type() == &DataType::Utf8 {
                let s = a.as_string::<i32>();
                VarSrc::Off32 { offsets: s.value_offsets(), values: s.value_data() }
            } else {
                let s = a.as_binary::<i32>();
                VarSrc::Off32 { offsets: s.value_offsets(), values: s.value_data() }
            }),
            ColKind::Off64 => Values::Var(if a.data_type() == &DataType::LargeUtf8 {
                let s = a.as_string::<i64>();
                VarSrc::Off64 { offsets: s.value_offsets(), values: s.value_data() }
            } else {
                let s = a.as_binary::<i64>();
                VarSrc::Off64 { offsets: s.value_offsets(), values: s.value_data() }
            }),
            ColKind::View => Values::Var(match a.data_type() {
                DataType::Utf8View => VarSrc::of_view(a.as_string_view()),
                _ => VarSrc::of_view(a.as_binary_view()),
            }),
        };
        Self { nulls: a.nulls().filter(|n| n.null_count() > 0), values }
    }

    #[inline]
    pub(crate) fn is_null(&self, i: usize) -> bool {
        self.nulls.is_some_and(|n| n.is_null(i))
    }

    /// Adds each row's variable-length byte count (0 for a null) to `sizes`; nothing for a
    /// fixed-width column.
    fn add_var_lens(&self, sizes: &mut [usize]) {
        match (&self.values, self.nulls) {
            (Values::Bool(_) | Values::Fixed { .. }, _) => {}
            (Values::Var(VarSrc::Off32 { offsets, .. }), None) => {
                for (s, w) in sizes.iter_mut().zip(offsets.windows(2)) {
                    *s += (w[1] - w[0]) as usize;
                }
            }
            (Values::Var(VarSrc::Off64 { offsets, .. }), None) => {
                for (s, w) in sizes.iter_mut().zip(offsets.windows(2)) {
                    *s += (w[1] - w[0]) as usize;
                }
            }
            // A view's low 32 bits are its length (Arrow columnar format, "Variable-size
            // Binary View Layout"): no need to resolve where its bytes live.
            (Values::Var(VarSrc::View { views, .. }), None) => add_view_lens(sizes, views),
            (Values::Var(src), Some(_)) => {
                for (i, s) in sizes.iter_mut().enumerate() {
                    if !self.is_null(i) {
                        *s += src.value(i).len();
                    }
                }
            }
        }
    }
}

fn add_view_lens(sizes: &mut [usize], views: &[u128]) {
    for (s, &v) in sizes.iter_mut().zip(views) {
        *s += (v as u32) as usize;
    }
}

/// Refuses a Decimal128 column with a value of more digits than `field`'s precision (nulls
/// are not checked): Arrow builds such arrays without complaint, and Parquet writes the column
/// in the bytes the precision needs, which would cut the value at the flush (as a key, two keys
/// could become one and the file's keys unsorted).
fn check_decimal_precision(field: &arrow_schema::Field, col: &dyn arrow_array::Array) -> Result<(), UnifyError> {
    let arrow_schema::DataType::Decimal128(precision, _) = field.data_type() else { return Ok(()) };
    let Some(a) = col.as_any().downcast_ref::<arrow_array::Decimal128Array>() else { return Ok(()) };
    let max = 10i128.checked_pow(u32::from(*precision)).map_or(i128::MAX, |p| p - 1);
    // `v` in `-max..=max` exactly when `v + max` (wrapping, as u128) is at most `2 * max`: one
    // add and one compare per value, folded without a branch so the common all-valid case
    // runs as a straight loop (the write path checks every decimal column of every batch).
    let span = max.unsigned_abs() * 2;
    let out = |v: i128| v.cast_unsigned().wrapping_add(max.cast_unsigned()) > span;
    let values = a.values();
    if a.null_count() == 0 && !values.iter().fold(false, |acc, &v| acc | out(v)) {
        return Ok(());
    }
    let bad = a.iter().position(|v| v.is_some_and(out));
    match bad {
        None => Ok(()),
        Some(row) => Err(UnifyError::ValueOutOfRange {
            column: field.name().clone(),
            row,
            detail: format!("the unscaled Decimal128 value {} has more than {precision} digits, the column's precision", a.value(row)),
        }),
    }
}

/// Refuses a string column (`Utf8`, `LargeUtf8`, `Utf8View`) with a valid value that is not
/// UTF-8 (nulls' bytes are not checked: the WAL logs them only when they are UTF-8, storage's
/// `compact_for_log`), and a byte column (those and `Binary`, `LargeBinary`) whose offsets run
/// backwards or past its values in any row. Arrow's `new_unchecked` constructors, FFI and unvalidated
/// IPC build such arrays; accepted, the row was acknowledged and logged, and the next open's
/// WAL replay, which checks UTF-8 when it casts the record back, refused the whole data
/// directory (helper-49's F4); a flushed file would fail every reader.
///
/// Cheap for valid input: an offsets column's value bytes are checked as one run
/// (`std::str::from_utf8`, which skips ASCII a word at a time) and each offset only for a
/// character boundary; a view column's data buffers are checked whole, a long view's ends
/// for boundaries and an inline view's bytes for ASCII (a mask). These passes look at every
/// row, nulls included, without a branch on validity; only when they fail (a null's bytes
/// or view are not UTF-8, an inline value is not ASCII, or a value is bad) is each valid
/// value checked, to name the first bad row.
fn check_utf8(field: &arrow_schema::Field, col: &dyn arrow_array::Array) -> Result<(), UnifyError> {
    let bad = match col.data_type() {
        DataType::Utf8 => first_bad_offsets_value(col.as_string::<i32>()),
        DataType::LargeUtf8 => first_bad_offsets_value(col.as_string::<i64>()),
        DataType::Utf8View => first_bad_view_value(col.as_string_view()),
        DataType::Binary => binary_disordered_offset(col.as_binary::<i32>()),
        DataType::LargeBinary => binary_disordered_offset(col.as_binary::<i64>()),
        _ => None,
    };
    match bad {
        None => Ok(()),
        Some(row) => Err(UnifyError::ValueOutOfRange {
            column: field.name().clone(),
            row,
            detail: format!("the value's bytes are not UTF-8 or its offsets are out of order or past its values ({} column)", col.data_type()),
        }),
    }
}

/// The first row whose offsets run backwards (`offsets[i] > offsets[i + 1]`) or past the
/// `values` bytes, null rows included.
fn first_disordered_offset<O: arrow_array::OffsetSizeTrait>(offsets: &[O], values: usize) -> Option<usize> {
    (0..offsets.len().saturating_sub(1)).find(|&i| offsets[i] > offsets[i + 1] || offsets[i + 1].as_usize() > values)
}

/// [`first_disordered_offset`] of a binary column's offsets over its value bytes.
fn binary_disordered_offset<O: arrow_array::OffsetSizeTrait>(a: &arrow_array::GenericBinaryArray<O>) -> Option<usize> {
    first_disordered_offset(a.value_offsets(), a.value_data().len())
}

/// Whether UTF-8 byte `c` starts a character (is not a continuation byte, `0b10xx_xxxx`):
/// as a signed byte, continuation bytes are −128..=−65. `str::is_char_boundary`'s test, on a
/// byte, so the checks below need no `str` (their bytes are not yet known to be UTF-8).
#[inline]
fn starts_char(c: u8) -> bool {
    (c as i8) >= -0x40
}

/// The first valid row of `a` whose bytes are not UTF-8 ([`check_utf8`]).
fn first_bad_offsets_value<O: arrow_array::OffsetSizeTrait>(a: &arrow_array::GenericStringArray<O>) -> Option<usize> {
    let offsets = a.value_offsets();
    let bytes = a.value_data();
    // Any row, null or not, whose offsets run backwards or past the values: the IPC encoder,
    // the row encoder and `arrow_row` index by them (non-monotonic key offsets aborted the
    // process in a 576 PB allocation; value offsets panicked after the WAL record was
    // written, helper-50's F2).
    if let Some(row) = first_disordered_offset(offsets, bytes.len()) {
        return Some(row);
    }
    let (first, last) = (offsets.first()?.as_usize(), offsets.last()?.as_usize());
    // The fast path: the bytes the offsets span are UTF-8 and every offset, nulls' included,
    // is a character boundary in them (one load a row; a continuation byte is 0b10xx_xxxx).
    // Then every value, null or not, is UTF-8.
    if let Some(run) = bytes.get(first..last)
        && std::str::from_utf8(run).is_ok()
        && offsets.iter().fold(true, |ok, &o| ok & run.get(o.as_usize() - first).is_none_or(|&c| starts_char(c)))
    {
        return None;
    }
    // Only valid rows count: a null's bytes may be anything.
    (0..a.len()).find(|&i| {
        a.is_valid(i) && {
            let (s, e) = (offsets[i].as_usize(), offsets[i + 1].as_usize());
            bytes.get(s..e).is_none_or(|v| std::str::from_utf8(v).is_err())
        }
    })
}

/// The first valid row of `a` whose bytes are not UTF-8 ([`check_utf8`]).
fn first_bad_view_value(a: &arrow_array::StringViewArray) -> Option<usize> {
    let views = a.views();
    let buffers = a.data_buffers();
    if buffers.iter().all(|b| std::str::from_utf8(b).is_ok()) && views_are_utf8(views, buffers) {
        return None;
    }
    // Only valid rows count: a null's view may be anything.
    (0..a.len()).find(|&i| {
        if !a.is_valid(i) {
            return false;
        }
        let v = views[i];
        let len = v as u32 as usize;
        if len <= 12 {
            let inline = v.to_le_bytes();
            return std::str::from_utf8(&inline[4..4 + len]).is_err();
        }
        let (b, at) = ((v >> 64) as u32 as usize, (v >> 96) as u32 as usize);
        buffers.get(b).and_then(|buf| buf.get(at..at + len)).is_none_or(|b| std::str::from_utf8(b).is_err())
    })
}

/// Whether every view of `views` (nulls' included), over `buffers` that are each UTF-8, is
/// UTF-8 by a cheap test: an inline view's bytes are ASCII (their high bits, masked to its
/// length, are combined with OR over the whole array and tested once), a long view lies inside its
/// buffer and starts and ends on character boundaries (a continuation byte is `0b10xx_xxxx`).
/// `false` says only that the test could not tell (a non-ASCII inline value, a null's
/// garbage view), not that a value is bad. No branch on validity and no variable shift:
/// `check_utf8` of lineitem's five `Utf8View` columns fell from 171 to 107 instructions a row
/// with this loop (callgrind, docs/performance.md, thirty-ninth pass).
fn views_are_utf8(views: &[u128], buffers: &[arrow_buffer::Buffer]) -> bool {
    const HIGH: u128 = 0x8080_8080_8080_8080_8080_8080;
    // The high bit of each of an inline view's first `len` bytes (bytes 4.. of the view,
    // shifted down by 32), by `len`: one load a view instead of a variable `u128` shift.
    const MASKS: [u128; 13] = {
        let mut m = [0u128; 13];
        let mut len = 1;
        while len <= 12 {
            m[len] = HIGH & ((1u128 << (8 * len)) - 1);
            len += 1;
        }
        m
    };
    let boundary = |buf: &[u8], j: usize| buf.get(j).is_none_or(|&c| starts_char(c));
    let mut high = 0u128;
    let mut ok = true;
    for &v in views {
        let len = v as u32 as usize;
        if let Some(&mask) = MASKS.get(len) {
            high |= (v >> 32) & mask;
        } else {
            let (b, at) = ((v >> 64) as u32 as usize, (v >> 96) as u32 as usize);
            ok &= buffers.get(b).is_some_and(|buf| at + len <= buf.len() && boundary(buf, at) && boundary(buf, at + len));
        }
    }
    ok && high == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Decimal128Array;
    use arrow_schema::Field;

    /// `value_bytes_by_row` finds each row's first longest value and the sum of its values
    /// over the variable-width columns of a sliced batch (offsets not from 0, a null whose
    /// offsets span bytes, views), and nothing for fixed-width columns only.
    #[test]
    fn value_bytes_by_row_of_sliced_batches_with_nulls_and_views() {
        use arrow_array::{ArrayRef, BinaryArray, Int64Array, LargeStringArray, StringViewArray};
        use arrow_schema::Schema;
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("a", DataType::Binary, true),
            Field::new("b", DataType::LargeUtf8, true),
            Field::new("c", DataType::Utf8View, true),
        ]));
        let codec = RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap();
        let a = BinaryArray::from(vec![Some(&[0u8; 900][..]), Some(&[1; 5][..]), Some(&[2; 40][..]), None, Some(&[3; 40][..])]);
        let b = LargeStringArray::from(vec![Some("x".repeat(800)), None, Some("y".repeat(30)), Some("z".repeat(41)), None]);
        let c = StringViewArray::from(vec![None, Some("v".repeat(41)), Some("w".repeat(20)), None, Some("u".repeat(39))]);
        let cols: Vec<ArrayRef> = vec![Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])), Arc::new(a), Arc::new(b), Arc::new(c)];
        let batch = RecordBatch::try_new(Arc::clone(&schema), cols).unwrap();
        let row = |column, largest, values| RowValueBytes { column, largest, values, key_values: 0 };
        // Row 0: 900 + 800; row 1: 5 + 41 (the view); row 2: 40 + 30 + 20; row 3: 41 (`b`,
        // beside a null in `a` and `c`); row 4: 40 in `a` before 39 in `c`.
        let whole = vec![row(1, 900, 1700), row(3, 41, 46), row(1, 40, 90), row(2, 41, 41), row(1, 40, 79)];
        assert_eq!(codec.value_bytes_by_row(&batch), whole);
        assert_eq!(codec.value_bytes_by_row(&batch.slice(1, 4)), whole[1..5].to_vec());
        assert_eq!(codec.value_bytes_by_row(&batch.slice(3, 2)), whole[3..5].to_vec());
        // A tie goes to the earlier column: 41 in `b` then 41 in `c`.
        let tie = LargeStringArray::from(vec![Some("t".repeat(41))]);
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(vec![9])),
            Arc::new(BinaryArray::from(vec![None::<&[u8]>])),
            Arc::new(tie),
            Arc::new(StringViewArray::from(vec![Some("s".repeat(41))])),
        ];
        assert_eq!(codec.value_bytes_by_row(&RecordBatch::try_new(Arc::clone(&schema), cols).unwrap()), vec![row(2, 41, 82)]);
        let fixed = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let only = RecordBatch::try_new(Arc::clone(&fixed), vec![Arc::new(Int64Array::from(vec![1, 2]))]).unwrap();
        assert_eq!(RowCodec::new(fixed, &[0], 1 << 20).unwrap().value_bytes_by_row(&only), vec![RowValueBytes::default(); 2]);
        // Values of key columns count in `key_values` too: key (k, s), value t.
        let keyed =
            Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, false), Field::new("t", DataType::Utf8, true)]));
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(vec![1, 2])),
            Arc::new(arrow_array::StringArray::from(vec!["abc", "de"])),
            Arc::new(arrow_array::StringArray::from(vec![Some("wxyz"), None])),
        ];
        let b = RecordBatch::try_new(Arc::clone(&keyed), cols).unwrap();
        assert_eq!(
            RowCodec::new(keyed, &[0, 1], 1 << 20).unwrap().value_bytes_by_row(&b),
            vec![RowValueBytes { column: 2, largest: 4, values: 7, key_values: 3 }, RowValueBytes { column: 1, largest: 2, values: 2, key_values: 2 }]
        );
    }

    /// Every length from 0 to 70 bytes (each branch of `copy_short` and both sides of its
    /// boundaries) copies exactly those bytes, at every alignment of source and target, and
    /// touches nothing around the target.
    #[test]
    fn copy_short_copies_exactly_len_bytes() {
        let src: Vec<u8> = (0..100u8).map(|b| b.wrapping_mul(37).wrapping_add(1)).collect();
        for n in 0..=70 {
            for from in 0..3 {
                for to in 0..3 {
                    let mut dst = [0xEEu8; 80];
                    copy_short(&mut dst[to..to + n], &src[from..from + n]);
                    assert_eq!(&dst[to..to + n], &src[from..from + n], "len {n}, from {from}, to {to}");
                    assert!(dst[..to].iter().chain(&dst[to + n..]).all(|&b| b == 0xEE), "len {n}: wrote outside");
                }
            }
        }
    }

    /// Invalid UTF-8 in a valid value is refused with its row, in every string layout: an
    /// offsets column (whole and sliced; a bad byte in the middle of a value, a value cut
    /// inside a character), a view column (inline and long values); a null's bytes, and bytes
    /// outside every value, are not checked; valid multi-byte text passes.
    #[test]
    fn invalid_utf8_is_refused_with_its_row() {
        use arrow_array::{LargeStringArray, StringArray, StringViewArray};
        use arrow_buffer::{Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
        let f = |t: DataType| Field::new("s", t, true);
        let row_of = |f: &Field, a: &dyn Array| match check_utf8(f, a) {
            Ok(()) => None,
            Err(UnifyError::ValueOutOfRange { row, column, .. }) => {
                assert_eq!(column, "s");
                Some(row)
            }
            Err(e) => panic!("{e}"),
        };
        // "ab", "ü" (2 bytes), "\xff", "cd", "é" cut after its first byte, "x".
        let bytes: Vec<u8> = [b"ab".as_slice(), "ü".as_bytes(), &[0xff], b"cd", &"é".as_bytes()[..1], b"x"].concat();
        let offsets = |ends: &[i32]| OffsetBuffer::new(ScalarBuffer::from(ends.to_vec()));
        let ends = [0, 2, 4, 5, 7, 8, 9];
        // SAFETY: (test) the offsets are in bounds and monotonic; the bytes are deliberately
        // not all UTF-8, which `new_unchecked` allows and `check_utf8` exists to catch.
        let all = unsafe { StringArray::new_unchecked(offsets(&ends), Buffer::from(bytes.clone()), None) };
        assert_eq!(row_of(&f(DataType::Utf8), &all), Some(2));
        assert_eq!(row_of(&f(DataType::Utf8), &all.slice(3, 3)), Some(1), "the cut character, row 4 of the parent");
        assert_eq!(row_of(&f(DataType::Utf8), &all.slice(0, 2)), None, "\"ab\", \"ü\"");
        assert_eq!(row_of(&f(DataType::Utf8), &all.slice(3, 1)), None, "\"cd\" alone");
        // The same rows with the bad ones null: nothing to refuse.
        let nulls = NullBuffer::from(vec![true, true, false, true, false, true]);
        // SAFETY: (test) as above.
        let masked = unsafe { StringArray::new_unchecked(offsets(&ends), Buffer::from(bytes.clone()), Some(nulls)) };
        assert_eq!(row_of(&f(DataType::Utf8), &masked), None);
        // A value ending inside a character of an otherwise valid run ("ü" cut in two).
        // SAFETY: (test) as above.
        let split = unsafe { StringArray::new_unchecked(offsets(&[0, 3, 4]), Buffer::from("abü".as_bytes().to_vec()), None) };
        assert_eq!(row_of(&f(DataType::Utf8), &split), Some(0));
        let large_ends: Vec<i64> = ends.iter().map(|&e| i64::from(e)).collect();
        // SAFETY: (test) as above.
        let large = unsafe { LargeStringArray::new_unchecked(OffsetBuffer::new(ScalarBuffer::from(large_ends)), Buffer::from(bytes.clone()), None) };
        assert_eq!(row_of(&f(DataType::LargeUtf8), &large), Some(2));
        // Views: a valid long and inline value, then an inline bad one, then a long bad one.
        let good = StringViewArray::from(vec!["a long value über twelve bytes", "kurz ü"]);
        assert_eq!(row_of(&f(DataType::Utf8View), &good), None);
        let mut inline_bad = [0u8; 16];
        inline_bad[..4].copy_from_slice(&3u32.to_le_bytes());
        inline_bad[4..7].copy_from_slice(&[b'a', 0xc3, b'b']);
        let long: Vec<u8> = [b"0123456789abcdef".as_slice(), &[0xff], b"xyz"].concat();
        let long_view = |at: u32, len: u32| {
            let mut v = [0u8; 16];
            v[..4].copy_from_slice(&len.to_le_bytes());
            v[4..8].copy_from_slice(&long[at as usize..at as usize + 4]);
            v[8..12].copy_from_slice(&0u32.to_le_bytes());
            v[12..].copy_from_slice(&at.to_le_bytes());
            u128::from_le_bytes(v)
        };
        let views = ScalarBuffer::from(vec![long_view(0, 16), u128::from_le_bytes(inline_bad), long_view(0, 20)]);
        // SAFETY: (test) every view is in bounds of buffer 0; the bytes are deliberately not
        // all UTF-8.
        let bad = unsafe { StringViewArray::new_unchecked(views.clone(), vec![Buffer::from(long.clone())], None) };
        assert_eq!(row_of(&f(DataType::Utf8View), &bad), Some(1));
        assert_eq!(row_of(&f(DataType::Utf8View), &bad.slice(2, 1)), Some(0), "the long value with 0xff");
        assert_eq!(row_of(&f(DataType::Utf8View), &bad.slice(0, 1)), None, "a valid value of a buffer that is not UTF-8 throughout");
        // Nulls holding garbage fail the fast pass over every view and are then skipped: a
        // non-UTF-8 inline view and a view past the buffers' end, both null, beside valid
        // values; the same garbage in a valid row names that row.
        let garbage = |i: u32| {
            let mut v = [0u8; 16];
            v[..4].copy_from_slice(&40u32.to_le_bytes());
            v[8..12].copy_from_slice(&i.to_le_bytes());
            u128::from_le_bytes(v)
        };
        let mixed = ScalarBuffer::from(vec![long_view(0, 16), u128::from_le_bytes(inline_bad), garbage(7), long_view(0, 16)]);
        let nulls = NullBuffer::from(vec![true, false, false, true]);
        // SAFETY: (test) the valid views are in bounds of buffer 0; the null ones are
        // deliberately not (a view past the buffers, non-UTF-8 inline bytes), which
        // `new_unchecked` allows and nothing may read.
        let masked = unsafe { StringViewArray::new_unchecked(mixed.clone(), vec![Buffer::from(long.clone())], Some(nulls)) };
        assert_eq!(row_of(&f(DataType::Utf8View), &masked), None);
        // SAFETY: (test) as above; row 2 is valid and points past the buffers.
        let exposed = unsafe { StringViewArray::new_unchecked(mixed, vec![Buffer::from(long.clone())], Some(NullBuffer::from(vec![true, false, true, true]))) };
        assert_eq!(row_of(&f(DataType::Utf8View), &exposed), Some(2));
        // An offsets column whose null row's offsets cut a character ("ü" split between a
        // null and the next row would be refused were the next valid; here both are null).
        // SAFETY: (test) the offsets are in bounds and monotonic.
        let cut = unsafe {
            StringArray::new_unchecked(offsets(&[0, 2, 3, 4]), Buffer::from("abü".as_bytes().to_vec()), Some(NullBuffer::from(vec![true, false, false])))
        };
        assert_eq!(row_of(&f(DataType::Utf8), &cut), None);
        // SAFETY: (test) as above.
        let cut_valid = unsafe {
            StringArray::new_unchecked(offsets(&[0, 2, 3, 4]), Buffer::from("abü".as_bytes().to_vec()), Some(NullBuffer::from(vec![true, true, false])))
        };
        assert_eq!(row_of(&f(DataType::Utf8), &cut_valid), Some(1));
        // Other types are not checked.
        assert_eq!(row_of(&f(DataType::Binary), &arrow_array::BinaryArray::from(vec![[0xffu8].as_slice()])), None);
    }

    /// The precision bounds at both ends of Decimal128's range: precision 1 and 38 accept
    /// `±(10^p − 1)` and refuse one more (and `i128::MIN`/`MAX` at 38), naming the first bad
    /// row; nulls are not checked.
    #[test]
    fn decimal_precision_bounds() {
        for p in [1_u8, 18, 38] {
            let f = Field::new("d", DataType::Decimal128(p, 0), true);
            let max = 10i128.pow(u32::from(p)) - 1;
            let ok = Decimal128Array::from(vec![Some(-max), None, Some(0), Some(max)]).with_precision_and_scale(p, 0).unwrap();
            check_decimal_precision(&f, &ok).unwrap();
            let mut bad = vec![(max + 1, 2), (-max - 1, 2)];
            if p == 38 {
                bad.extend([(i128::MAX, 2), (i128::MIN, 2)]);
            }
            for (v, row) in bad {
                let a = Decimal128Array::from(vec![Some(0), None, Some(v), Some(v)]).with_precision_and_scale(p, 0).unwrap();
                match check_decimal_precision(&f, &a) {
                    Err(UnifyError::ValueOutOfRange { row: r, .. }) => assert_eq!(r, row, "precision {p}, value {v}"),
                    other => panic!("precision {p}, value {v}: {other:?}"),
                }
                let no_nulls = Decimal128Array::from(vec![0, v]).with_precision_and_scale(p, 0).unwrap();
                assert!(check_decimal_precision(&f, &no_nulls).is_err(), "precision {p}, value {v}, no nulls");
            }
        }
    }

    /// A `List` of a `List` of ... `Int64`, `depth` levels deep (built without recursion).
    fn deep_list(depth: usize) -> DataType {
        let mut t = DataType::Int64;
        for _ in 1..depth {
            t = DataType::List(Arc::new(Field::new("item", t, true)));
        }
        t
    }

    /// Runs `work` on a thread with a stack of `bytes`.
    fn on_stack<T: Send + 'static>(bytes: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new().stack_size(bytes).spawn(work).expect("spawn").join().expect("no panic")
    }

    #[test]
    fn a_deeply_nested_column_type_is_refused_typed_not_formatted() {
        let schema =
            |t: DataType| -> SchemaRef { Arc::new(arrow_schema::Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", t, true)])) };
        assert!(matches!(
            RowCodec::new(schema(deep_list(MAX_TYPE_DEPTH)), &[0], 1 << 20),
            Err(UnifyError::UnsupportedType { column, .. }) if column == "v"
        ));
        assert!(matches!(
            RowCodec::new(schema(deep_list(MAX_TYPE_DEPTH + 1)), &[0], 1 << 20),
            Err(UnifyError::TypeTooDeep { column, depth, limit }) if column == "v" && depth == MAX_TYPE_DEPTH + 1 && limit == MAX_TYPE_DEPTH
        ));
        let deep = on_stack(256 << 20, move || {
            let t = deep_list(10_000);
            let batch =
                RecordBatch::try_new(schema(t.clone()), vec![Arc::new(arrow_array::Int64Array::from(Vec::<i64>::new())), arrow_array::new_empty_array(&t)])
                    .expect("batch");
            (schema(t), batch)
        });
        let deep = Arc::new(deep);
        let shared = Arc::clone(&deep);
        let (created, validated) = on_stack(2 << 20, move || {
            let created = RowCodec::new(Arc::clone(&shared.0), &[0], 1 << 20).map(|_| ());
            let table = RowCodec::new(schema(DataType::Int64), &[0], 1 << 20).expect("flat table");
            let validated = table.validate(&shared.1);
            let keys_validated = table.validate_keys(&shared.1.project(&[1]).expect("project"));
            drop(shared);
            (created.map_err(|e| e.to_string()), (validated.map_err(|e| e.to_string()), keys_validated.map_err(|e| e.to_string())))
        });
        let want = "column `v` has a type nested 10000 levels deep, more than 64; nested types are not supported";
        assert_eq!(created, Err(want.to_owned()));
        assert_eq!(validated.0, Err(want.to_owned()));
        assert_eq!(validated.1, Err(want.to_owned()));
        on_stack(256 << 20, move || drop(deep));
    }

    /// `max_row_bytes` above what the row format's `u32` lengths hold is taken as that
    /// maximum, so no accepted row can wrap a length or offset.
    #[test]
    fn max_row_bytes_is_capped_at_u32_max() {
        let s: SchemaRef = Arc::new(arrow_schema::Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        assert_eq!(RowCodec::new(Arc::clone(&s), &[0], usize::MAX).expect("codec").max_row_bytes, u32::MAX as usize);
        assert_eq!(RowCodec::new(s, &[0], 1 << 20).expect("codec").max_row_bytes, 1 << 20);
        assert_eq!(MAX_ROW_BYTES, u32::MAX as usize);
    }
}

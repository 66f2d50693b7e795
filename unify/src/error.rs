use arrow_schema::{ArrowError, DataType};
use gritdb_memctl::MemoryError;

/// Errors of the delta store: bad input (the whole batch is rejected and nothing changes),
/// or no memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UnifyError {
    /// A column type the row codec does not support.
    #[error(
        "column `{column}` has unsupported type {data_type}; supported: Boolean, Int8-64, UInt8-64, Float16/32/64, Decimal128 (precision 1-38, scale 0 to precision), Date32/64, Time32/64, Timestamp, Duration, Utf8, LargeUtf8, Utf8View, Binary, LargeBinary, BinaryView"
    )]
    UnsupportedType {
        /// Column name.
        column: String,
        /// Its type.
        data_type: DataType,
    },
    /// A column type nests deeper than [`crate::MAX_TYPE_DEPTH`] levels (a `List` of a
    /// `Struct` of ... ). No nested type is a supported column type; this is the refusal of
    /// one too deep to be shown in an error message, since formatting (and comparing) an Arrow
    /// `DataType` recurses once per level: a type nested 100,000 deep aborted the process
    /// being formatted into [`UnifyError::SchemaMismatch`].
    #[error("column `{column}` has a type nested {depth} levels deep, more than {limit}; nested types are not supported")]
    TypeTooDeep {
        /// Column name.
        column: String,
        /// Nesting depth of its type ([`crate::type_depth`]).
        depth: usize,
        /// [`crate::MAX_TYPE_DEPTH`].
        limit: usize,
    },
    /// The batch's schema does not match the table's.
    #[error("schema mismatch: {detail}")]
    SchemaMismatch {
        /// What differs, naming the column.
        detail: String,
    },
    /// A primary-key column holds a null.
    #[error("primary-key column `{column}` is null at row {row}; primary keys must be non-null")]
    NullKey {
        /// Column name.
        column: String,
        /// Row index within the batch.
        row: usize,
    },
    /// A non-nullable column holds a null.
    #[error("column `{column}` is declared non-nullable but is null at row {row}")]
    NullInNonNullable {
        /// Column name.
        column: String,
        /// Row index within the batch.
        row: usize,
    },
    /// A value does not fit its column's declared type: a Decimal128 value with more digits
    /// than the column's precision (Arrow does not check this when an array is built; Parquet
    /// stores such a column in as few bytes as the precision needs, so the value would be cut).
    #[error("column `{column}` row {row}: {detail}")]
    ValueOutOfRange {
        /// Column name.
        column: String,
        /// Row index within the batch.
        row: usize,
        /// The value and the type it does not fit.
        detail: String,
    },
    /// An encoded row is larger than the configured maximum row size.
    #[error("row {row} encodes to {bytes} bytes, above the maximum row size of {max} bytes (EngineConfig::max_row_bytes)")]
    RowTooLarge {
        /// Row index within the batch.
        row: usize,
        /// Encoded size in bytes.
        bytes: usize,
        /// The configured maximum in bytes.
        max: usize,
    },
    /// No memory for the rows (after the caller's backpressure).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// An Arrow error while encoding keys or building arrays.
    #[error("arrow error: {0}")]
    Arrow(#[from] ArrowError),
}

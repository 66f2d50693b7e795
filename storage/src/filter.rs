//! Scan predicates: what a filter is ([`ScanFilter`]), how it is checked against a table
//! schema ([`ScanFilter::bind`]), evaluated exactly on a batch ([`BoundFilter::evaluate`]),
//! and used to skip row groups and pages of a data file by their Parquet statistics
//! ([`BoundFilter::plan`]).
//!
//! Semantics are exact and SQL-like: a row is returned only when the predicate is **true**
//! for it. A comparison with a null value (in the column or as the literal) is not true, so
//! `x <> 5` does not return rows where `x` is null. Values compare as Arrow's comparison
//! kernels (`arrow_ord::cmp`) compare them, floats after both sides are made canonical
//! (`gritdb_keys::canonical_floats`): `-0.0 = 0.0`, every `NaN` equals every other `NaN`, and
//! `NaN` is greater than every number. That is how `PostgreSQL` and `DuckDB` compare floats,
//! and how keys are identified, so `k = 0.0` returns the row whose key was written as `-0.0`.
//! (Arrow's kernels alone compare in IEEE 754 totalOrder, where `-0.0 < 0.0` and NaNs differ
//! by sign and payload; `DataFusion` 55's SQL drops the sign of zero only, so it orders a
//! negative NaN below −∞: `docs/sql.md`.)
//!
//! Pruning never changes a result, it only skips reading: a row group (or page) is skipped
//! when its statistics prove that no row in it can make the predicate true. Float columns
//! are not pruned by statistics (Parquet's float statistics leave out `NaN`); they are
//! filtered row by row.
//!
//! Nesting is bounded: a filter nested more than [`MAX_FILTER_DEPTH`] levels deep is refused
//! by [`ScanFilter::bind`] ([`FilterError::TooDeep`]), measured without recursion before any
//! recursive walk, because binding, evaluation and pruning recurse once per level (a filter
//! nested 100,000 deep overflowed the stack and aborted the process). Dropping, cloning and
//! formatting a filter of any depth are safe too: drop and clone walk the tree with a heap
//! stack, and `Display` / `Debug` stop at that depth.

use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, Scalar, UInt64Array, new_empty_array};
use arrow_buffer::BooleanBuffer;
use arrow_schema::{ArrowError, DataType, Schema};
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::file::metadata::ParquetMetaData;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A comparison operator of [`ScanFilter::Compare`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CompareOp {
    /// `column = literal`
    Eq,
    /// `column <> literal`
    NotEq,
    /// `column < literal`
    Lt,
    /// `column <= literal`
    LtEq,
    /// `column > literal`
    Gt,
    /// `column >= literal`
    GtEq,
}

impl std::fmt::Display for CompareOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Eq => "=",
            Self::NotEq => "<>",
            Self::Lt => "<",
            Self::LtEq => "<=",
            Self::Gt => ">",
            Self::GtEq => ">=",
        })
    }
}

/// A predicate a scan pushes down: only rows for which it is true are returned.
///
/// Build it with [`ScanFilter::compare`], [`ScanFilter::is_null`], [`ScanFilter::is_not_null`],
/// [`ScanFilter::and`], [`ScanFilter::or`] (or the variants directly). Columns are named as in
/// the table schema (exact, case-sensitive).
///
/// ```
/// use std::sync::Arc;
/// use arrow_array::Int64Array;
/// use gritdb_storage::{CompareOp, ScanFilter};
/// let f = ScanFilter::and([
///     ScanFilter::compare("id", CompareOp::GtEq, Arc::new(Int64Array::from(vec![100]))),
///     ScanFilter::is_not_null("name"),
/// ]);
/// assert_eq!(f.to_string(), "(id >= 100 AND name IS NOT NULL)");
/// ```
///
/// At most [`MAX_FILTER_DEPTH`] levels of nesting bind ([`FilterError::TooDeep`] beyond);
/// `And` and `Or` take any number of parts, so a long chain of one operator is one level.
#[non_exhaustive]
pub enum ScanFilter {
    /// `column <op> value`. `value` is a one-element Arrow array (the literal). Its type must
    /// be the column's type, or losslessly convertible to it within one family: integers,
    /// floats and decimals among themselves; `Utf8`/`LargeUtf8`/`Utf8View` among themselves;
    /// `Binary`/`LargeBinary`/`BinaryView` among themselves. Floats are made canonical first
    /// (module docs), so a NaN of any sign, payload or width, and −0.0, convert wherever the
    /// value they name exists (−0.0 is 0 for an integer column); 0.1 for a `Float32` column
    /// does not. A null literal makes the comparison true for no row.
    Compare {
        /// Column name.
        column: String,
        /// Operator.
        op: CompareOp,
        /// The literal: an array of exactly one element.
        value: ArrayRef,
    },
    /// `column IS NULL`.
    IsNull(String),
    /// `column IS NOT NULL`.
    IsNotNull(String),
    /// True when every part is true (an empty list is true).
    And(Vec<ScanFilter>),
    /// True when some part is true (an empty list is false).
    Or(Vec<ScanFilter>),
}

/// Deepest [`ScanFilter`] nesting [`ScanFilter::bind`] accepts: a leaf is depth 1, an `And` or
/// `Or` one more than its deepest part.
///
/// Why 128: binding, evaluating and pruning a filter recurse once per level, about 1.0, 0.4
/// and 1.3 KiB of stack a level in the `ci` profile (measured: a filter 256 deep needed 267,
/// 107 and 327 KiB; one 128 deep 139, 59 and 171 KiB), and a scan runs on whatever thread
/// the caller has — a spawned thread or a tokio worker gets 2 MiB by default, and a SQL
/// query's operators already use some of it. 128 levels stay under a tenth of that in the
/// `ci` profile, leaving room for unoptimised builds, whose frames are several times larger
/// (`filter::depth_tests::a_filter_at_the_limit_runs_in_512_kib_of_stack`). Real predicates
/// are wide, not deep: `And` / `Or` take any number of parts (`a = 1 OR a = 2 OR ...` is one
/// level however long, and the SQL translation flattens chains of one operator the same
/// way), so only alternations of AND and OR nest. (`DuckDB`'s `max_expression_depth`
/// defaults to 1,000 for the same purpose, with a larger stack; sqlparser's recursion limit
/// is 50.)
pub const MAX_FILTER_DEPTH: usize = 128;

impl ScanFilter {
    /// Nesting depth: 1 for a comparison or null test, one more than the deepest part for
    /// `And` / `Or` (an empty one counts as a leaf). Computed with a heap stack, not recursion,
    /// so it is safe on a filter of any depth.
    pub fn depth(&self) -> usize {
        let mut deepest = 0;
        let mut todo = vec![(self, 1usize)];
        while let Some((f, d)) = todo.pop() {
            deepest = deepest.max(d);
            if let Self::And(parts) | Self::Or(parts) = f {
                todo.extend(parts.iter().map(|p| (p, d + 1)));
            }
        }
        deepest
    }

    /// `column <op> value`, `column IS NULL` or `column IS NOT NULL` copied; `None` for
    /// `And` / `Or`.
    fn clone_leaf(&self) -> Option<Self> {
        Some(match self {
            Self::Compare { column, op, value } => Self::Compare { column: column.clone(), op: *op, value: Arc::clone(value) },
            Self::IsNull(c) => Self::IsNull(c.clone()),
            Self::IsNotNull(c) => Self::IsNotNull(c.clone()),
            Self::And(_) | Self::Or(_) => return None,
        })
    }
}

/// Drops the parts with a heap stack: the derived drop recursed once per level, and a filter
/// nested 1,000,000 deep overflowed an 8 MiB stack being dropped.
impl Drop for ScanFilter {
    fn drop(&mut self) {
        let mut todo = match self {
            Self::And(parts) | Self::Or(parts) if !parts.is_empty() => std::mem::take(parts),
            _ => return,
        };
        while let Some(mut f) = todo.pop() {
            if let Self::And(parts) | Self::Or(parts) = &mut f {
                todo.append(parts);
            }
            // `f` drops here with no parts left: no recursion.
        }
    }
}

/// Copies with a heap stack (see [`Drop`]): a derived clone recursed once per level.
impl Clone for ScanFilter {
    fn clone(&self) -> Self {
        enum Step<'a> {
            Visit(&'a ScanFilter),
            /// Gather the last `n` copies into an `And` (true) or `Or` (false).
            Build(bool, usize),
        }
        let mut todo = vec![Step::Visit(self)];
        let mut done: Vec<ScanFilter> = Vec::new();
        while let Some(step) = todo.pop() {
            match step {
                Step::Visit(f) => match f {
                    Self::And(parts) | Self::Or(parts) => {
                        todo.push(Step::Build(matches!(f, Self::And(_)), parts.len()));
                        // Reversed onto the stack: the first part is copied first.
                        todo.extend(parts.iter().rev().map(Step::Visit));
                    }
                    leaf => done.extend(leaf.clone_leaf()),
                },
                Step::Build(and, n) => {
                    let parts = done.split_off(done.len() - n);
                    done.push(if and { Self::And(parts) } else { Self::Or(parts) });
                }
            }
        }
        done.pop().expect("the root's copy") // infallible: every visit leaves one copy
    }
}

/// The variants' fields, as a derived `Debug` shows them, down to [`MAX_FILTER_DEPTH`] levels
/// (deeper parts show as `..`): a derived `Debug` recursed once per level without bound.
impl std::fmt::Debug for ScanFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct At<'a>(&'a ScanFilter, usize);
        impl std::fmt::Debug for At<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let At(filter, depth) = *self;
                match filter {
                    ScanFilter::Compare { column, op, value } => {
                        f.debug_struct("Compare").field("column", column).field("op", op).field("value", value).finish()
                    }
                    ScanFilter::IsNull(c) => f.debug_tuple("IsNull").field(c).finish(),
                    ScanFilter::IsNotNull(c) => f.debug_tuple("IsNotNull").field(c).finish(),
                    ScanFilter::And(parts) | ScanFilter::Or(parts) => {
                        let name = if matches!(filter, ScanFilter::And(_)) { "And" } else { "Or" };
                        if depth >= MAX_FILTER_DEPTH && !parts.is_empty() {
                            return write!(f, "{name}([..])");
                        }
                        let list: Vec<At<'_>> = parts.iter().map(|p| At(p, depth + 1)).collect();
                        f.debug_tuple(name).field(&list).finish()
                    }
                }
            }
        }
        At(self, 1).fmt(f)
    }
}

impl ScanFilter {
    /// `column <op> value`, `value` a one-element array (see [`ScanFilter::Compare`]).
    pub fn compare(column: impl Into<String>, op: CompareOp, value: ArrayRef) -> Self {
        Self::Compare { column: column.into(), op, value }
    }

    /// `column IS NULL`.
    pub fn is_null(column: impl Into<String>) -> Self {
        Self::IsNull(column.into())
    }

    /// `column IS NOT NULL`.
    pub fn is_not_null(column: impl Into<String>) -> Self {
        Self::IsNotNull(column.into())
    }

    /// Conjunction of `parts`.
    pub fn and(parts: impl IntoIterator<Item = ScanFilter>) -> Self {
        Self::And(parts.into_iter().collect())
    }

    /// Disjunction of `parts`.
    pub fn or(parts: impl IntoIterator<Item = ScanFilter>) -> Self {
        Self::Or(parts.into_iter().collect())
    }

    /// Checks the filter against `schema` and resolves its columns.
    ///
    /// # Errors
    /// [`FilterError::ColumnNotFound`] for a column not in `schema`;
    /// [`FilterError::NotComparable`] for a literal that is not one element, or whose type
    /// cannot be compared with the column's (see [`ScanFilter::Compare`]), or a column type
    /// that has no ordering (nested types); [`FilterError::TooDeep`] for a filter nested more
    /// than [`MAX_FILTER_DEPTH`] levels (checked first, without recursion).
    pub fn bind(&self, schema: &Schema) -> Result<BoundFilter, FilterError> {
        // Every walk below recurses once per level: the depth is measured first, iteratively.
        let depth = self.depth();
        if depth > MAX_FILTER_DEPTH {
            return Err(FilterError::TooDeep { depth, limit: MAX_FILTER_DEPTH });
        }
        let expr = bind(self, schema)?;
        let mut columns = Vec::new();
        expr.columns(&mut columns);
        columns.sort_unstable();
        columns.dedup();
        Ok(BoundFilter { expr, columns, schema: Arc::new(schema.clone()) })
    }
}

/// The one value of a comparison as `arrow-cast` displays it. A timestamp whose zone name
/// `arrow-cast` cannot resolve (a named zone needs its `chrono-tz` feature, which this build
/// leaves out) shows the instant in UTC with the zone named, e.g.
/// `2023-11-14T22:13:20Z (Europe/Berlin)`, rather than failing; anything else that cannot be
/// displayed shows as `?`.
fn value_text(value: &ArrayRef) -> String {
    use arrow_cast::display::{ArrayFormatter, FormatOptions};
    // arrow-cast's formatter of a nested type recurses once per level.
    if value.len() != 1 || gritdb_keys::type_depth(value.data_type()) > MAX_LITERAL_TYPE_DEPTH {
        return "?".to_owned();
    }
    let opts = FormatOptions::default().with_null("NULL");
    if let Ok(fmt) = ArrayFormatter::try_new(value.as_ref(), &opts) {
        return fmt.value(0).to_string();
    }
    if let DataType::Timestamp(unit, Some(tz)) = value.data_type() {
        // The same i64 read as a zone-less timestamp: the UTC instant, no conversion.
        if let Ok(utc) = value.to_data().into_builder().data_type(DataType::Timestamp(*unit, None)).build() {
            let utc = arrow_array::make_array(utc);
            if let Ok(fmt) = ArrayFormatter::try_new(utc.as_ref(), &opts) {
                return format!("{}Z ({tz})", fmt.value(0));
            }
        }
    }
    "?".to_owned()
}

/// SQL-like text, e.g. `(id >= 100 AND name IS NOT NULL)`, down to [`MAX_FILTER_DEPTH`]
/// levels: deeper parts show as `(...)`, so formatting a filter of any depth is safe.
impl std::fmt::Display for ScanFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn write(filter: &ScanFilter, f: &mut std::fmt::Formatter<'_>, depth: usize) -> std::fmt::Result {
            let list = |f: &mut std::fmt::Formatter<'_>, parts: &[ScanFilter], sep: &str, empty: &str| {
                if parts.is_empty() {
                    return f.write_str(empty);
                }
                if depth >= MAX_FILTER_DEPTH {
                    return f.write_str("(...)");
                }
                f.write_str("(")?;
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        write!(f, " {sep} ")?;
                    }
                    write(p, f, depth + 1)?;
                }
                f.write_str(")")
            };
            match filter {
                ScanFilter::Compare { column, op, value } => {
                    let v = value_text(value);
                    let v = if matches!(value.data_type(), DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View) && value.is_valid(0) {
                        format!("'{v}'")
                    } else {
                        v
                    };
                    write!(f, "{column} {op} {v}")
                }
                ScanFilter::IsNull(c) => write!(f, "{c} IS NULL"),
                ScanFilter::IsNotNull(c) => write!(f, "{c} IS NOT NULL"),
                ScanFilter::And(p) => list(f, p, "AND", "TRUE"),
                ScanFilter::Or(p) => list(f, p, "OR", "FALSE"),
            }
        }
        write(self, f, 1)
    }
}

/// Why a [`ScanFilter`] does not fit a table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FilterError {
    /// The filter names a column the table does not have.
    #[error("filter column `{column}` does not exist")]
    ColumnNotFound {
        /// The column named.
        column: String,
    },
    /// The literal cannot be compared with the column.
    #[error("filter on column `{column}` ({column_type}): {detail}")]
    NotComparable {
        /// The column named.
        column: String,
        /// The column's Arrow type.
        column_type: DataType,
        /// What is wrong, and what would work.
        detail: String,
    },
    /// The filter nests deeper than [`MAX_FILTER_DEPTH`] (binding, evaluation and pruning
    /// recurse once per level). Flatten chains of one operator into one `And` / `Or` list.
    #[error("the filter is nested {depth} levels deep, more than the {limit} a scan accepts; put a chain of ANDs (or ORs) into one And (Or) of many parts")]
    TooDeep {
        /// The filter's depth ([`ScanFilter::depth`]).
        depth: usize,
        /// [`MAX_FILTER_DEPTH`].
        limit: usize,
    },
}

#[derive(Debug, Clone)]
enum Expr {
    Cmp { col: usize, op: CompareOp, lit: ArrayRef },
    IsNull(usize),
    IsNotNull(usize),
    And(Vec<Expr>),
    Or(Vec<Expr>),
}

impl Expr {
    fn columns(&self, out: &mut Vec<usize>) {
        match self {
            Self::Cmp { col, .. } | Self::IsNull(col) | Self::IsNotNull(col) => out.push(*col),
            Self::And(p) | Self::Or(p) => p.iter().for_each(|e| e.columns(out)),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Number,
    Text,
    Bytes,
    Other,
}

fn family(t: &DataType) -> Family {
    match t {
        t if t.is_integer() || t.is_floating() => Family::Number,
        DataType::Decimal32(..) | DataType::Decimal64(..) | DataType::Decimal128(..) | DataType::Decimal256(..) => Family::Number,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Family::Text,
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => Family::Bytes,
        _ => Family::Other,
    }
}

/// Deepest literal type [`ScanFilter::bind`] looks at (and `Display` shows): a type nested
/// deeper is refused before anything formats or compares it, since Arrow's `Display`,
/// `PartialEq` and formatters of a `DataType` recurse once per level. No nested type can be
/// compared with a column anyway. The bound column types have too.
const MAX_LITERAL_TYPE_DEPTH: usize = gritdb_keys::MAX_TYPE_DEPTH;

fn bind(f: &ScanFilter, schema: &Schema) -> Result<Expr, FilterError> {
    let col = |name: &str| schema.index_of(name).map_err(|_| FilterError::ColumnNotFound { column: name.to_owned() });
    Ok(match f {
        ScanFilter::Compare { column, op, value } => {
            let i = col(column)?;
            let ty = schema.field(i).data_type();
            let bad = |detail: String| FilterError::NotComparable { column: column.clone(), column_type: ty.clone(), detail };
            let depth = gritdb_keys::type_depth(value.data_type());
            if depth > MAX_LITERAL_TYPE_DEPTH {
                return Err(bad(format!("the literal's type is nested {depth} levels deep (more than {MAX_LITERAL_TYPE_DEPTH}); pass a literal of type {ty}")));
            }
            if value.len() != 1 {
                return Err(bad(format!("the literal must be an array of one element, not {}", value.len())));
            }
            // Floats compare canonically (module docs): the literal is made canonical here,
            // before the cast (a cast of a canonical float is canonical), the column in `eval`.
            // Before the cast, because every NaN and −0.0 has an equal value in every float
            // width and −0.0 in every integer type, while the cast's bit-exact round trip
            // refused a NaN with a sign or payload of another width, and −0.0 for an integer
            // column, though they name values there.
            let canonical = gritdb_keys::canonical_floats(Arc::clone(value));
            let lit = if value.data_type() == ty {
                canonical
            } else {
                let (from, to) = (family(value.data_type()), family(ty));
                if from != to || from == Family::Other {
                    return Err(bad(format!("a {} literal cannot be compared with it; pass a literal of type {ty}", value.data_type())));
                }
                lossless_cast(&canonical, ty).ok_or_else(|| {
                    bad(format!(
                        "the {} literal {} is not representable as {ty}",
                        value.data_type(),
                        ScanFilter::compare(column.as_str(), *op, Arc::clone(value))
                    ))
                })?
            };
            // The kernels decide what is comparable (nested types are not).
            if let Err(e) = arrow_ord::cmp::eq(&new_empty_array(ty), &Scalar::new(Arc::clone(&lit))) {
                return Err(bad(format!("values of this type cannot be compared: {e}")));
            }
            Expr::Cmp { col: i, op: *op, lit }
        }
        ScanFilter::IsNull(c) => Expr::IsNull(col(c)?),
        ScanFilter::IsNotNull(c) => Expr::IsNotNull(col(c)?),
        ScanFilter::And(p) => Expr::And(p.iter().map(|e| bind(e, schema)).collect::<Result<_, _>>()?),
        ScanFilter::Or(p) => Expr::Or(p.iter().map(|e| bind(e, schema)).collect::<Result<_, _>>()?),
    })
}

/// `value` cast to `to`, when casting back gives `value` again (no overflow, no rounding).
fn lossless_cast(value: &ArrayRef, to: &DataType) -> Option<ArrayRef> {
    let opts = arrow_cast::CastOptions { safe: false, ..Default::default() };
    let there = arrow_cast::cast_with_options(value, to, &opts).ok()?;
    let back = arrow_cast::cast_with_options(&there, value.data_type(), &opts).ok()?;
    (back.to_data() == value.to_data()).then_some(there)
}

/// A [`ScanFilter`] checked against a table schema (see [`ScanFilter::bind`]).
#[derive(Debug, Clone)]
pub struct BoundFilter {
    expr: Expr,
    columns: Vec<usize>,
    schema: Arc<Schema>,
}

/// `true` where `r` is true (null counts as not true).
fn truth(r: &BooleanArray) -> BooleanBuffer {
    match r.nulls() {
        Some(n) => r.values() & n.inner(),
        None => r.values().clone(),
    }
}

fn compare(op: CompareOp, l: &dyn arrow_array::Datum, r: &dyn arrow_array::Datum) -> Result<BooleanArray, ArrowError> {
    match op {
        CompareOp::Eq => arrow_ord::cmp::eq(l, r),
        CompareOp::NotEq => arrow_ord::cmp::neq(l, r),
        CompareOp::Lt => arrow_ord::cmp::lt(l, r),
        CompareOp::LtEq => arrow_ord::cmp::lt_eq(l, r),
        CompareOp::Gt => arrow_ord::cmp::gt(l, r),
        CompareOp::GtEq => arrow_ord::cmp::gt_eq(l, r),
    }
}

impl BoundFilter {
    /// Table column indices the filter reads, sorted, each once.
    pub fn columns(&self) -> &[usize] {
        &self.columns
    }

    /// Which rows of `batch` make the predicate true. `position(c)` is where table column
    /// `c` sits in `batch` (identity for a batch of the whole table schema).
    ///
    /// # Errors
    /// Arrow kernel errors (none expected for a filter bound to the batch's schema).
    pub fn evaluate(&self, batch: &RecordBatch, position: &dyn Fn(usize) -> usize) -> Result<BooleanBuffer, ArrowError> {
        eval(&self.expr, batch, position)
    }

    /// Which row groups and rows of a data file can hold matching rows, from the row-group
    /// statistics and, when `metadata` holds the page index, the page statistics.
    /// `row_groups` of the plan keeps the order of the file; `ranges` are file row numbers
    /// (`0..num_rows` of the whole file) of the rows to read, in order, within those groups.
    pub fn plan(&self, metadata: &ParquetMetaData, arrow_schema: &Schema) -> FilePlan {
        let groups = metadata.row_groups();
        let mut plan = FilePlan { row_groups: Vec::new(), ranges: Vec::new(), pruned_row_groups: 0, pruned_page_rows: 0 };
        let may = may_match_groups(&self.expr, &self.schema, metadata, arrow_schema);
        let mut start = 0u64;
        for (g, rg) in groups.iter().enumerate() {
            let rows = rg.num_rows() as u64;
            if may[g] {
                let within = page_ranges(&self.expr, &self.schema, metadata, arrow_schema, g).unwrap_or_else(|| whole(rows));
                let kept: u64 = within.iter().map(|r| r.end - r.start).sum();
                if kept == 0 {
                    // Every page ruled out: the whole group is skipped (counted as a group).
                    plan.pruned_row_groups += 1;
                } else {
                    plan.pruned_page_rows += rows - kept;
                    plan.row_groups.push(g);
                    plan.ranges.extend(within.into_iter().map(|r| r.start + start..r.end + start));
                }
            } else {
                plan.pruned_row_groups += 1;
            }
            start += rows;
        }
        plan
    }
}

/// What [`BoundFilter::plan`] decided for one data file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePlan {
    /// Row groups to read, in file order.
    pub row_groups: Vec<usize>,
    /// File row numbers to read (ascending, within `row_groups`).
    pub ranges: Vec<Range<u64>>,
    /// Row groups skipped (statistics, or every page of them skipped).
    pub pruned_row_groups: u64,
    /// Rows of read row groups skipped by the page index (rows of skipped groups not included).
    pub pruned_page_rows: u64,
}

fn eval(e: &Expr, batch: &RecordBatch, pos: &dyn Fn(usize) -> usize) -> Result<BooleanBuffer, ArrowError> {
    let n = batch.num_rows();
    Ok(match e {
        Expr::Cmp { col, op, lit } => {
            let column = gritdb_keys::canonical_floats(Arc::clone(batch.column(pos(*col))));
            truth(&compare(*op, &column, &Scalar::new(Arc::clone(lit)))?)
        }
        Expr::IsNull(c) => match batch.column(pos(*c)).logical_nulls() {
            Some(nulls) => !nulls.inner(),
            None => BooleanBuffer::new_unset(n),
        },
        Expr::IsNotNull(c) => match batch.column(pos(*c)).logical_nulls() {
            Some(nulls) => nulls.inner().clone(),
            None => BooleanBuffer::new_set(n),
        },
        Expr::And(parts) => {
            let mut acc = BooleanBuffer::new_set(n);
            for p in parts {
                acc = &acc & &eval(p, batch, pos)?;
            }
            acc
        }
        Expr::Or(parts) => {
            let mut acc = BooleanBuffer::new_unset(n);
            for p in parts {
                acc = &acc | &eval(p, batch, pos)?;
            }
            acc
        }
    })
}

/// Statistics of one column for a list of units (row groups or pages).
struct Stats {
    mins: ArrayRef,
    maxes: ArrayRef,
    /// Null counts (null: unknown).
    nulls: UInt64Array,
    rows: Vec<u64>,
    /// Whether min and max are the exact values (not truncated); `None`: unknown (pages).
    exact: Option<(BooleanArray, BooleanArray)>,
}

/// Per unit: can a row in it make `op lit` true? Unknown statistics say yes.
fn leaf_may_match(e: &Expr, s: &Stats) -> Vec<bool> {
    let n = s.rows.len();
    let null_count = |i: usize| s.nulls.is_valid(i).then(|| s.nulls.value(i));
    let all_null = |i: usize| null_count(i).is_some_and(|c| c >= s.rows[i]);
    match e {
        Expr::IsNull(_) => (0..n).map(|i| null_count(i).is_none_or(|c| c > 0)).collect(),
        Expr::IsNotNull(_) => (0..n).map(|i| !all_null(i)).collect(),
        Expr::Cmp { op, lit, .. } => {
            if lit.is_null(0) {
                return vec![false; n];
            }
            let lit = Scalar::new(Arc::clone(lit));
            // `bound op' lit` per unit; None where unknown.
            let test = |arr: &ArrayRef, op: CompareOp| -> Option<BooleanArray> { compare(op, arr, &lit).ok() };
            let pick = |r: &Option<BooleanArray>, i: usize| r.as_ref().is_none_or(|r| r.is_null(i) || r.value(i));
            let res: Vec<bool> = match op {
                CompareOp::Eq => {
                    let lo = test(&s.mins, CompareOp::LtEq);
                    let hi = test(&s.maxes, CompareOp::GtEq);
                    (0..n).map(|i| pick(&lo, i) && pick(&hi, i)).collect()
                }
                CompareOp::Lt => {
                    let r = test(&s.mins, CompareOp::Lt);
                    (0..n).map(|i| pick(&r, i)).collect()
                }
                CompareOp::LtEq => {
                    let r = test(&s.mins, CompareOp::LtEq);
                    (0..n).map(|i| pick(&r, i)).collect()
                }
                CompareOp::Gt => {
                    let r = test(&s.maxes, CompareOp::Gt);
                    (0..n).map(|i| pick(&r, i)).collect()
                }
                CompareOp::GtEq => {
                    let r = test(&s.maxes, CompareOp::GtEq);
                    (0..n).map(|i| pick(&r, i)).collect()
                }
                CompareOp::NotEq => {
                    // Only a unit whose every non-null value is the literal (exact min = max =
                    // literal) holds no match.
                    let Some((emin, emax)) = &s.exact else { return vec![true; n] };
                    let lo = test(&s.mins, CompareOp::Eq);
                    let hi = test(&s.maxes, CompareOp::Eq);
                    let known = |r: &Option<BooleanArray>, i: usize| r.as_ref().is_some_and(|r| r.is_valid(i) && r.value(i));
                    let exact = |b: &BooleanArray, i: usize| b.is_valid(i) && b.value(i);
                    (0..n).map(|i| !(known(&lo, i) && known(&hi, i) && exact(emin, i) && exact(emax, i))).collect()
                }
            };
            (0..n).map(|i| res[i] && !all_null(i)).collect()
        }
        Expr::And(_) | Expr::Or(_) => vec![true; n],
    }
}

/// Float columns are filtered row by row, never pruned (see the module docs).
fn prunable(schema: &Schema, col: usize) -> bool {
    !schema.field(col).data_type().is_floating()
}

fn may_match_groups(e: &Expr, schema: &Schema, md: &ParquetMetaData, arrow_schema: &Schema) -> Vec<bool> {
    let n = md.num_row_groups();
    match e {
        Expr::And(parts) => parts.iter().fold(vec![true; n], |acc, p| {
            let m = may_match_groups(p, schema, md, arrow_schema);
            acc.iter().zip(m).map(|(a, b)| *a && b).collect()
        }),
        Expr::Or(parts) => parts.iter().fold(vec![false; n], |acc, p| {
            let m = may_match_groups(p, schema, md, arrow_schema);
            acc.iter().zip(m).map(|(a, b)| *a || b).collect()
        }),
        Expr::Cmp { col, .. } | Expr::IsNull(col) | Expr::IsNotNull(col) => {
            group_stats(*col, schema, md, arrow_schema).map_or_else(|| vec![true; n], |s| leaf_may_match(e, &s))
        }
    }
}

fn group_stats(col: usize, schema: &Schema, md: &ParquetMetaData, arrow_schema: &Schema) -> Option<Stats> {
    if !prunable(schema, col) {
        return None;
    }
    let conv = StatisticsConverter::try_new(schema.field(col).name(), arrow_schema, md.file_metadata().schema_descr()).ok()?;
    let groups = md.row_groups();
    Some(Stats {
        mins: conv.row_group_mins(groups).ok()?,
        maxes: conv.row_group_maxes(groups).ok()?,
        nulls: conv.row_group_null_counts(groups).ok()?,
        rows: groups.iter().map(|g| g.num_rows() as u64).collect(),
        exact: Some((conv.row_group_is_min_value_exact(groups).ok()?, conv.row_group_is_max_value_exact(groups).ok()?)),
    })
}

/// Rows of row group `g` (relative to its first row) that may match, from the page index;
/// `None` when the file has no page index.
fn page_ranges(e: &Expr, schema: &Schema, md: &ParquetMetaData, arrow_schema: &Schema, g: usize) -> Option<Vec<Range<u64>>> {
    let (ci, oi) = (md.column_index()?, md.offset_index()?);
    let rows = md.row_group(g).num_rows() as u64;
    let all = whole(rows);
    Some(match e {
        Expr::And(parts) => {
            let mut acc = all;
            for p in parts {
                let r = page_ranges(p, schema, md, arrow_schema, g).unwrap_or_else(|| whole(rows));
                acc = intersect(&acc, &r);
            }
            acc
        }
        Expr::Or(parts) => {
            let mut acc = Vec::new();
            for p in parts {
                let r = page_ranges(p, schema, md, arrow_schema, g).unwrap_or_else(|| whole(rows));
                acc = union(&acc, &r);
            }
            acc
        }
        Expr::Cmp { col, .. } | Expr::IsNull(col) | Expr::IsNotNull(col) => {
            if !prunable(schema, *col) {
                return Some(all);
            }
            let conv = StatisticsConverter::try_new(schema.field(*col).name(), arrow_schema, md.file_metadata().schema_descr()).ok()?;
            let gs = [g];
            let (Ok(mins), Ok(maxes), Ok(nulls), Ok(Some(counts))) = (
                conv.data_page_mins(ci, oi, &gs),
                conv.data_page_maxes(ci, oi, &gs),
                conv.data_page_null_counts(ci, oi, &gs),
                conv.data_page_row_counts(oi, md.row_groups(), &gs),
            ) else {
                return Some(all);
            };
            let page_rows: Vec<u64> = counts.values().iter().copied().collect();
            if page_rows.iter().sum::<u64>() != rows || mins.len() != page_rows.len() {
                return Some(all);
            }
            let may = leaf_may_match(e, &Stats { mins, maxes, nulls, rows: page_rows.clone(), exact: None });
            let mut out: Vec<Range<u64>> = Vec::new();
            let mut at = 0u64;
            for (keep, n) in may.into_iter().zip(page_rows) {
                if keep && n > 0 {
                    match out.last_mut() {
                        Some(last) if last.end == at => last.end = at + n,
                        _ => out.push(at..at + n),
                    }
                }
                at += n;
            }
            out
        }
    })
}

/// One range of all `rows` rows.
pub(crate) fn whole(rows: u64) -> Vec<Range<u64>> {
    std::iter::once(0..rows).collect()
}

/// The rows in both `left` and `right` (each ascending and non-overlapping), ascending.
pub(crate) fn intersect(left: &[Range<u64>], right: &[Range<u64>]) -> Vec<Range<u64>> {
    let (mut li, mut ri, mut out) = (0, 0, Vec::new());
    while li < left.len() && ri < right.len() {
        let (lo, hi) = (left[li].start.max(right[ri].start), left[li].end.min(right[ri].end));
        if lo < hi {
            out.push(lo..hi);
        }
        if left[li].end < right[ri].end {
            li += 1;
        } else {
            ri += 1;
        }
    }
    out
}

fn union(a: &[Range<u64>], b: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = a.iter().chain(b).cloned().collect();
    all.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in all {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Counters of one scan, shared with its file readers ([`ScanMetrics`] is a snapshot).
#[derive(Debug, Default)]
pub struct ScanCounters {
    files: AtomicU64,
    row_groups_total: AtomicU64,
    row_groups_pruned: AtomicU64,
    rows_pruned_by_page_index: AtomicU64,
    rows_decoded: AtomicU64,
    rows_matched: AtomicU64,
}

impl ScanCounters {
    pub(crate) fn add_file(&self, row_groups: u64, pruned: u64, page_rows: u64) {
        self.files.fetch_add(1, Ordering::Relaxed);
        self.row_groups_total.fetch_add(row_groups, Ordering::Relaxed);
        self.row_groups_pruned.fetch_add(pruned, Ordering::Relaxed);
        self.rows_pruned_by_page_index.fetch_add(page_rows, Ordering::Relaxed);
    }

    /// Counts rows decoded from a data file.
    pub fn add_decoded(&self, rows: u64) {
        self.rows_decoded.fetch_add(rows, Ordering::Relaxed);
    }

    /// Counts rows returned to the caller.
    pub fn add_matched(&self, rows: u64) {
        self.rows_matched.fetch_add(rows, Ordering::Relaxed);
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> ScanMetrics {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ScanMetrics {
            files_opened: get(&self.files),
            row_groups_total: get(&self.row_groups_total),
            row_groups_pruned: get(&self.row_groups_pruned),
            rows_pruned_by_page_index: get(&self.rows_pruned_by_page_index),
            rows_decoded: get(&self.rows_decoded),
            rows_matched: get(&self.rows_matched),
        }
    }
}

/// What a scan has done so far (counts grow as it is iterated; files are opened lazily).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ScanMetrics {
    /// Committed data files opened.
    pub files_opened: u64,
    /// Row groups in the opened files.
    pub row_groups_total: u64,
    /// Row groups not read: their statistics (or those of every page in them) prove no row
    /// matches the filter.
    pub row_groups_pruned: u64,
    /// Rows of read row groups skipped because the page index proves no row of their pages
    /// matches.
    pub rows_pruned_by_page_index: u64,
    /// Rows decoded from data files (before deletion vectors and the exact filter).
    pub rows_decoded: u64,
    /// Rows returned to the caller (files and in-memory deltas).
    pub rows_matched: u64,
}

/// The rows of `batch` where `keep` is set (`keep.len()` = rows of `batch`); `None` when no
/// row is kept. All rows kept returns `batch` itself (no copy).
///
/// # Errors
/// Arrow errors.
pub fn keep_rows(batch: &RecordBatch, keep: BooleanBuffer) -> Result<Option<RecordBatch>, ArrowError> {
    let n = keep.count_set_bits();
    if n == 0 {
        return Ok(None);
    }
    if n == batch.num_rows() {
        return Ok(Some(batch.clone()));
    }
    arrow_select::filter::filter_record_batch(batch, &BooleanArray::new(keep, None)).map(Some)
}

/// Evaluates `filter` on `batch` (whose column `i` is table column `i`) and keeps the rows it
/// makes true; `None` when no row is.
///
/// # Errors
/// Arrow errors.
pub fn filter_batch(batch: &RecordBatch, filter: &BoundFilter) -> Result<Option<RecordBatch>, ArrowError> {
    let keep = filter.evaluate(batch, &|c| c)?;
    keep_rows(batch, keep)
}

#[cfg(test)]
mod display_tests {
    use super::*;
    use arrow_array::{Int64Array, TimestampSecondArray};

    /// Comparison values display as `arrow-cast` shows them; a timestamp in a named zone that
    /// `arrow-cast` cannot resolve here shows its UTC instant and the zone, not `?`.
    #[test]
    fn timestamps_in_any_zone_display_their_value() {
        let at = 1_700_000_000i64; // 2023-11-14T22:13:20Z
        let cmp = |v: ArrayRef| ScanFilter::compare("t", CompareOp::GtEq, v).to_string();
        assert_eq!(cmp(Arc::new(Int64Array::from(vec![7]))), "t >= 7");
        assert_eq!(cmp(Arc::new(TimestampSecondArray::from(vec![at]))), "t >= 2023-11-14T22:13:20");
        assert_eq!(cmp(Arc::new(TimestampSecondArray::from(vec![at]).with_timezone("+02:00"))), "t >= 2023-11-15T00:13:20+02:00");
        // Without arrow's `chrono-tz` feature the fallback; with it (DataFusion, the `sql`
        // feature, turns it on in a workspace build) arrow-cast's own rendering.
        let berlin = cmp(Arc::new(TimestampSecondArray::from(vec![at]).with_timezone("Europe/Berlin")));
        assert!(["t >= 2023-11-14T22:13:20Z (Europe/Berlin)", "t >= 2023-11-14T23:13:20+01:00"].contains(&berlin.as_str()), "{berlin}");
        assert_eq!(cmp(Arc::new(Int64Array::from(vec![Some(1), Some(2)]))), "t >= ?");
    }
}

#[cfg(test)]
mod depth_tests {
    use super::*;
    use arrow_array::Int64Array;
    use arrow_schema::Field;

    fn cmp(op: CompareOp, v: i64) -> ScanFilter {
        ScanFilter::compare("k", op, Arc::new(Int64Array::from(vec![v])))
    }

    /// A filter `depth` levels deep: `k >= 500` at the bottom, then levels alternating
    /// `Or([below, k = level])` and `And([below, k < 900])`; and the same predicate as a model.
    fn nested(depth: usize) -> (ScanFilter, impl Fn(i64) -> bool) {
        let mut f = cmp(CompareOp::GtEq, 500);
        for level in 1..depth {
            f = if level % 2 == 1 { ScanFilter::Or(vec![f, cmp(CompareOp::Eq, level as i64)]) } else { ScanFilter::And(vec![f, cmp(CompareOp::Lt, 900)]) };
        }
        let model = move |k: i64| {
            let mut r = k >= 500;
            for level in 1..depth {
                r = if level % 2 == 1 { r || k == level as i64 } else { r && k < 900 };
            }
            r
        };
        (f, model)
    }

    /// A chain of single-part `And`s and `Or`s `depth` levels deep, built without recursion.
    fn chain(depth: usize) -> ScanFilter {
        let mut f = ScanFilter::is_null("k");
        for level in 1..depth {
            f = if level % 2 == 0 { ScanFilter::And(vec![f]) } else { ScanFilter::Or(vec![f]) };
        }
        f
    }

    fn on_stack<T: Send + 'static>(bytes: usize, work: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new().stack_size(bytes).spawn(work).expect("spawn").join().expect("no panic")
    }

    /// A filter nested 1,000,000 deep on a thread with the default 2 MiB stack: its depth is
    /// measured, `bind` refuses it typed (before any recursive walk), it clones, formats
    /// (cut at the limit) and drops without overflowing the stack. Before, `bind` recursed
    /// once per level and so did the derived drop: a stack overflow aborted the process.
    #[test]
    fn a_filter_a_million_deep_is_refused_typed_and_clones_formats_and_drops() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        on_stack(2 << 20, move || {
            let f = chain(1_000_000);
            assert_eq!(f.depth(), 1_000_000);
            assert_eq!(f.bind(&schema).map(|_| ()), Err(FilterError::TooDeep { depth: 1_000_000, limit: MAX_FILTER_DEPTH }));
            let copy = f.clone();
            assert_eq!(copy.depth(), 1_000_000);
            let text = copy.to_string();
            assert_eq!(text.matches('(').count(), MAX_FILTER_DEPTH, "{}", &text[..200]);
            assert!(text.ends_with(&")".repeat(MAX_FILTER_DEPTH)));
            assert!(text.contains("(...)"));
            let debug = format!("{copy:?}");
            assert!(debug.starts_with("And([Or([And([") || debug.starts_with("Or([And([Or(["), "{}", &debug[..60]);
            assert!(debug.contains("([..])"));
            assert!(debug.len() < 20 * MAX_FILTER_DEPTH, "{} bytes", debug.len());
            drop(copy);
            drop(f);
            // Wide filters are not deep: 1,000,000 parts in one `Or` are depth 2.
            let wide = ScanFilter::or((0..1_000_000).map(|v| cmp(CompareOp::Eq, v)));
            assert_eq!(wide.depth(), 2);
            assert!(wide.bind(&schema).is_ok());
        });
    }

    /// The limit itself: depth 128 binds, 129 does not; `depth` counts a leaf as 1 and an
    /// empty `And` as a leaf.
    #[test]
    fn the_limit_is_exact() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        assert_eq!(cmp(CompareOp::Eq, 1).depth(), 1);
        assert_eq!(ScanFilter::and([]).depth(), 1);
        assert_eq!(ScanFilter::and([ScanFilter::or([]), cmp(CompareOp::Eq, 1)]).depth(), 2);
        assert_eq!(chain(MAX_FILTER_DEPTH).depth(), MAX_FILTER_DEPTH);
        assert!(chain(MAX_FILTER_DEPTH).bind(&schema).is_ok());
        assert_eq!(chain(MAX_FILTER_DEPTH + 1).bind(&schema).map(|_| ()), Err(FilterError::TooDeep { depth: MAX_FILTER_DEPTH + 1, limit: MAX_FILTER_DEPTH }));
        // The depth is checked before the columns: an unknown column deeper down is not reached.
        let mut f = ScanFilter::is_null("nope");
        for _ in 0..MAX_FILTER_DEPTH {
            f = ScanFilter::and([f]);
        }
        assert_eq!(f.bind(&schema).map(|_| ()), Err(FilterError::TooDeep { depth: MAX_FILTER_DEPTH + 1, limit: MAX_FILTER_DEPTH }));
        // Clone keeps structure and order.
        let (f, _) = nested(5);
        assert_eq!(f.clone().to_string(), f.to_string());
        assert_eq!(f.to_string(), "((((k >= 500 OR k = 1) AND k < 900) OR k = 3) AND k < 900)");
    }

    /// A filter at the limit binds, evaluates exactly and plans a Parquet file (row-group and
    /// page statistics) on a thread with 512 KiB of stack, a quarter of a spawned thread's
    /// default (it needs 171 KiB in the `ci` profile; an unoptimised build gets the whole
    /// default 2 MiB): the documented headroom of [`MAX_FILTER_DEPTH`].
    #[test]
    fn a_filter_at_the_limit_runs_in_512_kib_of_stack() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(0..1_000))]).expect("batch");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.parquet");
        {
            let props = parquet::file::properties::WriterProperties::builder()
                .set_max_row_group_row_count(Some(100))
                .set_data_page_row_count_limit(10)
                .set_write_batch_size(10)
                .build();
            let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&path).expect("create"), Arc::clone(&schema), Some(props)).expect("writer");
            w.write(&batch).expect("write");
            w.close().expect("close");
        }
        let file = std::fs::File::open(&path).expect("open");
        let md = parquet::file::metadata::ParquetMetaDataReader::new()
            .with_column_index_policy(parquet::file::metadata::PageIndexPolicy::Required)
            .with_offset_index_policy(parquet::file::metadata::PageIndexPolicy::Required)
            .parse_and_finish(&file)
            .expect("metadata");
        let stack = if cfg!(debug_assertions) { 2 << 20 } else { 512 << 10 };
        let (plan, matched) = on_stack(stack, move || {
            let (f, model) = nested(MAX_FILTER_DEPTH);
            assert_eq!(f.depth(), MAX_FILTER_DEPTH);
            let bound = f.bind(&schema).expect("binds at the limit");
            let keep = bound.evaluate(&batch, &|c| c).expect("evaluates");
            let want: Vec<bool> = (0..1_000).map(&model).collect();
            assert_eq!(keep.iter().collect::<Vec<bool>>(), want);
            (bound.plan(&md, &schema), keep.count_set_bits())
        });
        // Rows 1, 3, ..., 127 and 500..900: groups 2, 3, 4 (200..500) and 9 (900..) pruned;
        // in group 1 only the pages of 100..130 are read.
        assert_eq!(matched, 64 + 400);
        assert_eq!(plan.row_groups, vec![0, 1, 5, 6, 7, 8]);
        assert_eq!(plan.pruned_row_groups, 4);
        assert_eq!(plan.pruned_page_rows, 70);
        assert_eq!(plan.ranges.iter().map(|r| r.end - r.start).sum::<u64>(), 130 + 400);
    }
}

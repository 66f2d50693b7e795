//! SQL functions whose result size an argument sets, held to the engine's memory limit.
//!
//! A query's operators take their memory through gritdb's [`MemoryPool`] (`pool.rs`), but a
//! scalar function's result is allocated by the function itself, outside any pool. For most
//! functions that result is about the size of their inputs, which the limit already governs.
//! For these it is set by an argument: `repeat(s, n)`, `lpad`/`rpad(s, n)`, `array_repeat(e,
//! n)`, `array_resize(a, n)`, `range`/`generate_series(start, stop, step)`, or grows with the
//! product of two inputs: `replace(s, from, to)`, `regexp_replace(s, pattern, replacement)`.
//! `lpad('a', 1000000000)` took 3.9 GB at a 256 MiB limit (`DataFusion` folds it while
//! planning, building the result several times), and `rpad('a', 2147483647, 'xy')` aborted
//! the process on a failed allocation of 2 GiB.
//!
//! Each such function is registered wrapped ([`OutputBound`]): before the function runs on a
//! batch (or on constants, while planning), an upper bound of its result's bytes is computed
//! from the argument values and reserved in the query's memory pool while it runs. When the
//! bound does not fit, the statement fails before anything is allocated, as any query over
//! the limit does: the pool's `ResourcesExhausted`, which `Engine::sql` returns as
//! [`crate::Error::MemoryLimit`] in the `query` category with its figures. The bounds (bytes, all saturating):
//! - `repeat(s, n)`: `len(s) × n`;
//! - `lpad`/`rpad(s, n [, fill])`: `n` characters of 1 byte when `s` and `fill` are ASCII,
//!   else 4 (UTF-8's widest);
//! - `replace(s, from, to)`: `len(s) + (len(s) / max(len(from), 1) + 1) × len(to)`;
//! - `regexp_replace(s, p, r [, flags])`: `len(s) + (len(s) + 1) × len(r) + k × len(s)`,
//!   where `k` counts `$` and `\` in `r` (group references: matches do not overlap, so each
//!   reference expands to at most `len(s)` bytes over all matches);
//! - `array_repeat(e, n)`: `n ×` the bytes of that row's `e`;
//! - `array_resize(a, n [, fill])`: that row's list + `n ×` its fill (16 without one);
//! - `range`/`generate_series`: `(|stop − start| / |step| + 1) × 8`, temporal bounds and
//!   steps in nanoseconds (the smallest a month of 28–31 days makes; a step that can be 0 or
//!   change sign, `1 month -30 days`, is unbounded), a step that is not a constant 1 ns.
//!
//! - a call whose arguments are all constants: 4 × the above ([`CONSTANT_COPIES`]).
//!
//! Results below [`CHECKED_BYTES`] are not reserved (most calls: the check costs a pass over
//! the arguments' lengths).

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::compute::kernels::length::length;
use datafusion::arrow::compute::{CastOptions, cast, cast_with_options};
use datafusion::arrow::datatypes::FieldRef;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int32Type, Int64Type, IntervalMonthDayNano, TimeUnit};
use datafusion::common::ExprSchema;
use datafusion::common::config::ConfigOptions;
use datafusion::common::{Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool};
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, Expr, ExpressionPlacement, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, StructFieldMapping,
};
use datafusion::prelude::SessionContext;
use std::sync::Arc;

/// A result bound below this many bytes is not reserved (1 MiB).
pub const CHECKED_BYTES: usize = 1 << 20;

/// How many times a result of constant arguments is held at once: `DataFusion` folds such a
/// call into a literal while planning, which is then copied into the plan and into a batch.
/// Measured: `SELECT length(repeat('x', 100000000))` raised `VmHWM` by 3.9 × its 100 MB.
const CONSTANT_COPIES: f64 = 4.0;

/// How a function's result grows with its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Growth {
    Repeat,
    Pad,
    Replace,
    RegexpReplace,
    ArrayRepeat,
    ArrayResize,
    Range,
}

/// The functions wrapped, by their registered name.
const BOUNDED: [(&str, Growth); 9] = [
    ("repeat", Growth::Repeat),
    ("lpad", Growth::Pad),
    ("rpad", Growth::Pad),
    ("replace", Growth::Replace),
    ("regexp_replace", Growth::RegexpReplace),
    ("array_repeat", Growth::ArrayRepeat),
    ("array_resize", Growth::ArrayResize),
    ("range", Growth::Range),
    ("generate_series", Growth::Range),
];

/// Registers the functions of [`BOUNDED`] that `ctx` has, each wrapped in [`OutputBound`]
/// reserving in `pool` (the query memory pool of `ctx`'s runtime).
pub(crate) fn register(ctx: &SessionContext, pool: &Arc<dyn MemoryPool>) {
    let functions = ctx.state().scalar_functions().clone();
    for (name, growth) in BOUNDED {
        if let Some(inner) = functions.get(name) {
            ctx.register_udf(ScalarUDF::new_from_impl(OutputBound { inner: Arc::clone(inner), growth, pool: Arc::clone(pool) }));
        }
    }
}

/// A function whose result's bytes are bounded from its arguments and reserved before it runs.
struct OutputBound {
    inner: Arc<ScalarUDF>,
    growth: Growth,
    pool: Arc<dyn MemoryPool>,
}

impl std::fmt::Debug for OutputBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputBound").field("inner", &self.inner.name()).field("growth", &self.growth).finish_non_exhaustive()
    }
}

impl PartialEq for OutputBound {
    fn eq(&self, other: &Self) -> bool {
        self.inner == other.inner && self.growth == other.growth
    }
}

impl Eq for OutputBound {}

impl std::hash::Hash for OutputBound {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner.hash(state);
        self.growth.hash(state);
    }
}

/// An argument's per-row figures (a constant's one figure stands for every row).
struct PerRow {
    values: Vec<f64>,
    constant: bool,
}

impl PerRow {
    fn at(&self, row: usize) -> f64 {
        if self.constant { self.values.first().copied().unwrap_or(0.0) } else { self.values.get(row).copied().unwrap_or(0.0) }
    }

    fn of(arg: &ColumnarValue, f: impl Fn(&ArrayRef) -> Result<Vec<f64>>) -> Result<Self> {
        Ok(match arg {
            ColumnarValue::Array(a) => Self { values: f(a)?, constant: false },
            ColumnarValue::Scalar(s) => Self { values: f(&s.to_array_of_size(1)?)?, constant: true },
        })
    }

    /// Byte lengths (strings, binaries) or element counts (lists); 0 for nulls.
    fn lengths(arg: &ColumnarValue) -> Result<Self> {
        Self::of(arg, lengths_of)
    }

    /// Numbers as `f64` (no overflow); dates and timestamps in nanoseconds since the epoch;
    /// 0 for nulls and values that are not numbers.
    fn numbers(arg: &ColumnarValue) -> Result<Self> {
        Self::of(arg, |a| {
            // Nanoseconds per unit of a temporal value (a trial's `range` of second timestamps
            // stepped by a millisecond was undercounted 10^9 times when units were mixed).
            let (a, scale) = match a.data_type() {
                DataType::Date32 => (cast(a, &DataType::Int64)?, DAY_NS),
                DataType::Date64 => (cast(a, &DataType::Int64)?, 1e6),
                DataType::Timestamp(unit, _) => (
                    cast(a, &DataType::Int64)?,
                    match unit {
                        TimeUnit::Second => 1e9,
                        TimeUnit::Millisecond => 1e6,
                        TimeUnit::Microsecond => 1e3,
                        TimeUnit::Nanosecond => 1.0,
                    },
                ),
                _ => (Arc::clone(a), 1.0),
            };
            let f = cast_with_options(&a, &DataType::Float64, &CastOptions { safe: true, ..CastOptions::default() })?;
            Ok(f.as_primitive::<Float64Type>().iter().map(|v| v.filter(|v| v.is_finite()).map_or(0.0, |v| v * scale)).collect())
        })
    }

    /// Bytes of each row's value: a fixed width; a string's or binary's length + 16 (offset or
    /// view); a list's elements, summed per row, + 16; a struct's fields summed; other types
    /// (maps, unions, dictionaries) their array's memory over its rows, a mean.
    fn sizes(arg: &ColumnarValue) -> Result<Self> {
        fn of(a: &ArrayRef) -> Result<Vec<f64>> {
            let dt = a.data_type();
            if let Some(w) = dt.primitive_width() {
                return Ok(vec![w as f64; a.len()]);
            }
            if matches!(dt, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Binary | DataType::LargeBinary | DataType::BinaryView) {
                return Ok(lengths_of(a)?.into_iter().map(|l| l + 16.0).collect());
            }
            let list = |values: &ArrayRef, bounds: &mut dyn Iterator<Item = (usize, usize)>| -> Result<Vec<f64>> {
                let each = of(values)?;
                let mut prefix = Vec::with_capacity(each.len() + 1);
                prefix.push(0.0);
                for v in &each {
                    prefix.push(prefix.last().copied().unwrap_or(0.0) + v);
                }
                Ok(bounds.map(|(s, e)| prefix[e.min(each.len())] - prefix[s.min(each.len())] + 16.0).collect())
            };
            match dt {
                DataType::List(_) => {
                    let l = a.as_list::<i32>();
                    let o = l.value_offsets();
                    list(l.values(), &mut o.windows(2).map(|w| (w[0] as usize, w[1] as usize)))
                }
                DataType::LargeList(_) => {
                    let l = a.as_list::<i64>();
                    let o = l.value_offsets();
                    list(l.values(), &mut o.windows(2).map(|w| (w[0] as usize, w[1] as usize)))
                }
                DataType::FixedSizeList(_, n) => {
                    let l = a.as_fixed_size_list();
                    let n = usize::try_from(*n).unwrap_or(0);
                    list(l.values(), &mut (0..l.len()).map(|i| (i * n, (i + 1) * n)))
                }
                // A row's fields summed (before: the column's memory over its rows, so one
                // large row among small ones was counted at the mean: a trial's
                // `array_repeat(named_struct('a', v), k)` reached 1 GB at 256 MiB).
                DataType::Struct(_) => {
                    let mut rows = vec![16.0; a.len()];
                    for c in a.as_struct().columns() {
                        for (r, v) in rows.iter_mut().zip(of(c)?) {
                            *r += v;
                        }
                    }
                    Ok(rows)
                }
                // Maps, unions, dictionaries: the column's memory over its rows (a mean).
                _ => Ok(vec![a.get_array_memory_size() as f64 / a.len().max(1) as f64; a.len()]),
            }
        }
        Self::of(arg, of)
    }

    /// Counts of `$` and `\` in each string (group references of a replacement).
    fn references(arg: &ColumnarValue) -> Result<Self> {
        Self::of(arg, |a| {
            let s = cast(a, &DataType::Utf8)?;
            Ok(s.as_string::<i32>().iter().map(|v| v.map_or(0, |v| v.bytes().filter(|&b| b == b'$' || b == b'\\').count()) as f64).collect())
        })
    }
}

/// Byte lengths of `a`'s strings or binaries, or element counts of its lists; 0 for nulls.
fn lengths_of(a: &ArrayRef) -> Result<Vec<f64>> {
    let l = length(a.as_ref())?;
    Ok(match l.data_type() {
        DataType::Int32 => l.as_primitive::<Int32Type>().iter().map(|v| f64::from(v.unwrap_or(0))).collect(),
        _ => l.as_primitive::<Int64Type>().iter().map(|v| v.unwrap_or(0) as f64).collect(),
    })
}

/// Whether every string of `arg` is ASCII (`false` for anything else).
fn ascii(arg: &ColumnarValue) -> bool {
    let check = |a: &dyn Array| match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().is_ascii(),
        DataType::LargeUtf8 => a.as_string::<i64>().is_ascii(),
        DataType::Utf8View => a.as_string_view().is_ascii(),
        _ => false,
    };
    match arg {
        ColumnarValue::Array(a) => check(a.as_ref()),
        ColumnarValue::Scalar(s) => s.to_array_of_size(1).is_ok_and(|a| check(a.as_ref())),
    }
}

/// Nanoseconds in a day.
const DAY_NS: f64 = 86_400e9;

/// A temporal range's smallest step in nanoseconds (its bounds' unit in [`PerRow::numbers`]):
/// a month is 28 to 31 days, so `1 month -30 days` may be -2 to +1 days. `None` when the step
/// can be 0 or change sign: `DataFusion`'s timestamp range then never ends (a trial's `range`
/// stepped by `1 month -30 days` grew 33 MB/s without end), so it counts as unbounded. 1 when
/// the step is not a constant.
fn temporal_step(step: Option<&ColumnarValue>) -> Option<f64> {
    let (months, rest) = match step {
        Some(ColumnarValue::Scalar(ScalarValue::IntervalMonthDayNano(Some(IntervalMonthDayNano { months, days, nanoseconds })))) => {
            (f64::from(*months), f64::from(*days) * DAY_NS + *nanoseconds as f64)
        }
        Some(ColumnarValue::Scalar(ScalarValue::IntervalDayTime(Some(v)))) => (0.0, f64::from(v.days) * DAY_NS + f64::from(v.milliseconds) * 1e6),
        Some(ColumnarValue::Scalar(ScalarValue::IntervalYearMonth(Some(m)))) => (f64::from(*m), 0.0),
        _ => return Some(1.0),
    };
    let (a, b) = (months * 28.0 * DAY_NS + rest, months * 31.0 * DAY_NS + rest);
    let (lo, hi) = (a.min(b), a.max(b));
    if lo <= 0.0 && hi >= 0.0 {
        return None;
    }
    Some(lo.abs().min(hi.abs()).max(1.0))
}

impl OutputBound {
    /// An upper bound of the bytes of the function's result on `args`.
    fn bound(&self, args: &ScalarFunctionArgs) -> Result<f64> {
        let a = &args.args;
        let rows = args.number_rows.max(1);
        let sum = |f: &dyn Fn(usize) -> f64| (0..rows).map(f).sum::<f64>();
        let nonneg = |v: f64| v.max(0.0);
        Ok(match (self.growth, a.len()) {
            (Growth::Repeat, 2..) => {
                let (s, n) = (PerRow::lengths(&a[0])?, PerRow::numbers(&a[1])?);
                sum(&|i| s.at(i) * nonneg(n.at(i)))
            }
            (Growth::Pad, 2..) => {
                let n = PerRow::numbers(&a[1])?;
                let width = if ascii(&a[0]) && a.get(2).is_none_or(ascii) { 1.0 } else { 4.0 };
                sum(&|i| nonneg(n.at(i)) * width)
            }
            (Growth::Replace, 3..) => {
                let (s, from, to) = (PerRow::lengths(&a[0])?, PerRow::lengths(&a[1])?, PerRow::lengths(&a[2])?);
                sum(&|i| s.at(i) + ((s.at(i) / from.at(i).max(1.0)).floor() + 1.0) * to.at(i))
            }
            (Growth::RegexpReplace, 3..) => {
                let (s, r, refs) = (PerRow::lengths(&a[0])?, PerRow::lengths(&a[2])?, PerRow::references(&a[2])?);
                // Matches do not overlap: a reference expands, summed over all matches, to at
                // most the whole of `s`.
                sum(&|i| s.at(i) + (s.at(i) + 1.0) * r.at(i) + refs.at(i) * s.at(i))
            }
            (Growth::ArrayRepeat, 2..) => {
                let (n, each) = (PerRow::numbers(&a[1])?, PerRow::sizes(&a[0])?);
                sum(&|i| nonneg(n.at(i)) * each.at(i))
            }
            (Growth::ArrayResize, 2..) => {
                // The row's own elements (at most all of them kept) and `n` new ones of the
                // fill (a null without one), per row.
                let (n, list) = (PerRow::numbers(&a[1])?, PerRow::sizes(&a[0])?);
                let fill = a.get(2).map(PerRow::sizes).transpose()?;
                sum(&|i| list.at(i) + nonneg(n.at(i)) * fill.as_ref().map_or(16.0, |f| f.at(i)))
            }
            (Growth::Range, 1..) => {
                // `range(start, stop, step)`: `end` is the function's `stop`.
                let (start, end, step) = match a.len() {
                    1 => (None, &a[0], None),
                    2 => (Some(&a[0]), &a[1], None),
                    _ => (Some(&a[0]), &a[1], Some(&a[2])),
                };
                let temporal = matches!(end.data_type(), DataType::Date32 | DataType::Date64 | DataType::Timestamp(..));
                let end = PerRow::numbers(end)?;
                let start = start.map(PerRow::numbers).transpose()?;
                let (numeric_step, fixed_step) =
                    if temporal { (None, temporal_step(step).unwrap_or(0.0)) } else { (step.map(PerRow::numbers).transpose()?, 1.0) };
                sum(&|i| {
                    let span = (end.at(i) - start.as_ref().map_or(0.0, |s| s.at(i))).abs();
                    let step = numeric_step.as_ref().map_or(fixed_step, |s| s.at(i).abs().max(1.0));
                    if step == 0.0 {
                        // A temporal step that can be 0 or change sign: no end.
                        return f64::INFINITY;
                    }
                    (span / step + 1.0) * 8.0
                })
            }
            // Arity errors are the function's own.
            _ => 0.0,
        })
    }
}

impl ScalarUDFImpl for OutputBound {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn display_name(&self, args: &[Expr]) -> Result<String> {
        #[allow(deprecated)]
        self.inner.display_name(args)
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        self.inner.schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        let inner = self.inner.inner().with_updated_config(config)?;
        Some(ScalarUDF::new_from_impl(Self { inner: Arc::new(inner), growth: self.growth, pool: Arc::clone(&self.pool) }))
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn is_nullable(&self, args: &[Expr], schema: &dyn ExprSchema) -> bool {
        #[allow(deprecated)]
        self.inner.is_nullable(args, schema)
    }

    fn is_strict(&self) -> bool {
        self.inner.inner().is_strict()
    }

    /// Reserves the bound of the result (when at least [`CHECKED_BYTES`]) in the query's pool
    /// while the function runs.
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let mut bound = self.bound(&args)?;
        if args.args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_))) {
            bound *= CONSTANT_COPIES;
        }
        // `as` saturates a float to `usize::MAX`.
        let bytes = bound as usize;
        if bytes < CHECKED_BYTES {
            return self.inner.invoke_with_args(args);
        }
        let reservation = MemoryConsumer::new(format!("{}() result", self.inner.name())).register(&self.pool);
        reservation.try_grow(bytes)?;
        let out = self.inner.invoke_with_args(args);
        drop(reservation);
        out
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        self.inner.simplify(args, info)
    }

    fn preimage(&self, args: &[Expr], lit_expr: &Expr, info: &SimplifyContext) -> Result<PreimageResult> {
        self.inner.preimage(args, lit_expr, info)
    }

    fn conditional_arguments<'a>(&self, args: &'a [Expr]) -> Option<(Vec<&'a Expr>, Vec<&'a Expr>)> {
        self.inner.conditional_arguments(args)
    }

    fn short_circuits(&self) -> bool {
        self.inner.short_circuits()
    }

    fn evaluate_bounds(&self, input: &[&Interval]) -> Result<Interval> {
        self.inner.evaluate_bounds(input)
    }

    fn propagate_constraints(&self, interval: &Interval, inputs: &[&Interval]) -> Result<Option<Vec<Interval>>> {
        self.inner.propagate_constraints(interval, inputs)
    }

    fn struct_field_mapping(&self, literal_args: &[Option<ScalarValue>]) -> Option<StructFieldMapping> {
        self.inner.struct_field_mapping(literal_args)
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(inputs)
    }

    fn preserves_lex_ordering(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.preserves_lex_ordering(inputs)
    }

    fn strictly_order_preserving(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.strictly_order_preserving(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner.placement(args)
    }
}

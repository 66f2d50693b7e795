//! How deep a SQL statement nests, measured before `DataFusion` plans it.
//!
//! `DataFusion`'s planner, optimizer and physical expressions recurse once per level of a
//! statement's expression and plan trees, and parts of them (derived `Clone`, `Drop`,
//! `PartialEq` and `Hash` of `Expr`, `PhysicalExpr::evaluate`) are not covered by its
//! `recursive_protection`: a `WHERE` clause of 2,000 `OR`s overflowed a 2 MiB stack and
//! aborted the process. The SQL parser's recursion limit (50) bounds parentheses, function
//! calls, `CASE` and subqueries, but not chains it builds in a loop: `a OR b OR c ...`,
//! `a + b + ...`, `x::t::t ...`, `IS NULL IS NULL ...`, `UNION` after `UNION`, nor what
//! `DataFusion` nests from flat lists (a join of many tables, a chain of CTEs).
//!
//! So [`Engine::sql`](crate::Engine::sql) runs every statement on the engine's SQL runtime,
//! whose threads have [`STACK_BYTES`] of stack, and refuses, before planning, one that nests
//! deeper than [`MAX_DEPTH`] levels with `Error::Sql { kind: SqlErrorKind::TooDeep, .. }`:
//!
//! 1. [`token_depth`], on the tokens (a loop, no recursion): an upper bound of the depth of
//!    any syntax tree the parser can build from them. Above [`MAX_TOKEN_DEPTH`] the text is
//!    not parsed at all, so the parser's own unguarded recursion (nested `ARRAY<...>` types)
//!    and the recursive drop of the syntax tree stay within the stack.
//! 2. [`statement_depth`], on the syntax tree: the nesting counted as `docs/sql.md` says
//!    (each expression node, each query, each set operation of a chain, each table joined
//!    beyond the first, each CTE of a `WITH`). It walks the tree with the parser's visitor,
//!    which recurses, but stops one level past [`MAX_DEPTH`], so its recursion is bounded too.
//! 3. [`expansion`], on the syntax tree that passed: what `DataFusion` plans once each CTE
//!    reference is replaced by its CTE's plan, as `DataFusion` does (it copies the plan into
//!    each reference): the levels ([`MAX_DEPTH`]), the subqueries nested inside expressions
//!    ([`MAX_SUBQUERY_DEPTH`]) and the relations ([`MAX_EXPANDED_RELATIONS`]). Each CTE's
//!    cost is computed once, when the walk leaves its body, and a reference adds it where it
//!    stands, so a chain of CTEs each reading the one before twice is counted (saturating) in
//!    one walk of the text.

use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::{Expr, ObjectName, Query, Select, SetExpr, Statement, TableFactor, Visit, Visitor};
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::Token;
use std::ops::ControlFlow;

/// The deepest statement [`Engine::sql`](crate::Engine::sql) plans (see the module docs and
/// `docs/sql.md` for what counts as a level). Deeper is `Error::Sql { kind:
/// SqlErrorKind::TooDeep, .. }`.
pub const MAX_DEPTH: usize = 2_000;

/// Above this bound on the tokens ([`token_depth`]) a statement is refused unparsed: its
/// syntax tree could be too deep to parse and drop safely. Far above [`MAX_DEPTH`], since the
/// bound counts every token on a path (`id = 1 OR ...` is 4 tokens a level).
pub const MAX_TOKEN_DEPTH: usize = 16 * MAX_DEPTH;

/// The SQL parser's recursion limit in [`Engine::sql`](crate::Engine::sql)'s session
/// (`datafusion.sql_parser.recursion_limit`, 50 by default). The parser counts one per nested
/// expression, query, statement or table factor it enters, so at 50, 49 nested parentheses,
/// 49 `NOT`s, a `CASE` nested 50 deep or 30 nested subqueries were refused as confusing syntax
/// errors ("Expected: end of statement, found: NOT"). Past this limit a statement is
/// `TooDeep`.
///
/// Why 500 and not [`MAX_DEPTH`]: what the parser counts (parentheses, calls, `CASE`,
/// subqueries) costs far more stack to plan than a level of a chain. Measured in the `ci`
/// profile on a [`STACK_BYTES`] stack: 1,997 nested parentheses or `NOT`s and a `CASE` nested
/// 1,996 deep plan and run, but 1,990 nested subqueries in `FROM` overflowed the stack
/// (1,000 ran: about 40 KiB a level). Each such subquery is two counts, so 500 admits about 250
/// of them, some 10 MiB of stack, and 200 nested parentheses, 200 `NOT`s, a `CASE` 100 deep
/// and 100 nested subqueries in `FROM` run (`sql::deep_nesting_through_the_parser_runs`).
pub const PARSER_RECURSION_LIMIT: usize = 500;

/// The deepest nesting of subqueries inside expressions (`(SELECT ..)`, `IN (SELECT ..)`,
/// `EXISTS (..)`) [`Engine::sql`](crate::Engine::sql) plans: deeper is `TooDeep`. A CTE read
/// inside `k` of them counts `k` plus the nesting of its own body (`DataFusion` copies the
/// CTE's plan there), so a chain of CTEs each holding a scalar subquery of the one before
/// nests one more per CTE. `DataFusion`'s planning time about doubles with each level
/// (measured in the `ci` profile on 2 shared cores, planning and running: nested directly 15
/// 0.13 s, 18 0.87 s, 20 3.5 s; through such a CTE chain 15 0.16 s, 17 0.6 s, 18 1.2 s,
/// 19 2.4 s, 20 4.3–4.6 s, 22 18 s, 25 over 45 s), so 18 keeps planning near a second; a
/// deeper one would hold a `gritdb-sql` thread for hours. Subqueries in `FROM` do not grow
/// so (100 nested: 23 ms).
pub const MAX_SUBQUERY_DEPTH: usize = 18;

/// The most relations a statement may plan once each CTE reference is replaced by its CTE's
/// plan, as `DataFusion` does (each `SELECT` and each table it reads count one, a CTE
/// reference what its CTE counts): more is `TooDeep`. A chain of CTEs each reading the one
/// before twice doubles the count per CTE. Measured in the `ci` profile on 2 shared cores
/// (planning and running, `tests/all/sql.rs` chains): cross joins of constants
/// (`c1 AS (SELECT a.x FROM c0 a, c0 b)`, ...) took 0.14–0.21 s at 2,048 relations, 0.86 s at
/// 8,192, 1.5 s at 16,384 and 2.8 s at 32,768 (about 0.1 ms a relation), three-way ones
/// 0.35 s at 3,281 and 1.2 s at 9,842, equi-joins over a table (`JOIN .. ON a.x = b.x`)
/// 0.27 s at 768, 0.5–1 s at 1,536 and 1.1–1.5 s at 3,072 (0.35–0.5 ms a relation); the
/// chain of 30 CTEs the fresh-user trial would have planned 2^31. At this bound those plan
/// in under a second, and every chain of CTEs each read once that [`MAX_DEPTH`] admits
/// (1,990 CTEs: about 2,000 relations) is below it.
pub const MAX_EXPANDED_RELATIONS: usize = 2_048;

/// Levels each table joined beyond the first counts for: planning a join takes about four
/// times the stack of an expression level (measured in the `ci` profile: 7 KiB a join, 1.3 to
/// 1.75 KiB an expression level), so [`MAX_DEPTH`] bounds the stack either way.
pub const JOIN_LEVELS: usize = 4;

/// Stack of each thread of the engine's SQL runtime (planning and execution), sized so a
/// statement [`MAX_DEPTH`] deep fits with room to spare (docs/sql.md has the measurements).
/// Address space only: pages are touched as deep as a query recurses.
pub const STACK_BYTES: usize = 64 << 20;

/// What opened a group of the token scan.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Open {
    /// The outermost level, `(`, `{`.
    #[default]
    Plain,
    /// `[`: a subscript, an array literal or, empty or holding a size, an array type `INT[]`.
    Bracket,
    /// The `<` of `ARRAY<`, `STRUCT<`, `MAP<`: a nested type, closed by `>` or half a `>>`.
    Angle,
    /// The `(` of `NULLABLE(`, `LOWCARDINALITY(`, `MAP(`, `TUPLE(`, `NESTED(`: a nested type.
    TypeParen,
    /// `CASE`, closed by `END`: `WHEN`, `THEN` and `ELSE` separate its parts as commas do
    /// (its branches are siblings), so a `CASE` of 10,000 branches is shallow.
    Case,
}

#[derive(Clone, Copy, Default)]
struct Level {
    open: Open,
    /// Tokens of the current comma-separated part at this level.
    part: usize,
    /// The deepest bracketed group closed inside the current part.
    child: usize,
    /// The deepest part of this level so far.
    deepest: usize,
    /// `UNION` / `INTERSECT` / `EXCEPT` at this level (a chain spans commas).
    set_ops: usize,
    /// Tokens scanned when the group opened (the group's own tokens are those after it: an
    /// array type's `[]` holds none or a size).
    start: usize,
    /// For `[`: the run of array-type brackets (`INT[][]`) right before it.
    run_before: usize,
    /// For `[`: nothing but a number in it so far (`[]`, `[3]`: an array type's brackets).
    sized: bool,
}

impl Level {
    fn end_part(&mut self) {
        self.deepest = self.deepest.max(self.part + self.child);
        self.part = 0;
        self.child = 0;
    }

    fn depth(mut self) -> usize {
        self.end_part();
        self.set_ops + self.deepest + 1
    }
}

/// Bounds [`token_depth`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenDepth {
    /// An upper bound of the depth of any syntax tree the parser builds from the tokens.
    pub(crate) depth: usize,
    /// The deepest nesting of data types: open `ARRAY<` / `STRUCT<` / `MAP<` and
    /// `NULLABLE(`-like groups plus a run of array brackets `[]` (`INT[][]` is 2).
    pub(crate) type_depth: usize,
}

/// Scans `tokens` without recursion for [`TokenDepth`]. Within a bracketed group, a tree
/// built from a comma-separated part is at most as deep as the part's tokens plus its deepest
/// inner group (commas only ever separate siblings: select items, arguments, list elements);
/// a chain of set operations spans commas and is added on top. `(`, `[`, `{`, the `<` of
/// `ARRAY<`, `STRUCT<` and `MAP<`, and `CASE` (to its `END`, parts separated by `WHEN`,
/// `THEN`, `ELSE`) open groups.
pub(crate) fn token_depth(tokens: &[Token]) -> TokenDepth {
    let mut levels = vec![Level::default()];
    let mut previous_word = Keyword::NoKeyword;
    // Open type groups, the current run of array-type brackets, and the deepest sum.
    let (mut types_open, mut run, mut type_depth) = (0usize, 0usize, 0usize);
    let mut seen = 0usize;
    for token in tokens {
        if matches!(token, Token::Whitespace(_) | Token::EOF) {
            continue;
        }
        seen += 1;
        let word_before = std::mem::replace(&mut previous_word, Keyword::NoKeyword);
        let run_before = std::mem::take(&mut run);
        let angle_open = levels.len() > 1 && levels.last().is_some_and(|l| l.open == Open::Angle);
        match token {
            Token::LParen if matches!(word_before, Keyword::NULLABLE | Keyword::LOWCARDINALITY | Keyword::MAP | Keyword::TUPLE | Keyword::NESTED) => {
                types_open += 1;
                type_depth = type_depth.max(types_open);
                levels.push(Level { open: Open::TypeParen, start: seen, ..Level::default() });
            }
            Token::Lt if matches!(word_before, Keyword::ARRAY | Keyword::STRUCT | Keyword::MAP) => {
                types_open += 1;
                type_depth = type_depth.max(types_open);
                levels.push(Level { open: Open::Angle, start: seen, ..Level::default() });
            }
            Token::LParen | Token::LBrace => levels.push(Level { start: seen, ..Level::default() }),
            Token::LBracket => levels.push(Level { open: Open::Bracket, start: seen, run_before, sized: true, ..Level::default() }),
            Token::Gt if angle_open => {
                close(&mut levels, &mut types_open);
            }
            Token::ShiftRight if angle_open => {
                close(&mut levels, &mut types_open);
                if levels.len() > 1 && levels.last().is_some_and(|l| l.open == Open::Angle) {
                    close(&mut levels, &mut types_open);
                }
            }
            Token::RParen | Token::RBracket | Token::RBrace if levels.len() > 1 => {
                if let Some(Level { open: Open::Bracket, start, run_before, sized: true, .. }) = close(&mut levels, &mut types_open)
                    && seen - start <= 2
                {
                    // `[]` or `[3]` (the closing bracket is the last token seen): an array
                    // type (or a subscript by a number), one level deeper than the run of such
                    // brackets before it.
                    run = run_before + 1;
                    type_depth = type_depth.max(types_open + run);
                }
            }
            Token::Comma => top(&mut levels).end_part(),
            Token::Word(w) if w.quote_style.is_none() && w.keyword == Keyword::CASE => {
                top(&mut levels).part += 1;
                levels.push(Level { open: Open::Case, start: seen, ..Level::default() });
            }
            Token::Word(w) if matches!(w.keyword, Keyword::WHEN | Keyword::THEN | Keyword::ELSE) && levels.last().is_some_and(|l| l.open == Open::Case) => {
                top(&mut levels).end_part();
            }
            Token::Word(w) if w.keyword == Keyword::END && levels.len() > 1 && levels.last().is_some_and(|l| l.open == Open::Case) => {
                close(&mut levels, &mut types_open);
            }
            token => {
                let level = top(&mut levels);
                level.part += 1;
                level.sized &= matches!(token, Token::Number(..));
                if let Token::Word(w) = token {
                    previous_word = w.keyword;
                    if matches!(w.keyword, Keyword::UNION | Keyword::INTERSECT | Keyword::EXCEPT | Keyword::MINUS) {
                        level.set_ops += 1;
                    }
                }
            }
        }
    }
    // Groups left open (the parser refuses the text) count as closed at the end.
    while close(&mut levels, &mut types_open).is_some() {}
    TokenDepth { depth: levels.pop().map_or(0, Level::depth), type_depth }
}

fn top(levels: &mut [Level]) -> &mut Level {
    levels.last_mut().expect("the outermost level is never closed")
}

/// Closes the innermost group and returns it: its depth goes to the enclosing part, the
/// brackets count as a token of it.
fn close(levels: &mut Vec<Level>, types_open: &mut usize) -> Option<Level> {
    if levels.len() < 2 {
        return None;
    }
    let inner = levels.pop()?;
    if matches!(inner.open, Open::Angle | Open::TypeParen) {
        *types_open -= 1;
    }
    let outer = top(levels);
    outer.part += 1;
    outer.child = outer.child.max(inner.depth());
    Some(inner)
}

/// Walks a syntax tree counting levels; breaks once past the limit.
struct Depth {
    current: usize,
    deepest: usize,
    limit: usize,
    /// Levels each open node added, popped by its `post_visit`.
    added: Vec<usize>,
}

impl Depth {
    fn enter(&mut self, levels: usize) -> ControlFlow<()> {
        self.current += levels;
        self.added.push(levels);
        self.deepest = self.deepest.max(self.current);
        if self.current > self.limit { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    }

    fn leave(&mut self) -> ControlFlow<()> {
        self.current -= self.added.pop().unwrap_or(0);
        ControlFlow::Continue(())
    }
}

/// The depth of a set-operation tree (`a UNION b UNION c` is 2 deep), walked with a heap
/// stack: the visitor would recurse down such a chain without calling back.
fn set_operation_depth(body: &SetExpr) -> usize {
    let mut deepest = 0;
    let mut todo = vec![(body, 0usize)];
    while let Some((set, depth)) = todo.pop() {
        deepest = deepest.max(depth);
        if let SetExpr::SetOperation { left, right, .. } = set {
            todo.push((left, depth + 1));
            todo.push((right, depth + 1));
        }
    }
    deepest
}

impl Visitor for Depth {
    type Break = ();

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        // Each CTE may read the one before it: `DataFusion` nests their plans.
        let ctes = query.with.as_ref().map_or(0, |w| w.cte_tables.len());
        self.enter(1 + ctes + set_operation_depth(&query.body))
    }

    fn post_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        self.leave()
    }

    fn pre_visit_select(&mut self, select: &Select) -> ControlFlow<()> {
        // `FROM a, b JOIN c` is a left-deep tree of joins in the plan.
        let relations: usize = select.from.iter().map(|t| 1 + t.joins.len()).sum();
        self.enter(relations.saturating_sub(1) * JOIN_LEVELS)
    }

    fn post_visit_select(&mut self, _: &Select) -> ControlFlow<()> {
        self.leave()
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        self.enter(match factor {
            TableFactor::NestedJoin { table_with_joins, .. } => table_with_joins.joins.len() * JOIN_LEVELS,
            _ => 0,
        })
    }

    fn post_visit_table_factor(&mut self, _: &TableFactor) -> ControlFlow<()> {
        self.leave()
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        // Field accesses `a.b.c[1]` are one node here and one level each in `DataFusion`
        // (counted from the second name on, though `t.col` is a qualified column).
        self.enter(
            1 + match expr {
                Expr::CompoundIdentifier(parts) => parts.len().saturating_sub(1),
                Expr::CompoundFieldAccess { access_chain, .. } => access_chain.len(),
                _ => 0,
            },
        )
    }

    fn post_visit_expr(&mut self, _: &Expr) -> ControlFlow<()> {
        self.leave()
    }
}

/// The SQL statement `DataFusion` would plan for `statement`, through any `EXPLAIN`; `None`
/// for statements gritdb refuses anyway (`check_read_only`): nothing is planned.
pub(crate) fn planned_statement(mut statement: &DfStatement) -> Option<&Statement> {
    loop {
        match statement {
            DfStatement::Statement(s) => return Some(s),
            DfStatement::Explain(e) => statement = &e.statement,
            _ => return None,
        }
    }
}

/// The nesting depth of `statement` when it is at most `limit`, else `Err` with at least
/// `limit + 1` (the walk stops there, so its recursion is bounded by the limit).
pub(crate) fn statement_depth(statement: &DfStatement, limit: usize) -> Result<usize, usize> {
    let Some(sql) = planned_statement(statement) else { return Ok(0) };
    let mut depth = Depth { current: 0, deepest: 0, limit, added: Vec::new() };
    match sql.visit(&mut depth) {
        ControlFlow::Continue(()) => Ok(depth.deepest),
        ControlFlow::Break(()) => Err(depth.deepest),
    }
}

/// What planning a statement costs once every CTE reference is expanded: `DataFusion` plans
/// each CTE once and copies its plan into every place that reads it, so a reference to CTE `c`
/// costs as much as `c`'s own body (itself with its references expanded), where it stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Expansion {
    /// The deepest nesting of subqueries inside expressions (`(SELECT ..)`, `IN (SELECT ..)`,
    /// `EXISTS (..)`), a CTE reference inside `k` of them counting `k` plus the CTE's own
    /// ([`MAX_SUBQUERY_DEPTH`]).
    pub(crate) subqueries: usize,
    /// The levels of [`statement_depth`] with each CTE reference counting its CTE's body's
    /// depth where it stands, instead of one level a CTE ([`MAX_DEPTH`]).
    pub(crate) depth: usize,
    /// Relations of the expanded plan: each `SELECT` and each table it reads is one, a CTE
    /// reference its CTE's count (saturating: a chain of CTEs each reading the one before
    /// twice doubles it per CTE). [`MAX_EXPANDED_RELATIONS`].
    pub(crate) relations: usize,
}

impl Expansion {
    fn max(self, other: Self) -> Self {
        Self { subqueries: self.subqueries.max(other.subqueries), depth: self.depth.max(other.depth), relations: self.relations.max(other.relations) }
    }
}

/// One CTE of a `WITH`, as the walk knows it.
struct Cte {
    /// Its name as `DataFusion` looks it up (unquoted names lowercased).
    name: String,
    /// Its body, to know when the walk enters it (compared, never read).
    body: *const Query,
    /// Its body's cost relative to where it is read, once walked: a reference before that
    /// (a later CTE's name, not yet visible) is no reference to it.
    cost: Option<Expansion>,
}

/// A query being walked.
struct Frame {
    query: *const Query,
    ctes: Vec<Cte>,
    recursive: bool,
    /// The CTE of this query's `WITH` whose body is being walked.
    defining: Option<usize>,
    /// Levels and subqueries around the query where it starts.
    entry: (usize, usize),
    /// The deepest levels and subqueries reached inside it (CTE references expanded), and
    /// its relations.
    reached: Expansion,
}

/// Walks a statement for its [`Expansion`], resolving names as `DataFusion` does: a `WITH`'s
/// CTE is visible to the CTEs after it (to itself too under `RECURSIVE`, where it reads its
/// work table: one relation) and to the query's body and the subqueries inside them; an inner
/// `WITH` shadows an outer one; any other name is a table.
struct Expand {
    levels: Depth,
    subqueries: usize,
    /// Subquery expressions open, innermost last (whether each counted one).
    opened: Vec<bool>,
    frames: Vec<Frame>,
    /// The most reached anywhere, also inside CTE bodies never read (planned once each).
    reached: Expansion,
}

impl Expand {
    /// Records `levels` and `subqueries` reached (relations are summed apart).
    fn reach(&mut self, levels: usize, subqueries: usize) {
        let at = Expansion { subqueries, depth: levels, relations: 0 };
        self.reached = self.reached.max(at);
        if let Some(frame) = self.frames.last_mut() {
            frame.reached = frame.reached.max(at);
        }
    }

    fn relations(&mut self, n: usize) {
        if let Some(frame) = self.frames.last_mut() {
            frame.reached.relations = frame.reached.relations.saturating_add(n);
        }
    }

    /// The cost of the CTE `name` where it is read, if `name` is one in scope.
    fn resolve(&self, name: &str) -> Option<Expansion> {
        for frame in self.frames.iter().rev() {
            for (i, cte) in frame.ctes.iter().enumerate() {
                if cte.name != name {
                    continue;
                }
                if let Some(cost) = cte.cost {
                    return Some(cost);
                }
                if frame.recursive && frame.defining == Some(i) {
                    // A recursive CTE reading itself: its work table.
                    return Some(Expansion { relations: 1, ..Expansion::default() });
                }
            }
        }
        None
    }
}

/// A name as `DataFusion` normalizes it (`enable_ident_normalization`, on by default).
fn normalized(ident: &datafusion::sql::sqlparser::ast::Ident) -> String {
    if ident.quote_style.is_some() { ident.value.clone() } else { ident.value.to_lowercase() }
}

impl Visitor for Expand {
    type Break = ();

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        let entry = (self.levels.current, self.subqueries);
        if let Some(frame) = self.frames.last_mut() {
            let body = std::ptr::from_ref(query);
            if let Some(i) = frame.ctes.iter().position(|c| std::ptr::eq(c.body, body)) {
                frame.defining = Some(i);
            }
        }
        let with = query.with.as_ref();
        self.frames.push(Frame {
            query: std::ptr::from_ref(query),
            ctes: with.map_or_else(Vec::new, |w| {
                w.cte_tables.iter().map(|c| Cte { name: normalized(&c.alias.name), body: std::ptr::from_ref(&*c.query), cost: None }).collect()
            }),
            recursive: with.is_some_and(|w| w.recursive),
            defining: None,
            entry,
            reached: Expansion::default(),
        });
        // The query's own levels, without the level `statement_depth` counts for each CTE:
        // here a CTE costs where it is read.
        let _ = self.levels.enter(1 + set_operation_depth(&query.body));
        self.reach(self.levels.current, self.subqueries);
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        let _ = self.levels.leave();
        let Some(done) = self.frames.pop() else {
            return ControlFlow::Continue(());
        };
        debug_assert!(std::ptr::eq(done.query, query));
        let Some(parent) = self.frames.last_mut() else {
            // The statement's query: its relations are the statement's.
            self.reached.relations = done.reached.relations;
            return ControlFlow::Continue(());
        };
        match parent.defining.take() {
            Some(i) if std::ptr::eq(parent.ctes[i].body, done.query) => {
                let (levels, subqueries) = done.entry;
                parent.ctes[i].cost =
                    Some(Expansion { subqueries: done.reached.subqueries - subqueries, depth: done.reached.depth - levels, relations: done.reached.relations });
            }
            defining => {
                parent.defining = defining;
                parent.reached = parent.reached.max(Expansion { relations: 0, ..done.reached });
                parent.reached.relations = parent.reached.relations.saturating_add(done.reached.relations);
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_select(&mut self, select: &Select) -> ControlFlow<()> {
        let _ = self.levels.pre_visit_select(select);
        self.relations(1);
        self.reach(self.levels.current, self.subqueries);
        ControlFlow::Continue(())
    }

    fn post_visit_select(&mut self, select: &Select) -> ControlFlow<()> {
        self.levels.post_visit_select(select)
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        let _ = self.levels.pre_visit_table_factor(factor);
        self.reach(self.levels.current, self.subqueries);
        ControlFlow::Continue(())
    }

    fn post_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        self.levels.post_visit_table_factor(factor)
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<()> {
        // `DataFusion` looks a CTE up by the whole name: `public.c` is a table.
        let cte = match relation.0.as_slice() {
            [part] => part.as_ident().and_then(|i| self.resolve(&normalized(i))),
            _ => None,
        };
        match cte {
            Some(cost) => {
                self.relations(cost.relations);
                self.reach(self.levels.current.saturating_add(cost.depth), self.subqueries.saturating_add(cost.subqueries));
            }
            None => self.relations(1),
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        let _ = self.levels.pre_visit_expr(expr);
        let sub = matches!(expr, Expr::Subquery(_) | Expr::InSubquery { .. } | Expr::Exists { .. });
        self.opened.push(sub);
        self.subqueries += usize::from(sub);
        self.reach(self.levels.current, self.subqueries);
        ControlFlow::Continue(())
    }

    fn post_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        self.subqueries -= usize::from(self.opened.pop().unwrap_or(false));
        self.levels.post_visit_expr(expr)
    }
}

/// The [`Expansion`] of `statement`. Run after [`statement_depth`] passed, so the visitor's
/// recursion is bounded; the expanded counts are arithmetic on each CTE's cost, never a walk
/// through a reference, so a `WITH RECURSIVE` or a chain doubling per CTE is counted in one
/// walk of the text.
pub(crate) fn expansion(statement: &DfStatement) -> Expansion {
    let Some(sql) = planned_statement(statement) else { return Expansion::default() };
    let mut v = Expand {
        levels: Depth { current: 0, deepest: 0, limit: usize::MAX, added: Vec::new() },
        subqueries: 0,
        opened: Vec::new(),
        frames: Vec::new(),
        reached: Expansion::default(),
    };
    let _ = sql.visit(&mut v);
    v.reached
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::sql::parser::DFParserBuilder;
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::Tokenizer;

    fn scan(sql: &str) -> TokenDepth {
        token_depth(&Tokenizer::new(&GenericDialect {}, sql).tokenize().unwrap())
    }

    fn tokens(sql: &str) -> usize {
        scan(sql).depth
    }

    fn depth(sql: &str) -> Result<usize, usize> {
        let statement = DFParserBuilder::new(sql).build().unwrap().parse_statement().unwrap();
        statement_depth(&statement, 10_000)
    }

    /// Each form that nests counts as `docs/sql.md` says, and the token bound is never below
    /// the tree's depth.
    #[test]
    fn depth_counts_each_level_and_the_token_bound_is_above_it() {
        let or = |n: usize| format!("SELECT * FROM t WHERE {}", (0..n).map(|i| format!("id = {i}")).collect::<Vec<_>>().join(" OR "));
        let cases = [
            // query 1 + `=` 1 + its operand 1
            ("SELECT * FROM t WHERE id = 1".to_owned(), 3),
            // 9 ORs on the left spine: 1 + 9 + 2
            (or(10), 12),
            (or(100), 102),
            ("SELECT a + b + c + d FROM t".to_owned(), 5),
            ("SELECT ((((a)))) FROM t".to_owned(), 6),
            ("SELECT CASE WHEN a = 1 THEN CASE WHEN b = 2 THEN 1 END END FROM t".to_owned(), 5),
            ("SELECT abs(abs(abs(a))) FROM t".to_owned(), 5),
            // three set operations on the left spine of four selects
            ("SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4".to_owned(), 5),
            // each table joined beyond the first: `JOIN_LEVELS`
            ("SELECT 1 FROM a JOIN b ON a.x = b.x JOIN c ON a.x = c.x".to_owned(), 1 + 2 * JOIN_LEVELS + 3),
            ("SELECT 1 FROM a, b, c, d".to_owned(), 1 + 3 * JOIN_LEVELS + 1),
            ("SELECT 1 FROM (a JOIN b ON true) JOIN c ON true".to_owned(), 1 + 2 * JOIN_LEVELS + 1),
            ("WITH a AS (SELECT 1), b AS (SELECT * FROM a) SELECT * FROM b".to_owned(), 5),
            // query, IN, subquery, `>`, operand
            ("SELECT * FROM t WHERE id IN (SELECT id FROM u WHERE id > 1)".to_owned(), 5),
            ("EXPLAIN SELECT a::bigint::bigint FROM t".to_owned(), 4),
            // a flat list: the query, the list, its elements
            (format!("SELECT * FROM t WHERE id IN ({})", (0..10_000).map(|i| i.to_string()).collect::<Vec<_>>().join(", ")), 3),
        ];
        for (sql, want) in cases {
            let got = depth(&sql).unwrap();
            assert_eq!(got, want, "{}", &sql[..sql.len().min(80)]);
            // The token bound is of the syntax tree, where a join is one level, not `JOIN_LEVELS`.
            let joins = sql.matches(" JOIN ").count() + sql.matches(", ").count() * usize::from(sql.contains("FROM a,"));
            let tree = got - joins * (JOIN_LEVELS - 1);
            assert!(tokens(&sql) >= tree, "token bound {} < tree depth {tree}: {}", tokens(&sql), &sql[..sql.len().min(80)]);
        }
        // A CASE of 10,000 branches is flat: its branches are siblings.
        let branches = format!("SELECT CASE {} ELSE 0 END FROM t", (0..10_000).map(|i| format!("WHEN a + 1 = {i} THEN {i}")).collect::<Vec<_>>().join(" "));
        assert!(tokens(&branches) < 20, "{}", tokens(&branches));
        // ... and a deep path through one stays counted: the chain before the CASE, the CASE,
        // the chain inside its condition.
        let through = format!("SELECT {} + CASE WHEN {} = 1 THEN 1 END FROM t", vec!["a"; 500].join(" + "), vec!["b"; 500].join(" + "));
        assert!(tokens(&through) >= depth(&through).unwrap(), "{} < {:?}", tokens(&through), depth(&through));
        // A flat list stays shallow for the token bound too.
        assert!(tokens(&format!("SELECT {} FROM t", (0..10_000).map(|i| format!("a + {i}")).collect::<Vec<_>>().join(", "))) < 10);
    }

    /// Past the limit the walk stops one level past it, so a chain of 100,000 ORs is measured
    /// (and refused) within a bounded recursion; nested array types count on tokens.
    #[test]
    fn the_walk_stops_past_the_limit() {
        let sql = format!("SELECT * FROM t WHERE {}", (0..100_000).map(|i| format!("id = {i}")).collect::<Vec<_>>().join(" OR "));
        let statement = DFParserBuilder::new(sql.as_str()).build().unwrap().parse_statement().unwrap();
        assert_eq!(statement_depth(&statement, 1_000), Err(1_001));
        // Dropped on a large stack: the parser's tree of 100,000 levels drops recursively.
        std::thread::Builder::new().stack_size(256 << 20).spawn(move || drop(statement)).unwrap().join().unwrap();
        assert!(tokens(&sql) > 100_000);
        // Type brackets `ARRAY<...>` nest (`>>` closes two), as `(` does: 3 a level (the word,
        // the brackets and the level), not 1 per `<` or `>` of the text.
        for closing in [">".repeat(100), ">>".repeat(50), "> ".repeat(100)] {
            let nested = format!("SELECT CAST(NULL AS {}INT{closing})", "ARRAY<".repeat(100));
            assert_eq!(tokens(&nested), 308, "{closing}");
        }
        let comparisons = format!("SELECT {} FROM t", (0..1_000).map(|i| format!("a < {i}, b > {i}")).collect::<Vec<_>>().join(", "));
        assert!(tokens(&comparisons) < 10, "comparisons are not brackets");
        assert_eq!(scan(&comparisons).type_depth, 0);
    }

    fn expanded(sql: &str) -> Expansion {
        let statement = DFParserBuilder::new(sql).build().unwrap().parse_statement().unwrap();
        expansion(&statement)
    }

    /// `c0 AS (SELECT 1 AS x)` and `n` CTEs after it, each built by `body(i)` from the one
    /// before, and `tail` reading them.
    fn chain(n: usize, body: impl Fn(usize) -> String, tail: &str) -> String {
        let ctes: Vec<String> = (1..=n).map(|i| format!("c{i} AS ({})", body(i - 1))).collect();
        format!("WITH c0 AS (SELECT 1 AS x), {} {tail}", ctes.join(", "))
    }

    /// A CTE reference costs its CTE's subqueries, levels and relations where it stands,
    /// computed through the CTEs it reads; counts saturate.
    #[test]
    fn a_cte_reference_counts_its_cte_where_it_stands() {
        let sub = |n: usize| chain(n, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), &format!("SELECT x FROM c{n}"));
        for n in [1, 5, 18, 30] {
            assert_eq!(expanded(&sub(n)).subqueries, n, "{n}");
        }
        // Read from inside two subqueries: two more.
        let inside = chain(5, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), "SELECT (SELECT (SELECT x FROM c5))");
        assert_eq!(expanded(&inside).subqueries, 7);
        // Each SELECT and table one relation; reading the one before twice doubles.
        assert_eq!(expanded("SELECT 1").relations, 1);
        assert_eq!(expanded("SELECT 1 FROM a, b JOIN c ON true").relations, 4);
        let twice = |n: usize| chain(n, |p| format!("SELECT a.x FROM c{p} a, c{p} b"), &format!("SELECT x FROM c{n}"));
        assert_eq!(expanded(&twice(1)).relations, 4);
        assert_eq!(expanded(&twice(10)).relations, 2_048);
        assert_eq!(expanded(&twice(11)).relations, 4_096);
        assert_eq!(expanded(&twice(100)).relations, usize::MAX);
        // Once each: linear, and one level a CTE where `statement_depth` counts one too.
        let once = |n: usize| chain(n, |p| format!("SELECT x + 1 AS x FROM c{p}"), &format!("SELECT x FROM c{n}"));
        let e = expanded(&once(200));
        assert_eq!((e.relations, e.subqueries), (202, 0));
        assert_eq!(e.depth, 1 + 200 + 2);
        assert_eq!(depth(&once(200)), Ok(1 + 201 + 3));
        // A CTE body's own depth counts at each level: three nested queries a CTE.
        let from = |n: usize| chain(n, |p| format!("SELECT x FROM (SELECT x FROM (SELECT x FROM c{p}) a) b"), &format!("SELECT x FROM c{n}"));
        assert_eq!(expanded(&from(100)).depth, 1 + 3 * 100 + 2);
        assert!(depth(&from(100)).unwrap() < 110);
        // A CTE never read is planned once, where it is defined.
        let unread = "WITH a AS (SELECT (SELECT (SELECT 1))), b AS (SELECT 1) SELECT 1 FROM b";
        assert_eq!(expanded(unread).subqueries, 2);
        assert_eq!(expanded(unread).relations, 2);
    }

    /// Names resolve as `DataFusion` resolves them: to earlier CTEs of the same `WITH` and
    /// to outer ones, the inner first; a later CTE's name, a qualified name or a name quoted
    /// in another case is a table; `WITH RECURSIVE` reads its own work table, once.
    #[test]
    fn cte_names_resolve_by_scope() {
        // `deep` nests two subqueries; read inside one more, three.
        let deep = "WITH deep AS (SELECT (SELECT (SELECT 1 AS x) AS x) AS x)";
        assert_eq!(expanded(&format!("{deep} SELECT (SELECT x FROM deep)")).subqueries, 3);
        // An inner WITH's `deep` shadows it: one subquery around a flat CTE.
        let shadowed = format!("{deep} SELECT (WITH deep AS (SELECT 1 AS x) SELECT x FROM deep)");
        assert_eq!(expanded(&shadowed).subqueries, 2, "only the outer definition's own two");
        let e = expanded(&format!("{deep} SELECT (SELECT (SELECT (WITH deep AS (SELECT 1 AS x) SELECT x FROM deep)))"));
        assert_eq!(e.subqueries, 3);
        // ... and is not visible outside its subquery: `inner` there is a table.
        let outside = "SELECT (WITH inner1 AS (SELECT (SELECT (SELECT 1))) SELECT 1) FROM inner1";
        let e = expanded(outside);
        assert_eq!((e.subqueries, e.relations), (3, 1 + 1 + 1));
        // A later CTE is not visible to an earlier one: there `b` is a table (1 relation).
        let later = "WITH a AS (SELECT x FROM b), b AS (SELECT (SELECT (SELECT 1 AS x))) SELECT x FROM a";
        let e = expanded(later);
        assert_eq!((e.subqueries, e.relations), (2, 3));
        // Unquoted names are lowercased, quoted ones kept; a qualified name is a table.
        assert_eq!(expanded(&format!("{deep} SELECT (SELECT x FROM DEEP)")).subqueries, 3);
        assert_eq!(expanded(&format!("{deep} SELECT (SELECT x FROM \"DEEP\")")).subqueries, 2);
        assert_eq!(expanded(&format!("{deep} SELECT (SELECT x FROM public.deep)")).subqueries, 2);
        // Recursive: the CTE reads its work table (one relation), and the walk ends.
        let recursive = "WITH RECURSIVE r AS (SELECT 1 AS x UNION ALL SELECT x + 1 FROM r WHERE x < 10) \
                         SELECT a.x FROM r a, r b";
        assert_eq!(expanded(recursive).relations, 1 + 2 * 3);
        // Without RECURSIVE, a CTE's own name inside it is a table.
        let own = "WITH r AS (SELECT x FROM r) SELECT x FROM r a, r b";
        assert_eq!(expanded(own).relations, 1 + 2 * 2);
        // EXPLAIN counts its statement.
        assert_eq!(expanded(&format!("EXPLAIN {deep} SELECT (SELECT x FROM deep)")).subqueries, 3);
    }

    /// Data types nest by `ARRAY<`, `STRUCT<`, `MAP<`, `NULLABLE(`-like groups and runs of
    /// array brackets, together; a subscript or an array literal of several elements is no
    /// type.
    #[test]
    fn type_depth_counts_nested_types() {
        let types = |sql: &str| scan(sql).type_depth;
        assert_eq!(types("SELECT CAST(x AS INT)"), 0);
        assert_eq!(types("SELECT CAST(x AS ARRAY<INT>)"), 1);
        assert_eq!(types("SELECT CAST(x AS ARRAY<ARRAY<INT>>)"), 2);
        assert_eq!(types("SELECT CAST(x AS STRUCT<a ARRAY<INT[][]>, b INT>)"), 4);
        assert_eq!(types("SELECT CAST(x AS INT[3][3][])"), 3);
        assert_eq!(types("SELECT CAST(x AS NULLABLE(NULLABLE(INT)))"), 2);
        assert_eq!(types(&format!("SELECT CAST(x AS {}INT{})", "ARRAY<".repeat(65), ">".repeat(65))), 65);
        assert_eq!(types(&format!("SELECT CAST(x AS INT{})", "[]".repeat(100))), 100);
        // A subscript chain by numbers `a[1][2]` looks like sized array brackets (and counts);
        // lists and other subscripts do not.
        assert_eq!(types("SELECT a[1][2], [1, 2, 3], b[i + 1], c['x']['y'] FROM t"), 2);
        assert_eq!(types("SELECT ARRAY[1, 2], ARRAY[[1, 2], [3, 4]] FROM t"), 0);
    }
}

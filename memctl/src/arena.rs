use crate::category::Category;
use crate::controller::{MemoryController, MemoryError, Reservation, TableAccount};
use std::sync::Arc;

/// Where one row lives inside a [`RowArena`]: block id, byte offset and length (12 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowRef {
    block: u32,
    offset: u32,
    len: u32,
}

/// The allocation point of a [`RowArena`] ([`RowArena::mark`]): the active block and its bump
/// offset, and the block table's length, capacity and `metadata` bytes. [`RowArena::rollback`]
/// returns the arena to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaMark {
    active: Option<u32>,
    used: usize,
    blocks: usize,
    table: (usize, usize),
}

/// Where a row starts, without its length (8 bytes): for callers that keep many references and
/// can read a row's length back from the row's own bytes (the delta store's key map). Turn it
/// back into a [`RowRef`] with [`RowAt::with_len`].
///
/// Ordered by block id, then offset: within one block, the order rows were allocated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowAt {
    block: u32,
    offset: u32,
}

/// Longest row a [`RowArena`] holds: a row's offset in its block and its length are `u32`s in
/// [`RowRef`] (12 bytes a row in the delta store's key map), so a longer one would wrap.
/// [`RowArena::alloc`] and [`RowArena::prepare`] refuse longer rows with
/// [`MemoryError::RowTooLong`].
pub const MAX_ROW_LEN: usize = u32::MAX as usize;

fn check_row_len(len: usize) -> Result<(), MemoryError> {
    if len > MAX_ROW_LEN {
        return Err(MemoryError::RowTooLong { bytes: len, max: MAX_ROW_LEN });
    }
    Ok(())
}

impl RowAt {
    /// The row starting here, `len` bytes long. `len` must be the length the row was
    /// allocated with: [`RowArena::get`] of a longer one panics past its block's end, or
    /// returns bytes of the rows after it.
    pub fn with_len(self, len: usize) -> RowRef {
        RowRef { block: self.block, offset: self.offset, len: len as u32 }
    }
}

impl RowAt {
    /// Id of the block the row lies in: below [`RowArena::block_slots`].
    pub fn block(self) -> usize {
        self.block as usize
    }

    /// Sorts `rows` within each run of one block ([`RowAt`]'s order, applied per run; a slice
    /// already grouped by block ends up in arena order). A run of distinct offsets below 1 MiB
    /// is placed through a bitmap of its offsets: linear in the run and in its offset span / 64,
    /// where a comparison sort of the ~250-row runs of 64 KiB chunks cost about 30 ns a row
    /// (timing of a 600,000-row lineitem flush; issue 7). Other runs are sorted by comparison.
    pub fn sort_within_blocks(rows: &mut [RowAt]) {
        let mut bits: Vec<u64> = Vec::new();
        for run in rows.chunk_by_mut(|a, b| a.block == b.block) {
            let span = run.iter().map(|r| r.offset as usize + 1).max().unwrap_or(0);
            // Small runs, or runs so sparse the bitmap scan would dominate: compare.
            if run.len() < 16 || span > 1 << 20 || span / 64 > run.len() * 8 {
                run.sort_unstable();
                continue;
            }
            bits.clear();
            bits.resize(span.div_ceil(64), 0);
            for r in run.iter() {
                bits[r.offset as usize / 64] |= 1u64 << (r.offset % 64);
            }
            // Equal offsets (two references to one row) would leave slots unfilled: compare.
            if bits.iter().map(|w| w.count_ones() as usize).sum::<usize>() != run.len() {
                run.sort_unstable();
                continue;
            }
            let block = run[0].block;
            let mut slots = run.iter_mut();
            for (w, &word) in bits.iter().enumerate() {
                let mut word = word;
                while word != 0 {
                    // `span` ≤ 1 MiB, so the offset fits a u32.
                    #[allow(clippy::cast_possible_truncation)]
                    let offset = (w * 64) as u32 + word.trailing_zeros();
                    word &= word - 1;
                    if let Some(slot) = slots.next() {
                        *slot = RowAt { block, offset };
                    }
                }
            }
        }
    }
}

impl RowRef {
    /// Length of the row in bytes.
    pub fn len(self) -> usize {
        self.len as usize
    }

    /// Where the row starts.
    pub fn at(self) -> RowAt {
        RowAt { block: self.block, offset: self.offset }
    }

    /// True for a zero-length row.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
}

struct Block {
    data: Box<[u8]>,
    used: usize,
    live: u32,
    /// A dedicated allocation for one row larger than a chunk (not from the pool).
    oversize: bool,
}

/// Bump allocator for encoded rows over pool chunks: **one allocation per row**.
///
/// - A row is placed at the bump pointer of the active chunk; a row that does not fit starts a
///   new chunk (the old tail stays unused: it is padding, counted in `row_blocks`).
/// - A row larger than a chunk gets a dedicated allocation of exactly its length, counted in
///   `row_blocks` too.
/// - Each block keeps a live-row count; [`RowArena::free`] decrements it, and a block whose
///   rows are all freed goes back to the pool whole (the active chunk stays until replaced).
/// - Dropping the arena returns every block.
///
/// The block table (`Vec` of block headers) is counted under `metadata`.
pub struct RowArena {
    ctl: Arc<MemoryController>,
    table: Option<TableAccount>,
    blocks: Vec<Option<Block>>,
    free_ids: Vec<u32>,
    active: Option<u32>,
    /// Chunks acquired ahead by [`RowArena::prepare`], used before asking the pool.
    spare: Vec<Box<[u8]>>,
    /// Oversize bytes reserved ahead by [`RowArena::prepare`].
    prepaid_oversize: usize,
    meta: Reservation,
    live_rows: usize,
    bytes: usize,
}

impl std::fmt::Debug for RowArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowArena").field("live_rows", &self.live_rows).field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

impl RowArena {
    /// An empty arena; it holds no chunk until the first row.
    pub fn new(ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Self {
        Self {
            ctl: Arc::clone(ctl),
            table: table.cloned(),
            blocks: Vec::new(),
            free_ids: Vec::new(),
            active: None,
            spare: Vec::new(),
            prepaid_oversize: 0,
            meta: Reservation::new(ctl, Category::Metadata, table),
            live_rows: 0,
            bytes: 0,
        }
    }

    /// Live rows.
    pub fn live_rows(&self) -> usize {
        self.live_rows
    }

    /// Accounted bytes held by this arena (chunks, oversize rows, spare chunks), excluding
    /// its block table.
    pub fn bytes(&self) -> usize {
        self.bytes + self.spare.len() * self.ctl.chunk_size() + self.prepaid_oversize
    }

    fn active_room(&self) -> usize {
        match self.active {
            Some(id) => self.blocks[id as usize].as_ref().map_or(0, |b| b.data.len() - b.used),
            None => 0,
        }
    }

    /// Acquires, ahead of time, every chunk and oversize byte needed to allocate rows of
    /// `sizes` (in order), so the following [`RowArena::alloc`] calls for them cannot fail.
    /// This is what lets a batch be applied all-or-nothing.
    ///
    /// # Errors
    /// [`MemoryError`] when the budget cannot be had; nothing stays acquired then.
    pub fn prepare(&mut self, sizes: impl IntoIterator<Item = usize>) -> Result<(), MemoryError> {
        let chunk = self.ctl.chunk_size();
        let mut room = self.active_room();
        let mut chunks = 0usize;
        let mut oversize = 0usize;
        let mut oversize_rows = 0usize;
        for len in sizes {
            check_row_len(len)?;
            if len > chunk {
                oversize += len;
                oversize_rows += 1;
            } else if len > room {
                chunks += 1;
                room = chunk - len;
            } else {
                room -= len;
            }
        }
        // Room in the block table first, so the allocations below cannot fail on it.
        let table_before = (self.blocks.capacity(), self.meta.size());
        self.reserve_blocks(chunks + oversize_rows)?;
        let have = self.spare.len();
        let need = chunks.saturating_sub(have);
        let mut got = Vec::with_capacity(need);
        for _ in 0..need {
            match self.ctl.take_chunk(self.table.as_ref()) {
                Ok(c) => got.push(c),
                Err(e) => {
                    for c in got {
                        self.ctl.put_chunk(c, self.table.as_ref());
                    }
                    self.unreserve_blocks(table_before);
                    return Err(e);
                }
            }
        }
        let extra_oversize = oversize.saturating_sub(self.prepaid_oversize);
        if extra_oversize > 0 {
            if let Err(e) = self.ctl.try_reserve(Category::RowBlocks, self.table.as_ref(), extra_oversize) {
                for c in got {
                    self.ctl.put_chunk(c, self.table.as_ref());
                }
                self.unreserve_blocks(table_before);
                return Err(e);
            }
            self.prepaid_oversize += extra_oversize;
        }
        self.spare.extend(got);
        Ok(())
    }

    /// Gives back chunks and oversize budget acquired by [`RowArena::prepare`] but not used.
    pub fn release_spare(&mut self) {
        for c in self.spare.drain(..) {
            self.ctl.put_chunk(c, self.table.as_ref());
        }
        if self.prepaid_oversize > 0 {
            self.ctl.release(Category::RowBlocks, self.table.as_ref(), self.prepaid_oversize);
            self.prepaid_oversize = 0;
        }
    }

    /// Makes room in the block table for `n` more blocks, reserving its growth under
    /// `metadata` first; after it, [`Self::insert_block`] cannot fail for those blocks.
    fn reserve_blocks(&mut self, n: usize) -> Result<(), MemoryError> {
        let needed = self.blocks.len() + n.saturating_sub(self.free_ids.len());
        if needed <= self.blocks.capacity() {
            return Ok(());
        }
        let new_cap = needed.max(self.blocks.capacity() * 2).max(4);
        // Block headers plus one free-id slot (u32) per block.
        let per_block = std::mem::size_of::<Option<Block>>() + std::mem::size_of::<u32>();
        self.meta.try_resize(new_cap * per_block)?;
        self.blocks.reserve_exact(new_cap - self.blocks.len());
        // free_ids never holds more ids than there are blocks.
        self.free_ids.reserve_exact(new_cap - self.free_ids.len());
        Ok(())
    }

    /// Undoes [`Self::reserve_blocks`] of a failed [`Self::prepare`]: the block table goes back
    /// to its capacity and `metadata` reservation from before, so a refused batch holds
    /// nothing.
    fn unreserve_blocks(&mut self, (capacity, meta): (usize, usize)) {
        if self.blocks.capacity() > capacity {
            self.blocks.shrink_to(capacity.max(self.blocks.len()));
            self.free_ids.shrink_to(capacity.max(self.free_ids.len()));
            self.meta.try_resize(meta).ok();
        }
    }

    /// Puts a block in the table; room was made by [`Self::reserve_blocks`].
    fn insert_block(&mut self, block: Block) -> u32 {
        if let Some(id) = self.free_ids.pop() {
            self.blocks[id as usize] = Some(block);
            return id;
        }
        debug_assert!(self.blocks.len() < self.blocks.capacity(), "reserve_blocks first");
        self.blocks.push(Some(block));
        (self.blocks.len() - 1) as u32
    }

    /// Allocates `len` bytes for one row and returns its place and the bytes to fill.
    ///
    /// The common case, a row that fits the active chunk, is a bump of its offset and is
    /// inlined into the caller; a new chunk or an oversize row takes the out-of-line path.
    ///
    /// # Errors
    /// [`MemoryError`] when a new chunk or the oversize allocation cannot be budgeted.
    #[inline]
    pub fn alloc(&mut self, len: usize) -> Result<(RowRef, &mut [u8]), MemoryError> {
        if let Some(id) = self.active
            && let Some(Some(b)) = self.blocks.get(id as usize)
            && len <= b.data.len() - b.used
        {
            return Ok(self.bump(id, len));
        }
        self.alloc_slow(len)
    }

    /// Places a row of `len` bytes at the bump offset of block `id` (which has the room).
    #[inline]
    fn bump(&mut self, id: u32, len: usize) -> (RowRef, &mut [u8]) {
        self.live_rows += 1;
        let Some(Some(block)) = self.blocks.get_mut(id as usize) else {
            unreachable!("bump into a missing block {id}");
        };
        let offset = block.used;
        block.used += len;
        block.live += 1;
        let r = RowRef { block: id, offset: offset as u32, len: len as u32 };
        (r, &mut block.data[offset..offset + len])
    }

    /// A row that does not fit the active chunk: a new chunk (spare or from the pool), or a
    /// dedicated allocation for a row larger than a chunk.
    #[inline(never)]
    fn alloc_slow(&mut self, len: usize) -> Result<(RowRef, &mut [u8]), MemoryError> {
        // Only here: a row in the active chunk (the fast path) is shorter than a chunk.
        check_row_len(len)?;
        self.reserve_blocks(1)?;
        let id = if len > self.ctl.chunk_size() {
            if self.prepaid_oversize >= len {
                self.prepaid_oversize -= len;
            } else {
                self.ctl.try_reserve(Category::RowBlocks, self.table.as_ref(), len)?;
            }
            self.bytes += len;
            self.insert_block(Block { data: vec![0u8; len].into_boxed_slice(), used: 0, live: 0, oversize: true })
        } else {
            let data = match self.spare.pop() {
                Some(c) => c,
                None => self.ctl.take_chunk(self.table.as_ref())?,
            };
            self.bytes += data.len();
            let id = self.insert_block(Block { data, used: 0, live: 0, oversize: false });
            if let Some(old) = self.active.replace(id) {
                self.release_if_empty(old);
            }
            id
        };
        Ok(self.bump(id, len))
    }

    /// The bytes of a live row.
    ///
    /// # Panics
    /// If `r` was freed or comes from another arena (a bug in the caller).
    pub fn get(&self, r: RowRef) -> &[u8] {
        let b = self.blocks[r.block as usize].as_ref().expect("row of a freed block"); // infallible for a RowRef this arena handed out (see # Panics)
        &b.data[r.offset as usize..(r.offset + r.len) as usize]
    }

    /// The bytes from the start of a live row to the end of its block: the row, then
    /// whatever follows it (other rows, unused room). For reading a row whose length is
    /// written in its own first bytes.
    ///
    /// # Panics
    /// If the row's block was freed or `at` comes from another arena (a bug in the caller).
    pub fn get_from(&self, at: RowAt) -> &[u8] {
        let b = self.blocks[at.block as usize].as_ref().expect("row of a freed block"); // infallible for a row this arena handed out (see # Panics)
        &b.data[at.offset as usize..]
    }

    /// The bytes of a live row, for writing.
    ///
    /// # Panics
    /// If `r` was freed or comes from another arena (a bug in the caller).
    pub fn get_mut(&mut self, r: RowRef) -> &mut [u8] {
        let b = self.blocks[r.block as usize].as_mut().expect("row of a freed block"); // infallible for a RowRef this arena handed out (see # Panics)
        &mut b.data[r.offset as usize..(r.offset + r.len) as usize]
    }

    /// The current allocation point, for [`Self::rollback`].
    pub fn mark(&self) -> ArenaMark {
        let used = self.active.and_then(|id| self.blocks.get(id as usize)).and_then(Option::as_ref).map_or(0, |b| b.used);
        ArenaMark { active: self.active, used, blocks: self.blocks.len(), table: (self.blocks.capacity(), self.meta.size()) }
    }

    /// Undoes the allocations of `rows`, which must be every row allocated since `mark` was
    /// taken (a write refused after its rows were encoded): frees them, gives back the blocks
    /// started since (to the pool, or the limit for oversize rows), moves the bump pointer
    /// back, and returns the block table to its length, capacity and `metadata` bytes at
    /// `mark` (a [`Self::prepare`] after `mark` may have grown it), so the arena holds exactly
    /// what it held at `mark`. Chunks prepared but unused stay spare: [`Self::release_spare`]
    /// gives them back.
    pub fn rollback(&mut self, mark: ArenaMark, rows: &[RowRef]) {
        // The block active at `mark` is active again first, so the frees below give back
        // every block started since as it empties, and keep that one.
        let current = self.active;
        self.active = mark.active.filter(|&id| self.blocks.get(id as usize).is_some_and(Option::is_some));
        for &r in rows.iter().rev() {
            self.free(r);
        }
        if let Some(id) = self.active
            && let Some(Some(b)) = self.blocks.get_mut(id as usize)
        {
            // Every row after `mark.used` in this block was one of `rows`.
            b.used = b.used.min(mark.used);
        }
        if let Some(id) = current
            && current != self.active
        {
            self.release_if_empty(id);
        }
        // Blocks started since `mark` are released now: drop their table slots.
        while self.blocks.len() > mark.blocks && self.blocks.last().is_some_and(Option::is_none) {
            self.blocks.pop();
        }
        let len = self.blocks.len();
        self.free_ids.retain(|&id| (id as usize) < len);
        self.unreserve_blocks(mark.table);
    }

    /// Frees one row; its block goes back to the pool when it was the last live row there.
    pub fn free(&mut self, r: RowRef) {
        let Some(b) = self.blocks[r.block as usize].as_mut() else {
            return;
        };
        debug_assert!(b.live > 0);
        b.live -= 1;
        self.live_rows -= 1;
        if b.live == 0 && self.active != Some(r.block) {
            self.release_block(r.block);
        }
    }

    fn release_if_empty(&mut self, id: u32) {
        if self.blocks[id as usize].as_ref().is_some_and(|b| b.live == 0) {
            self.release_block(id);
        }
    }

    fn release_block(&mut self, id: u32) {
        let Some(b) = self.blocks[id as usize].take() else {
            return;
        };
        self.free_ids.push(id);
        if b.oversize {
            self.bytes -= b.data.len();
            self.ctl.release(Category::RowBlocks, self.table.as_ref(), b.data.len());
        } else {
            self.bytes -= b.data.len();
            self.ctl.put_chunk(b.data, self.table.as_ref());
        }
    }

    /// Bound on block ids: every live row's [`RowAt::block`] is below it (ids of freed blocks
    /// are reused, so it is the most blocks held at once, not the number held now).
    pub fn block_slots(&self) -> usize {
        self.blocks.len()
    }

    /// Number of blocks currently held (chunks and oversize rows).
    pub fn block_count(&self) -> usize {
        self.blocks.iter().filter(|b| b.is_some()).count()
    }
}

impl Drop for RowArena {
    fn drop(&mut self) {
        self.release_spare();
        self.active = None;
        for id in 0..self.blocks.len() {
            self.release_block(id as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RowAt;

    /// A deterministic shuffle (xorshift) of `v`.
    fn shuffle(v: &mut [RowAt], mut seed: u64) {
        for i in (1..v.len()).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            v.swap(i, (seed % (i as u64 + 1)) as usize);
        }
    }

    #[test]
    fn sort_within_blocks_matches_a_comparison_sort() {
        // Block 0: 300 rows 13..300 bytes apart in a 64 KiB chunk (the bitmap path); block 1:
        // 5 rows (compared); block 2: 40 rows spread over 16 MiB (too sparse: compared);
        // block 3: 64 rows with one offset twice (compared); block 4: offsets up to 2^20 - 1.
        let mut rows = Vec::new();
        let mut off = 0u32;
        for i in 0..300u32 {
            rows.push(RowAt { block: 0, offset: off });
            off += 13 + (i * 37) % 288;
        }
        rows.extend((0..5).map(|i| RowAt { block: 1, offset: 1000 - i * 7 }));
        rows.extend((0..40).map(|i| RowAt { block: 2, offset: i * (16 << 20) / 40 }));
        rows.extend((0..64).map(|i| RowAt { block: 3, offset: (i % 63) * 100 }));
        rows.extend((0..100).map(|i| RowAt { block: 4, offset: (1 << 20) - 1 - i * 10_000 }));
        let mut expected = rows.clone();
        expected.sort_unstable();
        for (b, start, end) in [(0, 0, 300), (1, 300, 305), (2, 305, 345), (3, 345, 409), (4, 409, 509)] {
            assert!(rows[start..end].iter().all(|r| r.block() == b));
            shuffle(&mut rows[start..end], 0x9e37_79b9 + b as u64);
        }
        assert_ne!(rows, expected);
        RowAt::sort_within_blocks(&mut rows);
        assert_eq!(rows, expected);
        assert_eq!(rows.iter().filter(|r| r.block() == 3 && r.offset == 0).count(), 2);
        // Sorting sorted rows changes nothing.
        RowAt::sort_within_blocks(&mut rows);
        assert_eq!(rows, expected);
    }

    /// A row longer than `u32::MAX` bytes is refused before anything is budgeted or
    /// allocated (its offset and length in `RowRef` would wrap): by `alloc` and by `prepare`,
    /// and the arena holds nothing afterwards. One byte less is not refused by the length
    /// check (it fails on the 1 MiB limit instead).
    #[test]
    fn rows_longer_than_u32_max_are_refused_typed() {
        use super::{MAX_ROW_LEN, RowArena};
        use crate::{ControllerConfig, MemoryController, MemoryError};
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(1 << 20), ..ControllerConfig::default() }).expect("config");
        let mut arena = RowArena::new(&ctl, None);
        let too_long = u32::MAX as usize + 1;
        assert_eq!(MAX_ROW_LEN, u32::MAX as usize);
        assert_eq!(arena.alloc(too_long).map(|_| ()), Err(MemoryError::RowTooLong { bytes: too_long, max: MAX_ROW_LEN }));
        assert_eq!(arena.prepare([10, too_long]), Err(MemoryError::RowTooLong { bytes: too_long, max: MAX_ROW_LEN }));
        assert_eq!(arena.bytes(), 0);
        assert_eq!(ctl.used(), 0);
        assert!(matches!(arena.alloc(MAX_ROW_LEN).map(|_| ()), Err(MemoryError::Limit { requested, .. }) if requested == MAX_ROW_LEN));
        assert!(matches!(arena.prepare([MAX_ROW_LEN]), Err(MemoryError::Limit { .. })));
    }
}
